"""The fleet's alert rules: generated files up to date, valid for promtool, and every alert proven firing and not
firing with `promtool test rules` (Debian's prometheus package) on series shaped like a real fleet's."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import yaml
from prometheus_client.parser import text_string_to_metric_families

from ipmasq.agent import exposition
from ipmasq.agent.metrics import DURATION_BUCKETS, Snapshot, metric_families, process_metric_families
from ipmasq.agent.reports import RuleCount
from ipmasq.monitoring import ALERTS, DASHBOARD_PANELS, JOB, OBSERVER_JOB, dashboard, generated, scrape_configs
from ipmasq.prefix import Family
from tests.conftest import ROOT
from tests.tools import PROMTOOL, need

MONITORING = ROOT / "deploy" / "monitoring"
JOB_MATCHER = f'job="{JOB}"'


def _promtool() -> str:
    return need("promtool", PROMTOOL)


def test_generated_files_are_up_to_date() -> None:
    for name, text in generated().items():
        assert (MONITORING / name).read_text() == text, f"{name}: run python -m ipmasq.monitoring"


def _served_metric_names(*, rule_series: bool = True) -> set[str]:
    """Every series name the agent's /metrics can hold: a snapshot with every optional family present
    (`rule_series` False: what the node-address scrape listener serves unless the operator opts in)."""
    snapshot = Snapshot(
        version="test", backend="nftables", syncs={"applied": 1, "in-sync": 2, "failed": 0, "no-policy": 0},
        duration_buckets=(1,) * (len(DURATION_BUCKETS) + 1), duration_sum=0.1, config_load_errors=0,
        config_reloads=1, drift_repairs=0, loop_errors=0, seconds_since_last_success=1.0, last_success_unix=1.0,
        rules={4: 3, 6: 3}, set_elements={4: 10, 6: 2}, ready=True, config_valid=True,
        enforced_config_hash="0123456789abcdef", resync_interval=60.0, foreign_masquerade_rules=0,
        rule_counters=(RuleCount("partner", Family.V4, 5, 500),), node_trust_verified=True)
    text = exposition.render([*metric_families(snapshot, rule_series=rule_series),
                              *process_metric_families()]).decode()
    return {sample.name for family in text_string_to_metric_families(text) for sample in family.samples}


# PromQL's words that are not metric names: functions, aggregations, keywords
_PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
                 "offset", "sum", "count", "min", "max", "avg", "rate", "increase", "irate", "histogram_quantile",
                 "absent", "time", "label_values", "topk", "bottomk", "quantile", "stddev", "delta", "deriv"}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: its identifiers outside label matchers, grouping lists,
    strings and ranges, that are not a function or keyword."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # strings (label values, legends)
    text = re.sub(r"\{[^}]*\}", "", text)  # label matchers
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", text)
    text = re.sub(r"\[[^\]]*\]", "", text)  # ranges
    text = re.sub(r"label_values\(([^,]*),\s*\w+\)", r"\1", text)  # Grafana's: its second word is a label
    words = set(re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", text))
    return {w for w in words if w not in _PROMQL_WORDS and not re.fullmatch(r"\d+[smhdwy]?|e", w)}


def test_metric_names_reads_promql_as_prometheus_would() -> None:
    assert metric_names('sum by (result) (rate(ipmasq_syncs_total{job="x", node=~"$node"}[5m]))') == \
        {"ipmasq_syncs_total"}
    assert metric_names("count(count by (config_hash) (a{x=\"y\"})) > 1 and on (instance) b == 0") == {"a", "b"}
    assert metric_names('histogram_quantile(0.99, sum by (le) (rate(h_bucket[5m])))') == {"h_bucket"}
    assert metric_names('label_values(ipmasq_build_info{job="x"}, node)') == {"ipmasq_build_info"}


def test_every_dashboard_query_uses_metrics_the_agent_serves() -> None:
    served = _served_metric_names() | {"up"}  # up: Prometheus' own, one per target
    model = json.loads((MONITORING / "ipmasq-dashboard.json").read_text())
    queries = [t["expr"] for panel in model["panels"] for t in panel["targets"]]
    queries += [v["definition"] for v in model["templating"]["list"] if "definition" in v]
    assert len(queries) >= sum(len(p.queries) for p in DASHBOARD_PANELS) and queries
    for query in queries:
        names = metric_names(query)
        assert names, query
        assert names <= served, f"{query}: {sorted(names - served)} not served by the agent"
    for alert in ALERTS:  # the alerts too
        assert metric_names(alert.expr) <= served, alert.name
    assert model == dashboard()


def test_no_alert_and_no_panel_but_an_opt_in_one_needs_series_the_scraped_port_serves_only_when_opted_in() -> None:
    """Prometheus scrapes the node-address listener, which serves the per-rule series only with
    --prometheus-rule-metrics=true: no alert may need them, and a panel that shows them says so."""
    default = _served_metric_names(rule_series=False) | {"up"}
    assert _served_metric_names() - default == {"ipmasq_rule_packets_total", "ipmasq_rule_bytes_total"}
    for alert in ALERTS:
        assert metric_names(alert.expr) <= default, alert.name
    for panel in DASHBOARD_PANELS:
        if not all(metric_names(query) <= default for query, _legend in panel.queries):
            assert "(opt-in)" in panel.title and "--prometheus-rule-metrics=true" in panel.description, panel.title


def test_the_documented_scrape_jobs_are_the_ones_the_lab_runs() -> None:
    """Debian's promtool cannot check them (its build leaves Kubernetes discovery out): the lab's Prometheus, built
    from its Go module, loads exactly the enforcing agents' job against a real API server (test_day_two.py)."""
    jobs = scrape_configs()
    assert [job["job_name"] for job in jobs] == [JOB, OBSERVER_JOB]
    for job in jobs:
        assert job["kubernetes_sd_configs"][0]["role"] == "pod"
        keep = [r for r in job["relabel_configs"] if r.get("action") == "keep"]
        assert keep and keep[0]["regex"] == f"{job['job_name']};metrics"  # the pods' k8s-app label is the job
    docs = (ROOT / "docs" / "operations" / "monitoring.md").read_text()
    assert yaml.safe_dump(jobs, sort_keys=False).strip() in docs  # the page shows exactly these jobs


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
    return f'instance="{name}:9847",{JOB_MATCHER}'


def _observer(name: str) -> str:
    return f'instance="{name}:9849",job="{OBSERVER_JOB}"'


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
    # the Lease's holder (a) finds the node-trust policy deleted at minute 5; b holds nothing (no series)
    {"series": {f"ipmasq_node_trust_verified{{{_node('a')}}}": "1x5 0x25"},
     "checks": [("15m", "IpMasqNodeTrustUnverified", [], {}, None),
                ("25m", "IpMasqNodeTrustUnverified", ["a"], {}, None)]},
    # observers only: not an absence of enforcing agents; a dead observer is the observers' own alert, a warning
    {"series": {f"up{{{_observer('a')}}}": "1 1 0x20", f"up{{{_observer('b')}}}": "1x22"},
     "checks": [("20m", "IpMasqAgentAbsent", [], {}, None), ("20m", "IpMasqAgentDown", [], {}, None),
                ("4m", "IpMasqObserverDown", [], {}, None), ("10m", "IpMasqObserverDown", ["a"], {}, None)]},
    # the node's rules (the provider's agent's) stop enforcing the config on a; b keeps catching up
    {"series": {f"ipmasq_seconds_since_last_successful_sync{{{_observer('a')}}}": "1 1 60+60x30",
                f"ipmasq_seconds_since_last_successful_sync{{{_observer('b')}}}": "1 120 1 120 1 120 1 120 1 120 "
                                                                                  "1 120 1 120 1 120 1 120 1 120 1",
                f"ipmasq_seconds_since_last_successful_sync{{{_node('c')}}}": "1 1 60+60x30"},
     "checks": [("10m", "IpMasqObserverConfigNotEnforced", [], {}, None),
                ("20m", "IpMasqObserverConfigNotEnforced", ["a"], {}, None)]},
    # an observer that cannot read the rules (not ready, its looks failing) is not an enforcing agent failing to
    # write: only its own alert says it
    {"series": {f"ipmasq_config_valid{{{_observer('a')}}}": "1x30", f"ipmasq_ready{{{_observer('a')}}}": "0x30",
                f"ipmasq_last_successful_sync_timestamp_seconds{{{_observer('a')}}}": "0x30",
                f"ipmasq_resync_interval_seconds{{{_observer('a')}}}": "2x30",
                f'ipmasq_syncs_total{{{_observer("a")},result="failed"}}': "0+30x30",
                f"ipmasq_drift_repairs_total{{{_observer('a')}}}": "0x30",
                f"ipmasq_seconds_since_last_successful_sync{{{_observer('a')}}}": "0+60x30"},
     "checks": [("25m", "IpMasqAgentKernelNotMatching", [], {}, None), ("25m", "IpMasqAgentSyncFailing", [], {}, None),
                ("25m", "IpMasqObserverConfigNotEnforced", ["a"], {}, None)]},
]


def _expected(alert_name: str, node: str | None, extra: dict[str, str], value: str | None) -> dict[str, Any]:
    alert = next(a for a in ALERTS if a.name == alert_name)
    labels = {"severity": alert.severity, **extra}
    if node is not None and "Observer" in alert_name:
        labels.update(instance=f"{node}:9849", job=OBSERVER_JOB)
    elif node is not None:
        labels.update(instance=f"{node}:9847", job="ip-masq-agent")

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
