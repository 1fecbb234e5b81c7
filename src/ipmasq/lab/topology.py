"""The outages' world as namespaces: pod -> node -> VPC router -> {VPN/on-prem peers, partner, Cloud NAT -> internet}.

    pod (10.44.14.15, secondary range 10.44.0.0/14, this node's pod range 10.44.14.0/24)
     └─ node (10.142.15.203 and a spare 10.142.15.204, primary range 10.142.0.0/20; runs the agent)
         └─ router (the VPC: routes pod ranges natively, like GKE's alias IPs)
             ├─ peers: AWS VPC db 172.30.12.110 (GKE upgrade), on-prem endpoint 10.2.1.100 (SNAT),
             │         VPN host 10.11.0.5 in 10.11.0.0/24 (VPN in 10/8) -- all behind firewalls admitting only
             │         the node range 10.128.0.0/9 on port 443 (80 and 8080 admit anyone) --, and a VPC VM
             │         10.130.0.6 that admits anyone
             │         (IPv6: fd00:130::6 inside the VPC's fd00::/8, 2001:db8:30::110 outside it; any source)
             ├─ partner: 192.168.77.10, whose own iptables firewall admits only the egress address 10.142.15.204
             │         on port 443 and resets everyone else (it remembers whom it refused: xt_recent)
             └─ cloudnat (translates the configured source ranges to 35.199.0.71, drops other private sources)
                 └─ internet (34.120.0.10)

Every address exists only inside these namespaces; nothing is linked to the machine's own network.
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ipmasq.cloudnat import CloudNatMode
from ipmasq.errors import NetnsError
from ipmasq.lab.netns import Namespace, Network

__all__ = [
    "ADDR", "OPEN_PORT", "PLAIN_PORT", "STRICT_PORT", "Lab", "Probe", "ProbeClient", "ProbeResult", "admits",
    "build_lab", "build_world", "start_probe_server",
]


@dataclass(frozen=True)
class _Addresses:
    pod_range: str = "10.44.0.0/14"
    pod: str = "10.44.14.15"
    pod_gateway: str = "10.44.14.1"
    node_pod_range: str = "10.44.14.0/24"  # the pod range of this node (its podCIDR)
    node_range: str = "10.142.0.0/20"
    node: str = "10.142.15.203"
    spare_node: str = "10.142.15.204"  # a second address of the node, the one the partner's firewall admits
    router: str = "10.142.0.1"
    firewall_allows: str = "10.128.0.0/9"  # the AWS side admits only GCP's primary ranges (node IPs)
    aws_db: str = "172.30.12.110"
    onprem_endpoint: str = "10.2.1.100"
    vpn_host: str = "10.11.0.5"
    vpc_vm: str = "10.130.0.6"
    internet: str = "34.120.0.10"
    nat_ip: str = "35.199.0.71"
    partner: str = "192.168.77.10"  # a partner's endpoint over the VPN, behind the partner's own firewall
    # IPv6 (the dual-stack Kubernetes lab): the VPC's node subnet and pod ranges in fd00::/8, one peer inside it and
    # one outside, in the documentation range (not the internet: it stays out of Cloud NAT's way)
    node_range6: str = "fd00:142::/64"
    router6: str = "fd00:142::1"
    pod_range6: str = "fd00:44::/48"
    vpc_vm6: str = "fd00:130::6"
    outside6: str = "2001:db8:30::110"


ADDR = _Addresses()
STRICT_PORT = 443  # behind the node-range-only firewall (the partner's: behind its one-address firewall)
OPEN_PORT = 8080  # admits any source
PLAIN_PORT = 80  # admits any source too: the peers' plain-HTTP side of the endpoints whose 443 is strict
PARTNER_REFUSED = "partner-refused"  # the xt_recent list of the sources the partner's firewall reset



# runs the probe client (`python ARGV...`) where the probes start from, within a timeout; returns its output
ProbeClient = Callable[[list[str], float], "subprocess.CompletedProcess[str]"]


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


def admits(probe: Probe, source: str) -> bool:
    """Whether the firewall in front of a probe's target lets a connection from `source` through."""
    address = ipaddress.ip_address(source)
    if probe.destination == ADDR.partner:
        return probe.port != STRICT_PORT or source == ADDR.spare_node
    if probe.port == STRICT_PORT:
        return address in ipaddress.ip_network(ADDR.firewall_allows)
    return True


@dataclass
class Lab:
    net: Network
    workdir: str
    servers: list[subprocess.Popen[str]] = field(default_factory=list)
    cloud_nat_mode: CloudNatMode = CloudNatMode.ALL_IP_RANGES
    server_logs: dict[str, int] = field(default_factory=dict)  # each probe server's log file -> its port

    @property
    def node(self) -> Namespace:
        return self.net["node"]

    @property
    def pod(self) -> Namespace:
        return self.net["pod"]

    def reset_node(self) -> None:
        """The node comes up anew, as a recreated node would: an empty netfilter ruleset (every nftables table,
        the iptables-nft ones included: whatever the agent or an operator wrote is gone) and no connections."""
        self.node.run(["nft", "flush", "ruleset"])
        self.node.run(["conntrack", "-F"], check=False)

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

    def probe(self, probes: list[Probe], *, timeout: float = 1.0, client: ProbeClient | None = None,
              nodes: Sequence[Namespace] = ()) -> list[ProbeResult]:
        """Connect from the pod to each target (one process for the batch); read what each peer saw.

        client: how to run the probe client's argv in the pod and wait for it (default: the lab's pod namespace;
        the Kubernetes lab runs it in a real pod with kubectl exec); nodes: whose connection tracking to forget
        first (default: the lab's node).

        A target is probed at most once per batch: the partner's firewall remembers whom it refused, not for
        which connection."""
        if len({p.target for p in probes}) != len(probes):
            raise NetnsError(f"a batch probes each target once: {', '.join(p.target for p in probes)}")
        offsets = {path: os.path.getsize(path) if os.path.exists(path) else 0 for path in self.server_logs}
        partner = self.net.namespaces.get("partner")
        if partner is not None:
            partner.run(["sh", "-c", f"echo / > /proc/net/xt_recent/{PARTNER_REFUSED}"])  # forget earlier refusals
        # forget earlier NAT decisions, as a fresh connection from a new pod would
        for node in nodes or [self.node]:
            node.run(["conntrack", "-F"], check=False)
        argv = ["-m", "ipmasq.lab.probe", "connect-many", "--timeout", str(timeout), *[p.target for p in probes]]
        if client is None:
            result = self.pod.run([sys.executable, *argv], check=False, timeout=30 + timeout * len(probes))
        else:
            result = client(argv, 30 + timeout * len(probes))
        connected: dict[str, bool] = {}
        for line in result.stdout.splitlines():
            target, _, answer = line.rpartition(" ")
            connected[target] = answer != "FAILED"
        if set(connected) != {p.target for p in probes}:
            raise NetnsError(f"probe client failed: {result.stderr.strip() or result.stdout.strip()}")
        seen: dict[tuple[str, int], str] = {}
        for path, port in self.server_logs.items():
            if not os.path.exists(path):
                continue
            with open(path) as fh:
                fh.seek(offsets[path])
                for line in fh:
                    _verdict, destination, source = line.split()
                    seen[(destination, port)] = source
        if partner is not None:
            # what the partner's firewall saw and reset never reached its server: read the firewall's own list
            listing = partner.run(["cat", f"/proc/net/xt_recent/{PARTNER_REFUSED}"]).stdout
            for line in listing.splitlines():
                source = line.split()[0].removeprefix("src=")
                seen.setdefault((ADDR.partner, STRICT_PORT), source)
        return [ProbeResult(p, connected[p.target], seen.get((p.destination, p.port))) for p in probes]

    def close(self) -> None:
        """Stop the probe servers and remove the lab's files (the namespaces belong to the Network)."""
        for server in self.servers:
            server.kill()
            server.wait()
        self.servers.clear()
        shutil.rmtree(self.workdir, ignore_errors=True)


def start_probe_server(lab: Lab, role: str, port: int, allow: list[str]) -> None:
    """A probe server in the namespace of `role` on `port` (every address), its log read by Lab.probe."""
    log = os.path.join(lab.workdir, f"{role}-{port}.log")
    argv = [sys.executable, "-m", "ipmasq.lab.probe", "serve", str(port), "--log", log]
    for a in allow:
        argv += ["--allow", a]
    server = lab.net[role].popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    lab.servers.append(server)
    lab.server_logs[log] = port
    assert server.stdout is not None
    if server.stdout.readline().strip() != "ready":
        raise NetnsError(f"probe server in {role} did not start")


def _partner_firewall() -> str:
    """The partner's iptables filter: port 443 admits the one egress address it was given, resets the rest and
    remembers their sources (the partner's deny log)."""
    match = f"-A INPUT -d {ADDR.partner}/32 -p tcp --dport {STRICT_PORT}"
    return "\n".join([
        "*filter", ":INPUT ACCEPT [0:0]",
        f"{match} -s {ADDR.spare_node}/32 -j ACCEPT",
        f"{match} -m recent --name {PARTNER_REFUSED} --set --rsource -j REJECT --reject-with tcp-reset",
        "COMMIT", ""])


def build_lab(net: Network, *, workdir: str | None = None, anyip_peers: bool = False) -> Lab:
    """Create the namespaces, links, routes, firewalls and probe servers. `net` owns the cleanup.

    anyip_peers: the peers namespace answers on *every* address (a local route for 0.0.0.0/0), so that random
    destinations (the differential test) reach a real TCP server; the internet branch is then unused.
    """
    lab = Lab(net, workdir or tempfile.mkdtemp(prefix="ipmasq-lab-"))
    pod, node, router = net.add("pod"), net.add("node"), net.add("router")
    for ns in (node, router):
        ns.sysctl("net.ipv4.ip_forward", "1")
        ns.sysctl("net.ipv4.conf.all.rp_filter", "0")
    net.link(pod, [f"{ADDR.pod}/24"], node, [f"{ADDR.pod_gateway}/24"])
    # the spare address is secondary: masquerade keeps choosing the node's primary address
    net.link(node, [f"{ADDR.node}/20", f"{ADDR.spare_node}/20"], router, [f"{ADDR.router}/20"])
    pod.run(["ip", "route", "add", "default", "via", ADDR.pod_gateway])
    node.run(["ip", "route", "add", "default", "via", ADDR.router])
    router.run(["ip", "route", "add", ADDR.pod_range, "via", ADDR.node])  # alias IP ranges are VPC-routable
    build_world(lab, router, anyip_peers=anyip_peers)
    return lab


def build_world(lab: Lab, router: Namespace, *, anyip_peers: bool = False) -> None:
    """Everything beyond the VPC router: the peers behind their firewalls, the partner, Cloud NAT and the
    internet, their routes and probe servers. The caller has made `router` and routed its pod ranges to nodes."""
    net = lab.net
    peers, cloudnat, internet = net.add("peers"), net.add("cloudnat"), net.add("internet")
    partner = net.add("partner")
    for ns in (router, cloudnat):
        ns.sysctl("net.ipv4.ip_forward", "1")
        ns.sysctl("net.ipv4.conf.all.rp_filter", "0")
    router.sysctl("net.ipv6.conf.all.forwarding", "1")
    net.link(router, ["10.250.0.1/30", "fd00:250::1/64"], peers, ["10.250.0.2/30", "fd00:250::2/64"])
    net.link(router, ["10.250.1.1/30"], cloudnat, ["10.250.1.2/30"])
    net.link(router, ["10.250.2.1/30"], partner, ["10.250.2.2/30"])
    cloudnat_if, _ = net.link(cloudnat, ["34.120.0.1/24", f"{ADDR.nat_ip}/32"], internet,
                                        [f"{ADDR.internet}/24"])
    cloudnat.run(["ip", "link", "set", cloudnat_if, "name", "inet"])  # rules below name the interface
    peers.run(["ip", "route", "add", "default", "via", "10.250.0.1"])
    peers.run(["ip", "-6", "route", "add", "default", "via", "fd00:250::1"])
    for address in (ADDR.vpc_vm6, ADDR.outside6):  # IPv6 peers admit anyone: they say what source they saw
        peers.run(["ip", "addr", "add", f"{address}/128", "dev", "lo"])
        router.run(["ip", "-6", "route", "add", f"{address}/128", "via", "fd00:250::2"])
    partner.run(["ip", "addr", "add", f"{ADDR.partner}/32", "dev", "lo"])
    partner.run(["ip", "route", "add", "default", "via", "10.250.2.1"])
    router.run(["ip", "route", "add", f"{ADDR.partner}/32", "via", "10.250.2.2"])
    partner.run(["iptables-restore"], stdin=_partner_firewall())
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
    start_probe_server(lab, "peers", STRICT_PORT, [ADDR.firewall_allows])
    start_probe_server(lab, "peers", OPEN_PORT, [])
    start_probe_server(lab, "peers", PLAIN_PORT, [])
    start_probe_server(lab, "partner", STRICT_PORT, [])
    start_probe_server(lab, "internet", OPEN_PORT, [])
    lab.set_cloud_nat(CloudNatMode.ALL_IP_RANGES)


