"""The fleet's alert rules, defined once: a plain Prometheus rules file and a PrometheusRule are generated from here.

    python -m ipmasq.monitoring [DIR]      writes DIR/ip-masq-agent.rules.yaml and DIR/prometheusrule.yaml
                                           (default deploy/monitoring)

Each alert names the `ipmasq` command that diagnoses it (annotation `runbook`). The `for:` durations are those of a
production fleet; the lab loads the same group with every duration shortened (`rule_group(for_override=...)`).
The scrape job is `ip-masq-agent`, one target per node; a `node` label (the node's name, from relabelling) is used
where it helps to name the node, `instance` otherwise.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

__all__ = ["ALERTS", "GROUP", "JOB", "Alert", "prometheus_rule", "rule_group", "rules_file", "write"]

JOB = "ip-masq-agent"
GROUP = "ip-masq-agent"


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
        "The agent on {{ $labels.instance }} cannot load the ip-masq-agent ConfigMap; it keeps enforcing the last "
        "good config, so a change you made is not in force on this node.",
        "kubectl get configmap ip-masq-agent -n kube-system -o yaml | ipmasq lint -",
    ),
    Alert(
        "IpMasqAgentKernelNotMatching",
        "ipmasq_config_valid == 1 and ipmasq_ready == 0 and "
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
        "increase(ipmasq_drift_repairs_total[15m]) > 2",
        "0m", "warning",
        "something keeps rewriting the nat rules on {{ $labels.instance }}",
        "The agent on {{ $labels.instance }} repaired its rules more than twice in 15 minutes although its config "
        "did not change: another agent or a script is fighting it.",
        "on the node: ipmasq check (foreign-masquerade, stale-chain, other-variant-rules); look for a second agent",
    ),
    Alert(
        "IpMasqAgentForeignMasquerade",
        "ipmasq_foreign_masquerade_rules > 0",
        "10m", "warning",
        "nat rules outside the agent masquerade pod traffic on {{ $labels.instance }}",
        "{{ $value }} rules outside the agent's own masquerade or SNAT pod traffic on {{ $labels.instance }}; they "
        "may override what the config says.",
        "on the node: ipmasq check --pod-range POD_CIDR",
    ),
    Alert(
        "IpMasqAgentSyncFailing",
        "increase(ipmasq_syncs_total{result=\"failed\"}[10m]) > 0 and on (instance, job) ipmasq_ready == 0",
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
        "absent(up{job=\"" + JOB + "\"})",
        "15m", "warning",
        "no ip-masq-agent is scraped at all",
        "Prometheus has no target of job " + JOB + ": the DaemonSet is missing or the scrape config lost it.",
        "kubectl get daemonset ip-masq-agent -n kube-system; check the scrape job " + JOB,
    ),
)


def rule_group(*, for_override: str | None = None) -> dict[str, Any]:
    """The alert group as Prometheus loads it; `for_override` replaces every `for:` (the lab's short durations)."""
    rules = []
    for alert in ALERTS:
        rule: dict[str, Any] = {"alert": alert.name, "expr": alert.expr}
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


def write(directory: Path) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in (("ip-masq-agent.rules.yaml", rules_file()), ("prometheusrule.yaml", prometheus_rule())):
        path = directory / name
        path.write_text(text)
        written.append(path)
    return written


if __name__ == "__main__":
    for path in write(Path(sys.argv[1] if len(sys.argv) > 1 else "deploy/monitoring")):
        print(path)
