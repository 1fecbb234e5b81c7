"""The rules index answers exactly as the first-match walk over every rule: which rule decides, and which earlier
rules the answer depends on when a packet's source, protocol or port is not known (hypothesis, both families)."""

from __future__ import annotations

from fnmatch import fnmatchcase

from hypothesis import given, settings
from hypothesis import strategies as st

from ipmasq.config import ConfigInput, config_from_bytes
from ipmasq.config.model import MasqConfig, Rule, RuleAction
from ipmasq.options import PolicyOptions
from ipmasq.policy.packet import Packet
from ipmasq.policy.policy import PACKET_FIELDS, Policy, Reason
from ipmasq.policy.rule_index import RuleIndex
from ipmasq.prefix import Family, Prefix
from ipmasq.testing.first_match import first_match_walk

PROTOCOLS = ("tcp", "udp", "sctp", "icmp")
NODES = ("pool-a-1", "pool-b-1", "other")
GLOBS = ("pool-a-*", "pool-b-1", "*", "nothing-*")
BASE = {Family.V4: 10 << 24, Family.V6: 0xFD00 << 112}
# a 64-address universe, so that random rules nest and overlap often, with the ends of the address space and the
# whole space among the destinations too (interval boundaries at 0 and at the last address)
UNIVERSE = 64


def prefix_at(family: Family, offset: int, length: int) -> Prefix:
    mask = family.max_address & ~((1 << (family.bits - length)) - 1)
    return Prefix(family, (BASE[family] + offset) & mask, length)


def prefixes(family: Family) -> st.SearchStrategy[Prefix]:
    bits = family.bits
    nested = st.integers(bits - 6, bits).flatmap(
        lambda length: st.integers(0, UNIVERSE - 1).map(lambda offset: prefix_at(family, offset, length)))
    edges = st.sampled_from((Prefix(family, 0, 0), Prefix(family, 0, bits), Prefix(family, family.max_address, bits),
                             Prefix(family, family.max_address & ~0xFF, bits - 8), Prefix(family, BASE[family], 8)))
    return st.one_of(nested, nested, nested, edges)


@st.composite
def rule_sets(draw: st.DrawFn, family: Family = Family.V4, max_rules: int = 12) -> tuple[Rule, ...]:
    out = []
    for i in range(draw(st.integers(0, max_rules))):
        protocol = draw(st.sampled_from((None, *PROTOCOLS)))
        ports: tuple[tuple[int, int], ...] = ()
        if protocol in ("tcp", "udp", "sctp") and draw(st.booleans()):
            ports = tuple((low, low + width) for low, width in
                          draw(st.lists(st.tuples(st.integers(1, 8), st.integers(0, 3)), min_size=1, max_size=3)))
        action = draw(st.sampled_from(tuple(RuleAction)))
        out.append(Rule(f"r{i}", family, tuple(draw(st.lists(prefixes(family), min_size=1, max_size=4))), action,
                        tuple(draw(st.lists(prefixes(family), max_size=2))), protocol, ports,
                        tuple(draw(st.lists(st.sampled_from(GLOBS), max_size=2))),
                        "10.9.9.9" if action is RuleAction.SNAT else None, "/cfg", i + 1))
    return tuple(out)


def addresses(rules: tuple[Rule, ...], family: Family) -> list[int]:
    """Every boundary of every destination and source (first, last, and either side), clipped to the family."""
    out = {0, family.max_address}
    for rule in rules:
        for p in rule.destinations + rule.sources:
            out.update(a for a in (p.network - 1, p.network, p.last, p.last + 1) if 0 <= a <= family.max_address)
    return sorted(out)


def brute_force(config: MasqConfig, node: str, packet: Packet) -> tuple[str | None, list[str], list[str]]:
    """(deciding rule, earlier rules that depend on unknown fields, those fields) over every rule in config order,
    None fields unknown; written from the README's semantics, not from the policy's code."""
    conditional: list[str] = []
    unknown: set[str] = set()
    for rule in config.rules:
        if rule.family is not packet.family or (rule.nodes and not any(fnmatchcase(node, g) for g in rule.nodes)):
            continue
        if not any(p.network <= packet.destination <= p.last for p in rule.destinations):
            continue
        needs = set()
        if rule.sources:
            if packet.source_address is None:
                needs.add("source")
            elif not any(p.network <= packet.source_address <= p.last for p in rule.sources):
                continue
        if rule.protocol is not None:
            if packet.protocol is None:
                needs.add("protocol")
            elif rule.protocol != packet.protocol:
                continue
        if rule.ports:
            if packet.port is None:
                needs.add("port")
            elif not any(low <= packet.port <= high for low, high in rule.ports):
                continue
        if needs:
            conditional.append(rule.name)
            unknown |= needs
            continue
        return rule.name, conditional, [f for f in PACKET_FIELDS if f in unknown]
    return None, conditional, [f for f in PACKET_FIELDS if f in unknown]


def packets(draw: st.DrawFn, rules: tuple[Rule, ...], family: Family) -> list[Packet]:
    points = addresses(rules, family)
    out = []
    for _ in range(draw(st.integers(1, 12))):
        destination = draw(st.sampled_from(points))
        source = draw(st.one_of(st.none(), st.sampled_from(points)))
        protocol = draw(st.sampled_from((None, *PROTOCOLS, "gre")))
        port = draw(st.one_of(st.none(), st.integers(0, 12)))
        out.append(Packet.exact(family, destination, source, protocol, port))
    return out


@settings(max_examples=300, deadline=None)
@given(st.data(), st.sampled_from(tuple(Family)), st.sampled_from((0, 1, 3, 32, 10**6)))
def test_the_index_finds_what_the_walk_finds(data: st.DataObject, family: Family, merge_limit: int) -> None:
    # every merge limit: from one group per destination (the scan over several groups) to everything merged
    rules = data.draw(rule_sets(family))
    index = RuleIndex(rules, merge_limit)
    for packet in packets(data.draw, rules, family):
        found = index.first_match(packet.destination, packet.source_address, packet.protocol, packet.port)
        assert (found.rule, found.conditional, found.depends_on) == first_match_walk(rules, packet), packet
        # the candidates are exactly the rules holding the destination, each once
        held = [i for i, rule in enumerate(rules) if any(p.contains(packet.destination) for p in rule.destinations)]
        assert sorted(i for group in index.candidates(packet.destination) for i in group) == held


@settings(max_examples=200, deadline=None)
@given(st.data(), st.sampled_from(NODES))
def test_the_policy_verdict_is_the_brute_force_first_match(data: st.DataObject, node: str) -> None:
    rules = data.draw(rule_sets(Family.V4))
    base = config_from_bytes(ConfigInput((("/cfg", b"nonMasqueradeCIDRs: [10.0.0.0/27]\n"
                                                   b"masqueradeCIDRs: [10.0.0.8/29]\n"),)), PolicyOptions())
    config = MasqConfig(base.non_masquerade, base.masquerade, rules=rules)
    policy = Policy(config, PolicyOptions(node_name=node))
    lists = Policy(MasqConfig(base.non_masquerade, base.masquerade), PolicyOptions(node_name=node))
    for packet in packets(data.draw, rules, Family.V4):
        verdict = policy.verdict_for(Family.V4, packet.destination, source=packet.source_address,
                                     protocol=packet.protocol, port=packet.port)
        decider, conditional, depends_on = brute_force(config, node, packet)
        assert (None if verdict.rule is None else verdict.rule.name) == decider, packet
        assert [r.name for r in verdict.conditional] == conditional and list(verdict.depends_on) == depends_on
        if verdict.rule is not None:
            assert verdict.reason is Reason.RULE and verdict.entry is None and verdict.snat_to == verdict.rule.snat_to
            assert verdict.masquerade == (verdict.rule.action is not RuleAction.PRESERVE)
        else:  # no rule decided: the lists do, as without rules
            listed = lists.verdict_for(Family.V4, packet.destination)
            assert (verdict.masquerade, verdict.reason, verdict.entry) == (listed.masquerade, listed.reason,
                                                                           listed.entry)


def test_wide_overlapping_rules_share_one_group() -> None:
    # 2,000 rules to 0.0.0.0/0 (on ports) and 2,000 endpoints inside it: the wide rules' positions are stored once,
    # not once per endpoint's interval, and an endpoint's packet still tests the wide rules before it in order
    everywhere = Prefix(Family.V4, 0, 0)
    rules = []
    for i in range(2000):
        rules.append(Rule(f"wide-{i}", Family.V4, (everywhere,), RuleAction.PRESERVE, protocol="tcp",
                          ports=((20000 + i, 20000 + i),)))
        rules.append(Rule(f"endpoint-{i}", Family.V4, (Prefix(Family.V4, (10 << 24) + 4 * i, 32),),
                          RuleAction.MASQUERADE))
    index = RuleIndex(rules)
    stored = {id(group): len(group) for start in index.interval_starts for group in index.candidates(start)}
    assert index.intervals == 2 * 2000 + 1
    assert sum(stored.values()) <= 2000 + 2000 * 2 + 10
    found = index.first_match((10 << 24) + 4 * 1500, 1, "tcp", 443)
    assert found.rule is not None and found.rule.name == "endpoint-1500" and not found.conditional
    unknown_port = index.first_match((10 << 24) + 4 * 3, 1, "tcp")
    assert unknown_port.rule is not None and unknown_port.rule.name == "endpoint-3"
    assert [r.name for r in unknown_port.conditional] == ["wide-0", "wide-1", "wide-2", "wide-3"]
    assert unknown_port.depends_on == ("port",)
    assert index.first_match(1 << 31, 1, "tcp", 20007).rule == rules[14]


def test_a_policy_without_rules_has_no_index_and_the_node_selects_rules() -> None:
    text = b"""nonMasqueradeCIDRs: [10.0.0.0/8]
rules:
  - name: batch-only
    destinations: [10.1.0.0/16]
    nodes: ["batch-*"]
    action: masquerade
"""
    for node, names in (("batch-1", ["batch-only"]), ("web-1", [])):
        options = PolicyOptions(node_name=node)
        policy = Policy(config_from_bytes(ConfigInput((("/cfg", text),)), options), options)
        index = policy.rule_index(Family.V4)
        assert (None if index is None else [r.name for r in index.rules]) == (names or None)
        verdict = policy.verdict("10.1.2.3")
        assert (verdict.reason, verdict.masquerade) == ((Reason.RULE, True) if names else (Reason.CONFIG, False))
