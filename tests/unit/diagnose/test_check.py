"""check: every finding id on a dump that shows it, and ok on the agent's own output."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ipmasq.cli import main
from ipmasq.config import ConfigInput, config_from_bytes
from ipmasq.diagnose.check import FindingId, check_iptables, check_nft
from ipmasq.diagnose.sources import family_of_dump
from ipmasq.findings import Finding, Severity
from ipmasq.netfilter.iptables import parse_save, render_restore
from ipmasq.netfilter.nft import desired_table, parse_list_json
from ipmasq.options import PolicyOptions
from ipmasq.policy.policy import Policy
from ipmasq.policy.prefix import Family, parse_cidr
from ipmasq.testing.nft import list_json
from tests.conftest import ROOT

DUMPS = ROOT / "tests" / "dumps"
GKE = PolicyOptions(masq_chain="IP-MASQ", nomasq_all_reserved_ranges=True, random_fully=False)
REFERENCE_2_9 = PolicyOptions(random_fully=False)  # the vectors' reference agent predates --random-fully
# the config of vector 03 (nonMasqueradeCIDRs [10.0.0.0/8], masqLinkLocal), whose output several dumps hold
TEN = "nonMasqueradeCIDRs: [10.0.0.0/8]\nmasqLinkLocal: true\n"


def _policy(text: str, options: PolicyOptions) -> Policy:
    return Policy(config_from_bytes(ConfigInput((("/c", text.encode()),)), options), options)


def _ids(name: str, policy: Policy, **kw: object) -> dict[str, Finding]:
    table = parse_save((DUMPS / name).read_text())
    report = check_iptables(policy, table, Family.V4, **kw)  # type: ignore[arg-type]
    return {f.id: f for f in report.findings}


def test_agent_output_is_ok() -> None:
    policy = _policy("nonMasqueradeCIDRs: [10.0.0.0/8]\nmasqueradeCIDRs: [10.11.0.0/24]\n", PolicyOptions())
    table = parse_save(render_restore(policy, Family.V4))
    report = check_iptables(policy, table, Family.V4)
    assert report.ok and report.findings == ()


def test_gke_1_14_chain_is_ok_for_gke_flags() -> None:
    assert _ids("gke-1.14-aws-vpn.save", _policy("", GKE)) == {}


def test_gke_1_14_chain_against_the_upgrade_fix_lists_the_exact_extra_destinations() -> None:
    found = _ids("gke-1.14-aws-vpn.save", _policy("nonMasqueradeCIDRs: [10.0.0.0/8]\n", GKE))
    assert set(found) == {FindingId.RULES_DIFFER}
    differ = found[FindingId.RULES_DIFFER]
    assert differ.missing == ()
    assert "-d 172.16.0.0/12 -j RETURN" in differ.extra
    assert len(differ.extra) == 10


def test_config_not_applied() -> None:
    found = _ids("catch-all-only.save", _policy(TEN, REFERENCE_2_9))
    assert set(found) == {FindingId.CONFIG_NOT_APPLIED}


def test_kubenet_rule_is_foreign_masquerade_with_its_destinations() -> None:
    found = _ids("gke-kubenet.save", _policy("", GKE))
    assert set(found) == {FindingId.FOREIGN_MASQUERADE}
    finding = found[FindingId.FOREIGN_MASQUERADE]
    assert finding.rule is not None and "kubenet" in finding.rule
    assert "172.16.0.0/12" in finding.destinations
    assert "10.0.0.0/8" not in finding.destinations
    assert "--non-masquerade-cidr" in finding.hint


def test_fix_nat_daemonset_rule() -> None:
    found = _ids("fix-nat-daemonset.save", _policy(TEN, REFERENCE_2_9))
    assert set(found) == {FindingId.FOREIGN_MASQUERADE}
    assert found[FindingId.FOREIGN_MASQUERADE].destinations == ("10.11.0.0/24",)
    # the same intent said in the config: the rule no longer changes an outcome
    intent = _policy(TEN + "masqueradeCIDRs: [10.11.0.0/24]\n", REFERENCE_2_9)
    assert set(_ids("fix-nat-daemonset.save", intent)) == {FindingId.RULES_DIFFER}


def test_hand_written_snat_rule_needs_the_pod_range() -> None:
    policy = _policy("", GKE)
    assert set(_ids("manual-private-endpoint.save", policy)) == {FindingId.UNSUPPORTED}
    found = _ids("manual-private-endpoint.save", policy, pod_ranges=(parse_cidr("100.64.0.0/16"),))
    assert set(found) == {FindingId.FOREIGN_MASQUERADE}
    assert found[FindingId.FOREIGN_MASQUERADE].destinations == ("10.1.2.100/32",)
    # pods elsewhere: the rule never applies to them
    assert _ids("manual-private-endpoint.save", policy, pod_ranges=(parse_cidr("10.44.0.0/14"),)) == {}


def test_renamed_chain_is_stale() -> None:
    found = _ids("renamed-chain.save", _policy(TEN, REFERENCE_2_9))
    assert set(found) == {FindingId.STALE_CHAIN}
    assert found[FindingId.STALE_CHAIN].severity is Severity.ERROR



def test_a_node_running_another_chain_name_is_not_told_to_delete_it() -> None:
    # a GKE node (chain IP-MASQ) checked without --masq-chain=IP-MASQ: its live chain is not stale, and advising
    # `iptables -X IP-MASQ` would tear down the node's working rules
    missing = _ids("gke-1.14-aws-vpn.save", _policy("", PolicyOptions(nomasq_all_reserved_ranges=True)))
    assert set(missing) == {FindingId.CHAIN_MISSING}
    assert "this node uses chain IP-MASQ" in missing[FindingId.CHAIN_MISSING].message
    assert "--masq-chain=IP-MASQ" in missing[FindingId.CHAIN_MISSING].hint
    assert "-X" not in missing[FindingId.CHAIN_MISSING].hint + missing[FindingId.CHAIN_MISSING].message


def test_jump_missing() -> None:
    policy = _policy("", PolicyOptions())
    text = "\n".join(line for line in render_restore(policy, Family.V4).splitlines()
                     if not line.startswith("-A POSTROUTING"))
    report = check_iptables(policy, parse_save(text), Family.V4)
    assert [f.id for f in report.findings] == [FindingId.JUMP_MISSING]


def test_jump_shadowed() -> None:
    found = _ids("shadowed-jump.save", _policy(TEN, REFERENCE_2_9))
    assert set(found) == {FindingId.JUMP_SHADOWED}
    assert found[FindingId.JUMP_SHADOWED].destinations == ("172.30.0.0/16",)


def test_port_scoped_snat_is_decided_for_its_port_only() -> None:
    policy = _policy(TEN, REFERENCE_2_9)
    found = _ids("unsupported.save", policy, pod_ranges=(parse_cidr("10.44.0.0/14"),))
    assert set(found) == {FindingId.FOREIGN_MASQUERADE}
    snat = found[FindingId.FOREIGN_MASQUERADE]
    assert snat.rule is not None and "--dport 5432" in snat.rule
    assert snat.destinations == ("10.9.0.0/16",) and "(tcp port 5432)" in snat.message
    assert "POSTROUTING:3 " in snat.message  # the jump, docker's rule, then this one


def test_unsupported_quotes_the_rule() -> None:
    policy = _policy(TEN, REFERENCE_2_9)
    dump = (DUMPS / "unsupported.save").read_text().replace("-p tcp -m tcp --dport 5432",
                                                            "-m statistic --mode random --probability 0.5")
    report = check_iptables(policy, parse_save(dump), Family.V4, pod_ranges=(parse_cidr("10.44.0.0/14"),))
    found = {f.id: f for f in report.findings}
    assert set(found) == {FindingId.UNSUPPORTED}
    unsupported = found[FindingId.UNSUPPORTED].rule
    assert unsupported is not None and "-m statistic" in unsupported


def test_random_fully_only_is_a_warning() -> None:
    found = _ids("fix-nat-daemonset.save", _policy(TEN + "masqueradeCIDRs: [10.11.0.0/24]\n", PolicyOptions()))
    assert found[FindingId.RULES_DIFFER].severity is Severity.ERROR
    policy = _policy(TEN, PolicyOptions())
    table = parse_save((DUMPS / "fix-nat-daemonset.save").read_text().replace(
        '-A POSTROUTING -d 10.11.0.0/24 -m comment --comment "NAT-VPN: SNAT for outbound traffic through VPN" '
        '-m addrtype ! --dst-type LOCAL -j MASQUERADE\n', ""))
    report = check_iptables(policy, table, Family.V4)
    assert report.ok and [(f.id, f.severity) for f in report.findings] == [(FindingId.RULES_DIFFER, Severity.WARNING)]


def test_family_of_dump() -> None:
    assert family_of_dump(parse_save("*nat\n:X - [0:0]\n-A X -d fd00::/8 -j RETURN\nCOMMIT\n")) is Family.V6
    assert family_of_dump(parse_save((DUMPS / "gke-1.14-aws-vpn.save").read_text())) is Family.V4


def test_nft_table_against_policy() -> None:
    policy = _policy("nonMasqueradeCIDRs: [10.0.0.0/8, 172.16.0.0/12]\n", PolicyOptions())
    listing = json.dumps({"nftables": list_json(desired_table(policy))})
    assert check_nft(policy, parse_list_json(listing)).findings == ()
    fixed = _policy("nonMasqueradeCIDRs: [10.0.0.0/8]\n", PolicyOptions())
    report = check_nft(fixed, parse_list_json(listing))
    assert [f.id for f in report.findings] == [FindingId.RULES_DIFFER]
    assert report.findings[0].extra == ("172.16.0.0/12",)
    assert check_nft(policy, None).findings[0].id is FindingId.CHAIN_MISSING


def test_cli_json_and_exit_codes(capsys: pytest.CaptureFixture[str]) -> None:
    ok = main(["check", "--from-dump", str(DUMPS / "gke-1.14-aws-vpn.save"), "--masq-chain=IP-MASQ",
               "--nomasq-all-reserved-ranges", "--random-fully=false", "-o", "json"])
    assert ok == 0 and json.loads(capsys.readouterr().out) == {"ok": True, "findings": []}
    bad = main(["check", "--from-dump", str(DUMPS / "gke-kubenet.save"), "--masq-chain=IP-MASQ",
                "--nomasq-all-reserved-ranges", "--random-fully=false", "-o", "json"])
    document = json.loads(capsys.readouterr().out)
    assert bad == 1 and document["ok"] is False
    assert [(f["id"], f["severity"]) for f in document["findings"]] == [("foreign-masquerade", "error")]
    assert {"id", "severity", "message"} <= set(document["findings"][0])


def test_cli_bad_dump(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    junk = tmp_path / "junk.txt"
    junk.write_text("hello\n")
    assert main(["check", "--from-dump", str(junk)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no *nat table" in err
    bad_json = tmp_path / "bad.json"
    bad_json.write_text("{not json")
    assert main(["check", "--from-dump", str(bad_json)]) == 1
    assert str(bad_json) in capsys.readouterr().err
