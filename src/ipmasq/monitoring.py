"""The fleet's monitoring, defined once: the alert rules (a plain Prometheus rules file and a PrometheusRule), the
PodMonitor and the plain Prometheus scrape job that find every agent, and the Grafana dashboard are generated here.

    python -m ipmasq.monitoring [DIR]      writes DIR/ip-masq-agent.rules.yaml, DIR/prometheusrule.yaml,
                                           DIR/podmonitor.yaml and DIR/ipmasq-dashboard.json
                                           (default deploy/monitoring)

Every agent serves /metrics alone on its node's address, port `metrics` (the DaemonSet's --prometheus-address):
the PodMonitor and the scrape jobs keep exactly the agent's pods' `metrics` port, found by Kubernetes service
discovery (role pod), and name the job and the node (label `node`). The enforcing agents are job `ip-masq-agent`; the
observers (deploy/overlays/observe: pods labelled k8s-app=ipmasq-observer, in either mode the same `metrics` port)
are a job of their own, `ipmasq-observer`: an observer's verdict is about another program's rules, so the enforcing
agents' alerts select only their job, and the observers have theirs. What is down or absent is what is installed:
an observe-only cluster has no `ip-masq-agent` target, and no alert fires for the lack of one.

Each alert names the `ipmasq` command that diagnoses it (annotation `runbook`). The `for:` durations are those of a
production fleet; the lab loads the same group with every duration shortened (`rule_group(for_override=...)`).
The scrape job is `ip-masq-agent`, one target per node; a `node` label (the node's name, from relabelling) is used
where it helps to name the node, `instance` otherwise.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

__all__ = ["ALERTS", "DASHBOARD_PANELS", "GROUP", "JOB", "JOBS", "METRICS_PORT", "NOT_ENFORCED_OBSERVED",
           "OBSERVED_GRACE_SECONDS", "OBSERVER_JOB", "Alert", "Panel",
           "dashboard", "pod_monitor", "prometheus_rule", "rule_group", "rules_file", "scrape_config", "scrape_configs",
           "write"]

JOB = "ip-masq-agent"
GROUP = "ip-masq-agent"
METRICS_PORT = "metrics"  # the agent container's named port (deploy/base/daemonset.yaml)
AGENT_LABEL = ("k8s-app", "ip-masq-agent")  # the pods' label (the DaemonSet's selector)
OBSERVER_JOB = "ipmasq-observer"  # the observers' pods' value of that label (deploy/overlays/observe), and their job
JOBS = (JOB, OBSERVER_JOB)
NAMESPACE = "kube-system"
_ENFORCING = '{job="' + JOB + '"}'
_OBSERVING = '{job="' + OBSERVER_JOB + '"}'
_EITHER = '{job=~"' + "|".join(JOBS) + '"}'
# how long a provider's agent may take to follow a change before its observer's alert is pending (its ip-masq-agent
# resyncs every minute, kubelet's ConfigMap volume a minute or more behind the API): a threshold, not a `for:`
OBSERVED_GRACE_SECONDS = 300
NOT_ENFORCED_OBSERVED = "IpMasqObserverConfigNotEnforced"


def _observed_not_enforced(grace: float) -> str:
    return f"ipmasq_seconds_since_last_successful_sync{_OBSERVING} > {grace:g}"


@dataclass(frozen=True, slots=True)
class Alert:
    name: str
    expr: str
    for_: str
    severity: str
    summary: str
    description: str
    runbook: str


ALERTS: tuple[Alert, ...] = (
    Alert(
        "IpMasqAgentConfigInvalid",
        "ipmasq_config_valid == 0",
        "5m", "warning",
        "ip-masq-agent on {{ $labels.instance }} refuses its config",
        "The agent on {{ $labels.instance }} cannot load its config (the ip-masq-agent ConfigMap; an observer of AKS "
        "or EKS: that provider's inputs); it keeps the last good one (enforcing it, or in observe mode comparing the "
        "node's rules with it), so a change you made is not in force on this node.",
        "kubectl get configmap ip-masq-agent -n kube-system -o yaml | ipmasq lint -",
    ),
    Alert(
        "IpMasqAgentKernelNotMatching",
        "ipmasq_config_valid" + _ENFORCING + " == 1 and ipmasq_ready == 0 and "
        "(time() - ipmasq_last_successful_sync_timestamp_seconds) > 3 * ipmasq_resync_interval_seconds",
        "5m", "critical",
        "the nat rules on {{ $labels.instance }} do not match its good config",
        "The agent on {{ $labels.instance }} has a valid config but has not verified the kernel's rules for more "
        "than three resync intervals: pod traffic may leave with the wrong source address.",
        "on the node: ipmasq health; ipmasq check --config /etc/config/ip-masq-agent (with the agent's flags)",
    ),
    Alert(
        "IpMasqAgentConfigDivergence",
        "count(count by (config_hash) (ipmasq_enforced_config_info{job=\"" + JOB + "\"})) > 1",
        "30m", "warning",
        "nodes enforce different ip-masq-agent configs",
        "{{ $value }} different configs are enforced across the fleet for longer than a rollout takes. Find the odd "
        "nodes with: count by (config_hash) (ipmasq_enforced_config_info), then ipmasq_enforced_config_info by node.",
        "ipmasq render --print-hash --config FILE gives the expected hash; on an odd node: ipmasq check",
    ),
    Alert(
        "IpMasqAgentDriftRepairs",
        "increase(ipmasq_drift_repairs_total" + _ENFORCING + "[15m]) > 2",
        "0m", "warning",
        "something keeps rewriting the nat rules on {{ $labels.instance }}",
        "The agent on {{ $labels.instance }} repaired its rules more than twice in 15 minutes although its config "
        "did not change: another agent or a script is fighting it.",
        "on the node: ipmasq check (foreign-masquerade, stale-chain, other-variant-rules); look for a second agent",
    ),
    Alert(
        "IpMasqAgentForeignMasquerade",
        "ipmasq_foreign_masquerade_rules" + _ENFORCING + " > 0",
        "10m", "warning",
        "nat rules outside the agent masquerade pod traffic on {{ $labels.instance }}",
        "{{ $value }} rules outside the agent's own masquerade or SNAT pod traffic on {{ $labels.instance }}; they "
        "may override what the config says.",
        "on the node: ipmasq check --pod-range POD_CIDR",
    ),
    Alert(
        "IpMasqAgentSyncFailing",
        "increase(ipmasq_syncs_total{job=\"" + JOB + "\", result=\"failed\"}[10m]) > 0 "
        "and on (instance, job) ipmasq_ready == 0",
        "10m", "critical",
        "ip-masq-agent on {{ $labels.instance }} cannot write its rules",
        "Reconcile passes keep failing on {{ $labels.instance }} (iptables-restore or nft errors); the agent logs the "
        "tool's error once per change.",
        "kubectl logs -n kube-system -l k8s-app=ip-masq-agent --field-selector spec.nodeName=NODE; ipmasq health",
    ),
    Alert(
        "IpMasqAgentDown",
        "up{job=\"" + JOB + "\"} == 0",
        "5m", "critical",
        "ip-masq-agent on {{ $labels.instance }} is down",
        "Prometheus cannot scrape the agent on {{ $labels.instance }}: its rules stay in place, but nothing repairs "
        "or updates them.",
        "kubectl get pods -n kube-system -l k8s-app=ip-masq-agent -o wide; on the node: ipmasq health --live",
    ),
    Alert(
        "IpMasqAgentAbsent",
        "absent(up" + _EITHER + ")",
        "15m", "warning",
        "no ipmasq agent, enforcing or observing, is scraped at all",
        "Prometheus has no target of job " + JOB + " nor " + OBSERVER_JOB + ": the DaemonSet is missing or the "
        "scrape config lost it.",
        "kubectl get daemonsets -n kube-system " + " ".join(JOBS) + "; check the scrape jobs " + " and ".join(JOBS),
    ),
    Alert(
        "IpMasqNodeTrustUnverified",
        "ipmasq_node_trust_verified == 0",
        "15m", "warning",
        "the node-trust admission policy is not in force",
        "The summary Lease's holder ({{ $labels.instance }}) finds the ip-masq-agent-own-node "
        "ValidatingAdmissionPolicy or its binding missing: any node's agent could write what another node says (its "
        "status object, its Events), so ipmasq status marks every row unverified.",
        "kubectl get validatingadmissionpolicies,validatingadmissionpolicybindings ip-masq-agent-own-node; ipmasq "
        "status says why; kubectl apply -k deploy/ restores them",
    ),
    Alert(
        "IpMasqObserverDown",
        "up" + _OBSERVING + " == 0",
        "5m", "warning",
        "the ipmasq observer on {{ $labels.instance }} is down",
        "Prometheus cannot scrape the observer on {{ $labels.instance }}: nothing says whether the node's rules, "
        "written by the provider's agent, enforce the config.",
        "kubectl get pods -n kube-system -l k8s-app=" + OBSERVER_JOB + " -o wide; on the node: ipmasq health --live "
        "--address=127.0.0.1:9848",
    ),
    Alert(
        NOT_ENFORCED_OBSERVED,
        _observed_not_enforced(OBSERVED_GRACE_SECONDS),
        "10m", "warning",
        "the rules on {{ $labels.instance }} do not enforce the config (observed)",
        "The observer on {{ $labels.instance }} has not seen the node's rules, written by the provider's agent, "
        "enforce the config for more than 15 minutes, or cannot read them: pod traffic leaves as those rules say.",
        "ipmasq status (the node's reason); kubectl logs -n kube-system -l k8s-app=" + OBSERVER_JOB
        + " --field-selector spec.nodeName=NODE",
    ),
)


@dataclass(frozen=True, slots=True)
class Panel:
    """One time-series panel of the dashboard: its queries (PromQL, legend) use only what the agent serves."""

    title: str
    unit: str
    queries: tuple[tuple[str, str], ...]
    description: str


_NODE = '{job=~"$job", node=~"$node"}'  # the enforcing agents by default; the observers, or both
DASHBOARD_PANELS: tuple[Panel, ...] = (
    Panel("Agents scraped / ready", "short", (
        ('count(up' + _NODE + ' == 1)', "scraped"), ('sum(ipmasq_ready' + _NODE + ')', "ready"),
        ('count(ipmasq_config_valid' + _NODE + ' == 0)', "refusing their config")),
          "Agents Prometheus reaches, those whose kernel matches their config, and those refusing a bad config."),
    Panel("Configs enforced across the fleet", "short", (
        ('count by (config_hash) (ipmasq_enforced_config_info' + _NODE + ')', "{{config_hash}}"),),
          "Nodes per enforced config hash: more than one line for longer than a rollout is "
          "IpMasqAgentConfigDivergence."),
    Panel("Reconcile passes by result", "ops", (
        ('sum by (result) (rate(ipmasq_syncs_total' + _NODE + '[5m]))', "{{result}}"),),
          "Passes per second: in-sync when idle, applied after a change or a repair, failed when a tool refused."),
    Panel("Pass duration (p50, p99)", "s", (
        ('histogram_quantile(0.5, sum by (le) (rate(ipmasq_sync_duration_seconds_bucket' + _NODE + '[5m])))', "p50"),
        ('histogram_quantile(0.99, sum by (le) (rate(ipmasq_sync_duration_seconds_bucket' + _NODE + '[5m])))',
         "p99")),
          "How long one reconcile pass takes, over every selected node."),
    Panel("Drift repairs and config errors", "short", (
        ('sum by (node) (increase(ipmasq_drift_repairs_total' + _NODE + '[15m]))', "repairs {{node}}"),
        ('sum by (node) (increase(ipmasq_config_load_errors_total' + _NODE + '[15m]))', "config errors {{node}}")),
          "Something rewriting the nat rules, and config changes refused, per node over 15 minutes."),
    Panel("Seconds since the last verified pass", "s", (
        ('ipmasq_seconds_since_last_successful_sync' + _NODE, "{{node}}"),),
          "Grows past the resync interval when the agent cannot verify the kernel's rules."),
    Panel("Foreign masquerade rules", "short", (
        ('ipmasq_foreign_masquerade_rules' + _NODE, "{{node}}"),),
          "NAT rules not written by the agent that masquerade or SNAT: they may override the config."),
    Panel("Rules and set elements written", "short", (
        ('sum by (node, family) (ipmasq_rules' + _NODE + ')', "rules {{node}} {{family}}"),
        ('sum by (node, family) (ipmasq_set_elements' + _NODE + ')', "set elements {{node}} {{family}}")),
          "What the agent holds in the kernel per node and family."),
    Panel("Packets per config rule (opt-in)", "pps", (
        ('sum by (rule) (rate(ipmasq_rule_packets_total' + _NODE + '[5m]))', "{{rule}}"),),
          "Traffic through each rule of the config's rules: section, over every selected node. Empty unless the "
          "agents run with --prometheus-rule-metrics=true: the rules' names and traffic are then readable on every "
          "node's port 9848 by any pod."),
    Panel("Agent memory", "bytes", (
        ('process_resident_memory_bytes' + _NODE, "RSS {{node}}"),),
          "The agent process's resident memory (the DaemonSet's request and limit are sized in docs/measurements.md)."),
)


def dashboard() -> dict[str, Any]:
    """The Grafana dashboard (JSON model, schema 39): template variables for the data source, the job (the enforcing
    agents, the observers or both) and the node."""
    panels = []
    for index, panel in enumerate(DASHBOARD_PANELS):
        panels.append({
            "id": index + 1, "type": "timeseries", "title": panel.title, "description": panel.description,
            "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "gridPos": {"h": 8, "w": 12, "x": 12 * (index % 2), "y": 8 * (index // 2)},
            "fieldConfig": {"defaults": {"unit": panel.unit}, "overrides": []},
            "options": {"legend": {"displayMode": "list", "placement": "bottom"}, "tooltip": {"mode": "multi"}},
            "targets": [{"refId": chr(ord("A") + i), "expr": expr, "legendFormat": legend,
                         "datasource": {"type": "prometheus", "uid": "${datasource}"}}
                        for i, (expr, legend) in enumerate(panel.queries)],
        })
    return {
        "title": "ipmasq", "uid": "ipmasq-agents", "tags": ["ipmasq", "kubernetes"], "editable": True,
        "schemaVersion": 39, "time": {"from": "now-6h", "to": "now"}, "refresh": "1m",
        "templating": {"list": [
            {"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Data source"},
            {"name": "job", "type": "custom", "label": "Agents", "query": ",".join(JOBS), "multi": True,
             "includeAll": True, "current": {"text": JOB, "value": JOB},
             "options": [{"text": job, "value": job, "selected": job == JOB} for job in JOBS]},
            {"name": "node", "type": "query", "label": "Node", "includeAll": True, "multi": True,
             "allValue": ".*", "refresh": 2, "datasource": {"type": "prometheus", "uid": "${datasource}"},
             "query": {"query": 'label_values(ipmasq_build_info{job=~"$job"}, node)', "refId": "nodes"},
             "definition": 'label_values(ipmasq_build_info{job=~"$job"}, node)'},
        ]},
        "panels": panels,
    }


# the node's name as the label `node` (what the dashboard and the alerts' descriptions name it by)
NODE_SOURCE, NODE_LABEL = "__meta_kubernetes_pod_node_name", "node"


def pod_monitor() -> dict[str, Any]:
    """The Prometheus Operator's PodMonitor: every agent pod's `metrics` port, job `ip-masq-agent`, and every
    observer pod's, job `ipmasq-observer`."""
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PodMonitor",
        "metadata": {"name": "ip-masq-agent", "namespace": NAMESPACE,
                     "labels": {"app.kubernetes.io/name": "ipmasq"}},
        "spec": {
            "jobLabel": AGENT_LABEL[0],  # the pods' k8s-app label's value names the job: the two stay apart
            "selector": {"matchExpressions": [{"key": AGENT_LABEL[0], "operator": "In",
                                               "values": [AGENT_LABEL[1], OBSERVER_JOB]}]},
            "namespaceSelector": {"matchNames": [NAMESPACE]},
            "podMetricsEndpoints": [{"port": METRICS_PORT, "path": "/metrics", "interval": "30s",
                                     "relabelings": [{"sourceLabels": [NODE_SOURCE], "targetLabel": NODE_LABEL}]}],
        },
    }


def scrape_config(job: str = JOB) -> dict[str, Any]:
    """A plain Prometheus' scrape job (prometheus.yml `scrape_configs:`), found by Kubernetes service discovery:
    pods in kube-system, the pods' label k8s-app=JOB (the enforcing agents', or the observers'), their `metrics` port
    kept, every other pod and port dropped."""
    return {
        "job_name": job,
        "scrape_interval": "30s",
        "kubernetes_sd_configs": [{"role": "pod", "namespaces": {"names": [NAMESPACE]},
                                   "selectors": [{"role": "pod", "label": f"{AGENT_LABEL[0]}={job}"}]}],
        "relabel_configs": [
            {"source_labels": ["__meta_kubernetes_pod_label_" + AGENT_LABEL[0].replace("-", "_"),
                               "__meta_kubernetes_pod_container_port_name"],
             "regex": f"{job};{METRICS_PORT}", "action": "keep"},
            {"source_labels": [NODE_SOURCE], "target_label": NODE_LABEL},
            {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
        ],
    }


def scrape_configs() -> list[dict[str, Any]]:
    """Both jobs, what the PodMonitor finds: the enforcing agents and the observers."""
    return [scrape_config(job) for job in JOBS]


def rule_group(*, for_override: str | None = None, grace_override: float | None = None) -> dict[str, Any]:
    """The alert group as Prometheus loads it; `for_override` replaces every `for:`, `grace_override` the seconds a
    provider's agent may take to follow (OBSERVED_GRACE_SECONDS): the lab's short durations."""
    rules = []
    for alert in ALERTS:
        expr = alert.expr
        if grace_override is not None and alert.name == NOT_ENFORCED_OBSERVED:
            expr = _observed_not_enforced(grace_override)
        rule: dict[str, Any] = {"alert": alert.name, "expr": expr}
        duration = alert.for_ if for_override is None else for_override
        if duration != "0m":
            rule["for"] = duration
        rule["labels"] = {"severity": alert.severity}
        rule["annotations"] = {"summary": alert.summary, "description": alert.description, "runbook": alert.runbook}
        rules.append(rule)
    return {"name": GROUP, "rules": rules}


def rules_file(*, for_override: str | None = None) -> str:
    return _dump({"groups": [rule_group(for_override=for_override)]})


def prometheus_rule() -> str:
    manifest = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": "ip-masq-agent", "namespace": "kube-system",
                     "labels": {"app.kubernetes.io/name": "ipmasq", "prometheus": "k8s", "role": "alert-rules"}},
        "spec": {"groups": [rule_group()]},
    }
    return _dump(manifest)


_HEADER = "# Generated by `python -m ipmasq.monitoring` from src/ipmasq/monitoring.py: edit there, not here.\n"


def _dump(document: dict[str, Any]) -> str:
    return _HEADER + yaml.safe_dump(document, sort_keys=False, width=120, allow_unicode=True)


def generated() -> dict[str, str]:
    """deploy/monitoring's generated files, by name, as their text."""
    return {"ip-masq-agent.rules.yaml": rules_file(), "prometheusrule.yaml": prometheus_rule(),
            "podmonitor.yaml": _dump(pod_monitor()),
            "ipmasq-dashboard.json": json.dumps(dashboard(), indent=2) + "\n"}


def write(directory: Path) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in generated().items():
        path = directory / name
        path.write_text(text)
        written.append(path)
    return written


if __name__ == "__main__":
    for path in write(Path(sys.argv[1] if len(sys.argv) > 1 else "deploy/monitoring")):
        print(path)
