"""The path model against the kernel: a node with two uplinks, policy routing and a mangle mark, real TCP from a
pod, the source each peer saw; the model, reading the node live (ip -j, iptables-save), must name the same source
and the uplink the kernel chose (`ip route get`), IPv4 and IPv6, iptables-legacy and nftables.

pod (10.44.0.5) -> node: eth0 192.168.10.2/24 (peer A: the main table's default route), eth1 192.168.20.2/24 plus
the secondary 192.168.20.99/24 (peer B); `from 10.44.0.0/14 to 172.30.0.0/16 lookup 100` (table 100: 172.30/16 via
peer B), `fwmark 0x80/0x80 lookup 200` (table 200: default via peer B src 192.168.20.99), the pod's TCP to port
5432 marked 0x80 in mangle PREROUTING, MASQUERADE for everything outside 10/8. Both peers hold every destination,
so the peer that logs a connection is the uplink the kernel chose. IPv6 the same with ULA prefixes; there the
secondary-looking fd20::99 is what the kernel picks on eth1 (newest first among equals), which the model must know.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from ipmasq.diagnose.path import path
from ipmasq.diagnose.path_sources import read_live_facts
from ipmasq.lab.netns import Namespace, NamespaceRunner, Network
from ipmasq.policy.packet import Outcome, Packet
from ipmasq.prefix import Family
from tests.kernel.servers import LAB_PROBE, start_server, stop_server

PORTS = (80, 5432)


@dataclass(frozen=True)
class Plan:
    family: Family
    pod: str
    pod_net: str  # the pod range the rules name
    node_pod_side: str
    eth0: str
    eth1: tuple[str, str]  # primary, then the second address
    peer_a: str
    peer_b: str
    vpc: str  # the range table 100 routes (the AWS VPC behind the VPN)
    destinations: dict[str, dict[int, tuple[str, str]]]  # destination -> port -> (peer, source it sees)
    keep: str  # the range MASQUERADE leaves alone
    length: int


V4 = Plan(Family.V4, "10.44.0.5", "10.44.0.0/14", "10.44.0.1", "192.168.10.2", ("192.168.20.2", "192.168.20.99"),
          "192.168.10.1", "192.168.20.1", "172.30.0.0/16",
          {"198.51.100.10": {80: ("a", "192.168.10.2"), 5432: ("b", "192.168.20.2")},
           "172.30.1.10": {80: ("b", "192.168.20.2"), 5432: ("b", "192.168.20.2")},
           "10.20.0.5": {80: ("a", "10.44.0.5"), 5432: ("b", "10.44.0.5")}},
          "10.0.0.0/8", 24)
V6 = Plan(Family.V6, "fd44::5", "fd44::/16", "fd44::1", "fd10::2", ("fd20::2", "fd20::99"), "fd10::1", "fd20::1",
          "fd30::/16",
          {"2001:db8:100::10": {80: ("a", "fd10::2"), 5432: ("b", "fd20::99")},
           "fd30::10": {80: ("b", "fd20::99"), 5432: ("b", "fd20::99")},
           "fd05::5": {80: ("a", "fd44::5"), 5432: ("b", "fd44::5")}},
          "fd05::/16", 64)


@dataclass
class Node:
    pod: Namespace
    node: Namespace
    peers: dict[str, Namespace]
    uplinks: dict[str, str]  # peer -> the node's interface towards it


def _build(net: Network, plan: Plan, *, backend: str) -> Node:
    pod, node, a, b = net.add("pod"), net.add("node"), net.add("a"), net.add("b")
    v6 = plan.family is Family.V6
    ip = ["ip", "-6"] if v6 else ["ip"]
    for ns in (node,):
        ns.sysctl("net.ipv6.conf.all.forwarding" if v6 else "net.ipv4.ip_forward", "1")
        if not v6:
            ns.sysctl("net.ipv4.conf.all.rp_filter", "0")
    for ns in (a, b):
        ns.sysctl("net.ipv4.tcp_max_tw_buckets", "0")
    n = plan.length
    net.link(pod, [f"{plan.pod}/{n}"], node, [f"{plan.node_pod_side}/{n}"])
    eth0, _ = net.link(node, [f"{plan.eth0}/{n}"], a, [f"{plan.peer_a}/{n}"])
    eth1, _ = net.link(node, [f"{plan.eth1[0]}/{n}", f"{plan.eth1[1]}/{n}"], b, [f"{plan.peer_b}/{n}"])
    pod.run([*ip, "route", "add", "default", "via", plan.node_pod_side])
    for peer in (a, b):
        for destination in plan.destinations:
            peer.run([*ip, "addr", "add", f"{destination}/{128 if v6 else 32}", "dev", "lo"]
                     + (["nodad"] if v6 else []))
    a.run([*ip, "route", "add", plan.pod_net, "via", plan.eth0])
    b.run([*ip, "route", "add", plan.pod_net, "via", plan.eth1[0]])
    node.run([*ip, "route", "add", "default", "via", plan.peer_a, "dev", eth0])
    node.run([*ip, "rule", "add", "from", plan.pod_net, "to", plan.vpc, "lookup", "100"])
    node.run([*ip, "rule", "add", "fwmark", "0x80/0x80", "lookup", "200"])
    node.run([*ip, "route", "add", plan.vpc, "via", plan.peer_b, "dev", eth1, "table", "100"])
    node.run([*ip, "route", "add", "default", "via", plan.peer_b, "dev", eth1, "table", "200", "src", plan.eth1[1]])
    family = "ip6" if v6 else "ip"
    if backend == "nftables":
        node.run(["nft", "-f", "-"], stdin=(
            f"table {family} marks {{\n chain pre {{\n type filter hook prerouting priority mangle\n"
            f"{family} saddr {plan.pod_net} tcp dport 5432 meta mark set meta mark | 0x80\n }}\n}}\n"
            f"table {family} masq {{\n chain post {{\n type nat hook postrouting priority srcnat\n"
            f"{family} daddr != {plan.keep} masquerade\n }}\n}}\n"))
    else:
        tool = "ip6tables" if v6 else "iptables"
        legacy = f"{tool}-legacy"
        node.run([legacy, "-w", "-t", "mangle", "-A", "PREROUTING", "-s", plan.pod_net, "-p", "tcp", "--dport",
                  "5432", "-j", "MARK", "--set-xmark", "0x80/0x80"])
        node.run([legacy, "-w", "-t", "nat", "-A", "POSTROUTING", "!", "-d", plan.keep, "-j", "MASQUERADE"])
    return Node(pod, node, {"a": a, "b": b}, {"a": eth0, "b": eth1})


def _seen(built: Node, plan: Plan) -> dict[tuple[str, int], tuple[str, str]]:
    """(destination, port) -> (the peer that got the connection, the source it saw), by real TCP."""
    out: dict[tuple[str, int], tuple[str, str]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        servers = {}
        try:
            for name, peer in built.peers.items():
                for port in PORTS:
                    log = Path(tmp, f"{name}-{port}.log")
                    servers[(name, port)] = (start_server(peer, [*LAB_PROBE, "serve", str(port), "--log", str(log)]),
                                             log)
            targets = [f"[{d}]:{p}" if ":" in d else f"{d}:{p}" for d in plan.destinations for p in PORTS]
            built.pod.run([*LAB_PROBE, "connect-many", "--timeout", "3", *targets], check=False)
        finally:
            for server, _ in servers.values():
                stop_server(server)
        for (name, port), (_, log) in servers.items():
            for line in log.read_text().splitlines():
                _, destination, source = line.split()
                out[(destination, port)] = (name, source)
    return out


@pytest.fixture(params=[("v4", "iptables"), ("v6", "iptables"), ("v4", "nftables"), ("v6", "nftables")],
                ids=lambda p: "-".join(p))
def built(request: pytest.FixtureRequest, net: Network) -> Iterator[tuple[Node, Plan]]:
    family, backend = request.param
    plan = V4 if family == "v4" else V6
    yield _build(net, plan, backend=backend), plan


def test_the_model_names_the_source_and_the_uplink_the_kernel_chose(built: tuple[Node, Plan]) -> None:
    node, plan = built
    seen = _seen(node, plan)
    expected = {(d, p): want for d, ports in plan.destinations.items() for p, want in ports.items()}
    assert seen == expected  # the kernel did what the measured topology describes
    facts = read_live_facts(NamespaceRunner(node.node), plan.family)
    for (destination, port), (peer, source) in seen.items():
        answer = path(facts, Packet.of(destination, source=plan.pod, protocol="tcp", port=port))
        assert answer.source_seen == source, (destination, port, answer)
        assert answer.out_interface == node.uplinks[peer], (destination, port, answer)
        assert answer.outcome is (Outcome.PRESERVE if source == plan.pod else Outcome.MASQUERADE)
        # every step names what decided it
        assert all(step.decided_by for step in answer.steps), answer.steps


ROUTING_DUMP = "{ ip -j -4 rule; ip -j -6 rule; ip -j route show table all; ip -j addr; }"


def test_trace_on_the_node_and_from_its_dumps_says_what_the_peer_saw(built: tuple[Node, Plan]) -> None:
    """`ipmasq trace` run on the node (it reads the routes itself: no --out-interface, no --local-address) and
    offline from the documented dumps: the same source as the peer, the same egress interface."""
    node, plan = built
    seen = _seen(node, plan)
    with tempfile.TemporaryDirectory() as tmp:
        routes = Path(tmp, "routing.json")
        routes.write_text(node.node.run(["sh", "-c", ROUTING_DUMP]).stdout)
        save = Path(tmp, "node.save")
        save.write_text(node.node.run(["ip6tables-legacy-save" if plan.family is Family.V6
                                       else "iptables-legacy-save"]).stdout)
        ruleset = Path(tmp, "ruleset.json")
        ruleset.write_text(node.node.run(["nft", "-j", "list", "ruleset"]).stdout)
        for (destination, port), (peer, source) in seen.items():
            question = [destination, "--source", plan.pod, "--protocol", "tcp", "--port", str(port), "-o", "json"]
            live = node.node.run([sys.executable, "-m", "ipmasq", "trace", *question], check=False)
            dumps = ["--dump", str(save)] if "*nat" in save.read_text() else []  # the nftables node has none
            offline = subprocess.run([sys.executable, "-m", "ipmasq", "trace", *question, "--routes", str(routes),
                                      *dumps, "--dump", str(ruleset)], capture_output=True, text=True, timeout=60)
            for how, result in (("live", live), ("offline", offline)):
                assert result.returncode == 0, (how, destination, port, result.stderr)
                document = json.loads(result.stdout)
                assert document["source_seen"] == source, (how, destination, port, document)
                assert document["egress_interface"] == node.uplinks[peer], (how, destination, port, document)
                assert document["route"]["route"], document
