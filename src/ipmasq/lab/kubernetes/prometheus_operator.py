"""deploy/monitoring on the lab's cluster as a cluster with the Prometheus Operator takes it, the operator's part
played by the lab: its two kinds (PodMonitor, PrometheusRule: CRDs that keep every field, not the operator's own
schemas), `kubectl apply -k deploy/monitoring` as shipped, and the lab's real Prometheus (ipmasq.lab.prometheus, built
with Kubernetes discovery) given what the operator makes of the objects the API server holds:

- each endpoint of each PodMonitor a scrape job of role pod, relabelled as the operator does it
  (prometheus-operator, pkg/prometheus/promcfg.go generatePodMonitorConfig: the running filter, the selector's labels
  and the endpoint's port kept, `namespace`, `container`, `pod`, `job` from the monitor or its jobLabel, `endpoint`,
  then the endpoint's own relabelings); the lab scrapes every second and reaches the API server from outside;
- each PrometheusRule's groups a rules file, with the lab's short durations (ipmasq.monitoring.rule_group's
  overrides: the group in the cluster is checked to be ipmasq.monitoring's own first).

Prometheus runs outside every node, in the control plane's namespace, as a service account allowed exactly what the
discovery needs (pods in kube-system: get, list, watch), its token in a file, as an operator gives a Prometheus outside
the cluster.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ipmasq.errors import ClusterError
from ipmasq.lab.kubernetes.artifacts import prometheus_binary
from ipmasq.lab.kubernetes.cluster import Cluster, Progress
from ipmasq.lab.kubernetes.layout import CONTROL_PLANE, LAB_NAMESPACE
from ipmasq.lab.prometheus import PrometheusServer
from ipmasq.monitoring import NAMESPACE, rule_group

__all__ = ["GROUP", "KINDS", "SHIPPED", "deploy_monitoring", "discovering", "install_kinds", "pod_monitor_jobs",
           "prometheus_identity", "remove_kinds", "remove_prometheus_identity", "start_from_the_api"]

GROUP = "monitoring.coreos.com"
KINDS = (("PodMonitor", "podmonitors", "podmonitor"), ("PrometheusRule", "prometheusrules", "prometheusrule"))
SHIPPED = "deploy/monitoring"
SCRAPE_SECONDS = "1s"  # the lab's scrape interval and timeout, for every job (a fleet's: the PodMonitor's 30 s)
IDENTITY = "lab-prometheus"
# the operator's CRDs are its own (its bundle labels them so): never ipmasq's, kept by an uninstall
CRD_LABELS = {"app.kubernetes.io/name": "prometheus-operator"}


def _crd(kind: str, plural: str, singular: str) -> dict[str, Any]:
    return {
        "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{GROUP}", "labels": dict(CRD_LABELS)},
        "spec": {"group": GROUP, "scope": "Namespaced",
                 "names": {"kind": kind, "plural": plural, "singular": singular, "listKind": f"{kind}List"},
                 "versions": [{"name": "v1", "served": True, "storage": True, "schema": {"openAPIV3Schema": {
                     "type": "object", "x-kubernetes-preserve-unknown-fields": True}}}]},
    }


def install_kinds(cluster: Cluster, timeout: float = 60.0) -> None:
    """The operator's PodMonitor and PrometheusRule kinds, served (their CRDs Established)."""
    cluster.kubectl("apply", "-f", "-", stdin=json.dumps(
        {"apiVersion": "v1", "kind": "List", "items": [_crd(*kind) for kind in KINDS]}))
    for _, plural, _ in KINDS:
        result = cluster.kubectl("wait", "--for=condition=Established", f"crd/{plural}.{GROUP}",
                                 f"--timeout={timeout:.0f}s", check=False, timeout=timeout + 10)
        if result.returncode != 0:
            raise ClusterError(f"the CRD {plural}.{GROUP} was not established: {result.stderr.strip()[-300:]}")


def remove_kinds(cluster: Cluster) -> None:
    cluster.kubectl("delete", "crd", *(f"{plural}.{GROUP}" for _, plural, _ in KINDS), "--ignore-not-found",
                    "--wait", "--timeout=60s", timeout=90)


def deploy_monitoring(cluster: Cluster, shipped: str | Path = SHIPPED) -> None:
    """`kubectl apply -k deploy/monitoring` (or an earlier release's copy: a directory anywhere), as shipped."""
    cluster.apply_shipped(cluster.source / shipped)


# ---- what the operator makes of a PodMonitor ---------------------------------------------------------------------

def _label(name: str) -> str:
    """A Kubernetes label's name as a Prometheus meta label's suffix (the operator's sanitizeLabelName)."""
    return re.sub(r"[^a-zA-Z0-9_]", "_", name)


def _selected(key: str) -> list[str]:
    return [f"__meta_kubernetes_pod_label_{_label(key)}", f"__meta_kubernetes_pod_labelpresent_{_label(key)}"]


_RELABEL_KEYS = {"sourceLabels": "source_labels", "targetLabel": "target_label", "separator": "separator",
                 "regex": "regex", "modulus": "modulus", "replacement": "replacement", "action": "action"}


def _relabeling(given: Mapping[str, Any]) -> dict[str, Any]:
    """A PodMonitor's relabeling (the CRD's camelCase) as Prometheus takes it."""
    unknown = set(given) - set(_RELABEL_KEYS)
    if unknown:
        raise ClusterError(f"a relabeling field the lab does not translate: {', '.join(sorted(unknown))}")
    out = {_RELABEL_KEYS[key]: value for key, value in given.items()}
    if "action" in out:
        out["action"] = str(out["action"]).lower()
    return out


def _selection(selector: Mapping[str, Any]) -> list[dict[str, Any]]:
    rules: list[dict[str, Any]] = []
    for key, value in sorted((selector.get("matchLabels") or {}).items()):
        rules.append({"action": "keep", "source_labels": _selected(key), "regex": f"({value});true"})
    for expression in selector.get("matchExpressions") or []:
        key, operator, values = expression["key"], expression["operator"], expression.get("values") or []
        if operator in ("In", "NotIn"):
            rules.append({"action": "keep" if operator == "In" else "drop", "source_labels": _selected(key),
                          "regex": f"({'|'.join(values)});true"})
        elif operator in ("Exists", "DoesNotExist"):
            rules.append({"action": "keep" if operator == "Exists" else "drop",
                          "source_labels": [f"__meta_kubernetes_pod_labelpresent_{_label(key)}"], "regex": "true"})
        else:
            raise ClusterError(f"a label selector operator Kubernetes does not have: {operator!r}")
    return rules


def pod_monitor_jobs(monitor: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The scrape jobs the operator generates for a PodMonitor (one per endpoint), as the API server holds it."""
    meta, spec = monitor["metadata"], monitor["spec"]
    namespace, name = meta["namespace"], meta["name"]
    namespaces = spec.get("namespaceSelector") or {}
    if namespaces.get("any"):
        raise ClusterError("namespaceSelector any: the lab's Prometheus discovers named namespaces only")
    jobs = []
    for index, endpoint in enumerate(spec.get("podMetricsEndpoints") or []):
        relabel: list[dict[str, Any]] = [{"source_labels": ["job"], "target_label": "__tmp_prometheus_job_name"}]
        if endpoint.get("filterRunning", True):
            relabel.append({"action": "drop", "source_labels": ["__meta_kubernetes_pod_phase"],
                            "regex": "(Failed|Succeeded)"})
        relabel += _selection(spec.get("selector") or {})
        port = endpoint.get("port")
        if port:
            relabel.append({"action": "keep", "source_labels": ["__meta_kubernetes_pod_container_port_name"],
                            "regex": port})
        relabel += [{"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
                    {"source_labels": ["__meta_kubernetes_pod_container_name"], "target_label": "container"},
                    {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
                    {"target_label": "job", "replacement": f"{namespace}/{name}"}]
        if spec.get("jobLabel"):
            relabel.append({"source_labels": [f"__meta_kubernetes_pod_label_{_label(spec['jobLabel'])}"],
                            "target_label": "job", "regex": "(.+)", "replacement": "${1}"})
        if port:
            relabel.append({"target_label": "endpoint", "replacement": port})
        relabel += [_relabeling(given) for given in endpoint.get("relabelings") or []]
        job: dict[str, Any] = {
            "job_name": f"podMonitor/{namespace}/{name}/{index}", "honor_labels": False,
            "kubernetes_sd_configs": [{"role": "pod",
                                       "namespaces": {"names": list(namespaces.get("matchNames") or [namespace])}}],
            "scrape_interval": endpoint.get("interval") or "30s", "relabel_configs": relabel}
        if endpoint.get("path"):
            job["metrics_path"] = endpoint["path"]
        jobs.append(job)
    return jobs


# ---- the lab's Prometheus -----------------------------------------------------------------------------------------

def prometheus_identity(cluster: Cluster, workdir: Path) -> Path:
    """A service account allowed exactly what the scrape jobs' discovery needs (pods in kube-system: get, list,
    watch), and a token of it in a file, as an operator gives a Prometheus outside the cluster."""
    cluster.kubectl("apply", "-f", "-", stdin=json.dumps({"apiVersion": "v1", "kind": "List", "items": [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "prometheus", "namespace": LAB_NAMESPACE}},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
         "metadata": {"name": IDENTITY, "namespace": NAMESPACE},
         "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
         "metadata": {"name": IDENTITY, "namespace": NAMESPACE},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": IDENTITY},
         "subjects": [{"kind": "ServiceAccount", "name": "prometheus", "namespace": LAB_NAMESPACE}]},
    ]}))
    token = cluster.kubectl("create", "token", "prometheus", "-n", LAB_NAMESPACE, "--duration=1h").stdout.strip()
    path = workdir / "token"
    workdir.mkdir(parents=True, exist_ok=True)
    path.write_text(token)
    path.chmod(0o600)
    return path


def remove_prometheus_identity(cluster: Cluster) -> None:
    cluster.kubectl("delete", "rolebinding,role", IDENTITY, "-n", NAMESPACE, "--ignore-not-found")
    cluster.kubectl("delete", "serviceaccount", "prometheus", "-n", LAB_NAMESPACE, "--ignore-not-found")


def discovering(cluster: Cluster, job: dict[str, Any], token: Path) -> dict[str, Any]:
    """A scrape job scraping every second, its discovery through the lab's API server from outside the cluster."""
    job.update(scrape_interval=SCRAPE_SECONDS, scrape_timeout=SCRAPE_SECONDS)
    for sd in job["kubernetes_sd_configs"]:
        sd.update(api_server=f"https://{CONTROL_PLANE}:6443", authorization={"credentials_file": str(token)},
                  tls_config={"ca_file": str(cluster.state / "pki" / "ca.crt")})
    return job


def _held(cluster: Cluster, plural: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = cluster.kubectl_json("get", f"{plural}.{GROUP}", "-n", NAMESPACE)["items"]
    return items


def start_from_the_api(cluster: Cluster, workdir: Path, progress: Progress, *, for_seconds: float = 2.0,
                       grace_seconds: float = 10.0) -> PrometheusServer:
    """The lab's Prometheus with the scrape jobs of every PodMonitor and the groups of every PrometheusRule in
    kube-system (the group checked to be ipmasq.monitoring's, then loaded with `for:` shortened to `for_seconds`
    and the observers' grace to `grace_seconds`); started and ready. The caller stops it (and removes the identity:
    remove_prometheus_identity)."""
    binary = prometheus_binary(progress)
    token = prometheus_identity(cluster, workdir)
    jobs = [discovering(cluster, job, token) for monitor in _held(cluster, "podmonitors")
            for job in pod_monitor_jobs(monitor)]
    rules = [group for held in _held(cluster, "prometheusrules") for group in held["spec"].get("groups") or []]
    if not jobs or rules != [rule_group()]:
        raise ClusterError(f"deploy/monitoring is not in the cluster as ipmasq.monitoring makes it: {len(jobs)} scrape "
                           f"jobs, {len(rules)} rule groups")
    server = PrometheusServer(cluster.net["cp"], "127.0.0.1", str(workdir))
    server.start((), for_seconds=for_seconds, scrape_configs=jobs, binary=binary,
                 rule_groups=[rule_group(for_override=f"{for_seconds:g}s", grace_override=grace_seconds)])
    return server
