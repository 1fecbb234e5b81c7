"""The whole path, pure: the measured node (two uplinks, policy routing, a mangle mark) from its iproute2 JSON and
iptables-save, each step naming what decided, and what the model says when it cannot decide or the packet never
leaves. tests/kernel/diagnose/test_path.py proves the same node against real TCP."""

from __future__ import annotations

import json

import pytest

from ipmasq.cloudnat import CloudNat, CloudNatMode
from ipmasq.diagnose.path import PathFacts, path
from ipmasq.netfilter.iptables import parse_save
from ipmasq.policy.packet import Outcome, Packet
from ipmasq.prefix import Family, parse_cidr
from ipmasq.route.iproute2 import parse_routing

RULES = [{"priority": 0, "src": "all", "table": "local"},
         {"priority": 32764, "src": "all", "fwmark": "0x80", "fwmask": "0x80", "table": "200"},
         {"priority": 32765, "src": "10.44.0.0", "srclen": 14, "dst": "172.30.0.0", "dstlen": 16, "table": "100"},
         {"priority": 32766, "src": "all", "table": "main"},
         {"priority": 32767, "src": "all", "table": "default"}]
ROUTES = [
    {"dst": "default", "gateway": "192.168.10.1", "dev": "eth0", "flags": []},
    {"dst": "10.44.0.0/24", "dev": "cni0", "protocol": "kernel", "scope": "link", "prefsrc": "10.44.0.1",
     "flags": []},
    {"dst": "192.168.10.0/24", "dev": "eth0", "protocol": "kernel", "scope": "link", "prefsrc": "192.168.10.2",
     "flags": []},
    {"dst": "192.168.20.0/24", "dev": "eth1", "protocol": "kernel", "scope": "link", "prefsrc": "192.168.20.2",
     "flags": []},
    {"dst": "172.30.0.0/16", "gateway": "192.168.20.1", "dev": "eth1", "table": "100", "flags": []},
    {"dst": "default", "gateway": "192.168.20.1", "dev": "eth1", "table": "200", "prefsrc": "192.168.20.99",
     "flags": []},
    {"type": "blackhole", "dst": "203.0.113.0/24", "flags": []},
    {"dst": "198.18.0.0/15", "flags": [], "nexthops": [{"gateway": "192.168.10.1", "dev": "eth0", "weight": 1},
                                                       {"gateway": "192.168.20.1", "dev": "eth1", "weight": 1}]},
    {"dst": "10.60.0.0/16", "flags": [], "nexthops": [{"gateway": "192.168.10.1", "dev": "eth0", "weight": 1},
                                                      {"gateway": "192.168.10.3", "dev": "eth0", "weight": 1}]},
    {"type": "local", "dst": "192.168.10.2", "dev": "eth0", "table": "local", "scope": "host", "flags": []},
    {"type": "local", "dst": "192.168.20.2", "dev": "eth1", "table": "local", "scope": "host", "flags": []},
    {"type": "local", "dst": "192.168.20.99", "dev": "eth1", "table": "local", "scope": "host", "flags": []},
]
LINKS = [
    {"ifindex": 1, "ifname": "lo", "flags": ["UP"], "addr_info": [
        {"family": "inet", "local": "127.0.0.1", "prefixlen": 8, "scope": "host"}]},
    {"ifindex": 2, "ifname": "eth0", "flags": ["UP"], "addr_info": [
        {"family": "inet", "local": "192.168.10.2", "prefixlen": 24, "scope": "global"}]},
    {"ifindex": 3, "ifname": "eth1", "flags": ["UP"], "addr_info": [
        {"family": "inet", "local": "192.168.20.2", "prefixlen": 24, "scope": "global"},
        {"family": "inet", "local": "192.168.20.99", "prefixlen": 24, "scope": "global", "secondary": True}]},
    {"ifindex": 4, "ifname": "cni0", "flags": ["UP"], "addr_info": [
        {"family": "inet", "local": "10.44.0.1", "prefixlen": 24, "scope": "global"}]},
]
SAVE = """\
*mangle
:PREROUTING ACCEPT [0:0]
-A PREROUTING -s 10.44.0.0/14 -p tcp -m tcp --dport 5432 -j MARK --set-xmark 0x80/0x80
COMMIT
*nat
:PREROUTING ACCEPT [0:0]
:POSTROUTING ACCEPT [0:0]
-A POSTROUTING ! -d 10.0.0.0/8 -j MASQUERADE
-A POSTROUTING -d 10.60.0.0/16 -o eth0 -j MASQUERADE
COMMIT
"""
ROUTING = parse_routing("\n".join(json.dumps(a) for a in (RULES, ROUTES, LINKS)), "node.json")
NODE = PathFacts(ROUTING, {Family.V4: parse_save(SAVE)}, {Family.V4: parse_save(SAVE, "mangle")})


def _ask(destination: str, port: int | None = 80, node: PathFacts = NODE, **more: object) -> object:
    return path(node, Packet.of(destination, source="10.44.0.5", protocol="tcp", port=port, **more))  # type: ignore[arg-type]


@pytest.mark.parametrize(("destination", "port", "seen", "device"), [
    ("198.51.100.10", 80, "192.168.10.2", "eth0"),
    ("198.51.100.10", 5432, "192.168.20.2", "eth1"),  # marked, table 200: eth1's primary, not the route's src .99
    ("172.30.1.10", 80, "192.168.20.2", "eth1"),
    ("10.20.0.5", 80, "10.44.0.5", "eth0"),
    ("10.20.0.5", 5432, "10.44.0.5", "eth1"),
])
def test_the_measured_node(destination: str, port: int, seen: str, device: str) -> None:
    answer = _ask(destination, port)
    assert answer.source_seen == seen and answer.out_interface == device  # type: ignore[attr-defined]
    stages = [s.stage for s in answer.steps]  # type: ignore[attr-defined]
    assert stages[0] == "in-interface" and answer.in_interface == "cni0"  # type: ignore[attr-defined]
    assert "rule" in stages and "table" in stages and "nat" in stages
    if seen != "10.44.0.5":
        masquerade = answer.steps[-1]  # type: ignore[attr-defined]
        assert masquerade.stage == "masquerade" and seen in masquerade.result
    if port == 5432:
        assert answer.mark == 0x80 and any(s.stage == "mangle" for s in answer.steps)  # type: ignore[attr-defined]


def test_local_delivery_and_drops() -> None:
    local = _ask("192.168.20.99")
    assert local.source_seen == "10.44.0.5" and local.outcome is Outcome.PRESERVE  # type: ignore[attr-defined]
    assert local.nat is None and "delivered to the node" in local.steps[-1].result  # type: ignore[attr-defined]
    dropped = _ask("203.0.113.7")
    assert dropped.source_seen is None and not dropped.delivered  # type: ignore[attr-defined]
    assert "blackhole" in dropped.undecided  # type: ignore[attr-defined]


def test_multipath_one_of_its_hops() -> None:
    differ = _ask("198.18.0.1")
    assert differ.source_seen is None and "multipath" in differ.undecided  # type: ignore[attr-defined]
    assert "192.168.10.2" in differ.undecided and "192.168.20.2" in differ.undecided  # type: ignore[attr-defined]
    assert "--out-interface" in differ.undecided  # type: ignore[attr-defined]
    # each hop's way is shown, not the first one's as if it were the answer
    left_by = [s.result for s in differ.steps if s.stage in ("route", "masquerade")]  # type: ignore[attr-defined]
    assert [r.split(" via")[0].split(":")[0] for r in left_by] == [
        "leaves by eth0", "192.168.10.2", "leaves by eth1", "192.168.20.2"], left_by
    same = _ask("10.60.1.1")  # both hops on eth0: the same answer whichever the hash picks
    assert same.source_seen == "192.168.10.2" and any("multipath" in n for n in same.notes)  # type: ignore[attr-defined]
    chosen = _ask("198.18.0.1", out_interface="eth1")
    assert chosen.source_seen == "192.168.20.2"  # type: ignore[attr-defined]


def test_multipath_across_devices_names_no_one_device_when_the_source_is_the_same() -> None:
    """The hops agree on the source (the pod's, unmasqueraded) and leave by different devices: the answer gives the
    source and does not name the first hop's device as the way out (the kernel's hash picks either)."""
    spread = {"dst": "10.70.0.0/16", "flags": [], "nexthops": [{"gateway": "192.168.10.1", "dev": "eth0"},
                                                               {"gateway": "192.168.20.1", "dev": "eth1"}]}
    routing = parse_routing("\n".join(json.dumps(a) for a in (RULES, [*ROUTES, spread], LINKS)), "node.json")
    node = PathFacts(routing, NODE.nat, NODE.mangle)
    answer = _ask("10.70.1.1", node=node)
    assert answer.source_seen == "10.44.0.5" and answer.outcome is Outcome.PRESERVE  # type: ignore[attr-defined]
    assert answer.out_interface is None and answer.nexthop is None  # type: ignore[attr-defined]
    assert any("one of eth0, eth1" in n for n in answer.notes)  # type: ignore[attr-defined]
    left_by = [s.result for s in answer.steps if s.stage == "route"]  # type: ignore[attr-defined]
    assert [r.split(" via")[0] for r in left_by] == ["leaves by eth0", "leaves by eth1"], left_by
    # both hops on eth0: the device is known, the gateway is not
    same = _ask("10.60.1.1")
    assert same.out_interface == "eth0" and same.nexthop is None  # type: ignore[attr-defined]
    assert _ask("10.70.1.1", node=node, out_interface="eth1").out_interface == "eth1"  # type: ignore[attr-defined]


def test_overrides_and_missing_facts() -> None:
    assert _ask("198.51.100.10", local_addresses=["192.0.2.7"]).source_seen == "192.0.2.7"  # type: ignore[attr-defined]
    no_port = _ask("198.51.100.10", port=None)
    assert no_port.source_seen is None and "--port" in no_port.undecided  # type: ignore[attr-defined]
    bare = PathFacts(None, {Family.V4: parse_save(SAVE)})
    unknown = _ask("198.51.100.10", node=bare)
    assert unknown.outcome is Outcome.MASQUERADE and unknown.source_seen is None  # type: ignore[attr-defined]
    assert "--out-interface" in unknown.undecided  # type: ignore[attr-defined]
    given = _ask("198.51.100.10", node=bare, out_interface="eth0", local_addresses=["192.168.10.2"])
    assert given.source_seen == "192.168.10.2"  # type: ignore[attr-defined]
    no_source = path(NODE, Packet.of("198.51.100.10"))
    assert no_source.source_seen is None and "--source" in (no_source.undecided or "")


def test_cloud_nat_behind_the_node() -> None:
    nat = CloudNat(CloudNatMode.PRIMARY_IP_RANGE, "34.1.2.3", (parse_cidr("192.168.0.0/16"),),
                   (parse_cidr("10.44.0.0/14"),))
    translated = path(NODE, Packet.of("34.120.0.10", source="10.44.0.5", protocol="tcp", port=80), cloud_nat=nat)
    assert translated.source_seen == "34.1.2.3" and translated.steps[-1].stage == "cloud-nat"
    secondary = CloudNat(CloudNatMode.LIST_OF_SECONDARY_IP_RANGES, "34.1.2.3", (parse_cidr("192.168.0.0/16"),),
                         (parse_cidr("10.44.0.0/14"),))
    dropped = path(NODE, Packet.of("34.120.0.10", source="10.44.0.5", protocol="tcp", port=80),
                   cloud_nat=secondary)
    assert dropped.source_seen is None and not dropped.delivered and "Cloud NAT" in (dropped.undecided or "")


def test_the_in_interface_is_the_route_to_the_pod_not_the_pods_own_table() -> None:
    # AWS VPC CNI: `from POD lookup ENI_TABLE` sends the pod's packets out of its ENI; the way back to the pod is
    # the main table's route to its veth (its `to POD lookup main` rule, here the main table alone)
    rules = [*RULES[:1], {"priority": 1536, "src": "10.44.0.5", "table": "2"}, *RULES[1:]]
    routes = [*ROUTES, {"dst": "default", "gateway": "192.168.20.1", "dev": "eth1", "table": "2", "flags": []}]
    routing = parse_routing("\n".join(json.dumps(a) for a in (rules, routes, LINKS)), "aws.json")
    answer = path(PathFacts(routing, {Family.V4: parse_save(SAVE)}),
                  Packet.of("198.51.100.10", source="10.44.0.5", protocol="tcp", port=80))
    assert answer.in_interface == "cni0" and answer.out_interface == "eth1"
    assert answer.source_seen == "192.168.20.2"
    assert any(s.decided_by.startswith("1536: from 10.44.0.5 lookup 2") for s in answer.steps)


def test_a_mark_set_in_nat_prerouting_routes_the_connection() -> None:
    # AWS VPC CNI: a pod on a secondary ENI (rule 1536: table 2, eth1) to outside the VPC gets connmark 0x80 in
    # nat PREROUTING, restored into the packet's mark there; rule 1024 then routes it through main (eth0)
    rules = [*RULES[:1], {"priority": 1024, "src": "all", "fwmark": "0x80", "fwmask": "0x80", "table": "main"},
             {"priority": 1536, "src": "10.44.0.5", "table": "2"}, *RULES[3:]]
    routes = [*ROUTES, {"dst": "default", "gateway": "192.168.20.1", "dev": "eth1", "table": "2", "flags": []}]
    routing = parse_routing("\n".join(json.dumps(a) for a in (rules, routes, LINKS)), "aws.json")
    nat = parse_save("*nat\n:PREROUTING ACCEPT [0:0]\n:POSTROUTING ACCEPT [0:0]\n"
                     "-A PREROUTING -i cni0 ! -d 192.168.0.0/16 -j CONNMARK --set-xmark 0x80/0x80\n"
                     "-A PREROUTING -j CONNMARK --restore-mark --nfmask 0x80 --ctmask 0x80\n"
                     "-A POSTROUTING ! -d 192.168.0.0/16 -j SNAT --to-source 192.168.10.2\nCOMMIT\n")
    node = PathFacts(routing, {Family.V4: nat})
    outside = path(node, Packet.of("198.51.100.10", source="10.44.0.5", protocol="tcp", port=80))
    assert (outside.mark, outside.out_interface, outside.source_seen) == (0x80, "eth0", "192.168.10.2")
    assert any(s.stage == "mangle" and s.decided_by.startswith("nat -A PREROUTING") for s in outside.steps)
    vpc = path(node, Packet.of("192.168.30.10", source="10.44.0.5", protocol="tcp", port=80))
    assert (vpc.mark, vpc.out_interface, vpc.source_seen) == (0, "eth1", "10.44.0.5")


def test_addresses_alone_name_the_masquerade_address_of_the_interface_given() -> None:
    links_only = parse_routing(json.dumps(LINKS), "addr.json")
    facts = PathFacts(links_only, {Family.V4: parse_save(SAVE)})
    answer = path(facts, Packet.of("198.51.100.10", source="10.44.0.5", protocol="tcp", port=80,
                                   out_interface="eth1"))
    assert answer.delivered and answer.route is None and answer.source_seen == "192.168.20.2"
    unknown = path(facts, Packet.of("198.51.100.10", source="10.44.0.5", protocol="tcp", port=80))
    assert unknown.delivered and unknown.source_seen is None and "--out-interface" in (unknown.undecided or "")
