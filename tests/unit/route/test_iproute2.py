"""Reading iproute2's JSON: the shapes `ip -j rule`, `ip -j route show table all` and `ip -j addr` really print
(captured from iproute2 6.1 in a namespace), and hostile input ending in one RouteDumpError line."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ipmasq.errors import RouteDumpError
from ipmasq.prefix import Family, parse_address, parse_cidr
from ipmasq.route.iproute2 import parse_routing

RULES4 = [{"priority": 0, "src": "all", "table": "local"},
          {"priority": 50, "not": None, "src": "all", "iif": "pmxa", "oif": "pmxb", "uid_start": 0, "uid_end": 10,
           "ipproto": "tcp", "sport": 5, "dport_start": 80, "dport_end": 90, "table": "300", "suppress_prefixlen": 0},
          {"priority": 60, "src": "all", "goto": 32766},
          {"priority": 80, "src": "all", "iif": "nosuch", "iif_detached": None, "action": "prohibit"},
          {"priority": 90, "src": "all", "nop": None},
          {"priority": 32764, "src": "all", "fwmark": "0x80", "fwmask": "0x80", "table": "200"},
          {"priority": 32765, "src": "10.44.0.0", "srclen": 14, "dst": "172.30.0.0", "dstlen": 16, "table": "100"},
          {"priority": 32766, "src": "all", "table": "main"},
          {"priority": 32767, "src": "all", "table": "default"}]
RULES6 = [{"priority": 0, "src": "all", "table": "local"},
          {"priority": 32765, "src": "fd00::", "srclen": 8, "table": "100"},
          {"priority": 32766, "src": "all", "table": "main"}]
ROUTES = [
    {"dst": "default", "gateway": "192.168.20.1", "dev": "eth1", "table": "200", "prefsrc": "192.168.20.99",
     "flags": []},
    {"dst": "192.168.20.0/24", "dev": "eth1", "protocol": "kernel", "scope": "link", "prefsrc": "192.168.20.2",
     "flags": []},
    {"type": "local", "dst": "192.168.20.2", "dev": "eth1", "table": "local", "protocol": "kernel",
     "scope": "host", "prefsrc": "192.168.20.2", "flags": []},
    {"dst": "172.30.0.0/16", "table": "100", "flags": [],
     "nexthops": [{"gateway": "192.168.20.3", "dev": "eth1", "weight": 2, "flags": []},
                  {"gateway": "192.168.20.4", "dev": "eth1", "weight": 1, "flags": []}]},
    {"type": "throw", "dst": "10.8.0.0/16", "table": "100", "flags": []},
    {"type": "unreachable", "dst": "10.7.0.0/16", "table": "100", "metric": 7, "flags": []},
    {"dst": "2001:db8::/32", "gateway": "fd00:20::1", "dev": "eth1", "table": "100", "prefsrc": "fd00:20::2",
     "metric": 5, "flags": [], "pref": "medium"},
    {"dst": "default", "dev": "eth1", "protocol": "kernel", "metric": 1024, "flags": [], "pref": "medium"},
    {"type": "local", "dst": "::1", "dev": "lo", "table": "local", "protocol": "kernel", "metric": 0, "flags": [],
     "pref": "medium"},
]
ADDRESSES = [
    {"ifindex": 1, "ifname": "lo", "flags": ["LOOPBACK", "UP", "LOWER_UP"], "addr_info": [
        {"family": "inet", "local": "127.0.0.1", "prefixlen": 8, "scope": "host", "label": "lo"},
        {"family": "inet6", "local": "::1", "prefixlen": 128, "scope": "host"}]},
    {"ifindex": 6, "link": "pmxb", "ifname": "eth1", "flags": ["BROADCAST", "MULTICAST", "UP", "LOWER_UP"],
     "addr_info": [
         {"family": "inet", "local": "192.168.20.2", "prefixlen": 24, "scope": "global", "label": "eth1"},
         {"family": "inet", "local": "192.168.20.99", "prefixlen": 24, "scope": "global", "secondary": True,
          "label": "eth1"},
         {"family": "inet6", "local": "fd00:20::2", "prefixlen": 64, "scope": "global", "nodad": True},
         {"family": "inet6", "local": "fe80::b0b4:68ff:fed3:a893", "prefixlen": 64, "scope": "link",
          "tentative": True}]},
]


def _dump(*arrays: object) -> str:
    return "\n".join(json.dumps(a) for a in arrays)


def test_every_field_of_the_real_outputs_is_read() -> None:
    routing = parse_routing(_dump(RULES4, RULES6, ROUTES, ADDRESSES), "node.json")
    assert routing.read == {"rules", "routes", "links"}
    rules = {(r.family, r.priority): r for r in routing.rules}
    odd = rules[(Family.V4, 50)]
    assert odd.invert and odd.iif == "pmxa" and odd.oif == "pmxb" and odd.uid_range == (0, 10)
    assert odd.ipproto == 6 and odd.sport == (5, 5) and odd.dport == (80, 90) and odd.suppress_prefixlength == 0
    assert odd.text == ("50: not from all iif pmxa oif pmxb uidrange 0-10 ipproto tcp sport 5 dport 80-90 "
                        "lookup 300 suppress_prefixlength 0")
    assert rules[(Family.V4, 60)].action == "goto" and rules[(Family.V4, 60)].goto == 32766
    assert rules[(Family.V4, 80)].action == "prohibit" and rules[(Family.V4, 80)].iif_detached
    assert rules[(Family.V4, 90)].action == "nop"
    marked = rules[(Family.V4, 32764)]
    assert (marked.fwmark, marked.fwmask, marked.table) == (0x80, 0x80, "200")
    assert marked.text == "32764: from all fwmark 0x80/0x80 lookup 200"
    vpc = rules[(Family.V4, 32765)]
    assert vpc.source == parse_cidr("10.44.0.0/14") and vpc.destination == parse_cidr("172.30.0.0/16")
    assert vpc.text == "32765: from 10.44.0.0/14 to 172.30.0.0/16 lookup 100"
    assert rules[(Family.V6, 32765)].source == parse_cidr("fd00::/8")  # the second rules array is IPv6's
    routes = {(r.family, r.table, str(r.destination)): r for r in routing.routes}
    default200 = routes[(Family.V4, "200", "0.0.0.0/0")]
    assert default200.preferred_source == parse_address("192.168.20.99")[1]
    assert default200.text == "default via 192.168.20.1 dev eth1 table 200 src 192.168.20.99"
    multipath = routes[(Family.V4, "100", "172.30.0.0/16")]
    assert [(h.device, h.weight) for h in multipath.nexthops] == [("eth1", 2), ("eth1", 1)]
    assert routes[(Family.V4, "100", "10.8.0.0/16")].kind == "throw"
    assert routes[(Family.V4, "100", "10.7.0.0/16")].metric == 7
    assert routes[(Family.V4, "local", "192.168.20.2/32")].kind == "local"
    assert routes[(Family.V6, "main", "::/0")].metric == 1024  # a default route without a gateway: its pref tells
    assert routes[(Family.V6, "100", "2001:db8::/32")].nexthops[0].gateway == parse_address("fd00:20::1")[1]
    eth1 = routing.link("eth1")
    assert eth1 is not None and eth1.index == 6 and eth1.up
    assert [(a.text, a.secondary) for a in eth1.addresses] == [
        ("192.168.20.2", False), ("192.168.20.99", True), ("fd00:20::2", False), ("fe80::b0b4:68ff:fed3:a893", False)]
    assert "tentative" in eth1.addresses[-1].flags


def test_a_rules_array_is_told_by_its_priorities_even_when_its_first_rule_names_a_destination() -> None:
    routing = parse_routing(_dump(RULES4[6:7], ROUTES), "x")
    assert routing.read == {"rules", "routes"} and routing.rules[0].priority == 32765


def test_a_field_the_model_does_not_know_is_kept_not_dropped() -> None:
    rule = {"priority": 5, "src": "all", "table": "main", "flowlabel": "0x1"}
    routing = parse_routing(_dump([rule]), "x")
    assert routing.rules[0].unknown == ("flowlabel",)


@pytest.mark.parametrize(("text", "said"), [
    ("", "empty"),
    ("{}", "a JSON dict"),
    ("[1, 2]", "none of ip -j rule"),
    ('[{"priority": "x", "table": "main"}]', "priority is not a number"),
    ('[{"priority": 1}]', "no action"),
    ('[{"dst": "300.1.1.1/8"}]', "dst is not an address"),
    ('[{"dst": "10.0.0.0/40"}]', "out of range"),
    ('[{"dst": "10.0.0.0/8", "type": "wormhole"}]', "unknown type"),
    ('[{"dst": "10.0.0.0/8", "nexthops": 5}]', "nexthops"),
    ('[{"ifname": "eth0", "addr_info": [{"family": "inet", "local": "::1"}]}]', "not an IPv4 address"),
    ("[" * 100_000, "nested too deep"),
    ('[{"priority": 1, "table": "main"}] garbage', "not iproute2's JSON"),
])
def test_hostile_input_is_one_line(text: str, said: str) -> None:
    with pytest.raises(RouteDumpError) as caught:
        parse_routing(text, "dump.json")
    message = str(caught.value)
    assert said in message and message.startswith("dump.json: ") and "\n" not in message
    assert len(message) < 400


@settings(max_examples=300, deadline=None)
@given(st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=20),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
                        st.sampled_from(["priority", "dst", "src", "table", "ifname", "addr_info", "gateway",
                                         "nexthops", "dev", "family", "local", "srclen", "fwmark", "type",
                                         "goto", "metric", "scope", "prefixlen"]), inner, max_size=6),
                    max_leaves=20))
def test_any_json_is_a_routing_or_one_error(value: object) -> None:
    try:
        parse_routing(json.dumps([value]), "x")
    except RouteDumpError as exc:
        assert "\n" not in str(exc)
