"""The nft table, applied by the real nft in a namespace: it lists back exactly as rendered, and real TCP
connections from a pod through the node arrive with the source the Policy predicts.

The JSON comparison is what makes the stateful fake trustworthy: the fake answers `nft -j list` with
`list_json(table)`, and here the kernel's own listing of the same table is shown to be identical (handles aside).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from ipmasq.lab.netns import Namespace, Network
from ipmasq.netfilter.nft import desired_table, render_script
from ipmasq.netfilter.nft_json import parse_list_json
from ipmasq.options import PolicyOptions, parse_to_ports
from ipmasq.policy.policy import Policy
from ipmasq.testing.nft import list_json
from tests.configs import policy_of
from tests.kernel.servers import LAB_PROBE, start_server, stop_server

CASES = {
    "defaults": ("", PolicyOptions()),
    "exceptions": ("nonMasqueradeCIDRs: [10.0.0.0/8, 10.11.5.0/24, 1.2.3.4/32]\n"
                   "masqueradeCIDRs: [10.11.0.0/16]\n", PolicyOptions(random_fully=False)),
    "to-ports": ("nonMasqueradeCIDRs: [10.0.0.0/8]\n",
                 PolicyOptions(to_ports=parse_to_ports("32768-40000,40001-50000,50001"))),
    "ipv6": ("nonMasqueradeCIDRs: [10.0.0.0/8, 'fd00::/8', '2001:db8::/32']\nmasqueradeCIDRs: ['2001:db8:1::/48']\n",
             PolicyOptions(enable_ipv6=True)),
    "empty-sets": ("nonMasqueradeCIDRs: []\nmasqLinkLocal: true\nmasqLinkLocalIPv6: true\n",
                   PolicyOptions(enable_ipv6=True)),
}


def make_policy(text: str, options: PolicyOptions) -> Policy:
    return policy_of(text, options)


def without_handles(objects: list[dict[str, dict[str, object]]]) -> list[dict[str, dict[str, object]]]:
    return [{kind: {k: v for k, v in body.items() if k != "handle"} for kind, body in o.items()} for o in objects]


@pytest.mark.parametrize("case", sorted(CASES))
def test_table_lists_back_as_rendered(net: Network, case: str) -> None:
    policy = make_policy(*CASES[case])
    node = net.add("node")
    node.run(["nft", "-f", "-"], stdin=render_script(policy))
    listing = node.run(["nft", "-j", "list", "table", "inet", "ip-masq-agent"]).stdout
    assert parse_list_json(listing) == desired_table(policy)
    kernel_objects = [o for o in json.loads(listing)["nftables"] if "metainfo" not in o]
    assert without_handles(kernel_objects) == list_json(desired_table(policy))
    # applying again over the current table is one transaction that leaves it the same
    node.run(["nft", "-f", "-"], stdin=render_script(policy))
    assert parse_list_json(node.run(["nft", "-j", "list", "table", "inet", "ip-masq-agent"]).stdout) == \
        desired_table(policy)


# --- real traffic ----------------------------------------------------------------------------------------------

POD, POD6 = "10.44.14.15", "fd44::15"
NODE, NODE6 = "10.142.15.203", "fd42::203"
PORT = 8080


@dataclass
class Path3:
    """pod -> node (runs our table) -> peer, the peer answering on every address (AnyIP)."""

    pod: Namespace
    node: Namespace
    peer: Namespace

    def seen(self, *destinations: str) -> dict[str, str]:
        """The source address the peer saw for one fresh TCP connection from the pod to each destination."""
        self.node.run(["conntrack", "-F"], check=False)  # every probe is a new connection, NATed afresh
        targets = [f"[{d}]:{PORT}" if ":" in d else f"{d}:{PORT}" for d in destinations]
        result = self.pod.run([sys.executable, "-m", "ipmasq.lab.probe", "connect-many", "--timeout", "2", *targets],
                              check=False)
        seen = dict(line.rsplit(" ", 1) for line in result.stdout.splitlines())
        return {d: seen[t] for d, t in zip(destinations, targets, strict=True)}


def build_path(net: Network) -> tuple[Path3, subprocess.Popen[str]]:
    pod, node, peer = net.add("pod"), net.add("node"), net.add("peer")
    for ns in (pod, node, peer):
        # link-local addresses under DAD for a second make the first IPv6 connections flaky
        ns.sysctl("net.ipv6.conf.default.accept_dad", "0")
    node.sysctl("net.ipv4.ip_forward", "1")
    node.sysctl("net.ipv6.conf.all.forwarding", "1")
    net.link(pod, [f"{POD}/24", f"{POD6}/64"], node, ["10.44.14.1/24", "fd44::1/64"])
    net.link(node, [f"{NODE}/20", f"{NODE6}/64"], peer, ["10.142.0.1/20", "fd42::1/64"])
    pod.run(["ip", "route", "add", "default", "via", "10.44.14.1"])
    pod.run(["ip", "-6", "route", "add", "default", "via", "fd44::1"])
    node.run(["ip", "route", "add", "default", "via", "10.142.0.1"])
    node.run(["ip", "-6", "route", "add", "default", "via", "fd42::1"])
    # AnyIP: the peer owns every address, so any destination reaches a real server there
    peer.run(["ip", "route", "add", "local", "0.0.0.0/0", "dev", "lo"])
    # (narrower for IPv6: a local ::/0 would swallow the replies to the pod's own address)
    for local in ("2000::/3", "fd00::/12"):
        peer.run(["ip", "-6", "route", "add", "local", local, "dev", "lo"])
    peer.run(["ip", "route", "add", "10.44.14.0/24", "via", NODE])  # pod IPs are routable, as in a VPC
    peer.run(["ip", "-6", "route", "add", "fd44::/64", "via", NODE6])
    return Path3(pod, node, peer), start_server(peer, [*LAB_PROBE, "serve", str(PORT)])


@pytest.fixture
def path(net: Network) -> Iterator[Path3]:
    p, server = build_path(net)
    try:
        yield p
    finally:
        stop_server(server)


def test_traffic_follows_the_policy(path: Path3) -> None:
    options = PolicyOptions(enable_ipv6=True)
    policy = make_policy("nonMasqueradeCIDRs: [10.0.0.0/8, 172.16.0.0/12, 'fd00::/8']\n"
                         "masqueradeCIDRs: [10.11.0.0/24, 'fd00:1::/32']\n", options)
    destinations = ["10.2.1.100", "172.30.12.110", "10.11.0.5", "34.120.0.10", "169.254.1.1",
                    "fd00:2::5", "fd00:1::5", "2001:db8::1"]
    before = path.seen(*destinations)
    assert before == {d: (POD6 if ":" in d else POD) for d in destinations}  # no table: nothing is masqueraded
    path.node.run(["nft", "-f", "-"], stdin=render_script(policy))
    after = path.seen(*destinations)
    for d in destinations:
        masquerade = policy.verdict(d).masquerade
        assert after[d] == ((NODE6 if ":" in d else NODE) if masquerade else (POD6 if ":" in d else POD)), d
    assert after["10.11.0.5"] == NODE and after["10.2.1.100"] == POD  # the VPN range's exception, by construction


def test_without_enable_ipv6_ipv6_leaves_with_the_pod_ip(path: Path3) -> None:
    path.node.run(["nft", "-f", "-"], stdin=render_script(make_policy("", PolicyOptions())))
    assert path.seen("34.120.0.10", "2001:db8::1", "10.1.2.3") == {
        "34.120.0.10": NODE, "2001:db8::1": POD6, "10.1.2.3": POD}


def test_to_ports_masquerades_into_the_ranges(path: Path3) -> None:
    options = PolicyOptions(to_ports=parse_to_ports("40000-40009,50000-50009"))
    path.node.run(["nft", "-f", "-"], stdin=render_script(make_policy("", options)))
    ports = set()
    for _ in range(20):  # each range has a 1/2 share: all 20 in one range happens 2 times in a million
        path.node.run(["conntrack", "-F"], check=False)
        assert path.seen("34.120.0.10") == {"34.120.0.10": NODE}
        listing = path.node.run(["conntrack", "-L", "-p", "tcp", "--dport", str(PORT)]).stdout
        # the reply tuple's dport (the last one on the line) is the source port the masquerade chose
        ports.update(int(line.rsplit("dport=", 1)[1].split()[0]) for line in listing.splitlines() if "dport=" in line)
    assert ports and all(40000 <= p <= 40009 or 50000 <= p <= 50009 for p in ports)
    assert any(p >= 50000 for p in ports) and any(p < 50000 for p in ports)
