"""Policy verdicts, longest-prefix exceptions, and their agreement with a brute-force model (hypothesis).

The policy with config rules: the first rule that matches a packet decides, ahead of the CIDR lists.
"""

from __future__ import annotations

import ipaddress
import itertools
from fnmatch import fnmatchcase

from hypothesis import given, settings
from hypothesis import strategies as st

from ipmasq.config import ConfigInput, config_from_bytes, load_config
from ipmasq.config.model import MasqConfig, Rule, RuleAction
from ipmasq.diff.diff import flipped_ranges
from ipmasq.options import PolicyOptions
from ipmasq.policy.hash import canonical_policy, policy_hash
from ipmasq.policy.packet import Packet
from ipmasq.policy.policy import Policy, Reason, rule_match
from ipmasq.policy.ranges import to_prefixes
from ipmasq.prefix import Family, Prefix, parse_address
from tests.configs import PARTNER_ENDPOINT_RULE, policy_of

V4 = PolicyOptions()


def policy(text: str, options: PolicyOptions = V4) -> Policy:
    return policy_of(text, options)


def test_gke_1_14_defaults_preserve_the_aws_vpc_and_the_fix_masquerades_it() -> None:
    gke = PolicyOptions(masq_chain="IP-MASQ", nomasq_all_reserved_ranges=True)
    before = Policy(load_config(None, gke), gke).verdict("172.30.12.110")
    assert (before.masquerade, str(before.matched), before.reason) == (False, "172.16.0.0/12", Reason.DEFAULT)
    after = policy("nonMasqueradeCIDRs: [10.0.0.0/8]\n", gke).verdict("172.30.12.110")
    assert (after.masquerade, after.matched, after.reason) == (True, None, Reason.CATCH_ALL)


def test_link_local() -> None:
    assert policy("nonMasqueradeCIDRs: []\n").verdict("169.254.169.254").reason is Reason.LINK_LOCAL
    assert policy("masqLinkLocal: true\nnonMasqueradeCIDRs: []\n").verdict("169.254.169.254").masquerade


def test_vpn_inside_10_8_with_an_exception() -> None:
    p = policy("nonMasqueradeCIDRs: [10.0.0.0/8]\nmasqueradeCIDRs: [10.11.0.0/24]\n")
    vpn = p.verdict("10.11.0.7")
    assert (vpn.masquerade, str(vpn.matched), vpn.reason) == (True, "10.11.0.0/24", Reason.EXCEPTION)
    assert not p.verdict("10.12.0.7").masquerade


def test_nested_exceptions_longest_prefix_wins() -> None:
    p = policy("nonMasqueradeCIDRs: [10.0.0.0/8, 10.11.5.0/24]\nmasqueradeCIDRs: [10.11.0.0/16, 10.11.5.128/25]\n")
    assert not p.verdict("10.1.1.1").masquerade
    assert p.verdict("10.11.1.1").masquerade
    assert not p.verdict("10.11.5.1").masquerade
    assert p.verdict("10.11.5.200").masquerade
    assert p.verdict("11.0.0.1").reason is Reason.CATCH_ALL


def test_without_exceptions_the_first_rule_in_config_order_decides() -> None:
    # the kernel walks the chain in order: 10.0.0.0/8 comes first, so it is the rule that matched
    p = policy("nonMasqueradeCIDRs: [10.0.0.0/8, 10.1.0.0/16]\n")
    assert str(p.verdict("10.1.2.3").matched) == "10.0.0.0/8"


def test_ipv6() -> None:
    v6 = PolicyOptions(enable_ipv6=True)
    p = policy("nonMasqueradeCIDRs: [10.0.0.0/8, 'fd00::/8']\n", v6)
    assert not p.verdict("fd00::1").masquerade
    assert p.verdict("2001:db8::1").masquerade
    assert p.verdict("fe80::1").reason is Reason.LINK_LOCAL
    assert policy("").verdict("2001:db8::1").reason is Reason.IPV6_DISABLED


def test_non_masquerade_ranges_are_disjoint_and_merged() -> None:
    p = policy("nonMasqueradeCIDRs: [10.0.0.0/9, 10.128.0.0/9, 10.64.0.0/10]\nmasqueradeCIDRs: [10.1.0.0/16]\n")
    ranges = p.non_masquerade_ranges(Family.V4)
    ten = int(ipaddress.IPv4Address("10.0.0.0"))
    assert ranges == [
        (ten, ten + 0x00FFFF),  # 10.0.0.0 - 10.0.255.255
        (ten + 0x020000, ten + 0xFFFFFF),  # 10.2.0.0 - 10.255.255.255
        (int(ipaddress.IPv4Address("169.254.0.0")), int(ipaddress.IPv4Address("169.254.255.255"))),
    ]


def test_range_to_prefixes_is_minimal() -> None:
    first = int(ipaddress.IPv4Address("10.0.0.1"))
    last = int(ipaddress.IPv4Address("10.0.0.6"))
    assert [str(p) for p in to_prefixes(Family.V4, first, last)] == [
        "10.0.0.1/32", "10.0.0.2/31", "10.0.0.4/31", "10.0.0.6/32"]
    assert [str(p) for p in to_prefixes(Family.V4, 0, 2**32 - 1)] == ["0.0.0.0/0"]


# --- properties ---------------------------------------------------------------------------------------------

# Small address space (10.0.0.0/24 and friends) so random prefixes nest and collide often.
prefix_lengths = st.integers(min_value=20, max_value=32)


@st.composite
def prefixes(draw: st.DrawFn) -> Prefix:
    length = draw(prefix_lengths)
    base = int(ipaddress.IPv4Address("10.0.0.0"))
    offset = draw(st.integers(min_value=0, max_value=(1 << 12) - 1))
    network = (base + offset) & ~((1 << (32 - length)) - 1) & 0xFFFFFFFF
    return Prefix(Family.V4, network, length)


@st.composite
def configs(draw: st.DrawFn) -> tuple[list[Prefix], list[Prefix], bool]:
    preserve = draw(st.lists(prefixes(), max_size=8))
    masquerade = [p for p in draw(st.lists(prefixes(), max_size=5)) if p not in preserve]
    return preserve, masquerade, draw(st.booleans())


def render_config(preserve: list[Prefix], masquerade: list[Prefix], masq_link_local: bool) -> str:
    lines = ["nonMasqueradeCIDRs:"] + [f"  - {p}" for p in preserve] or ["nonMasqueradeCIDRs: []"]
    if not preserve:
        lines = ["nonMasqueradeCIDRs: []"]
    if masquerade:
        lines += ["masqueradeCIDRs:"] + [f"  - {p}" for p in masquerade]
    lines.append(f"masqLinkLocal: {str(masq_link_local).lower()}")
    return "\n".join(lines) + "\n"


def brute_force_masquerade(address: int, preserve: list[Prefix], masquerade: list[Prefix], masq_ll: bool) -> bool:
    """Longest prefix wins; no match: masquerade. Link-local 169.254/16 preserves unless masqLinkLocal."""
    candidates = [(p.length, False) for p in preserve if p.contains(address)]
    candidates += [(p.length, True) for p in masquerade if p.contains(address)]
    if not masq_ll and (address >> 16) == (169 << 8 | 254):
        candidates.append((16, False))
    if not candidates:
        return True
    best = max(length for length, _ in candidates)
    decisions = {m for length, m in candidates if length == best}
    assert len(decisions) == 1
    return decisions.pop()


addresses = st.one_of(
    st.integers(min_value=int(ipaddress.IPv4Address("10.0.0.0")), max_value=int(ipaddress.IPv4Address("10.0.31.255"))),
    st.integers(min_value=0, max_value=2**32 - 1),
)


@settings(max_examples=300, deadline=None)
@given(configs(), st.lists(addresses, min_size=1, max_size=20))
def test_verdicts_agree_with_brute_force(config: tuple[list[Prefix], list[Prefix], bool], probe: list[int]) -> None:
    preserve, masquerade, masq_ll = config
    p = policy(render_config(preserve, masquerade, masq_ll))
    for address in probe:
        verdict = p.verdict(str(ipaddress.IPv4Address(address)))
        assert verdict.masquerade == brute_force_masquerade(address, preserve, masquerade, masq_ll)
        if verdict.matched is not None:
            assert verdict.matched.contains(address)


@settings(max_examples=200, deadline=None)
@given(configs())
def test_non_masquerade_ranges_match_verdicts(config: tuple[list[Prefix], list[Prefix], bool]) -> None:
    preserve, masquerade, masq_ll = config
    p = policy(render_config(preserve, masquerade, masq_ll))
    ranges = p.non_masquerade_ranges(Family.V4)
    for (_, last), (first, _) in itertools.pairwise(ranges):
        assert last + 1 < first  # disjoint and not adjacent
    # every boundary of every range, and its neighbours, gets the verdict the ranges say
    for first, last in ranges:
        for address in (first, last):
            assert not p.verdict_for(Family.V4, address).masquerade
        for outside in (first - 1, last + 1):
            if 0 <= outside < 2**32 and not any(a <= outside <= b for a, b in ranges):
                assert p.verdict_for(Family.V4, outside).masquerade


@settings(max_examples=150, deadline=None)
@given(configs(), configs(), st.lists(addresses, min_size=1, max_size=20))
def test_flips_agree_with_brute_force(a: tuple[list[Prefix], list[Prefix], bool],
                                      b: tuple[list[Prefix], list[Prefix], bool], probe: list[int]) -> None:
    before, after = policy(render_config(*a)), policy(render_config(*b))
    flips = flipped_ranges(before, after, Family.V4)
    for address in probe:
        changed = before.verdict_for(Family.V4, address).masquerade != after.verdict_for(Family.V4, address).masquerade
        inside = [f for f in flips if f.first <= address <= f.last]
        assert bool(inside) == changed
        if inside:
            assert inside[0].masquerade_before == before.verdict_for(Family.V4, address).masquerade


NODE = "gke-prod-egress-1"
CONFIG = """\
nonMasqueradeCIDRs: [10.0.0.0/8]
rules:
""" + PARTNER_ENDPOINT_RULE + """\
  - name: masq-partner
    destinations: [10.1.2.0/24]
    action: masquerade
  - name: other-pool
    destinations: [8.8.8.8/32]
    nodes: ["gke-prod-batch-*"]
    action: preserve
"""


def rules_policy(node: str | None = NODE, text: str = CONFIG) -> Policy:
    options = PolicyOptions(node_name=node)
    return Policy(config_from_bytes(ConfigInput((("/cfg/ip-masq-agent", text.encode()),)), options), options)


def v4(text: str) -> int:
    return parse_address(text)[1]


def test_a_fully_known_packet_gets_the_first_matching_rule() -> None:
    p = rules_policy()
    verdict = p.verdict_for(Family.V4, v4("10.1.2.100"), source=v4("100.64.3.4"), protocol="tcp", port=8080)
    assert verdict.reason is Reason.RULE and verdict.rule is not None and verdict.rule.name == "partner-endpoint"
    assert verdict.masquerade and verdict.snat_to == "10.142.0.50" and verdict.decided
    assert verdict.rule.where() == "/cfg/ip-masq-agent:3"
    # another port, source or protocol: the next rule (masquerade to the node address)
    for source, protocol, port in (("100.64.3.4", "tcp", 22), ("10.9.0.1", "tcp", 443), ("100.64.3.4", "udp", 443)):
        other = p.verdict_for(Family.V4, v4("10.1.2.100"), source=v4(source), protocol=protocol, port=port)
        assert other.rule is not None and other.rule.name == "masq-partner", (source, protocol, port)
        assert other.masquerade and other.snat_to is None and other.decided
    # no rule: the lists decide, as before
    plain = p.verdict_for(Family.V4, v4("10.3.0.1"), source=v4("100.64.3.4"), protocol="tcp", port=443)
    assert (plain.reason, plain.masquerade, plain.rule) == (Reason.CONFIG, False, None)


def test_unknown_fields_are_said_not_guessed() -> None:
    verdict = rules_policy().verdict("10.1.2.100")
    # the answer for packets the partner rule does not match, and that it depends on source, protocol and port
    assert verdict.rule is not None and verdict.rule.name == "masq-partner"
    assert [r.name for r in verdict.conditional] == ["partner-endpoint"] and not verdict.decided
    assert verdict.depends_on == ("source", "protocol", "port")
    only_port = rules_policy().verdict_for(Family.V4, v4("10.1.2.100"), source=v4("100.64.0.1"), protocol="tcp")
    assert only_port.depends_on == ("port",)
    # a destination no conditional rule covers is decided from the destination alone
    assert rules_policy().verdict("10.1.3.1").decided


def test_rules_of_other_nodes_do_not_exist_here() -> None:
    assert [r.name for r in rules_policy().rules(Family.V4)] == ["partner-endpoint", "masq-partner"]
    batch = rules_policy("gke-prod-batch-7")
    assert [r.name for r in batch.rules(Family.V4)] == ["masq-partner", "other-pool"]
    assert batch.verdict("8.8.8.8").reason is Reason.RULE and not batch.verdict("8.8.8.8").masquerade
    assert rules_policy().verdict("8.8.8.8").reason is Reason.CATCH_ALL
    assert batch.verdict("10.1.2.100").decided


def test_the_hash_sees_rules_and_is_unchanged_without_them() -> None:
    assert policy_hash(rules_policy()) != policy_hash(rules_policy("gke-prod-batch-7"))
    plain = "nonMasqueradeCIDRs: [10.0.0.0/8]\n"
    assert policy_hash(rules_policy(text=plain)) == policy_hash(rules_policy(None, plain))
    # a config without rules hashes the text it hashed before rules existed (fleet dashboards compare it)
    assert "rule" not in canonical_policy(rules_policy(text=plain))


# --- the property: the verdict is a brute-force first-match walk ---------------------------------------------

PROTOCOLS = ("tcp", "udp", "sctp", "icmp")
# a small address space (10.0.0.0/28, ...) so that random rules and packets overlap often
SMALL = st.integers(0, 15)


def small_prefix() -> st.SearchStrategy[Prefix]:
    return st.integers(28, 32).flatmap(
        lambda length: SMALL.map(lambda n: Prefix(Family.V4, (v4("10.0.0.0") + n) & ~((1 << (32 - length)) - 1)
                                                  & 0xFFFFFFFF, length)))


@st.composite
def rules(draw: st.DrawFn) -> tuple[Rule, ...]:
    out = []
    for i in range(draw(st.integers(0, 6))):
        protocol = draw(st.sampled_from((None, *PROTOCOLS)))
        ports: tuple[tuple[int, int], ...] = ()
        if protocol in ("tcp", "udp", "sctp") and draw(st.booleans()):
            ports = tuple(sorted(draw(st.lists(st.tuples(st.integers(1, 6), st.integers(0, 3)), min_size=1,
                                               max_size=3)))[:3])
            ports = tuple((low, low + width) for low, width in ports)
        action = draw(st.sampled_from(tuple(RuleAction)))
        out.append(Rule(f"r{i}", Family.V4, tuple(draw(st.lists(small_prefix(), min_size=1, max_size=3))), action,
                        tuple(draw(st.lists(small_prefix(), max_size=2))), protocol, ports,
                        tuple(draw(st.lists(st.sampled_from(("a-*", "b-1", "*")), max_size=2))),
                        "10.9.9.9" if action is RuleAction.SNAT else None, "/cfg", i + 1))
    return tuple(out)


def brute_force(config: MasqConfig, node: str, destination: int, source: int, protocol: str, port: int
                ) -> tuple[str | None, bool, str | None]:
    """(rule name, masquerade, snat address) by walking every rule, then every list entry, in kernel order."""
    for rule in config.rules:
        if rule.nodes and not any(fnmatchcase(node, g) for g in rule.nodes):
            continue
        if not any(p.contains(destination) for p in rule.destinations):
            continue
        if rule.sources and not any(p.contains(source) for p in rule.sources):
            continue
        if rule.protocol is not None and rule.protocol != protocol:
            continue
        if rule.ports and not any(low <= port <= high for low, high in rule.ports):
            continue
        return rule.name, rule.action is not RuleAction.PRESERVE, rule.snat_to
    entries = Policy(config, PolicyOptions(node_name=node)).rule_entries(Family.V4)
    for entry in entries:
        if entry.prefix.contains(destination):
            return None, entry.masquerade, None
    return None, True, None


@settings(max_examples=300, deadline=None)
@given(rules(), st.sampled_from(("a-1", "b-1", "c")), st.lists(st.tuples(SMALL, SMALL, st.sampled_from(PROTOCOLS),
                                                                          st.integers(1, 10)), min_size=1, max_size=8))
def test_verdict_is_first_match_over_rules_then_lists(rule_set: tuple[Rule, ...], node: str,
                                                      packets: list[tuple[int, int, str, int]]) -> None:
    base = config_from_bytes(ConfigInput((("/cfg", b"nonMasqueradeCIDRs: [10.0.0.0/29]\n"
                                                   b"masqueradeCIDRs: [10.0.0.4/30]\n"),)), PolicyOptions())
    config = MasqConfig(base.non_masquerade, base.masquerade, rules=rule_set)
    p = Policy(config, PolicyOptions(node_name=node))
    first = v4("10.0.0.0")
    for destination, source, protocol, port in packets:
        verdict = p.verdict_for(Family.V4, first + destination, source=first + source, protocol=protocol, port=port)
        got = (None if verdict.rule is None else verdict.rule.name, verdict.masquerade, verdict.snat_to)
        assert got == brute_force(config, node, first + destination, first + source, protocol, port)
        assert verdict.decided
        # asked without source, protocol and port: decided exactly when no earlier rule tests one of them
        partial = p.verdict_for(Family.V4, first + destination)
        if partial.decided:
            assert (partial.rule, partial.masquerade, partial.snat_to) == (verdict.rule, verdict.masquerade,
                                                                           verdict.snat_to)
        else:
            assert partial.depends_on and all(rule_match(r, Packet(Family.V4, first + destination)) for r in
                                               partial.conditional)
            # the full answer is one of the conditional rules, or the partial answer (no conditional rule matched)
            assert verdict.rule in partial.conditional or (verdict.rule, verdict.masquerade) == (partial.rule,
                                                                                                 partial.masquerade)
