"""The lab's part of the Prometheus Operator: the scrape jobs it makes of deploy/monitoring's PodMonitor, run through
Prometheus' relabelling (keep, drop, replace; anchored regexes) over the targets Kubernetes discovery hands it: an
agent's and an observer's `metrics` port kept under their own job with the node's name, everything else dropped."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import pytest
import yaml

from ipmasq.errors import ClusterError
from ipmasq.lab.kubernetes.prometheus_operator import pod_monitor_jobs
from tests.conftest import ROOT

MONITOR = yaml.safe_load((ROOT / "deploy" / "monitoring" / "podmonitor.yaml").read_text())


def _relabel(rules: Sequence[Mapping[str, Any]], labels: dict[str, str]) -> dict[str, str] | None:
    """Prometheus' relabel_configs over one target's labels (None: dropped)."""
    for rule in rules:
        value = rule.get("separator", ";").join(labels.get(name, "") for name in rule.get("source_labels", []))
        matched = re.fullmatch(rule.get("regex", "(.*)"), value)
        action = rule.get("action", "replace")
        if (action == "keep" and not matched) or (action == "drop" and matched):
            return None
        if action == "replace" and matched:
            replacement = matched.expand(re.sub(r"\$\{(\d+)\}|\$(\d+)", r"\\g<\1\2>", rule.get("replacement", "$1")))
            labels = {**labels, rule["target_label"]: replacement}
    return labels


def _target(pod: str, k8s_app: str | None, port: str, phase: str = "Running") -> dict[str, str]:
    """What Kubernetes discovery (role pod) says of one container port of a pod in kube-system on node n1."""
    labels = {"__meta_kubernetes_namespace": "kube-system", "__meta_kubernetes_pod_name": pod,
              "__meta_kubernetes_pod_node_name": "n1", "__meta_kubernetes_pod_phase": phase,
              "__meta_kubernetes_pod_container_name": "ip-masq-agent",
              "__meta_kubernetes_pod_container_port_name": port, "job": "podMonitor/kube-system/ip-masq-agent/0"}
    if k8s_app is not None:
        labels |= {"__meta_kubernetes_pod_label_k8s_app": k8s_app, "__meta_kubernetes_pod_labelpresent_k8s_app": "true"}
    return labels


def test_the_shipped_podmonitor_scrapes_agents_and_observers_under_their_own_job_and_nothing_else() -> None:
    (job,) = pod_monitor_jobs(MONITOR)
    assert job["job_name"] == "podMonitor/kube-system/ip-masq-agent/0"
    assert job["kubernetes_sd_configs"] == [{"role": "pod", "namespaces": {"names": ["kube-system"]}}]
    assert job["metrics_path"] == "/metrics" and job["scrape_interval"] == "30s"
    rules = job["relabel_configs"]
    for app in ("ip-masq-agent", "ipmasq-observer"):
        kept = _relabel(rules, _target(f"{app}-x1", app, "metrics"))
        assert kept is not None
        assert (kept["job"], kept["node"], kept["pod"], kept["endpoint"]) == (app, "n1", f"{app}-x1", "metrics")
    # GKE's own agent (its name and label, no metrics port), another port, another app, a pod that ended
    for dropped in (_target("ip-masq-agent-g1", "ip-masq-agent", ""), _target("x", "ip-masq-agent", "probes"),
                    _target("y", "kube-dns", "metrics"), _target("z", None, "metrics"),
                    _target("ip-masq-agent-x2", "ip-masq-agent", "metrics", phase="Succeeded")):
        assert _relabel(rules, dropped) is None, dropped


def test_what_the_lab_does_not_translate_is_said() -> None:
    anywhere = {**MONITOR, "spec": {**MONITOR["spec"], "namespaceSelector": {"any": True}}}
    with pytest.raises(ClusterError, match="named namespaces only"):
        pod_monitor_jobs(anywhere)
    endpoint = {**MONITOR["spec"]["podMetricsEndpoints"][0], "relabelings": [{"sourceLabels": ["a"], "foo": "b"}]}
    with pytest.raises(ClusterError, match="foo"):
        pod_monitor_jobs({**MONITOR, "spec": {**MONITOR["spec"], "podMetricsEndpoints": [endpoint]}})
