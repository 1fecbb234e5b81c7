"""ipmasq diff: flips against a brute-force verdict comparison, minimal CIDR output, named sets, the CLI contract."""

from __future__ import annotations

import json
from itertools import pairwise
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ipmasq.cli import main
from ipmasq.config.model import LINK_LOCAL_V4, Entry, MasqConfig, Origin
from ipmasq.diff.baselines import BASELINES, baseline_policy
from ipmasq.diff.diff import diff_policies
from ipmasq.options import PolicyOptions
from ipmasq.policy.packet import Outcome
from ipmasq.policy.policy import Policy
from ipmasq.policy.prefix import Family, Prefix, parse_address, parse_cidr
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
