"""ipmasq diff: flips against a brute-force verdict comparison, minimal CIDR output, named sets, the CLI contract.

ipmasq diff with config rules: exact regions of destination x source x protocol x port x node, checked packet by
packet against a first-match evaluation written independently of the diff; the CLI's text, JSON and --node-name.
"""

from __future__ import annotations

import json
from fnmatch import fnmatchcase
from itertools import pairwise
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ipmasq.cli import main
from ipmasq.config.model import LINK_LOCAL_V4, Entry, MasqConfig, Origin, Rule, RuleAction
from ipmasq.diff.baselines import BASELINES, baseline_policy
from ipmasq.diff.diff import diff_policies, diff_rule_policies
from ipmasq.options import PolicyOptions
from ipmasq.policy.packet import Outcome, Packet
from ipmasq.policy.policy import Policy
from ipmasq.prefix import Family, Prefix, parse_address, parse_cidr
from tests.conftest import ROOT

BASE = parse_address("10.0.0.0")[1]
UNIVERSE = 64  # 10.0.0.0/26: small enough to check every address
WIDE = (parse_cidr("10.0.0.0/8"), parse_cidr("0.0.0.0/0"), parse_cidr("10.0.0.0/24"))


@st.composite
def prefixes(draw: st.DrawFn) -> Prefix:
    if draw(st.integers(0, 9)) == 0:
        return draw(st.sampled_from(WIDE))
    length = draw(st.integers(26, 32))
    block = 1 << (32 - length)
    return Prefix(Family.V4, BASE + draw(st.integers(0, UNIVERSE // block - 1)) * block, length)


@st.composite
def configs(draw: st.DrawFn) -> MasqConfig:
    preserve = draw(st.lists(prefixes(), max_size=8))
    masquerade = [p for p in draw(st.lists(prefixes(), max_size=4)) if p not in preserve]
    return MasqConfig(
        non_masquerade=tuple(Entry(p, False, Origin.CONFIG) for p in preserve),
        masquerade=tuple(Entry(p, True, Origin.EXCEPTION) for p in dict.fromkeys(masquerade)),
        masq_link_local=draw(st.booleans()),
    )


def brute_masquerade(config: MasqConfig, address: int) -> bool:
    """The documented semantics, written independently of Policy: reference first match, or longest prefix."""
    rules = ([] if config.masq_link_local else [Entry(LINK_LOCAL_V4, False, Origin.LINK_LOCAL)])
    rules += list(config.non_masquerade) + list(config.masquerade)
    matching = [e for e in rules if e.prefix.network <= address <= e.prefix.last]
    if not matching:
        return True
    if not config.masquerade:
        return False  # every rule but the catch-all is a RETURN
    longest = max(e.prefix.length for e in matching)
    return any(e.masquerade for e in matching if e.prefix.length == longest)


def _points() -> list[int]:
    inside = [BASE + i for i in range(UNIVERSE)]
    return [*inside, BASE - 1, BASE + UNIVERSE, BASE + 255, BASE + 256, 0, (1 << 32) - 1,
            parse_address("169.254.1.1")[1]]


@settings(max_examples=300, deadline=None)
@given(configs(), configs())
def test_flips_match_brute_force(before: MasqConfig, after: MasqConfig) -> None:
    options = PolicyOptions()
    result = diff_policies(Policy(before, options), Policy(after, options))
    for address in _points():
        was, now = brute_masquerade(before, address), brute_masquerade(after, address)
        covering = [f for f in result.flips if f.prefix.network <= address <= f.prefix.last]
        assert len(covering) <= 1
        if was == now:
            assert not covering, (address, covering)
        else:
            [flip] = covering
            assert flip.before is (Outcome.MASQUERADE if was else Outcome.PRESERVE)
            assert flip.after is (Outcome.MASQUERADE if now else Outcome.PRESERVE)


@settings(max_examples=200, deadline=None)
@given(configs(), configs())
def test_flip_prefixes_are_minimal_and_symmetric(before: MasqConfig, after: MasqConfig) -> None:
    options = PolicyOptions()
    forward = diff_policies(Policy(before, options), Policy(after, options)).flips
    ordered = sorted(forward, key=lambda f: f.prefix.network)
    for a, b in pairwise(ordered):
        assert a.prefix.last < b.prefix.network  # disjoint
        size = 1 << (32 - a.prefix.length)
        siblings = a.prefix.length == b.prefix.length and a.prefix.network % (2 * size) == 0 \
            and b.prefix.network == a.prefix.network + size
        assert not (siblings and a.before is b.before), "two flips that one CIDR would cover"
    backward = diff_policies(Policy(after, options), Policy(before, options)).flips
    assert sorted((f.prefix, f.after) for f in backward) == sorted((f.prefix, f.before) for f in forward)


def test_gke_1_14_upgrade_kubenet_to_gke() -> None:
    options = PolicyOptions()
    result = diff_policies(baseline_policy("kubenet", options), baseline_policy("gke", options),
                           ("172.30.12.110", "10.44.14.15", "8.8.8.8"))
    flips = {str(f.prefix): (f.before, f.after) for f in result.flips}
    assert flips["172.16.0.0/12"] == (Outcome.MASQUERADE, Outcome.PRESERVE)
    assert flips["169.254.0.0/16"] == (Outcome.MASQUERADE, Outcome.PRESERVE)  # kubenet masqueraded link-local
    assert "10.0.0.0/8" not in flips and len(flips) == 11
    vpn, pod, internet = result.probes
    assert (vpn.before, vpn.after, vpn.flips) == (Outcome.MASQUERADE, Outcome.PRESERVE, True)
    assert not pod.flips and not internet.flips


def test_named_sets() -> None:
    options = PolicyOptions(enable_ipv6=True)
    assert set(BASELINES) == {"reference", "reference-all-reserved", "gke", "kubenet", "cilium"}
    same = diff_policies(baseline_policy("cilium", options), baseline_policy("reference-all-reserved", options))
    assert same.flips == ()
    # kubenet writes no IPv6 rules; the reference with --enable-ipv6 masquerades all but fe80::/10
    v6 = diff_policies(baseline_policy("kubenet", options), baseline_policy("reference", options), ("2001:db8::1",))
    assert v6.probes[0].flips and v6.probes[0].before is Outcome.PRESERVE
    assert any(f.prefix.family is Family.V6 for f in v6.flips)
    # the flag that picks the default list does not change a named set
    flagged = PolicyOptions(nomasq_all_reserved_ranges=True, enable_ipv6=True)
    assert diff_policies(baseline_policy("reference", flagged), baseline_policy("reference", options)).flips == ()


def test_probe_cidr_mixed() -> None:
    options = PolicyOptions()
    result = diff_policies(baseline_policy("reference", options), baseline_policy("kubenet", options),
                           ("172.0.0.0/8", "10.0.0.0/8"))
    mixed, ten = result.probes
    assert (mixed.before, mixed.after, mixed.flips) == (Outcome.MIXED, Outcome.MASQUERADE, True)
    assert (ten.before, ten.after, ten.flips) == (Outcome.PRESERVE, Outcome.PRESERVE, False)


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_gke_1_14_upgrade(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, "diff", "kubenet", "gke", "--probe", "172.30.12.110", "-o", "json")
    assert code == 1
    data = json.loads(out)
    assert {"range": "172.16.0.0/12", "before": "masquerade", "after": "preserve"} in data["flips"]
    assert data["probes"] == [{"destination": "172.30.12.110", "before": "masquerade", "after": "preserve",
                               "flips": True}]
    code, out, _ = run_cli(capsys, "diff", "kubenet", "gke", "--probe", "172.30.12.110")
    assert code == 1 and "probe 172.30.12.110: masquerade" in out and "FLIPS" in out


def test_cli_files_manifests_and_usage(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    fix = tmp_path / "fix.yaml"
    fix.write_text("nonMasqueradeCIDRs:\n  - 10.0.0.0/8\n")
    # the upgrade's fix restores kubenet's behaviour except for link-local, which the agent keeps exempt
    code, out, _ = run_cli(capsys, "diff", "kubenet", str(fix), "--probe", "172.30.12.110", "-o", "json")
    assert code == 0
    assert json.loads(out)["flips"] == [{"range": "169.254.0.0/16", "before": "masquerade", "after": "preserve"}]
    manifest = ROOT / "deploy" / "examples" / "private-endpoint-needs-snat.yaml"
    code, out, _ = run_cli(capsys, "diff", "gke", str(manifest), "--probe", "10.2.1.100")
    assert code == 1 and "10.2.1.100/32  preserve -> masquerade" in out
    assert f"{manifest}:23)" in out  # the line of the entry in the manifest, not in the embedded config
    assert run_cli(capsys, "diff", "gke", "gke")[:2] == (0, "gke -> gke: no destination changes verdict\n")
    assert run_cli(capsys, "diff", "gke", "nosuch")[0] == 2
    assert run_cli(capsys, "diff", "gke", "gke", "--probe", "10.0.0.1/8")[0] == 2
    bad = tmp_path / "bad.yaml"
    bad.write_text("nonMasqueradeCIDRs: [10.0.0.1/8]\n")
    code, _, err = run_cli(capsys, "diff", "gke", str(bad))
    assert code == 1 and f"{bad}:1" in err and "10.0.0.1/8" in err


SOURCE_BASE = parse_address("10.8.0.0")[1]
SOURCES = 16  # 10.8.0.0/28
NODES = ("a-1", "a-2", "b-1", "x")
GLOBS = (("a-*",), ("a-1",), ("b-*", "x"), ("*-1",))
PROTOCOLS = ("tcp", "udp", "icmp", "gre")  # gre: a protocol no rule may name
PORTS = (0, 1, 2, 4, 7, 9, 65535)
SNAT = ("10.9.0.1", "10.9.0.2")


@st.composite
def sources(draw: st.DrawFn) -> Prefix:
    length = draw(st.integers(28, 32))
    block = 1 << (32 - length)
    return Prefix(Family.V4, SOURCE_BASE + draw(st.integers(0, SOURCES // block - 1)) * block, length)


@st.composite
def rules(draw: st.DrawFn, name: str) -> Rule:
    protocol = draw(st.sampled_from([None, "tcp", "udp", "icmp"]))
    ports: tuple[tuple[int, int], ...] = ()
    if protocol in ("tcp", "udp") and draw(st.booleans()):
        pairs = draw(st.lists(st.tuples(st.integers(1, 7), st.integers(0, 3)), min_size=1, max_size=2))
        ports = tuple((low, min(low + extra, 65535)) for low, extra in pairs)
    action = draw(st.sampled_from(list(RuleAction)))
    return Rule(
        name=name, family=Family.V4,
        destinations=tuple(draw(st.lists(prefixes(), min_size=1, max_size=2))),
        action=action,
        sources=tuple(draw(st.lists(sources(), max_size=2))),
        protocol=protocol, ports=ports,
        nodes=draw(st.sampled_from([(), (), *GLOBS])),
        snat_to=draw(st.sampled_from(SNAT)) if action is RuleAction.SNAT else None,
    )


@st.composite
def rule_configs(draw: st.DrawFn, pool: list[Rule]) -> MasqConfig:
    preserve = draw(st.lists(prefixes(), max_size=4))
    masquerade = [p for p in draw(st.lists(prefixes(), max_size=2)) if p not in preserve]
    # rules drawn from a shared pool, so that the two sides often hold the same rule, reordered or removed
    chosen = draw(st.lists(st.sampled_from(pool), max_size=4, unique_by=lambda r: r.name)) if pool else []
    return MasqConfig(
        non_masquerade=tuple(Entry(p, False, Origin.CONFIG) for p in preserve),
        masquerade=tuple(Entry(p, True, Origin.EXCEPTION) for p in dict.fromkeys(masquerade)),
        masq_link_local=draw(st.booleans()),
        rules=tuple(chosen),
    )


@st.composite
def config_pairs(draw: st.DrawFn) -> tuple[MasqConfig, MasqConfig]:
    pool = [draw(rules(f"r{i}")) for i in range(draw(st.integers(0, 5)))]
    return draw(rule_configs(pool)), draw(rule_configs(pool))


def brute_outcome(config: MasqConfig, packet: Packet, node: str) -> tuple[Outcome, str | None]:
    """First match over the rules as the README states them, else the lists; (action, snat address)."""
    assert packet.source_address is not None and packet.port is not None
    for rule in config.rules:
        if rule.nodes and not any(fnmatchcase(node, glob) for glob in rule.nodes):
            continue
        if not any(p.network <= packet.destination <= p.last for p in rule.destinations):
            continue
        if rule.sources and not any(p.network <= packet.source_address <= p.last for p in rule.sources):
            continue
        if rule.protocol is not None and rule.protocol != packet.protocol:
            continue
        if rule.ports and not any(low <= packet.port <= high for low, high in rule.ports):
            continue
        return Outcome(rule.action.value), rule.snat_to
    return (Outcome.MASQUERADE if brute_masquerade(config, packet.destination) else Outcome.PRESERVE), None


def _packets() -> list[tuple[Packet, str]]:
    destinations = [BASE + i for i in range(1, UNIVERSE, 4)] + [BASE - 1, BASE + UNIVERSE, 0, (1 << 32) - 1]
    source_points = [SOURCE_BASE + i for i in range(0, SOURCES, 5)] + [SOURCE_BASE - 1, SOURCE_BASE + SOURCES]
    return [(Packet.exact(Family.V4, d, s, proto, port), node)
            for d in destinations for s in source_points for proto in PROTOCOLS
            for port in (PORTS if proto in ("tcp", "udp") else (0,)) for node in NODES]


PACKETS = _packets()


def _check_exact(before: MasqConfig, after: MasqConfig, node_names: tuple[str, ...] = ()) -> None:
    options = PolicyOptions()
    result = diff_rule_policies(Policy(before, options), Policy(after, options), node_names=node_names)
    for packet, node in PACKETS:
        if node_names and node not in node_names:
            continue
        was, now = brute_outcome(before, packet, node), brute_outcome(after, packet, node)
        holding = [r for r in result.regions if r.contains(packet, node)]
        assert len(holding) <= 1, (packet, node, holding)  # regions are disjoint
        if was == now:
            assert not holding, (packet, node, holding)
        else:
            assert holding, (packet, node, was, now)
            assert holding[0].before.effect() == was and holding[0].after.effect() == now, (packet, node, holding)


@settings(max_examples=120, deadline=None)
@given(config_pairs())
def test_regions_are_exactly_the_packets_whose_outcome_changes(pair: tuple[MasqConfig, MasqConfig]) -> None:
    _check_exact(*pair)


@settings(max_examples=40, deadline=None)
@given(config_pairs(), st.lists(st.sampled_from(NODES), min_size=1, max_size=3, unique=True))
def test_regions_for_named_nodes_are_exact_for_those_nodes(pair: tuple[MasqConfig, MasqConfig],
                                                            names: list[str]) -> None:
    _check_exact(*pair, node_names=tuple(names))


def _rule(name: str, destinations: str, action: RuleAction, **fields: object) -> Rule:
    network = parse_address(destinations.split("/")[0])[1]
    return Rule(name, Family.V4, (Prefix(Family.V4, network, int(destinations.split("/")[1])),), action,
                **fields)  # type: ignore[arg-type]


def test_a_reordered_rule_reports_the_overlap_and_who_decides() -> None:
    snat = _rule("partner", "10.1.0.0/16", RuleAction.SNAT, protocol="tcp", ports=((443, 443),),
                 snat_to="10.142.0.50")
    keep = _rule("keep-vpn", "10.1.2.0/24", RuleAction.PRESERVE)
    base = MasqConfig(non_masquerade=())
    old = MasqConfig(non_masquerade=(), rules=(snat, keep))
    new = MasqConfig(non_masquerade=(), rules=(keep, snat))
    options = PolicyOptions()
    result = diff_rule_policies(Policy(old, options), Policy(new, options), ("10.1.2.3", "10.1.3.3"))
    [region] = result.regions
    assert [str(p) for p in region.destination_prefixes()] == ["10.1.2.0/24"]
    assert region.protocols == ("tcp",) and region.ports == ((443, 443),) and region.sources is None
    assert region.nodes is None
    assert (region.before.sees(), region.before.rule) == ("snat to 10.142.0.50", "partner")
    assert (region.after.sees(), region.after.rule) == ("preserve pod IP", "keep-vpn")
    inside, outside = result.probes
    assert inside.flips and inside.before is Outcome.MIXED and inside.after is Outcome.PRESERVE
    assert not outside.flips and outside.before is Outcome.MIXED
    # removing every rule: the lists masquerade everything
    gone = diff_rule_policies(Policy(old, options), Policy(base, options))
    assert {(r.before.outcome.value, r.after.outcome.value) for r in gone.regions} == {("snat", "masquerade"),
                                                                         ("preserve", "masquerade")}


def test_node_scoped_rule_per_node_class_and_per_named_node() -> None:
    egress = _rule("egress", "0.0.0.0/0", RuleAction.SNAT, nodes=("gke-prod-egress-*",), snat_to="10.142.0.50")
    old = MasqConfig(non_masquerade=(Entry(Prefix(Family.V4, 10 << 24, 8), False, Origin.CONFIG),))
    new = MasqConfig(non_masquerade=old.non_masquerade, rules=(egress,))
    options = PolicyOptions()
    [*regions] = diff_rule_policies(Policy(old, options), Policy(new, options)).regions
    assert {r.nodes_shown() for r in regions} == {"nodes matching gke-prod-egress-*"}
    assert {r.before.outcome for r in regions} == {Outcome.PRESERVE, Outcome.MASQUERADE}
    named = diff_rule_policies(Policy(old, options), Policy(new, options), node_names=("gke-prod-default-1",))
    assert named.regions == ()
    named = diff_rule_policies(Policy(old, options), Policy(new, options),
                               node_names=("gke-prod-default-1", "gke-prod-egress-2"))
    assert {r.nodes_shown() for r in named.regions} == {"node gke-prod-egress-2"}


CONFIG_OLD = """\
nonMasqueradeCIDRs: [10.0.0.0/8]
rules:
  - name: partner
    destinations: [10.1.0.0/16]
    protocol: tcp
    ports: [443]
    action: snat
    snatTo: 10.142.0.50
"""
CONFIG_NEW = """\
nonMasqueradeCIDRs: [10.0.0.0/8]
rules:
  - name: partner
    destinations: [10.1.0.0/16]
    protocol: tcp
    ports: [443, "8000-8080"]
    nodes: ["egress-*"]
    action: snat
    snatTo: 10.142.0.50
"""


def test_cli_text_json_and_node_names(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    old, new = tmp_path / "old.yaml", tmp_path / "new.yaml"
    old.write_text(CONFIG_OLD)
    new.write_text(CONFIG_NEW)
    code = main(["diff", str(old), str(new), "--probe", "10.1.0.9"])
    out, err = capsys.readouterr()
    assert code == 1, err
    lines = out.splitlines()
    assert lines[0] == f"{old} -> {new}: 2 region(s) change outcome"
    assert (f"  10.1.0.0/16 tcp port 443 on nodes not matching egress-*: snat to 10.142.0.50 (rule partner, "
            f"{old}:3) -> preserve pod IP (no rule matches: CIDR lists)") in lines
    assert (f"  10.1.0.0/16 tcp port 8000-8080 on nodes matching egress-*: preserve pod IP (no rule matches: CIDR "
            f"lists) -> snat to 10.142.0.50 (rule partner, {new}:3)") in lines
    assert lines[-1].startswith("probe 10.1.0.9: mixed (") and lines[-1].endswith(": FLIPS")
    code = main(["diff", str(old), str(new), "-o", "json", "--node-name", "egress-1"])
    data = json.loads(capsys.readouterr()[0])
    assert code == 0 and data["probes"] == []
    assert data["regions"] == [{
        "destinations": ["10.1.0.0/16"], "sources": None, "protocols": ["tcp"], "ports": ["8000-8080"],
        "nodes": ["egress-1"],
        "before": {"action": "preserve", "snatTo": None, "rule": None, "where": None},
        "after": {"action": "snat", "snatTo": "10.142.0.50", "rule": "partner", "where": f"{new}:3"}}]
    assert main(["diff", str(old), str(old)]) == 0
    assert capsys.readouterr()[0] == f"{old} -> {old}: no packet changes outcome\n"


def test_too_many_node_glob_sets_is_one_usage_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    many = tmp_path / "many.yaml"
    many.write_text("rules:\n" + "".join(f"  - name: r{i}\n    destinations: [10.{i}.0.0/16]\n    nodes: [pool-{i}-*]\n"
                                          "    action: masquerade\n" for i in range(12)))
    assert main(["diff", "gke", str(many)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "--node-name" in err
    assert main(["diff", "gke", str(many), "--node-name", "pool-3-a"]) == 0
    out, _ = capsys.readouterr()
    assert "10.3.0.0/16 on node pool-3-a: preserve pod IP (no rule matches: CIDR lists) -> masquerade to node IP " \
           "(rule r3" in out


def test_text_names_the_shorter_side_of_sources_and_ports(capsys: pytest.CaptureFixture[str],
                                                          tmp_path: Path) -> None:
    old, new = tmp_path / "old.yaml", tmp_path / "new.yaml"
    old.write_text("nonMasqueradeCIDRs: [10.0.0.0/8]\nrules:\n  - name: partner\n    destinations: [10.1.0.0/16]\n"
                   "    action: masquerade\n")
    new.write_text("nonMasqueradeCIDRs: [10.0.0.0/8]\nrules:\n  - name: partner\n    destinations: [10.1.0.0/16]\n"
                   "    sources: [10.44.0.0/14]\n    action: masquerade\n  - name: web\n"
                   "    destinations: [10.1.0.0/16]\n    protocol: tcp\n    ports: [443]\n    action: masquerade\n")
    assert main(["diff", str(old), str(new)]) == 0
    lines = capsys.readouterr()[0].splitlines()
    assert lines[1:] == [
        "  10.1.0.0/16 from all but 10.44.0.0/14 tcp port all but 443: masquerade to node IP (rule partner, "
        f"{old}:3) -> preserve pod IP (no rule matches: CIDR lists)",
        "  10.1.0.0/16 from all but 10.44.0.0/14 any protocol but tcp: masquerade to node IP (rule partner, "
        f"{old}:3) -> preserve pod IP (no rule matches: CIDR lists)"]
