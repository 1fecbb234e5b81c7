"""The outages' world as namespaces: pod -> node -> VPC router -> {VPN/on-prem peers, Cloud NAT -> internet}.

    pod (10.44.14.15, secondary range 10.44.0.0/14)
     └─ node (10.142.15.203, primary range 10.142.0.0/20; runs the agent)
         └─ router (the VPC: routes pod ranges natively, like GKE's alias IPs)
             ├─ peers: AWS VPC db 172.30.12.110 (GKE upgrade), on-prem endpoint 10.2.1.100 (SNAT),
             │         VPN host 10.11.0.5 in 10.11.0.0/24 (VPN in 10/8) -- all behind firewalls admitting only
             │         the node range 10.128.0.0/9 --, and a VPC VM 10.130.0.6 that admits anyone
             └─ cloudnat (translates the configured source ranges to 35.199.0.71, drops other private sources)
                 └─ internet (34.120.0.10)

Every address exists only inside these namespaces; nothing is linked to the machine's own network.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

from ipmasq.cloudnat import CloudNatMode
from ipmasq.lab.netns import Namespace, NetnsError, Network

__all__ = ["ADDR", "Lab", "Probe", "ProbeResult", "build_lab"]


@dataclass(frozen=True)
class _Addresses:
    pod_range: str = "10.44.0.0/14"
    pod: str = "10.44.14.15"
    pod_gateway: str = "10.44.14.1"
    node_range: str = "10.142.0.0/20"
    node: str = "10.142.15.203"
    router: str = "10.142.0.1"
    firewall_allows: str = "10.128.0.0/9"  # the AWS side admits only GCP's primary ranges (node IPs)
    aws_db: str = "172.30.12.110"
    onprem_endpoint: str = "10.2.1.100"
    vpn_host: str = "10.11.0.5"
    vpc_vm: str = "10.130.0.6"
    internet: str = "34.120.0.10"
    nat_ip: str = "35.199.0.71"


ADDR = _Addresses()
STRICT_PORT = 443  # behind the node-range-only firewall
OPEN_PORT = 8080  # admits any source


@dataclass(frozen=True)
class Probe:
    destination: str
    port: int

    @property
    def target(self) -> str:
        return f"{self.destination}:{self.port}"


@dataclass(frozen=True)
class ProbeResult:
    probe: Probe
    connected: bool
    seen_source: str | None  # what the peer's kernel delivered (also when its firewall then refused it)


@dataclass
class Lab:
    net: Network
    workdir: str
    servers: list[subprocess.Popen[str]] = field(default_factory=list)
    cloud_nat_mode: CloudNatMode = CloudNatMode.ALL_IP_RANGES

    @property
    def node(self) -> Namespace:
        return self.net["node"]

    @property
    def pod(self) -> Namespace:
        return self.net["pod"]

    @property
    def log_paths(self) -> list[str]:
        return [os.path.join(self.workdir, f"{role}.log") for role in ("peers", "internet")]

    def set_cloud_nat(self, mode: CloudNatMode) -> None:
        """Reprogram the Cloud NAT gateway: SNAT the configured source ranges, drop every other private source."""
        ranges = {
            CloudNatMode.ALL_IP_RANGES: [ADDR.node_range, ADDR.pod_range],
            CloudNatMode.PRIMARY_IP_RANGE: [ADDR.node_range],
            CloudNatMode.LIST_OF_SECONDARY_IP_RANGES: [ADDR.pod_range],
        }[mode]
        lines = ["*nat", ":POSTROUTING ACCEPT [0:0]"]
        lines += [f"-A POSTROUTING -o inet -s {r} -j SNAT --to-source {ADDR.nat_ip}" for r in ranges]
        lines += ["COMMIT", "*filter", ":FORWARD ACCEPT [0:0]",
                  "-A FORWARD -i inet -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT"]
        lines += [f"-A FORWARD -o inet -s {r} -j ACCEPT" for r in ranges]
        lines += ["-A FORWARD -o inet -j DROP", "COMMIT"]
        cloudnat = self.net["cloudnat"]
        cloudnat.run(["iptables-restore"], stdin="\n".join(lines) + "\n")  # a full restore: the gateway is ours
        cloudnat.run(["conntrack", "-F"], check=False)
        self.cloud_nat_mode = mode

    def probe(self, probes: list[Probe], *, timeout: float = 1.0) -> list[ProbeResult]:
        """Connect from the pod to each target (one process for the batch); read what each peer saw."""
        offsets = [os.path.getsize(p) if os.path.exists(p) else 0 for p in self.log_paths]
        # forget earlier NAT decisions, as a fresh connection from a new pod would
        self.node.run(["conntrack", "-F"], check=False)
        result = self.pod.run([sys.executable, "-m", "ipmasq.lab.probe", "connect-many", "--timeout", str(timeout),
                               *[p.target for p in probes]], check=False, timeout=30 + timeout * len(probes))
        connected: dict[str, bool] = {}
        for line in result.stdout.splitlines():
            target, _, seen = line.rpartition(" ")
            connected[target] = seen != "FAILED"
        seen_by_destination: dict[str, str] = {}
        for path, offset in zip(self.log_paths, offsets, strict=True):
            if not os.path.exists(path):
                continue
            with open(path) as fh:
                fh.seek(offset)
                for line in fh:
                    _verdict, destination, source = line.split()
                    seen_by_destination[destination] = source
        if set(connected) != {p.target for p in probes}:
            raise NetnsError(f"probe client failed: {result.stderr.strip() or result.stdout.strip()}")
        return [ProbeResult(p, connected[p.target], seen_by_destination.get(p.destination)) for p in probes]

    def close(self) -> None:
        """Stop the probe servers and remove the lab's files (the namespaces belong to the Network)."""
        for server in self.servers:
            server.kill()
            server.wait()
        self.servers.clear()
        shutil.rmtree(self.workdir, ignore_errors=True)


def _start_server(lab: Lab, role: str, port: int, allow: list[str]) -> None:
    log = os.path.join(lab.workdir, f"{role}.log")
    argv = [sys.executable, "-m", "ipmasq.lab.probe", "serve", str(port), "--log", log]
    for a in allow:
        argv += ["--allow", a]
    server = lab.net[role].popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    lab.servers.append(server)
    assert server.stdout is not None
    if server.stdout.readline().strip() != "ready":
        raise NetnsError(f"probe server in {role} did not start")


def build_lab(net: Network, *, workdir: str | None = None, anyip_peers: bool = False) -> Lab:
    """Create the namespaces, links, routes, firewalls and probe servers. `net` owns the cleanup.

    anyip_peers: the peers namespace answers on *every* address (a local route for 0.0.0.0/0), so that random
    destinations (the differential test) reach a real TCP server; the internet branch is then unused.
    """
    lab = Lab(net, workdir or tempfile.mkdtemp(prefix="ipmasq-lab-"))
    pod, node, router = net.add("pod"), net.add("node"), net.add("router")
    peers, cloudnat, internet = net.add("peers"), net.add("cloudnat"), net.add("internet")
    for ns in (node, router, cloudnat):
        ns.sysctl("net.ipv4.ip_forward", "1")
        ns.sysctl("net.ipv4.conf.all.rp_filter", "0")
    net.link(pod, [f"{ADDR.pod}/24"], node, [f"{ADDR.pod_gateway}/24"])
    net.link(node, [f"{ADDR.node}/20"], router, [f"{ADDR.router}/20"])
    net.link(router, ["10.250.0.1/30"], peers, ["10.250.0.2/30"])
    net.link(router, ["10.250.1.1/30"], cloudnat, ["10.250.1.2/30"])
    cloudnat_if, _ = net.link(cloudnat, ["34.120.0.1/24", f"{ADDR.nat_ip}/32"], internet,
                                        [f"{ADDR.internet}/24"])
    cloudnat.run(["ip", "link", "set", cloudnat_if, "name", "inet"])  # rules below name the interface
    pod.run(["ip", "route", "add", "default", "via", ADDR.pod_gateway])
    node.run(["ip", "route", "add", "default", "via", ADDR.router])
    router.run(["ip", "route", "add", ADDR.pod_range, "via", ADDR.node])  # alias IP ranges are VPC-routable
    peers.run(["ip", "route", "add", "default", "via", "10.250.0.1"])
    cloudnat.run(["ip", "route", "add", "10.0.0.0/8", "via", "10.250.1.1"])
    internet.run(["ip", "route", "add", f"{ADDR.nat_ip}/32", "via", "34.120.0.1"])  # no route to private space
    if anyip_peers:
        peers.run(["ip", "route", "add", "local", "0.0.0.0/0", "dev", "lo"])
        # replies to the pod and node ranges must still leave: more specific than the AnyIP route, same table
        for back in (ADDR.pod_range, ADDR.node_range):
            peers.run(["ip", "route", "add", back, "via", "10.250.0.1", "table", "local"])
        router.run(["ip", "route", "add", "default", "via", "10.250.0.2"])
    else:
        for address in (ADDR.aws_db, ADDR.onprem_endpoint, ADDR.vpn_host, ADDR.vpc_vm):
            peers.run(["ip", "addr", "add", f"{address}/32", "dev", "lo"])
            router.run(["ip", "route", "add", f"{address}/32", "via", "10.250.0.2"])
        router.run(["ip", "route", "add", "default", "via", "10.250.1.2"])
    _start_server(lab, "peers", STRICT_PORT, [ADDR.firewall_allows])
    _start_server(lab, "peers", OPEN_PORT, [])
    _start_server(lab, "internet", OPEN_PORT, [])
    lab.set_cloud_nat(CloudNatMode.ALL_IP_RANGES)
    return lab


def wait_until(condition: object, *, timeout: float, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if callable(condition) and condition():
            return True
        time.sleep(interval)
    return False

