"""Every kustomization of deploy/ and every combination operators apply together, as kubectl renders them: each
DaemonSet's and Deployment's declared ports are listened on (its arguments read by ipmasq's own parser, the pod's
environment substituted), its probes ask addresses it serves, the PodMonitor scrapes every agent and observer under
the job the alert rules expect, the webhook judges with the flags of the agents that read the same ConfigMap, and
the alert rules (Prometheus' own evaluator, `promtool test rules`) fire for what is installed and only for that.

That a listener flag really opens a socket is proven on real processes by tests/kernel/agent/test_rendered_listeners.py.
"""

from __future__ import annotations

import copy
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from ipmasq.agent import exposition
from ipmasq.agent.metrics import DURATION_BUCKETS, Snapshot, metric_families
from ipmasq.monitoring import JOB, OBSERVER_JOB
from tests.manifests import (
    COMBINATIONS,
    FIELDS,
    KUSTOMIZATIONS,
    applied_in_turn,
    argv,
    combine,
    hostport_clashes,
    kustomize,
    policy_flags,
    scraped_jobs,
    workload_findings,
    workloads,
)
from tests.tools import PROMTOOL, need

# The alert that says a target of each job is down.
DOWN = {JOB: "IpMasqAgentDown", OBSERVER_JOB: "IpMasqObserverDown"}
ABSENT = "IpMasqAgentAbsent"


def _container(workload: dict[str, Any]) -> dict[str, Any]:
    (container,) = workload["spec"]["template"]["spec"]["containers"]
    return container


def _observing(workload: dict[str, Any]) -> bool:
    return any(word.startswith("--observe") for word in argv(_container(workload)))


# --- each kustomization -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(KUSTOMIZATIONS))
def test_every_declared_port_is_listened_on_and_every_probe_asks_a_served_address(name: str) -> None:
    found = workloads(kustomize(KUSTOMIZATIONS[name]))
    assert bool(found) == (name != "monitoring")
    for workload in found:
        assert workload_findings(workload) == [], name


@pytest.mark.parametrize("name", ["base", "gke", "observe", "observe-aks", "observe-eks"])
def test_the_base_arguments_survive_every_overlay(name: str) -> None:
    """No overlay replaces the base's argument list: each keeps every base argument it does not deliberately change
    (the observers' two listeners move beside an enforcing agent's; AKS's and EKS's observers read no mounted file)."""
    (base,) = workloads(kustomize(KUSTOMIZATIONS["base"]))
    (workload,) = workloads(kustomize(KUSTOMIZATIONS[name]))
    changed = {"--metrics-address", "--prometheus-address"} if _observing(workload) else set()
    if name in ("observe-aks", "observe-eks"):
        changed.add("--config")
    kept = [arg for arg in _container(base)["args"] if arg.split("=", 1)[0] not in changed]
    args = _container(workload)["args"]
    assert [arg for arg in args if arg in kept] == kept
    for flag in changed - {"--config"}:  # moved, never lost
        assert sum(arg.startswith(flag + "=") for arg in args) == 1


# --- what the checks find (each can fail) --------------------------------------------------------------------------

def _gke_daemonset() -> dict[str, Any]:
    (workload,) = workloads(kustomize(KUSTOMIZATIONS["gke"]))
    return workload


def test_the_port_check_finds_a_declared_port_nothing_listens_on() -> None:
    """The GKE overlay as it was: its own argument list, without --prometheus-address, under the base's port."""
    workload = _gke_daemonset()
    _container(workload)["args"] = ["agent", "--config=/etc/config/ip-masq-agent", "--backend=iptables",
                                    "--masq-chain=IP-MASQ", "--nomasq-all-reserved-ranges",
                                    "--metrics-address=127.0.0.1:9847"]
    assert workload_findings(workload) == ["DaemonSet ip-masq-agent: port metrics 9848: nothing listens on it"]


def test_the_port_check_finds_a_port_served_on_loopback_only_and_a_listener_not_declared() -> None:
    workload = _gke_daemonset()
    args = _container(workload)["args"]
    args[args.index("--prometheus-address=$(HOST_IP):9848")] = "--prometheus-address=127.0.0.1:9848"
    assert workload_findings(workload) == [
        "DaemonSet ip-masq-agent: port metrics 9848: served on 127.0.0.1 only, not the pod's address"]
    args[args.index("--prometheus-address=127.0.0.1:9848")] = "--prometheus-address=$(HOST_IP):9850"
    assert workload_findings(workload) == [
        "DaemonSet ip-masq-agent: port metrics 9848: nothing listens on it",
        f"DaemonSet ip-masq-agent: --prometheus-address listens on {FIELDS['status.hostIP']}:9850, no declared port"]


def test_the_probe_check_finds_a_probe_on_the_metrics_only_port_and_one_on_no_port() -> None:
    workload = _gke_daemonset()
    container = _container(workload)
    container["livenessProbe"]["exec"]["command"] = ["ipmasq", "health", "--live", "--address=$(HOST_IP):9848"]
    container["readinessProbe"]["exec"]["command"] = ["ipmasq", "health", "--address=127.0.0.1:9848"]
    assert workload_findings(workload) == [
        f"DaemonSet ip-masq-agent: livenessProbe asks HTTP {FIELDS['status.hostIP']}:9848/healthz, which nothing "
        "serves",
        "DaemonSet ip-masq-agent: readinessProbe asks HTTP 127.0.0.1:9848/readyz, which nothing serves"]


def test_the_probe_check_follows_a_named_port_and_its_scheme() -> None:
    (deployment,) = workloads(kustomize(KUSTOMIZATIONS["webhook"]))
    container = _container(deployment)
    container["readinessProbe"]["httpGet"]["scheme"] = "HTTP"
    container["livenessProbe"]["httpGet"]["port"] = 9443
    assert [f.split(" asks ")[0] for f in workload_findings(deployment)] == [
        "Deployment ipmasq-webhook: livenessProbe", "Deployment ipmasq-webhook: readinessProbe"]


def test_an_unknown_flag_in_an_overlay_fails_the_render_check() -> None:
    workload = _gke_daemonset()
    _container(workload)["args"].append("--prometheus-adress=$(HOST_IP):9848")
    with pytest.raises(Exception, match="prometheus-adress"):
        workload_findings(workload)


def test_the_combination_check_finds_a_webhook_judging_with_other_flags_than_the_agents() -> None:
    """GKE's agent beside deploy/webhook as it is: the webhook would judge without --nomasq-all-reserved-ranges."""
    docs, conflicts = combine(("gke", "webhook"))
    assert conflicts == []
    assert _flag_mismatches(docs) == ["ipmasq-webhook judges the ip-masq-agent ConfigMap with other policy flags than "
                                      "ip-masq-agent reads it with: masq_chain, nomasq_all_reserved_ranges"]


def test_the_combination_check_finds_objects_two_kustomizations_ship_differently() -> None:
    base, observe = kustomize(KUSTOMIZATIONS["base"]), kustomize(KUSTOMIZATIONS["observe"])
    assert applied_in_turn([("base", base), ("observe", observe)])[1] == []
    (lease,) = [doc for doc in observe if doc["kind"] == "Lease"]
    lease["spec"] = {"leaseDurationSeconds": 1}
    assert applied_in_turn([("base", base), ("observe", observe)])[1] == [
        "Lease/kube-system/ip-masq-agent: base and observe ship it differently"]


def test_the_hostport_check_finds_two_daemonsets_on_one_port() -> None:
    (enforcing,) = workloads(kustomize(KUSTOMIZATIONS["base"]))
    observer = copy.deepcopy(enforcing)
    observer["metadata"]["name"] = "ipmasq-observer"
    assert hostport_clashes([enforcing, observer]) == [
        "ipmasq-observer --metrics-address 127.0.0.1:9847 and ip-masq-agent --metrics-address",
        f"ipmasq-observer --prometheus-address {FIELDS['status.hostIP']}:9848 and ip-masq-agent --prometheus-address"]


# --- each combination ---------------------------------------------------------------------------------------------

def _flag_mismatches(docs: list[dict[str, Any]]) -> list[str]:
    """A webhook must judge a ConfigMap with the policy flags of every agent that reads it."""
    found = workloads(docs)
    webhooks = [w for w in found if argv(_container(w))[0] == "webhook"]
    mismatches = []
    for webhook in webhooks:
        _, judged = policy_flags(_container(webhook))
        for agent in found:
            if agent in webhooks:
                continue
            configmap, options = policy_flags(_container(agent))
            if configmap and options != judged:
                differ = [f for f in options.__dataclass_fields__ if getattr(options, f) != getattr(judged, f)]
                mismatches.append(f"{webhook['metadata']['name']} judges the {configmap} ConfigMap with other policy "
                                  f"flags than {agent['metadata']['name']} reads it with: {', '.join(differ)}")
    return mismatches


@pytest.mark.parametrize("name", list(COMBINATIONS))
def test_a_combination_operators_apply_holds_together(name: str) -> None:
    docs, conflicts = combine(COMBINATIONS[name])
    assert conflicts == []
    found = workloads(docs)
    for workload in found:
        assert workload_findings(workload) == []
    assert hostport_clashes(found) == []
    assert _flag_mismatches(docs) == []
    (monitor,) = [d for d in docs if d["kind"] == "PodMonitor"]
    for workload in found:
        jobs = scraped_jobs(monitor, workload)
        if workload["kind"] == "DaemonSet":  # every agent scraped, under the job its alerts select
            assert jobs == [OBSERVER_JOB if _observing(workload) else JOB], workload["metadata"]["name"]
        else:
            assert jobs == []  # the webhook serves no /metrics


# --- the alert rules, for what is installed -------------------------------------------------------------------------

def _promtool() -> str:
    return need("promtool", PROMTOOL)


def _healthy_samples(observing: bool) -> list[tuple[str, dict[str, str], float]]:
    """What a healthy agent serves, every sample of its /metrics as the agent writes it: an enforcing agent in sync
    with its config, or an observer whose node's rules enforce it."""
    snapshot = Snapshot(
        version="0.2.0", backend="observe (gke)" if observing else "iptables",
        syncs={"in-sync": 300, "applied": 0 if observing else 1, "failed": 0, "no-policy": 0,
               "out-of-sync": 0, "foreign-writer": 0},
        duration_buckets=(300,) * (len(DURATION_BUCKETS) + 1), duration_sum=3.0, config_load_errors=0,
        config_reloads=1, drift_repairs=0, loop_errors=0, seconds_since_last_success=1.0,
        last_success_unix=1_700_000_000.0, rules={} if observing else {4: 12}, set_elements={} if observing else {4: 0},
        ready=True, config_valid=True, enforced_config_hash="0123456789abcdef", resync_interval=2.0 if observing
        else 60.0, foreign_masquerade_rules=None if observing else 0)
    text = exposition.render(list(metric_families(snapshot))).decode()
    return [(s.name, dict(s.labels), s.value) for family in text_string_to_metric_families(text)
            for s in family.samples]


def _series(name: str, labels: dict[str, str]) -> str:
    return name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"


def _target(job: str, node: str) -> dict[str, str]:
    port = 9849 if job == OBSERVER_JOB else 9848
    return {"instance": f"{node}.example:{port}", "job": job, "node": node}


def _annotations(rule: dict[str, Any], labels: dict[str, str], value: str) -> dict[str, str]:
    def fill(template: str) -> str:
        text = re.sub(r"\{\{ \$labels\.(\w+) \}\}", lambda m: labels.get(m.group(1), ""), template)
        return text.replace("{{ $value }}", value)

    return {key: fill(text) for key, text in rule["annotations"].items()}


def _alerts_test(rules: list[dict[str, Any]], series: dict[str, str], at: str,
                 firing: dict[str, list[dict[str, str]]]) -> dict[str, Any]:
    """One promtool test: these series; at `at`, exactly the alerts `firing` (alert -> the series' labels each fires
    for) and no other alert of the group."""
    checks = []
    for rule in rules:
        expected = []
        for labels in firing.get(rule["alert"], []):
            full = {**labels, **rule["labels"]}
            expected.append({"exp_labels": full, "exp_annotations": _annotations(rule, full, "0" if labels else "1")})
        checks.append({"eval_time": at, "alertname": rule["alert"], "exp_alerts": expected})
    return {"interval": "1m", "input_series": [{"series": s, "values": v} for s, v in series.items()],
            "alert_rule_test": checks}


@pytest.mark.parametrize("name", list(COMBINATIONS))
def test_the_alert_rules_fire_for_what_is_installed_and_only_for_that(name: str, tmp_path: Path) -> None:
    """Prometheus' own evaluator, on the rules as this combination installs them (its PrometheusRule), with the
    series its pods really serve: healthy, nothing fires (an observe-only cluster: no alert for the lack of an
    enforcing agent); one pod of a job dead, that job's Down alert fires for it (an enforcing agent's, critical, also
    beside observers); every pod gone, IpMasqAgentAbsent."""
    docs, _ = combine(COMBINATIONS[name])
    (monitor,) = [d for d in docs if d["kind"] == "PodMonitor"]
    (rule_object,) = [d for d in docs if d["kind"] == "PrometheusRule"]
    installed = sorted({job for w in workloads(docs) for job in scraped_jobs(monitor, w)})
    assert installed
    rules = [r for group in rule_object["spec"]["groups"] for r in group["rules"]]
    healthy = {job: _healthy_samples(job == OBSERVER_JOB) for job in installed}

    def cluster(dead: tuple[str, str] | None = None) -> dict[str, str]:
        series = {_series("up", {"instance": "kube-state-metrics:8080", "job": "kube-state-metrics"}): "1x60"}
        for job in installed:
            for node in ("node-a", "node-b"):
                target = _target(job, node)
                if (job, node) == dead:  # a dead target: Prometheus' `up` only
                    series[_series("up", target)] = "0x60"
                    continue
                series[_series("up", target)] = "1x60"
                for metric, labels, value in healthy[job]:
                    series[_series(metric, {**labels, **target})] = f"{value:g}x60"
        return series

    tests = [_alerts_test(rules, cluster(), "60m", {})]
    for job in installed:
        tests.append(_alerts_test(rules, cluster(dead=(job, "node-a")), "20m",
                                  {DOWN[job]: [_target(job, "node-a")]}))
    nothing = {_series("up", {"instance": "kube-state-metrics:8080", "job": "kube-state-metrics"}): "1x60"}
    tests.append(_alerts_test(rules, nothing, "10m", {}))  # pending: `for: 15m`
    tests.append(_alerts_test(rules, nothing, "20m", {ABSENT: [{}]}))
    rules_path = tmp_path / "rules.yaml"
    rules_path.write_text(yaml.safe_dump({"groups": rule_object["spec"]["groups"]}, sort_keys=False))
    spec = tmp_path / "alerts.test.yaml"
    spec.write_text(yaml.safe_dump({"rule_files": [str(rules_path)], "evaluation_interval": "1m", "tests": tests},
                                   sort_keys=False))
    done = subprocess.run([_promtool(), "test", "rules", str(spec)], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout + done.stderr
