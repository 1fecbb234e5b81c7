"""The routing decision against the kernel's own: `ip route get` for a forwarded packet (iif, mark, protocol and
port given) on a node with rules of every action and routes of every type, IPv4 and IPv6; the model must name the
same device and gateway, or the same refusal."""

from __future__ import annotations

import json

import pytest

from ipmasq.diagnose.path_sources import read_live_routing
from ipmasq.lab.netns import Namespace, NamespaceRunner, Network
from ipmasq.prefix import Family, format_address, parse_address
from ipmasq.route.lookup import Fib, Flow

# `ip route get`'s refusals, by what the kernel answered
_REFUSALS = {"Network is unreachable": {"no-route", "unreachable"}, "No route to host": {"unreachable"},
             "Permission denied": {"prohibit"}, "Invalid argument": {"blackhole"}}

V4_SETUP = [
    "route add default via 192.168.10.1 dev {eth0}",
    "route add 172.30.0.0/16 via 192.168.20.1 dev {eth1} table 100",
    "route add throw 172.30.9.0/24 table 100",
    "route add default via 192.168.20.1 dev {eth1} table 200",
    "route add blackhole 198.51.100.0/28 table 200",
    "route add prohibit 198.51.100.16/28 table 200",
    "route add unreachable 198.51.100.32/28",
    "route add 203.0.113.0/24 via 192.168.20.1 dev {eth1} table 300",
    "route add 203.0.113.0/25 via 192.168.10.1 dev {eth0} table 300 metric 5",
    "route add 203.0.113.0/25 via 192.168.20.1 dev {eth1} table 300 metric 1",
    "rule add priority 100 from 10.44.0.0/14 to 172.30.0.0/16 lookup 100",
    "rule add priority 110 fwmark 0x80/0x80 lookup 200",
    "rule add priority 120 ipproto tcp dport 8000-8100 lookup 200",
    "rule add priority 130 iif {pod} to 203.0.113.0/24 lookup 300",
    "rule add priority 140 to 192.0.2.0/24 goto 160",
    "rule add priority 150 to 192.0.2.0/24 prohibit",
    "rule add priority 160 lookup 200 suppress_prefixlength 0",
    "rule add priority 170 uidrange 1000-2000 prohibit",
    "rule add priority 180 not fwmark 0x0/0x4 blackhole",
]
V4_FLOWS = [  # destination, source, mark, protocol, port (None: udp to 53)
    ("198.51.100.200", "10.44.0.5", 0, None, None), ("172.30.1.1", "10.44.0.5", 0, None, None),
    ("172.30.9.1", "10.44.0.5", 0, None, None), ("172.30.1.1", "10.99.0.5", 0, None, None),
    ("198.51.100.5", "10.44.0.5", 0x80, None, None), ("198.51.100.20", "10.44.0.5", 0x81, None, None),
    ("198.51.100.40", "10.44.0.5", 0, None, None), ("198.51.100.200", "10.44.0.5", 0, "tcp", 8080),
    ("198.51.100.5", "10.44.0.5", 0, "tcp", 8080), ("198.51.100.5", "10.44.0.5", 0, "udp", 8080),
    ("203.0.113.7", "10.44.0.5", 0, None, None), ("203.0.113.200", "10.44.0.5", 0, None, None),
    ("192.0.2.7", "10.44.0.5", 0, None, None), ("192.0.2.200", "10.44.0.5", 0, None, None),
    ("192.0.2.200", "10.99.0.5", 0, None, None), ("198.51.100.200", "10.44.0.5", 0x4, None, None),
]
V6_SETUP = [
    "-6 route add default via fd10::1 dev {eth0}",
    "-6 route add fd30::/16 via fd20::1 dev {eth1} table 100",
    "-6 route add default via fd20::1 dev {eth1} table 200",
    "-6 route add blackhole 2001:db8:5::/48 table 200",
    "-6 route add throw 2001:db8:6::/48 table 200",
    "-6 route add 2001:db8:7::/48 via fd20::1 dev {eth1} metric 10",
    "-6 route add 2001:db8:7::/48 via fd10::1 dev {eth0} metric 5",
    "-6 rule add priority 100 from fd44::/16 to fd30::/16 lookup 100",
    "-6 rule add priority 110 fwmark 0x80/0x80 lookup 200",
]
V6_FLOWS = [("2001:db8:100::1", "fd44::5", 0, None, None), ("fd30::1", "fd44::5", 0, None, None),
            ("2001:db8:100::1", "fd44::5", 0x80, None, None), ("2001:db8:5::1", "fd44::5", 0x80, None, None),
            ("2001:db8:7::1", "fd44::5", 0, None, None), ("fd30::1", "fd99::5", 0, None, None),
            ("2001:db8:6::1", "fd44::5", 0x80, None, None)]


def _node(net: Network, family: Family) -> tuple[Namespace, dict[str, str]]:
    node, up_a, up_b, pod = net.add("node"), net.add("a"), net.add("b"), net.add("pod")
    v6 = family is Family.V6
    node.sysctl("net.ipv6.conf.all.forwarding" if v6 else "net.ipv4.ip_forward", "1")
    node.sysctl("net.ipv4.conf.all.rp_filter", "0")
    node.sysctl("net.ipv4.conf.default.rp_filter", "0")
    pod_if, _ = net.link(node, ["fd44::1/64" if v6 else "10.44.0.1/24"], pod, ["fd44::5/64" if v6 else "10.44.0.5/24"])
    eth0, _ = net.link(node, ["fd10::2/64" if v6 else "192.168.10.2/24"], up_a, ["fd10::1/64" if v6 else
                                                                                "192.168.10.1/24"])
    eth1, _ = net.link(node, ["fd20::2/64" if v6 else "192.168.20.2/24"], up_b, ["fd20::1/64" if v6 else
                                                                                "192.168.20.1/24"])
    names = {"eth0": eth0, "eth1": eth1, "pod": pod_if}
    node.sysctl(f"net.ipv4.conf.{pod_if}.rp_filter", "0")
    for line in V6_SETUP if v6 else V4_SETUP:
        node.run(["ip", *line.format(**names).split()])
    return node, names


def _kernel(node: Namespace, flow: tuple[str, str, int, str | None, int | None], iif: str) -> tuple[str, ...]:
    destination, source, mark, protocol, port = flow
    argv = ["ip", "-j", "route", "get", destination, "from", source, "iif", iif, "mark", str(mark), "ipproto",
            protocol or "udp", "dport", str(port or 53)]
    result = node.run(argv, check=False)
    if result.returncode != 0:
        return ("refused", result.stderr.strip().rsplit(": ", 1)[-1])
    got = json.loads(result.stdout)[0]
    return ("unicast", got.get("dev", ""), got.get("gateway", ""))


@pytest.mark.parametrize("family", [Family.V4, Family.V6], ids=["v4", "v6"])
def test_the_lookup_agrees_with_ip_route_get(net: Network, family: Family) -> None:
    node, names = _node(net, family)
    fib = Fib(read_live_routing(NamespaceRunner(node)))
    seen: set[str] = set()
    for flow in V6_FLOWS if family is Family.V6 else V4_FLOWS:
        destination, source, mark, protocol, port = flow
        kernel = _kernel(node, flow, names["pod"])
        decision = fib.lookup(Flow(family, parse_address(destination)[1], parse_address(source)[1], names["pod"],
                                   mark, {"tcp": 6, "udp": 17}[protocol or "udp"], None, port or 53))
        seen.add(decision.kind if decision.route is None else f"{decision.kind} table {decision.route.table}")
        if kernel[0] == "refused":
            assert decision.kind in _REFUSALS.get(kernel[1], {kernel[1]}), (flow, kernel, decision)
            continue
        assert decision.kind == "unicast", (flow, kernel, decision)
        hop = decision.nexthops[0]
        gateway = "" if hop.gateway is None else format_address(family, hop.gateway)
        assert ("unicast", hop.device, gateway) == kernel, (flow, decision.described)
    # the flows reach every kind of decision the node holds
    wanted = {"unicast table main", "unicast table 100", "unicast table 200"}
    if family is Family.V6:
        wanted |= {"blackhole table 200"}
    if family is Family.V4:
        wanted |= {"unicast table 300", "prohibit table 200", "unreachable table main", "blackhole",
                   "blackhole table 200"}
    assert wanted <= seen, seen
