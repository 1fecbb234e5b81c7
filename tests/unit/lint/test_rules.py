"""lint's findings about config rules: each fires and stays quiet where it should; shadowed-rule and rule-no-effect
are exact (checked against a first-match evaluation over every cell of a small packet space); the CLI flags."""

from __future__ import annotations

from fnmatch import fnmatchcase
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ipmasq.cli import main
from ipmasq.config.model import Entry, MasqConfig, Origin, Rule, RuleAction
from ipmasq.findings import Severity
from ipmasq.lint import Expectations, lint_config
from ipmasq.lint.rules import lint_rules
from ipmasq.options import PolicyOptions
from ipmasq.policy.packet import Packet
from ipmasq.policy.policy import Policy
from ipmasq.prefix import Family, Prefix, parse_address, parse_cidr
from tests.unit.diff.test_diff import BASE, GLOBS, NODES, SNAT, SOURCE_BASE, brute_masquerade

OPTIONS = PolicyOptions()


def ids(text: str, expect: Expectations | None = None) -> list[tuple[str, int | None]]:
    return [(f.id, f.line) for f in lint_config(text, source="f", options=OPTIONS, expect=expect)]


def rule(body: str, name: str = "r") -> str:
    return f"  - name: {name}\n" + "".join(f"    {line}\n" for line in body.splitlines())


HTTPS = "destinations: [10.1.2.0/24]\nprotocol: tcp\nports: [443]\naction: snat\nsnatTo: 10.142.0.50"


def test_shadowed_rule_names_the_covering_rules() -> None:
    text = ("nonMasqueradeCIDRs: [10.0.0.0/8]\nrules:\n" + rule("destinations: [10.1.0.0/17]\nprotocol: tcp\n"
            "action: masquerade", "low") + rule("destinations: [10.1.128.0/17]\naction: masquerade", "high")
            + rule("destinations: [10.1.0.0/16]\nprotocol: tcp\nports: [443]\naction: preserve", "https"))
    [finding] = lint_config(text, source="f", options=OPTIONS)
    assert (finding.id, finding.line, finding.severity) == ("shadowed-rule", 10, Severity.WARNING)
    assert "rule https is never reached" in finding.message
    assert "low (line 3)" in finding.message and "high (line 7)" in finding.message


@pytest.mark.parametrize("earlier", [
    "destinations: [10.1.0.0/16]\nprotocol: udp\naction: masquerade",  # another protocol
    "destinations: [10.1.0.0/16]\nprotocol: tcp\nports: [80]\naction: masquerade",  # another port
    "destinations: [10.1.2.0/25]\naction: masquerade",  # half the destinations
    "destinations: [10.1.0.0/16]\nsources: [10.44.0.0/14]\naction: masquerade",  # some sources only
    "destinations: [10.1.0.0/16]\nnodes: [egress-*]\naction: masquerade",  # some nodes only
])
def test_a_partly_covered_rule_is_reached(earlier: str) -> None:
    text = "rules:\n" + rule(earlier, "first") + rule(HTTPS, "https")
    assert ("shadowed-rule", 5) not in ids(text) and "shadowed-rule" not in [i for i, _ in ids(text)]


def test_rule_no_effect_is_info_and_quiet_when_the_rule_matters() -> None:
    keep = "destinations: [10.2.0.0/16]\naction: preserve"
    findings = lint_config("nonMasqueradeCIDRs: [10.0.0.0/8]\nrules:\n" + rule(keep), source="f", options=OPTIONS)
    assert [(f.id, f.line, f.severity) for f in findings] == [("rule-no-effect", 3, Severity.INFO)]
    assert ids("nonMasqueradeCIDRs: [172.16.0.0/12]\nrules:\n" + rule(keep)) == []
    # the same action as the rule below it for its whole region: no effect; for part of it: an effect
    masq = "destinations: [10.1.0.0/16]\naction: masquerade"
    assert ids("nonMasqueradeCIDRs: [172.16.0.0/12]\nrules:\n" + rule("destinations: [10.1.2.0/24]\n"
               "action: masquerade", "a") + rule(masq, "b")) == [
        ("rule-no-effect", 3), ("rule-no-effect", 6)]  # b: the catch-all masquerades 10.1/16 too
    assert ids("nonMasqueradeCIDRs: [10.0.0.0/8]\nrules:\n"
               + rule("destinations: [10.1.2.0/24]\naction: masquerade", "a") + rule(masq, "b")) == [
        ("rule-no-effect", 3)]


def test_snat_to_a_pod_address_or_its_own_destination() -> None:
    partner = "destinations: [192.0.2.0/24]\naction: snat\nsnatTo: {}"
    pods = Expectations(pod_ranges=(parse_cidr("10.44.0.0/14"),))
    assert ids("rules:\n" + rule(partner.format("10.44.1.1")), pods) == [("snat-to-pod-address", 2)]
    assert ids("rules:\n" + rule(partner.format("10.142.0.50")), pods) == []
    # a rule's sources are pod addresses, without --pod-range
    sourced = "destinations: [192.0.2.0/24]\nsources: [10.8.0.0/14]\naction: snat\nsnatTo: 10.8.3.3"
    [finding] = lint_config("rules:\n" + rule(sourced), source="f", options=OPTIONS)
    assert finding.id == "snat-to-pod-address" and finding.severity is Severity.ERROR
    assert "the sources of rule r" in finding.message
    assert ids("rules:\n" + rule(partner.format("192.0.2.77"))) == [("snat-to-destination", 2)]


def test_rule_nodes_match_none_only_with_node_names() -> None:
    text = "rules:\n" + rule("destinations: [192.0.2.0/24]\nnodes: [gke-prod-egress-*]\naction: preserve")
    assert ids(text) == []
    assert ids(text, Expectations(node_names=("gke-prod-default-1",))) == [("rule-nodes-match-none", 2)]
    assert ids(text, Expectations(node_names=("gke-prod-default-1", "gke-prod-egress-3"))) == []


def test_mixed_families_are_the_agents_error() -> None:
    text = "rules:\n" + rule("destinations: [10.1.0.0/16]\nsources: ['fd00::/8']\naction: masquerade")
    findings = lint_config(text, source="f", options=PolicyOptions(enable_ipv6=True))
    assert [(f.id, f.severity) for f in findings] == [("invalid-rule", Severity.ERROR)]
    assert "one family per rule" in findings[0].message


def test_cli_flags_and_summary(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "ip-masq-agent"
    path.write_text("nonMasqueradeCIDRs: [10.0.0.0/8]\nrules:\n" + rule("destinations: [10.2.0.0/16]\n"
                    "action: preserve", "keep") + rule("destinations: [192.0.2.0/24]\nnodes: [egress-*]\n"
                    "action: snat\nsnatTo: 10.44.0.9", "egress"))
    assert main(["lint", str(path)]) == 0
    out, err = capsys.readouterr()
    assert f"{path}:3: info [rule-no-effect]" in out and err == "0 error(s), 0 warning(s), 1 info\n"
    assert main(["lint", str(path), "--pod-range", "10.44.0.0/14", "--node-name", "n1"]) == 1
    out, _ = capsys.readouterr()
    assert "[snat-to-pod-address]" in out and "[rule-nodes-match-none]" in out
    assert main(["lint", str(path), "--node-name", "a b"]) == 2


# --- exactness ------------------------------------------------------------------------------------------------

# one address of every piece the rules' and lists' edges cut (link-local: the list keeps it unless masqLinkLocal)
DEST_POINTS = [BASE + i for i in range(0, 64, 4)] + [BASE - 1, BASE + 64, BASE + 256, 0, (1 << 32) - 1,
                                                     parse_address("169.254.1.1")[1]]
SOURCE_POINTS = [SOURCE_BASE + i for i in range(0, 16, 4)] + [SOURCE_BASE - 1, SOURCE_BASE + 16]
PROTOCOL_PORTS = [("tcp", p) for p in [*range(12), 65535]] + [("udp", p) for p in [*range(12), 65535]] + [
    ("icmp", 0), ("gre", 0)]
WIDE = (parse_cidr("10.0.0.0/8"), parse_cidr("0.0.0.0/0"), parse_cidr("10.0.0.0/24"))


@st.composite
def coarse(draw: st.DrawFn, base: int, size: int, lengths: tuple[int, int]) -> Prefix:
    length = draw(st.integers(*lengths))
    block = 1 << (32 - length)
    return Prefix(Family.V4, base + draw(st.integers(0, size // block - 1)) * block, length)


@st.composite
def rules(draw: st.DrawFn, name: str) -> Rule:
    protocol = draw(st.sampled_from([None, "tcp", "udp", "icmp"]))
    ports: tuple[tuple[int, int], ...] = ()
    if protocol in ("tcp", "udp") and draw(st.booleans()):
        pairs = draw(st.lists(st.tuples(st.integers(1, 7), st.integers(0, 3)), min_size=1, max_size=2))
        ports = tuple((low, low + extra) for low, extra in pairs)
    action = draw(st.sampled_from(list(RuleAction)))
    wide = st.sampled_from(WIDE)
    return Rule(name, Family.V4,
                tuple(draw(st.lists(st.one_of(coarse(BASE, 64, (26, 30)), wide), min_size=1, max_size=2))),
                action, tuple(draw(st.lists(coarse(SOURCE_BASE, 16, (28, 30)), max_size=2))), protocol, ports,
                draw(st.sampled_from([(), (), *GLOBS])),
                draw(st.sampled_from(SNAT)) if action is RuleAction.SNAT else None, line=10 + int(name[1:]))


@st.composite
def configs(draw: st.DrawFn) -> MasqConfig:
    count = draw(st.integers(1, 5))
    # a later rule drawn as a copy of an earlier one's box (another action) often makes shadowing
    chosen: list[Rule] = []
    for i in range(count):
        fresh = draw(rules(f"r{i}"))
        copy_a_box: bool = draw(st.booleans())
        if chosen and copy_a_box:
            model = draw(st.sampled_from(chosen))
            fresh = Rule(fresh.name, Family.V4, model.destinations, fresh.action, model.sources, model.protocol,
                         model.ports, model.nodes, fresh.snat_to, line=fresh.line)
        chosen.append(fresh)
    preserve = draw(st.lists(st.one_of(coarse(BASE, 64, (26, 30)), st.sampled_from(WIDE)), max_size=3))
    return MasqConfig(non_masquerade=tuple(Entry(p, False, Origin.CONFIG) for p in preserve), rules=tuple(chosen))


def _matches(r: Rule, packet: Packet, node: str) -> bool:
    assert packet.source_address is not None and packet.port is not None
    return ((not r.nodes or any(fnmatchcase(node, g) for g in r.nodes))
            and any(p.contains(packet.destination) for p in r.destinations)
            and (not r.sources or any(p.contains(packet.source_address) for p in r.sources))
            and (r.protocol is None or r.protocol == packet.protocol)
            and (not r.ports or any(low <= packet.port <= high for low, high in r.ports)))


@settings(max_examples=60, deadline=None)
@given(configs())
def test_shadowed_and_no_effect_are_exact(config: MasqConfig) -> None:
    found: dict[str, set[int]] = {}

    def add(id_: str, severity: Severity, message: str, line: int | None) -> None:
        assert line is not None
        found.setdefault(id_, set()).add(line - 10)

    lint_rules(config, Policy(config, OPTIONS), add, str, node_names=NODES)
    reached = [False] * len(config.rules)
    changes = [False] * len(config.rules)
    for destination in DEST_POINTS:
        listed = "masquerade" if brute_masquerade(config, destination) else "preserve"
        for source in SOURCE_POINTS:
            for protocol, port in PROTOCOL_PORTS:
                packet = Packet.exact(Family.V4, destination, source, protocol, port)
                for node in NODES:
                    matching = [i for i, r in enumerate(config.rules) if _matches(r, packet, node)]
                    if not matching:
                        continue
                    first = config.rules[matching[0]]
                    reached[matching[0]] = True
                    below = (config.rules[matching[1]].action.value, config.rules[matching[1]].snat_to) \
                        if len(matching) > 1 else (listed, None)
                    if (first.action.value, first.snat_to) != below:
                        changes[matching[0]] = True
    on_some_node = [not r.nodes or any(fnmatchcase(n, g) for n in NODES for g in r.nodes) for r in config.rules]
    shadowed = {i for i in range(len(config.rules)) if on_some_node[i] and not reached[i]}
    assert found.get("shadowed-rule", set()) == shadowed
    assert found.get("rule-no-effect", set()) == {i for i in range(len(config.rules))
                                                  if on_some_node[i] and reached[i] and not changes[i]}
