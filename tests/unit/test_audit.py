"""audit: the GKE upgrade outage's REJECT lines surface with what the config does to them now; formats and bad input.

audit with config rules: each flow is evaluated with its own source, so a source-scoped rule decides the flows it
matches; a rule on protocol or port, which the flow logs read here do not hand to the policy, says so.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from ipmasq.audit import RawCounts, audit, count_flows
from ipmasq.cli import main
from ipmasq.errors import FlowLogError
from ipmasq.prefix import parse_cidr
from tests.configs import policy_of
from tests.conftest import ROOT

FLOWLOGS = ROOT / "tests" / "flowlogs"
PODS = (parse_cidr("10.44.0.0/14"),)
UPGRADE_FIX = "nonMasqueradeCIDRs: [10.0.0.0/8]\n"


def test_upgrade_reject_lines_with_the_fix(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    config = tmp_path / "config"
    config.write_text(UPGRADE_FIX)
    code = main(["audit", str(FLOWLOGS / "aws-vpc-rejects-pod-ips.log"), "--pod-range", "10.44.0.0/14",
                 "--config", str(config)])
    out = capsys.readouterr().out
    assert "172.30.12.110: pod source, rejected; with this config: masqueraded" in out
    assert "10.142.15.203" not in out  # the node's own flow is not a pod flow
    assert code == 0  # every rejected pod flow would now be masqueraded


def test_upgrade_reject_lines_with_gke_defaults_still_fail(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["audit", str(FLOWLOGS / "aws-vpc-rejects-pod-ips.log.gz"), "--pod-range", "10.44.0.0/14",
                 "--nomasq-all-reserved-ranges", "-o", "json"])
    document = json.loads(capsys.readouterr().out)
    assert code == 1
    first = document["groups"][0]
    assert (first["destination"], first["rejected"], first["masquerade"], first["matched"]) == \
        ("172.30.12.110", 2, False, ["172.16.0.0/12"])
    assert document["records"] == 5 and document["skipped"] == 1 and document["pod_flows"] == 4


def test_counts_and_grouping() -> None:
    raw = count_flows([str(FLOWLOGS / "aws-vpc-rejects-pod-ips.log")], PODS)
    report = audit(raw, policy_of(UPGRADE_FIX), group_bits={parse_cidr("0.0.0.0/0").family: 16})
    groups = {str(g.destination): g for g in report.groups}
    assert set(groups) == {"172.30.0.0/16", "10.142.0.0/16"}
    aws = groups["172.30.0.0/16"]
    assert (aws.flows, aws.rejected, aws.accepted, aws.source_count, aws.masquerade) == (3, 3, 0, 2, True)
    assert groups["10.142.0.0/16"].masquerade is False and not groups["10.142.0.0/16"].still_failing


def test_mixed_verdict_inside_a_group() -> None:
    raw = count_flows([str(FLOWLOGS / "aws-vpc-rejects-pod-ips.log")], PODS)
    policy = policy_of("nonMasqueradeCIDRs: [10.0.0.0/8, 172.30.0.0/16]\nmasqueradeCIDRs: [172.30.12.0/24]\n")
    report = audit(raw, policy, group_bits={parse_cidr("0.0.0.0/0").family: 16})
    aws = next(g for g in report.groups if str(g.destination) == "172.30.0.0/16")
    assert aws.masquerade is None and aws.with_config == "some masqueraded, some not" and aws.still_failing


def test_gcp_json_lines() -> None:
    raw = count_flows([str(FLOWLOGS / "gcp.jsonl")], PODS)
    report = audit(raw, policy_of(""))
    shown = {g.shown: g for g in report.groups}
    assert set(shown) == {"10.2.1.100", "172.30.12.110"}
    assert shown["10.2.1.100"].rejected == 1 and shown["10.2.1.100"].still_failing
    assert shown["172.30.12.110"].unknown == 1 and shown["172.30.12.110"].status == "no verdict in the log"
    assert raw.records == 3


def test_custom_format_header_and_cloudwatch_timestamp(tmp_path: Path) -> None:
    log = tmp_path / "custom.log"
    log.write_text("srcaddr dstaddr action\n10.44.1.1 8.8.8.8 REJECT\n10.44.1.1 8.8.8.8 REJECT\n")
    raw = count_flows([str(log)], PODS)
    assert raw.counts[("10.44.1.1", "8.8.8.8", "REJECT")][0] == 2
    cw = tmp_path / "cw.log"
    cw.write_text("2020-04-17T11:55:14.000Z 2 123 eni-1 10.44.14.15 172.30.12.110 1 2 6 3 180 1 2 REJECT OK\n")
    assert count_flows([str(cw)], PODS).counts[("10.44.14.15", "172.30.12.110", "REJECT")][0] == 1


def test_gzip_equals_plain(tmp_path: Path) -> None:
    text = (FLOWLOGS / "aws-vpc-rejects-pod-ips.log").read_bytes()
    packed = tmp_path / "x.gz"
    packed.write_bytes(gzip.compress(text))
    def counted(path: str) -> dict[tuple[str, str, str], tuple[int, int]]:
        return {k: (v[0], v[2]) for k, v in count_flows([path], PODS).counts.items()}  # (flows, first line)

    assert counted(str(packed)) == counted(str(FLOWLOGS / "aws-vpc-rejects-pod-ips.log"))


@pytest.mark.parametrize(("content", "needle"), [
    ("2 1 eni 10.44.1.1 8.8.8.8 1 2\n", ":1: not an AWS flow log record"),
    ("2 1 eni-1 10.44.1.x 8.8.8.8 1 2 6 1 1 1 2 ACCEPT OK\n", ":1: source '10.44.1.x'"),
    ("2 1 eni-1 10.44.1.1 8.8.8.8 1 2 6 1 1 1 2 MAYBE OK\n", ":1: action 'MAYBE'"),
    ('{"connection": {"src_ip": "10.44.1.1"}}\n', ":1: not a GCP VPC flow log"),
])
def test_bad_input_is_one_line_with_file_and_line(tmp_path: Path, content: str, needle: str,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    log = tmp_path / "bad.log"
    log.write_text(content)
    assert main(["audit", str(log), "--pod-range", "10.44.0.0/14"]) == 3  # could not read it
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{log}{needle}" in err


def test_missing_file(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["audit", "/nonexistent/flow.log", "--pod-range", "10.44.0.0/14"]) == 3
    assert "No such file" in capsys.readouterr().err
    with pytest.raises(FlowLogError):
        count_flows(["/nonexistent/flow.log"], PODS)


RULES = """\
nonMasqueradeCIDRs: [10.0.0.0/8]
rules:
  - name: vpn-pods-keep-ip
    destinations: [172.30.0.0/16]
    sources: [10.44.1.0/24]
    action: preserve
"""


def _raw(*flows: tuple[str, str, str]) -> RawCounts:
    return RawCounts({flow: [1, "flows.log", n] for n, flow in enumerate(flows, start=1)}, records=len(flows))


def test_the_flows_source_decides_a_source_scoped_rule() -> None:
    policy = policy_of(RULES)
    matched = audit(_raw(("10.44.1.5", "172.30.12.110", "REJECT")), policy).groups[0]
    assert matched.masquerade is False and matched.matched == ("rule vpn-pods-keep-ip",)
    assert matched.still_failing and matched.reasons == ("rule",)
    other = audit(_raw(("10.44.2.5", "172.30.12.110", "REJECT")), policy).groups[0]
    assert other.masquerade is True and other.matched == ("catch-all",) and not other.still_failing
    both = audit(_raw(("10.44.1.5", "172.30.12.110", "REJECT"), ("10.44.2.5", "172.30.12.110", "ACCEPT")),
                 policy).groups[0]
    assert both.masquerade is None and both.with_config == "some masqueraded, some not"
    assert both.matched == ("catch-all", "rule vpn-pods-keep-ip")


def test_a_port_rule_leaves_the_verdict_depending_on_the_port() -> None:
    policy = policy_of("nonMasqueradeCIDRs: [10.0.0.0/8]\nrules:\n  - name: https-keeps-ip\n"
                     "    destinations: [172.30.0.0/16]\n    protocol: tcp\n    ports: [443]\n    action: preserve\n")
    group = audit(_raw(("10.44.1.5", "172.30.12.110", "REJECT")), policy).groups[0]
    assert group.masquerade is None and "depends on protocol, port" in group.reasons


def test_without_rules_the_destination_alone_decides() -> None:
    group = audit(_raw(("10.44.1.5", "172.30.12.110", "REJECT"), ("10.44.2.5", "172.30.12.110", "REJECT")),
                  policy_of("nonMasqueradeCIDRs: [10.0.0.0/8]\n")).groups[0]
    assert group.masquerade is True and group.matched == ("catch-all",)
