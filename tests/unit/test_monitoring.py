"""The fleet's alert rules: generated files up to date, valid for promtool, and every alert proven firing and not
firing with `promtool test rules` (Debian's prometheus package) on series shaped like a real fleet's."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from ipmasq.monitoring import ALERTS, prometheus_rule, rules_file
from tests.conftest import ROOT

MONITORING = ROOT / "deploy" / "monitoring"
JOB = 'job="ip-masq-agent"'


def _promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        if os.environ.get("CI"):
            pytest.fail("promtool is missing (Debian package prometheus; scripts/bootstrap.sh installs it)")
        pytest.skip("promtool is missing (Debian package prometheus)")
    return found


def test_generated_files_are_up_to_date() -> None:
    assert (MONITORING / "ip-masq-agent.rules.yaml").read_text() == rules_file()
    assert (MONITORING / "prometheusrule.yaml").read_text() == prometheus_rule()


def test_every_alert_has_a_runbook_naming_an_ipmasq_or_kubectl_command() -> None:
    for alert in ALERTS:
        assert "ipmasq" in alert.runbook or "kubectl" in alert.runbook, alert.name


def test_promtool_checks_the_rules_and_the_prometheusrule(tmp_path: Path) -> None:
    promtool = _promtool()
    manifest = yaml.safe_load((MONITORING / "prometheusrule.yaml").read_text())
    extracted = tmp_path / "from-prometheusrule.yaml"
    extracted.write_text(yaml.safe_dump({"groups": manifest["spec"]["groups"]}))
    for path in (MONITORING / "ip-masq-agent.rules.yaml", extracted):
        done = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, check=False)
        assert done.returncode == 0, done.stdout + done.stderr
        assert f"SUCCESS: {len(ALERTS)} rules found" in done.stdout


def _node(name: str) -> str:
    return f'instance="{name}:9847",{JOB}'


# Each case: input series, then (time, alert, the instances expected firing, extra labels, $value) checks, both
# firing and not firing. Series values use promtool's expanding notation ('1x10' = 11 samples of 1, '0+1x9').
CASES: list[dict[str, Any]] = [
    {"series": {f"ipmasq_config_valid{{{_node('a')}}}": "1 1 0x10", f"ipmasq_config_valid{{{_node('b')}}}": "1x12"},
     "checks": [("4m", "IpMasqAgentConfigInvalid", [], {}, None),  # pending, not yet firing
                ("8m", "IpMasqAgentConfigInvalid", ["a"], {}, None)]},
    {"series": {f"ipmasq_config_valid{{{_node('a')}}}": "1x20", f"ipmasq_ready{{{_node('a')}}}": "1 1 0x18",
                f"ipmasq_last_successful_sync_timestamp_seconds{{{_node('a')}}}": "60x20",
                f"ipmasq_resync_interval_seconds{{{_node('a')}}}": "60x20",
                f"ipmasq_config_valid{{{_node('b')}}}": "1x20", f"ipmasq_ready{{{_node('b')}}}": "1x20",
                f"ipmasq_last_successful_sync_timestamp_seconds{{{_node('b')}}}": "0+60x20",
                f"ipmasq_resync_interval_seconds{{{_node('b')}}}": "60x20"},
     "checks": [("7m", "IpMasqAgentKernelNotMatching", [], {}, None),
                ("10m", "IpMasqAgentKernelNotMatching", ["a"], {}, None)]},
    {"series": {f'ipmasq_enforced_config_info{{{_node("a")}, config_hash="aaaaaaaaaaaaaaaa"}}': "1x40",
                f'ipmasq_enforced_config_info{{{_node("b")}, config_hash="bbbbbbbbbbbbbbbb"}}': "1x40"},
     "checks": [("20m", "IpMasqAgentConfigDivergence", [], {}, None),
                ("35m", "IpMasqAgentConfigDivergence", [None], {}, "2")]},
    {  # a rollout: b takes the new config 10 minutes after a; never two configs for 30 minutes
     "series": {f'ipmasq_enforced_config_info{{{_node("a")}, config_hash="aaaaaaaaaaaaaaaa"}}': "1x5 _x40",
                f'ipmasq_enforced_config_info{{{_node("a")}, config_hash="cccccccccccccccc"}}': "_x5 1x40",
                f'ipmasq_enforced_config_info{{{_node("b")}, config_hash="aaaaaaaaaaaaaaaa"}}': "1x15 _x30",
                f'ipmasq_enforced_config_info{{{_node("b")}, config_hash="cccccccccccccccc"}}': "_x15 1x30"},
     "checks": [("40m", "IpMasqAgentConfigDivergence", [], {}, None)]},
    {"series": {f"ipmasq_drift_repairs_total{{{_node('a')}}}": "0 0 1+1x18",
                f"ipmasq_drift_repairs_total{{{_node('b')}}}": "0x20",
                f"ipmasq_drift_repairs_total{{{_node('c')}}}": "0 0 1x18"},  # one repair: not a fight
     "checks": [("1m", "IpMasqAgentDriftRepairs", [], {}, None),
                ("12m", "IpMasqAgentDriftRepairs", ["a"], {}, None)]},
    {"series": {f"ipmasq_foreign_masquerade_rules{{{_node('a')}}}": "2x30",
                f"ipmasq_foreign_masquerade_rules{{{_node('b')}}}": "0x30"},
     "checks": [("5m", "IpMasqAgentForeignMasquerade", [], {}, None),
                ("15m", "IpMasqAgentForeignMasquerade", ["a"], {}, "2")]},
    {"series": {f'ipmasq_syncs_total{{{_node("a")},result="failed"}}': "0+1x30",
                f"ipmasq_ready{{{_node('a')}}}": "0x30",
                f'ipmasq_syncs_total{{{_node("b")},result="failed"}}': "0+1x30",
                f"ipmasq_ready{{{_node('b')}}}": "1x30"},
     "checks": [("5m", "IpMasqAgentSyncFailing", [], {}, None),
                ("15m", "IpMasqAgentSyncFailing", ["a"], {"result": "failed"}, None)]},
    {"series": {f"up{{{_node('a')}}}": "1 1 0x20", f"up{{{_node('b')}}}": "1x22"},
     "checks": [("4m", "IpMasqAgentDown", [], {}, None), ("10m", "IpMasqAgentDown", ["a"], {}, None),
                ("10m", "IpMasqAgentAbsent", [], {}, None)]},
    {"series": {'up{instance="x:9100",job="node-exporter"}': "1x30"},
     "checks": [("10m", "IpMasqAgentAbsent", [], {}, None), ("20m", "IpMasqAgentAbsent", [None], {}, None)]},
]


def _expected(alert_name: str, node: str | None, extra: dict[str, str], value: str | None) -> dict[str, Any]:
    alert = next(a for a in ALERTS if a.name == alert_name)
    labels = {"severity": alert.severity, **extra}
    if node is not None:
        labels.update(instance=f"{node}:9847", job="ip-masq-agent")
    elif alert_name == "IpMasqAgentAbsent":
        labels["job"] = "ip-masq-agent"

    def render(template: str) -> str:
        text = template.replace("{{ $labels.instance }}", labels.get("instance", ""))
        return text.replace("{{ $value }}", value or "")

    annotations = {"summary": render(alert.summary), "description": render(alert.description),
                   "runbook": render(alert.runbook)}
    assert not re.search(r"\{\{", "".join(annotations.values())), "a template the test does not fill"
    return {"exp_labels": labels, "exp_annotations": annotations}


def test_every_alert_fires_and_stays_quiet_when_it_should(tmp_path: Path) -> None:
    promtool = _promtool()
    tested: dict[str, set[bool]] = {a.name: set() for a in ALERTS}
    tests = []
    for case in CASES:
        checks = []
        for at, name, nodes, extra, value in case["checks"]:
            checks.append({"eval_time": at, "alertname": name,
                           "exp_alerts": [_expected(name, node, extra, value) for node in nodes]})
            tested[name].add(bool(nodes))
        tests.append({"interval": "1m", "input_series": [{"series": s, "values": v} for s, v in case["series"].items()],
                      "alert_rule_test": checks})
    assert all(seen == {True, False} for seen in tested.values()), tested  # every alert both firing and quiet
    rules = tmp_path / "ip-masq-agent.rules.yaml"
    rules.write_text((MONITORING / "ip-masq-agent.rules.yaml").read_text())
    spec = tmp_path / "alerts.test.yaml"
    spec.write_text(yaml.safe_dump({"rule_files": [str(rules)], "evaluation_interval": "1m", "tests": tests},
                                   sort_keys=False))
    done = subprocess.run([promtool, "test", "rules", str(spec)], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout + done.stderr
