"""`check --writer`: a provider's rules (EKS's AWS-SNAT-CHAIN-0) or map (Cilium's, from `cilium-dbg bpf ipmasq
list`) against what that provider's agent intends, on dumps of the formats those programs print."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from ipmasq.cli import main
from ipmasq.diagnose.check import FindingId, NodeRules
from ipmasq.diagnose.cilium import check_cilium_map, is_ipmasq_list, parse_ipmasq_list
from ipmasq.diagnose.eks import check_eks
from ipmasq.diagnose.writer_sources import sources_from_manifests
from ipmasq.errors import ConfigError, IpmasqError
from ipmasq.findings import Severity
from ipmasq.netfilter.aws_snat import read_aws_snat_chain
from ipmasq.netfilter.iptables import parse_save
from ipmasq.policy.policy import Policy
from ipmasq.prefix import Family, parse_cidr
from ipmasq.writers import WRITERS, Sources, cilium_map_intent, intended
from tests.conftest import ROOT

DUMPS = ROOT / "tests" / "dumps"
EKS_SAVE = (DUMPS / "eks-vpc-cni.save").read_text()


# --- Cilium's map -----------------------------------------------------------------------------------------------


def test_the_table_the_json_and_the_empty_listing_parse_alike() -> None:
    table = parse_ipmasq_list((DUMPS / "cilium-ipmasq-list-stale.txt").read_text(), "map.txt")
    as_json = parse_ipmasq_list((DUMPS / "cilium-ipmasq-list.json").read_text(), "map.json")
    assert table == as_json == {parse_cidr("10.0.0.0/8"), parse_cidr("169.254.0.0/16"), parse_cidr("fe80::/10")}
    assert parse_ipmasq_list("No entries found.\n", "x") == frozenset() == parse_ipmasq_list("null\n", "x")
    for text in ("IP PREFIX/ADDRESS\n", "[]", "No entries found."):
        assert is_ipmasq_list(text)
    assert not is_ipmasq_list("*nat\n:POSTROUTING ACCEPT [0:0]\nCOMMIT\n")
    assert not is_ipmasq_list('{"nftables": []}')


@pytest.mark.parametrize("text", ["10.0.0.0/8\n", "IP PREFIX/ADDRESS\n10.0.0.1/8\n", "IP PREFIX/ADDRESS\nnot a cidr\n",
                                  "[1, 2]", '{"a": 1}]', "[\"10.0.0.0/8\""])
def test_what_the_command_never_prints_is_one_located_error(text: str) -> None:
    with pytest.raises(IpmasqError) as caught:
        parse_ipmasq_list(text, "map.txt")
    assert str(caught.value).startswith("map.txt") and "\n" not in str(caught.value)


def test_the_defaults_listing_matches_a_missing_configmap() -> None:
    intent = cilium_map_intent(intended(WRITERS["cilium"], Sources()))
    have = parse_ipmasq_list((DUMPS / "cilium-ipmasq-list-defaults.txt").read_text(), "map")
    assert check_cilium_map(intent, have, map_name="m").findings == ()


def test_a_stale_map_names_what_is_masqueraded_against_the_config() -> None:
    config = intended(WRITERS["cilium"], Sources({"ip-masq-agent": {"config": b"nonMasqueradeCIDRs: [10.0.0.0/8, "
                                                                              b"100.64.0.0/10]\n"}}))
    have = parse_ipmasq_list((DUMPS / "cilium-ipmasq-list-stale.txt").read_text(), "map")
    report = check_cilium_map(cilium_map_intent(config), have, map_name="cilium_ipmasq_v4")
    assert not report.ok
    (finding,) = report.findings
    assert finding.id is FindingId.RULES_DIFFER and finding.missing == ("100.64.0.0/10",)
    # the other way round: the map keeps the pod's address where the config masquerades
    extra = check_cilium_map(frozenset({parse_cidr("10.0.0.0/8")}), have, map_name="m")
    assert {f.extra for f in extra.findings} == {("169.254.0.0/16",), ("fe80::/10",)}


def test_an_empty_map_is_config_not_applied_and_same_addresses_are_a_warning() -> None:
    intent = frozenset({parse_cidr("10.0.0.0/8")})
    (empty,) = check_cilium_map(intent, frozenset(), map_name="m").findings
    assert empty.id is FindingId.CONFIG_NOT_APPLIED
    split = frozenset({parse_cidr("10.0.0.0/9"), parse_cidr("10.128.0.0/9")})
    report = check_cilium_map(intent, split, map_name="m")
    assert report.ok and [f.severity for f in report.findings] == [Severity.WARNING]


# --- EKS: AWS-SNAT-CHAIN-0 --------------------------------------------------------------------------------------


def test_the_chain_is_read_by_part() -> None:
    chain = read_aws_snat_chain(parse_save(EKS_SAVE))
    assert chain is not None and chain.jump and chain.snat_to == "172.31.23.106"
    assert chain.vpc_cidrs == (parse_cidr("172.31.0.0/16"),)
    assert chain.exclusions == (parse_cidr("10.8.0.0/16"),)
    assert chain.others == ()
    assert read_aws_snat_chain(parse_save("*nat\n:POSTROUTING ACCEPT [0:0]\nCOMMIT\n")) is None


def _eks(env: dict[str, str], save: str = EKS_SAVE) -> dict[FindingId, list[str]]:
    rules = NodeRules("iptables", {Family.V4: parse_save(save)})
    config = intended(WRITERS["eks"], Sources(env=env, vpc_cidrs=("172.31.0.0/16",)))
    report = check_eks(Policy(config, WRITERS["eks"].options), rules, env)
    found: dict[FindingId, list[str]] = {}
    for f in report.findings:
        found.setdefault(f.id, []).append(f.message)  # type: ignore[arg-type]
    return found


def test_a_chain_that_matches_the_env_is_ok() -> None:
    assert _eks({"AWS_VPC_K8S_CNI_EXCLUDE_SNAT_CIDRS": "10.8.0.0/16"}) == {}


def test_an_exclusion_the_cni_has_not_applied_is_named_with_its_effect() -> None:
    found = _eks({"AWS_VPC_K8S_CNI_EXCLUDE_SNAT_CIDRS": "10.8.0.0/16,192.168.0.0/16"})
    assert "192.168.0.0/16" in found[FindingId.CONFIG_NOT_APPLIED][0]
    assert "192.168.0.0/16" in found[FindingId.RULES_DIFFER][0]  # the packet-space pass: SNATed there
    assert "AWS-SNAT-CHAIN-0 decides" in found[FindingId.RULES_DIFFER][0]


def test_an_exclusion_gone_from_the_env_is_extra() -> None:
    found = _eks({})
    assert any("10.8.0.0/16" in m and "does not list" in m for m in found[FindingId.RULES_DIFFER])


def test_an_invalid_exclusion_is_skipped_as_the_cni_skips_it() -> None:
    found = _eks({"AWS_VPC_K8S_CNI_EXCLUDE_SNAT_CIDRS": "10.8.0.0/16,10.9.0.0/16 "})
    assert "'10.9.0.0/16 '" in found[FindingId.UNSUPPORTED][0]
    assert set(found) == {FindingId.UNSUPPORTED}  # 10.9/16 is SNATed, as intended once the entry is skipped


def test_external_snat_with_the_chain_still_there() -> None:
    found = _eks({"AWS_VPC_K8S_CNI_EXTERNALSNAT": "true"})
    assert any("EXTERNALSNAT=true" in m for m in found[FindingId.RULES_DIFFER])
    without = "\n".join(line for line in EKS_SAVE.splitlines() if "AWS-SNAT-CHAIN-0" not in line) + "\n"
    assert _eks({"AWS_VPC_K8S_CNI_EXTERNALSNAT": "true"}, without) == {}
    assert FindingId.CHAIN_MISSING in _eks({}, without)


# --- the writer's inputs from manifests ---------------------------------------------------------------------------


def test_manifests_give_configmaps_and_the_aws_node_env() -> None:
    sources = sources_from_manifests([
        ("aks.yaml", (DUMPS / "aks-ip-masq-configmaps.yaml").read_text()),
        ("aws-node.yaml", (DUMPS / "eks-aws-node.yaml").read_text()),
        ("other.yaml", "kind: ConfigMap\nmetadata: {name: ip-masq-agent, namespace: default}\ndata: {config: x}\n"),
    ])
    assert set(sources.configmaps) == {"azure-ip-masq-agent-config-reconciled", "azure-ip-masq-agent-config"}
    assert sources.env["AWS_VPC_K8S_CNI_EXCLUDE_SNAT_CIDRS"] == "10.8.0.0/16,192.168.0.0/16,10.9.0.0/16 "
    config = intended(WRITERS["aks"], sources)
    assert sorted(str(e.prefix) for e in config.non_masquerade) == ["10.224.0.0/12", "10.244.0.0/16",
                                                                   "172.30.0.0/16"]
    assert config.masq_link_local


def test_an_env_value_from_elsewhere_is_refused_not_guessed() -> None:
    manifest = (DUMPS / "eks-aws-node.yaml").read_text().replace(
        'value: "false"', "valueFrom:\n            configMapKeyRef: {name: x, key: y}")
    with pytest.raises(ConfigError, match="valueFrom"):
        sources_from_manifests([("ds.yaml", manifest)])


# --- the command ----------------------------------------------------------------------------------------------


def test_cli_eks_and_cilium(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["check", "--writer", "eks", "--from-dump", str(DUMPS / "eks-vpc-cni.save"),
                 "--manifest", str(DUMPS / "eks-aws-node.yaml"), "-o", "json"]) == 1
    ids = {f["id"] for f in json.loads(capsys.readouterr().out)["findings"]}
    assert ids == {"unsupported", "config-not-applied", "rules-differ"}
    config = tmp_path / "config"
    config.write_text("nonMasqueradeCIDRs: [10.0.0.0/8]\n")
    # a listing needs no --writer: it can only be Cilium's map
    assert main(["check", "--from-dump", str(DUMPS / "cilium-ipmasq-list-stale.txt"), "--config", str(config)]) == 0
    assert "ok: the node's rules match the config" in capsys.readouterr().out
    assert main(["check", "--writer", "gke", "--from-dump", str(DUMPS / "cilium-ipmasq-list-stale.txt")]) == 2
    assert "--writer cilium" in capsys.readouterr().err
    assert main(["check", "--manifest", str(DUMPS / "eks-aws-node.yaml")]) == 2
    eks_dump = str(DUMPS / "eks-vpc-cni.save")
    assert main(["check", "--writer", "gke", "--masq-chain=IP-MASQ", "--from-dump", eks_dump]) == 2
    assert "drop --masq-chain" in capsys.readouterr().err


def test_cli_gke_writer_uses_its_chain_and_flags(capsys: pytest.CaptureFixture[str]) -> None:
    # GKE 1.14's chain with GKE's flags and no ConfigMap: the defaults with every reserved range (that agent
    # predates --random-fully, which today's writes: the one difference, a warning)
    assert main(["check", "--writer", "gke", "--from-dump", str(DUMPS / "gke-1.14-aws-vpn.save")]) == 0
    out = capsys.readouterr().out
    assert "IP-MASQ-AGENT" not in out and "only in MASQUERADE's --random-fully" in out
    # the advice is one a user of --writer can follow: no flag that --writer refuses (it runs with GKE's own flags)
    assert "nothing to do: the agent behind GKE's managed agent sets --random-fully" in out
    assert "--random-fully=" not in out and "pass --" not in out
    assert main(["check", "--writer", "reference", "--from-dump", str(DUMPS / "gke-1.14-aws-vpn.save")]) == 1


def test_a_mebibyte_of_junk_in_aws_nodes_env_is_a_screenful(capsys: pytest.CaptureFixture[str],
                                                            tmp_path: Path) -> None:
    """Output bounded by what a person reads: each finding list names the first few and counts the rest (before,
    this input printed 381,441 lines, 46 MB; docs/measurements.md)."""
    from tests.hostile.generated import aws_node_with_junk_env

    manifest = tmp_path / "aws-node.yaml"
    manifest.write_bytes(aws_node_with_junk_env())
    argv = ["check", "--writer", "eks", "--from-dump", str(DUMPS / "eks-vpc-cni.save"), "--manifest", str(manifest)]
    assert main(argv) == 1
    text = capsys.readouterr().out
    assert len(text.splitlines()) <= 40 and len(text.encode()) <= 8192, (len(text.splitlines()), len(text))
    assert re.search(r"and \d{3},\d{3} more warnings \[unsupported\] like the above, not shown", text)
    assert main([*argv, "-o", "json"]) == 1
    document = json.loads(capsys.readouterr().out)
    skipped = [f for f in document["findings"] if f["id"] == "unsupported"]
    assert len(skipped) == 6 and skipped[-1]["omitted"] > 150_000


def test_a_hundred_thousand_exclusions_the_chain_lacks_are_named_six_and_counted(capsys: pytest.CaptureFixture[str],
                                                                                tmp_path: Path) -> None:
    cidrs = ",".join(f"10.{i // 256 % 256}.{i % 256}.{i // 65536}/32" for i in range(100_000))
    manifest = (DUMPS / "eks-aws-node.yaml").read_text().replace('"10.8.0.0/16,192.168.0.0/16,10.9.0.0/16 "',
                                                                   f'"{cidrs}"')
    (tmp_path / "aws-node.yaml").write_text(manifest)
    assert main(["check", "--writer", "eks", "--from-dump", str(DUMPS / "eks-vpc-cni.save"), "--manifest",
                 str(tmp_path / "aws-node.yaml")]) == 1
    text = capsys.readouterr().out
    line = next(line for line in text.splitlines() if "has no RETURN for it" in line)
    assert "and 99,994 more from SNAT" in line and len(line) < 400


def test_cli_a_key_gkes_agent_ignores_is_ignored_by_writer_never_a_promised_rewrite(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from ipmasq.testing.writers import ip_masq_agent_rules

    # what GKE's agent writes from the how-to's example: nonMasqueradeCIDRs alone (masqueradeCIDRs is ipmasq's)
    written = ip_masq_agent_rules("IP-MASQ", ("10.0.0.0/8",), random_fully=True)
    dump = tmp_path / "node.save"
    dump.write_text("*nat\n:PREROUTING ACCEPT [0:0]\n:INPUT ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\n"
                    ":POSTROUTING ACCEPT [0:0]\n" + written.split("\n", 1)[1])
    example = str(ROOT / "deploy" / "examples" / "vpn-range-inside-10-8.yaml")
    assert main(["check", "--writer", "gke", "--from-dump", str(dump), "--config", example]) == 1
    out = capsys.readouterr().out
    assert "rules-differ" not in out and "next sync" not in out
    assert out.startswith("ERROR ignored-by-writer: GKE's managed agent ignores masqueradeCIDRs "
                          "(configmap/ip-masq-agent[config]:12): 10.11.0.0/24 stays un-masqueraded; enforce with "
                          "ipmasq to use it\n")
    # a real difference is still rules-differ (with the rewrite the agent really does), beside the ignored key
    config = tmp_path / "config"
    config.write_text("nonMasqueradeCIDRs: [10.0.0.0/8, 172.16.0.0/12]\nmasqueradeCIDRs: [10.11.0.0/24]\n")
    assert main(["check", "--writer", "gke", "--from-dump", str(dump), "--config", str(config), "-o", "json"]) == 1
    findings = json.loads(capsys.readouterr().out)["findings"]
    assert [f["id"] for f in findings] == ["ignored-by-writer", "rules-differ"]
    assert findings[1]["missing"] == ["-d 172.16.0.0/12 -j RETURN"]
    # an agent without --enable-ipv6 refuses a config with IPv6 CIDRs: said as what the key it ignores does
    config.write_text("nonMasqueradeCIDRs: [10.0.0.0/8, fd00::/8]\nenableIPv6: true\n")
    assert main(["check", "--writer", "gke", "--from-dump", str(dump), "--config", str(config), "-o", "json"]) == 1
    (refused,) = json.loads(capsys.readouterr().out)["findings"]
    assert refused["id"] == "ignored-by-writer" and "refuses the whole config" in refused["message"]
