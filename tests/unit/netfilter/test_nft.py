"""The nftables table: rendering from a Policy, the script and JSON dialects, and their round trips (hypothesis)."""

from __future__ import annotations

import ipaddress
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ipmasq.errors import NftParseError
from ipmasq.netfilter.nft import (
    MARKER_SET,
    NftSet,
    desired_table,
    format_element,
    format_elements,
    render_script,
    table_digest,
)
from ipmasq.netfilter.nft_json import parse_list_json, rule_from_json
from ipmasq.options import PolicyOptions, parse_to_ports
from ipmasq.policy.policy import Policy
from ipmasq.prefix import Family, parse_address
from ipmasq.testing.nft import list_json, parse_script, rule_to_json
from tests.configs import policy_of

DEFAULT_OPTIONS = PolicyOptions()


def policy(text: str, options: PolicyOptions = DEFAULT_OPTIONS) -> Policy:
    return policy_of(text, options)


def listing(objects: list[dict[str, object]]) -> str:
    return json.dumps({"nftables": [{"metainfo": {"version": "1.0.6", "json_schema_version": 1}}, *objects]})


def test_default_policy_script() -> None:
    script = render_script(policy(""))
    assert script.startswith("table inet ip-masq-agent\ndelete table inet ip-masq-agent\ntable inet ip-masq-agent {\n")
    assert "elements = { 10.0.0.0/8,\n\t\t\t169.254.0.0/16,\n\t\t\t172.16.0.0/12,\n\t\t\t192.168.0.0/16 }" in script
    assert "type nat hook postrouting priority srcnat; policy accept;" in script
    assert "nomasq_v6" not in script  # no --enable-ipv6: no IPv6 set, and IPv6 leaves untouched
    chain = desired_table(policy("")).chains[0]
    assert [r.split(" comment ")[0] for r in chain.rules] == [
        "fib daddr type local return", "meta nfproto ipv6 return", "ip daddr @nomasq_v4 return",
        "masquerade fully-random"]


def test_exceptions_are_resolved_into_the_set() -> None:
    # the VPN range inside 10/8: the VPN 10.11.0.0/24 inside 10.0.0.0/8 is masqueraded; no rule of its own is needed
    p = policy("nonMasqueradeCIDRs: [10.0.0.0/8]\nmasqueradeCIDRs: [10.11.0.0/24]\n")
    marker, nomasq = desired_table(p).sets
    # ipmasq's ownership marker: no flags, no elements, the digest of the rest of the table as its comment
    assert marker == NftSet(MARKER_SET, "ipv4_addr", (), (), f"ipmasq wrote sha256:{table_digest(desired_table(p))}")
    texts = [format_element(Family.V4, a, b) for a, b in nomasq.elements]
    assert texts == ["10.0.0.0-10.10.255.255", "10.11.1.0-10.255.255.255", "169.254.0.0/16"]
    assert all("10.11" not in r for r in desired_table(p).chains[0].rules)


def test_masq_link_local_and_empty_list_leave_an_empty_set_without_an_elements_line() -> None:
    p = policy("nonMasqueradeCIDRs: []\nmasqLinkLocal: true\n")
    script = render_script(p)
    assert "elements" not in script
    (definition,) = [c.definition for c in parse_script(script) if c.definition is not None]
    assert definition == desired_table(p)


def test_to_ports_and_random_fully() -> None:
    options = PolicyOptions(random_fully=False, to_ports=parse_to_ports("1000-1999,2000-2999,3000"))
    rules = [r.split(" comment ")[0] for r in desired_table(policy("", options)).chains[0].rules]
    assert rules[-4:] == [
        "meta l4proto { tcp, udp, sctp } numgen random mod 3 0 masquerade to :1000-1999",
        "meta l4proto { tcp, udp, sctp } numgen random mod 2 0 masquerade to :2000-2999",
        "meta l4proto { tcp, udp, sctp } masquerade to :3000",
        "masquerade",
    ]


def test_ipv6_set_and_rule() -> None:
    options = PolicyOptions(enable_ipv6=True)
    table = desired_table(policy("nonMasqueradeCIDRs: ['fd00::/8', 10.0.0.0/8]\nmasqueradeCIDRs: ['fd00:1::/32']\n",
                                 options))
    v6 = table.set_named("nomasq_v6")
    assert v6 is not None and v6.type == "ipv6_addr"
    assert [format_element(Family.V6, a, b) for a, b in v6.elements] == [
        "fd00::/32", "fd00:2::-fdff:ffff:ffff:ffff:ffff:ffff:ffff:ffff", "fe80::/10"]
    assert "ip6 daddr @nomasq_v6 return" in table.chains[0].rules[2]
    assert not any("nfproto ipv6" in r for r in table.chains[0].rules)


@pytest.mark.parametrize(("first", "last", "text"), [
    ("10.0.0.0", "10.255.255.255", "10.0.0.0/8"),
    ("10.0.0.1", "10.0.0.1", "10.0.0.1"),
    ("10.0.0.0", "10.0.0.2", "10.0.0.0-10.0.0.2"),
    ("10.0.0.2", "10.0.0.3", "10.0.0.2/31"),
    ("0.0.0.0", "255.255.255.255", "0.0.0.0/0"),
])
def test_format_element(first: str, last: str, text: str) -> None:
    assert format_element(Family.V4, parse_address(first)[1], parse_address(last)[1]) == text


def test_kernel_shaped_listing_parses() -> None:
    # the shapes nft 1.0.6 prints: a bare address, a prefix, a range, and elements wrapped with a comment
    text = listing([
        {"table": {"family": "inet", "name": "ip-masq-agent", "handle": 7}},
        {"set": {"family": "inet", "name": "nomasq_v4", "table": "ip-masq-agent", "type": "ipv4_addr", "handle": 2,
                 "flags": ["interval"], "elem": [
                     "1.2.3.4", {"range": ["5.0.0.1", "5.0.0.9"]}, {"prefix": {"addr": "10.0.0.0", "len": 8}},
                     {"elem": {"val": "11.0.0.1", "comment": "hi"}}]}},
        {"chain": {"family": "inet", "table": "ip-masq-agent", "name": "postrouting", "handle": 1, "type": "nat",
                   "hook": "postrouting", "prio": 100, "policy": "accept"}},
        {"rule": {"family": "inet", "table": "ip-masq-agent", "chain": "postrouting", "handle": 4,
                  "expr": [{"match": {"op": "==", "left": {"meta": {"key": "l4proto"}},
                                      "right": {"set": ["tcp", "udp", "sctp"]}}},
                           {"match": {"op": "==", "left": {"numgen": {"mode": "random", "mod": 3, "offset": 0}},
                                      "right": 0}},
                           {"masquerade": {"port": {"range": [32768, 40000]}, "flags": "fully-random"}}]}},
        {"table": {"family": "ip", "name": "kube-proxy", "handle": 9}},
        {"chain": {"family": "ip", "table": "kube-proxy", "name": "nat-postrouting", "type": "nat"}},
    ])
    table = parse_list_json(text)
    assert table is not None
    (s,) = table.sets
    assert [format_element(Family.V4, a, b) for a, b in s.elements] == [
        "1.2.3.4", "5.0.0.1-5.0.0.9", "10.0.0.0/8", "11.0.0.1"]
    (chain,) = table.chains
    assert chain.rules == ("meta l4proto { tcp, udp, sctp } numgen random mod 3 0 masquerade to :32768-40000 "
                           "fully-random",)


def test_absent_table_and_foreign_rules() -> None:
    assert parse_list_json(listing([{"table": {"family": "ip", "name": "nat"}}])) is None
    odd = {"expr": [{"limit": {"rate": 1, "per": "second"}}, {"accept": None}]}
    assert rule_from_json(odd).startswith("unrecognised: ")
    # a counter is ours (config rules count): listed without its values, which are traffic, not the rule
    counted = {"expr": [{"counter": {"packets": 7, "bytes": 420}}, {"accept": None}]}
    assert rule_from_json(counted) == "counter accept"
    with pytest.raises(NftParseError):
        parse_list_json("not json")


def test_script_parser_refuses_what_is_not_our_dialect() -> None:
    with pytest.raises(NftParseError, match="not our nft dialect"):
        parse_script("flush ruleset\n")
    with pytest.raises(NftParseError, match="not our nft dialect"):
        parse_script("table inet t {\n\tchain c {\n\t\tlimit rate 1/second accept\n\t}\n}\n")
    with pytest.raises(NftParseError, match="conflicting intervals"):
        parse_script("table inet t {\n\tset s {\n\t\ttype ipv4_addr\n\t\tflags interval\n"
                     "\t\telements = { 10.0.0.0/8, 10.1.0.0/16 }\n\t}\n}\n")


# --- round trips ------------------------------------------------------------------------------------------------


@st.composite
def cidr_texts(draw: st.DrawFn, family: Family) -> str:
    if family is Family.V4:
        length = draw(st.integers(min_value=8, max_value=32))
        address = draw(st.integers(min_value=0, max_value=2**32 - 1)) & ~((1 << (32 - length)) - 1)
        return f"{address >> 24}.{(address >> 16) & 255}.{(address >> 8) & 255}.{address & 255}/{length}"
    length = draw(st.integers(min_value=16, max_value=128))
    address = (0xFD << 120 | draw(st.integers(min_value=0, max_value=2**120 - 1))) & ~((1 << (128 - length)) - 1)
    return f"{ipaddress.IPv6Address(address)}/{length}"


@st.composite
def policies(draw: st.DrawFn) -> Policy:
    ipv6 = draw(st.booleans())
    families = [Family.V4, Family.V6] if ipv6 else [Family.V4]
    preserve = draw(st.lists(st.sampled_from(families).flatmap(cidr_texts), max_size=12, unique=True))
    masquerade = [c for c in draw(st.lists(st.sampled_from(families).flatmap(cidr_texts), max_size=6, unique=True))
                  if c not in preserve]
    ports = draw(st.sampled_from(["", "40000", "32768-40000,40001-65535", "1000,2000-2001,3000-3999"]))
    options = PolicyOptions(enable_ipv6=ipv6, random_fully=draw(st.booleans()), to_ports=parse_to_ports(ports))
    text = (f"nonMasqueradeCIDRs: {json.dumps(preserve)}\nmasqueradeCIDRs: {json.dumps(masquerade)}\n"
            f"masqLinkLocal: {json.dumps(draw(st.booleans()))}\nmasqLinkLocalIPv6: {json.dumps(draw(st.booleans()))}\n")
    return policy(text, options)


@settings(max_examples=150, deadline=None)
@given(policies())
def test_script_and_listing_round_trip(p: Policy) -> None:
    """render -> script parser -> kernel-shaped JSON -> JSON parser gives back exactly the desired table."""
    want = desired_table(p)
    commands = parse_script(render_script(p))
    assert [c.verb for c in commands] == ["add", "delete", "define"]
    assert commands[2].definition == want
    assert parse_list_json(listing(list_json(want))) == want
    for family in p.families:
        ranges = p.non_masquerade_ranges(family)
        s = want.set_named(f"nomasq_v{int(family)}")
        assert s is not None and list(s.elements) == ranges


@settings(max_examples=150, deadline=None)
@given(policies())
def test_rule_text_and_json_are_inverse(p: Policy) -> None:
    for rule in desired_table(p).chains[0].rules:
        as_json = rule_to_json(rule)
        assert rule_from_json(as_json) == rule
        assert rule_to_json(rule_from_json(as_json)) == as_json


@settings(max_examples=300)
@given(st.lists(st.tuples(st.integers(0, 2**32 - 1), st.integers(0, 2**16)), max_size=20))
def test_format_elements_is_format_element_over_a_set(ranges: list[tuple[int, int]]) -> None:
    # aligned prefixes, single addresses and arbitrary ranges all take the inlined IPv4 path
    elements = tuple((a, min(a + size, 2**32 - 1)) for a, size in ranges)
    aligned = tuple((a & ~0xFF, (a & ~0xFF) | 0xFF) for a, _ in ranges)
    for family_elements in (elements, aligned):
        assert format_elements(Family.V4, family_elements) == [format_element(Family.V4, a, b)
                                                                for a, b in family_elements]
