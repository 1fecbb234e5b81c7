"""The policy with config rules: the first rule that matches a packet decides, ahead of the CIDR lists."""

from __future__ import annotations

from fnmatch import fnmatchcase

from hypothesis import given, settings
from hypothesis import strategies as st

from ipmasq.config import ConfigInput, config_from_bytes
from ipmasq.config.model import MasqConfig, Rule, RuleAction
from ipmasq.options import PolicyOptions
from ipmasq.policy.hash import canonical_policy, policy_hash
from ipmasq.policy.packet import Packet
from ipmasq.policy.policy import Policy, Reason, rule_match
from ipmasq.policy.prefix import Family, Prefix, parse_address

NODE = "gke-prod-egress-1"
CONFIG = """\
nonMasqueradeCIDRs: [10.0.0.0/8]
rules:
  - name: partner-endpoint
    destinations: [10.1.2.100/32]
    sources: [100.64.0.0/16]
    protocol: tcp
    ports: [443, "8000-8080"]
    nodes: ["gke-prod-egress-*"]
    action: snat
    snatTo: 10.142.0.50
  - name: masq-partner
    destinations: [10.1.2.0/24]
    action: masquerade
  - name: other-pool
    destinations: [8.8.8.8/32]
    nodes: ["gke-prod-batch-*"]
    action: preserve
"""


def policy(node: str | None = NODE, text: str = CONFIG) -> Policy:
    options = PolicyOptions(node_name=node)
    return Policy(config_from_bytes(ConfigInput((("/cfg/ip-masq-agent", text.encode()),)), options), options)


def v4(text: str) -> int:
    return parse_address(text)[1]


def test_a_fully_known_packet_gets_the_first_matching_rule() -> None:
    p = policy()
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
    verdict = policy().verdict("10.1.2.100")
    # the answer for packets the partner rule does not match, and that it depends on source, protocol and port
    assert verdict.rule is not None and verdict.rule.name == "masq-partner"
    assert [r.name for r in verdict.conditional] == ["partner-endpoint"] and not verdict.decided
    assert verdict.depends_on == ("source", "protocol", "port")
    only_port = policy().verdict_for(Family.V4, v4("10.1.2.100"), source=v4("100.64.0.1"), protocol="tcp")
    assert only_port.depends_on == ("port",)
    # a destination no conditional rule covers is decided from the destination alone
    assert policy().verdict("10.1.3.1").decided


def test_rules_of_other_nodes_do_not_exist_here() -> None:
    assert [r.name for r in policy().rules(Family.V4)] == ["partner-endpoint", "masq-partner"]
    batch = policy("gke-prod-batch-7")
    assert [r.name for r in batch.rules(Family.V4)] == ["masq-partner", "other-pool"]
    assert batch.verdict("8.8.8.8").reason is Reason.RULE and not batch.verdict("8.8.8.8").masquerade
    assert policy().verdict("8.8.8.8").reason is Reason.CATCH_ALL
    assert batch.verdict("10.1.2.100").decided


def test_the_hash_sees_rules_and_is_unchanged_without_them() -> None:
    assert policy_hash(policy()) != policy_hash(policy("gke-prod-batch-7"))
    plain = "nonMasqueradeCIDRs: [10.0.0.0/8]\n"
    assert policy_hash(policy(text=plain)) == policy_hash(policy(None, plain))
    # a config without rules hashes the text it hashed before rules existed (fleet dashboards compare it)
    assert "rule" not in canonical_policy(policy(text=plain))


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
