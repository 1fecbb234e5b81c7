"""check and trace on a node where kube-proxy runs in nftables mode, beside the agent on each backend.

kube-proxy 1.37's ruleset (tests/dumps/kube-proxy-nftables.nft, tables ip and ip6 kube-proxy: a ClusterIP and a
NodePort service, one endpoint on this node, cluster CIDR 10.244.0.0/16 and fd00:10:244::/56, masqueradeAll false)
loaded with `nft -f` beside the agent's rules (nftables: its own table; iptables-nft and iptables-legacy: its chain
in iptables' nat table). Its nat-postrouting sits at srcnat (100) like the agent's chain, and masquerades only what
it marked 0x4000 (NodePort traffic) and an endpoint reaching itself through its Service (hairpin).

Real TCP, IPv4 and IPv6: a pod's egress to the internet and to a range the config keeps, a client outside the node
to the NodePort, the endpoint to its own ClusterIP, a second pod to that ClusterIP; each server logs the source it
saw. `ipmasq trace` on the live rules (run in the node's namespace, --backend auto) must say the same source and
name the rule that decided it: the agent's for pod egress, kube-proxy's masquerading chain for the NodePort and
hairpin connections. `ipmasq check` on the live node must find nothing.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from ipmasq.config import ConfigInput, config_from_bytes
from ipmasq.lab.netns import Namespace, Network
from ipmasq.netfilter.iptables import render_restore
from ipmasq.netfilter.nft import render_script
from ipmasq.options import PolicyOptions
from ipmasq.policy.policy import Policy
from ipmasq.prefix import Family
from tests.conftest import ROOT

FIXTURE = ROOT / "tests" / "dumps" / "kube-proxy-nftables.nft"
FIXTURE_JSON = ROOT / "tests" / "dumps" / "kube-proxy-nftables.json"
CONFIG = "nonMasqueradeCIDRs: [10.0.0.0/8, fd00:10::/32]\n"
NODE_PORT, ENDPOINT_PORT = 30080, 8080
BACKENDS = ["nftables", "iptables-nft", "iptables-legacy"]


@dataclass(frozen=True)
class Addresses:
    """The fixture's addresses in one family: the endpoint pod and its node-side address, a second pod, the node's
    address the NodePort listens on, a client outside, destinations on the internet and inside the kept range, the
    web service's ClusterIP."""

    family: Family
    pod: str
    pod_side: str
    pod2: str
    pod2_side: str
    node: str
    client: str
    internet: str
    private: str
    web_cluster_ip: str
    pod_range: str
    length: int

    def host(self, address: str) -> str:
        return f"{address}/{self.length}"


V4 = Addresses(Family.V4, "10.244.1.5", "10.244.1.1", "10.244.2.6", "10.244.2.1", "192.168.0.2", "192.168.0.1",
               "203.0.113.10", "10.20.0.5", "10.96.0.10", "10.244.0.0/16", 24)
V6 = Addresses(Family.V6, "fd00:10:244:1::5", "fd00:10:244:1::1", "fd00:10:244:2::6", "fd00:10:244:2::1",
               "2001:db8:0:1::2", "2001:db8:0:1::1", "2001:db8:ff::10", "fd00:10:20::5", "fd00:10:96::a",
               "fd00:10:244::/56", 64)


def _policy() -> Policy:
    """A dual-stack agent (--enable-ipv6), as on a dual-stack cluster where kube-proxy writes both tables."""
    options = PolicyOptions(enable_ipv6=True)
    return Policy(config_from_bytes(ConfigInput((("/etc/config/ip-masq-agent", CONFIG.encode()),)), options), options)


@contextmanager
def _server(ns: Namespace, log: Path, port: int) -> Iterator[None]:
    log.touch()
    server = ns.popen([sys.executable, "-m", "ipmasq.lab.probe", "serve", str(port), "--log", str(log)],
                      stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "ready"
        yield
    finally:
        server.kill()
        server.wait()


def _connect(ns: Namespace, host: str, port: int) -> str:
    """The source the server saw for one real TCP connection."""
    result = ns.run([sys.executable, "-m", "ipmasq.lab.probe", "connect", host, str(port), "3"], check=False)
    assert result.returncode == 0, (host, port, result.stdout, result.stderr)
    return result.stdout.strip()


def _ipmasq(node: Namespace, *args: str) -> tuple[int, dict[str, Any]]:
    result = node.run([sys.executable, "-m", "ipmasq", *args, "-o", "json"], check=False)
    assert result.returncode in (0, 1), result.stderr
    document: dict[str, Any] = json.loads(result.stdout)
    return result.returncode, document


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("a", [V4, V6], ids=["ipv4", "ipv6"])
def test_check_and_trace_beside_kube_proxy_nftables(net: Network, backend: str, a: Addresses) -> None:
    policy = _policy()
    pod, pod2, node, client = net.add("pod"), net.add("pod2"), net.add("node"), net.add("client")
    node.sysctl("net.ipv4.ip_forward", "1")
    node.sysctl("net.ipv6.conf.all.forwarding", "1")
    net.link(pod, [a.host(a.pod)], node, [a.host(a.pod_side)])
    net.link(pod2, [a.host(a.pod2)], node, [a.host(a.pod2_side)])
    net.link(node, [a.host(a.node)], client, [a.host(a.client)])
    pod.run(["ip", "route", "add", "default", "via", a.pod_side])
    pod2.run(["ip", "route", "add", "default", "via", a.pod2_side])
    node.run(["ip", "route", "add", "default", "via", a.client])
    client.run(["ip", "route", "add", a.pod_range, "via", a.node])  # the network routes pod ranges to the node
    for address in (a.internet, a.private):
        client.run(["ip", "addr", "add", address, "dev", "lo"])
    if backend == "nftables":
        node.run(["nft", "-f", "-"], stdin=render_script(policy))
    else:
        variant = backend.split("-")[1]
        for family in policy.families:
            tool = f"{'ip6' if family is Family.V6 else 'ip'}tables-{variant}-restore"
            node.run([tool, "--noflush", "-w"], stdin=render_restore(policy, family))
    node.run(["nft", "-f", str(FIXTURE)])  # kube-proxy (re)starting after the agent: its hooks are the newest

    with tempfile.TemporaryDirectory() as tmp:
        with _server(client, Path(tmp, "client.log"), ENDPOINT_PORT), \
                _server(pod, Path(tmp, "pod.log"), ENDPOINT_PORT):
            seen = {
                "egress to the internet": _connect(pod, a.internet, ENDPOINT_PORT),
                "egress to a kept range": _connect(pod, a.private, ENDPOINT_PORT),
                "NodePort from outside": _connect(client, a.node, NODE_PORT),
                "endpoint to its own ClusterIP": _connect(pod, a.web_cluster_ip, 80),
                "another pod to the ClusterIP": _connect(pod2, a.web_cluster_ip, 80),
            }
        config = Path(tmp, "config.yaml")
        config.write_text(CONFIG)
        code, report = _ipmasq(node, "check", "--config", str(config), "--enable-ipv6", "--pod-range", V4.pod_range,
                               "--pod-range", V6.pod_range, "--agent", "none")
    # what the kernel did: the agent decides pod egress, kube-proxy masquerades the NodePort and hairpin connections
    assert seen == {
        "egress to the internet": a.node,
        "egress to a kept range": a.pod,
        "NodePort from outside": a.pod_side,
        "endpoint to its own ClusterIP": a.pod_side,
        "another pod to the ClusterIP": a.pod2,
    }
    assert (code, report) == (0, {"apiVersion": "ipmasq.io/v1", "kind": "CheckReport", "ok": True, "findings": []})

    def trace(destination: str, source: str, out_address: str, *extra: str) -> dict[str, Any]:
        # the first --local-address is the out interface's, which a masquerade takes
        local = [x for address in (out_address, a.node, a.pod_side, a.pod2_side) for x in ("--local-address", address)]
        code, document = _ipmasq(node, "trace", destination, "--source", source, "--protocol", "tcp", "--port",
                                 str(ENDPOINT_PORT), *local, *extra)
        assert code == 0, document
        return document

    traced = {
        "egress to the internet": trace(a.internet, a.pod, a.node),
        "egress to a kept range": trace(a.private, a.pod, a.node),
        "NodePort from outside": trace(a.pod, a.client, a.pod_side, "--service", "--mark", "0x4000"),
        "endpoint to its own ClusterIP": trace(a.pod, a.pod, a.pod_side, "--service"),
        "another pod to the ClusterIP": trace(a.pod, a.pod2, a.pod_side, "--service"),
    }
    table = "ip6 kube-proxy" if a.family is Family.V6 else "ip kube-proxy"
    for case, document in traced.items():
        assert document["source_seen"] == seen[case], (case, document)
        chains = [step["chain"] for step in document["steps"]]
        assert f"{table} masquerading" in chains, (case, document)  # walked whatever the agent's backend
    agent_rule = "inet ip-masq-agent postrouting: " if backend == "nftables" else "-A IP-MASQ-AGENT "
    assert traced["egress to the internet"]["outcome"] == "masqueraded"
    assert traced["egress to the internet"]["decided_by"].startswith(agent_rule)
    nodeport = traced["NodePort from outside"]
    assert nodeport["decided_by_name"].startswith(f"{table} masquerading handle ")
    assert "meta mark & 0x00004000 != 0x00000000" in nodeport["decided_by"] and nodeport["mark"] == 0
    # the agent's chain and kube-proxy's share priority 100: trace says that the order does not matter here
    assert any("share priority 100" in note and f"only {table} nat-postrouting NATs" in note
               for note in nodeport["notes"]), nodeport
    assert "@hairpin-connections" in traced["endpoint to its own ClusterIP"]["decided_by"]
    assert traced["another pod to the ClusterIP"]["outcome"] == "unchanged"
    assert any("--service --mark 0x4000" in note for note in traced["egress to a kept range"]["notes"])


def test_the_json_fixture_is_what_nft_lists_for_the_text_fixture(net: Network) -> None:
    """tests/dumps/kube-proxy-nftables.json (the unit tests' input) is `nft -j list ruleset` of the .nft fixture,
    and nft lists that fixture back exactly as it is written."""
    node = net.add("node")
    node.run(["nft", "-f", str(FIXTURE)])
    assert node.run(["nft", "list", "ruleset"]).stdout == FIXTURE.read_text()
    listed = [o for o in json.loads(node.run(["nft", "-j", "list", "ruleset"]).stdout)["nftables"]
              if "metainfo" not in o]
    committed = [o for o in json.loads(FIXTURE_JSON.read_text())["nftables"] if "metainfo" not in o]
    assert listed == committed
