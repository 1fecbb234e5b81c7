"""The admission webhook on the lab's cluster, installed as users do it: `kubectl apply -k deploy/webhook` (only the
image's tag changed, by the lab's overlay), then waited for until the API server really calls it."""

from __future__ import annotations

import json
import time
from typing import Any

from ipmasq.errors import ClusterError
from ipmasq.lab.kubernetes.agent import CONFIGMAP, lab_overlay
from ipmasq.lab.kubernetes.cluster import Cluster
from ipmasq.lab.wait import until

__all__ = ["DEPLOYMENT", "SHIPPED", "deploy_webhook", "scale_webhook", "wait_endpoints_ready", "webhook_pods"]

SHIPPED = "deploy/webhook"
DEPLOYMENT = "ipmasq-webhook"
LABEL = "app.kubernetes.io/name=ipmasq-webhook"
# Not a config any agent accepts: a dry run of it is denied exactly when the API server calls the webhook.
_CANARY = "nonMasqueradeCIDRs:\n  - 10.0.0.0/33\n"


def deploy_webhook(cluster: Cluster, *, image: str | None = None, timeout: float = 120.0,
                   shipped: str = SHIPPED) -> float:
    """`kubectl apply -k deploy/webhook` (or `shipped`: deploy/overlays/gke/webhook, an earlier release's copy), then
    wait until the API server's calls reach it; returns the seconds."""
    started = time.monotonic()
    cluster.apply_shipped(lab_overlay(cluster, shipped, image or cluster.artifacts.image))
    wait_webhook_serving(cluster, timeout=timeout)
    return time.monotonic() - started


def wait_webhook_serving(cluster: Cluster, timeout: float = 120.0) -> None:
    """Rolled out, and a server-side dry run of a bad config denied (the caBundle is in place and trusted)."""
    result = cluster.kubectl("rollout", "status", f"deployment/{DEPLOYMENT}", "-n", "kube-system",
                             f"--timeout={timeout:.0f}s", check=False, timeout=timeout + 10)
    if result.returncode != 0:
        raise ClusterError(f"the webhook's Deployment did not roll out: {result.stderr.strip()[-300:]} "
                           f"{_pods_and_logs(cluster)}")
    answers: list[str] = []

    def denied() -> bool:
        answer = cluster.kubectl("apply", "--dry-run=server", "-f", "-", stdin=canary_manifest(), check=False)
        answers[:] = [(answer.stderr or answer.stdout).strip()[-300:]]
        return answer.returncode != 0 and "denied the request" in answer.stderr

    until(denied, lambda: f"the API server calls the webhook after it rolled out (a dry run of a bad config: "
                          f"{answers[0]}) {_pods_and_logs(cluster)}", timeout=timeout, interval=0.5, error=ClusterError)


def canary_manifest() -> str:
    return json.dumps({"apiVersion": "v1", "kind": "ConfigMap",
                       "metadata": {"name": CONFIGMAP, "namespace": "kube-system"}, "data": {"config": _CANARY}})


def scale_webhook(cluster: Cluster, replicas: int, timeout: float = 90.0) -> None:
    """Scale the Deployment and wait until exactly that many of its pods exist (and are ready, when any)."""
    cluster.kubectl("scale", f"deployment/{DEPLOYMENT}", "-n", "kube-system", f"--replicas={replicas}")
    counted: list[int] = [0, 0]

    def scaled() -> bool:
        pods = webhook_pods(cluster)
        counted[:] = [len(pods), len(_ready(pods))]
        return counted == [replicas, replicas]

    until(scaled, lambda: f"the webhook has {replicas} pods, all ready, after scaling (it has {counted[0]}, "
                          f"{counted[1]} ready)", timeout=timeout, interval=0.5, error=ClusterError)


def wait_endpoints_ready(cluster: Cluster, timeout: float = 60.0) -> None:
    """Until the Service's EndpointSlices name exactly the addresses of the webhook's ready pods, each ready: the API
    server then calls only pods that serve (the endpoints follow the pods' readiness a few seconds late)."""
    seen: list[object] = []

    def followed() -> bool:
        pods = webhook_pods(cluster)
        ready = {str(p.get("status", {}).get("podIP")) for p in _ready(pods)}
        slices = cluster.kubectl_json("get", "endpointslices", "-n", "kube-system", "-l",
                                      f"kubernetes.io/service-name={DEPLOYMENT}")
        listed = sorted((str(address), bool((endpoint.get("conditions") or {}).get("ready")))
                        for item in slices.get("items", []) for endpoint in item.get("endpoints") or []
                        for address in endpoint.get("addresses") or [])
        seen[:] = [listed, sorted(ready)]
        return bool(ready) and len(ready) == len(pods) and {a for a, _ in listed} == ready and all(r for _, r in listed)

    until(followed, lambda: f"the webhook's endpoints {seen[0]} are the addresses of its ready pods {seen[1]}",
          timeout=timeout, interval=0.5, error=ClusterError)


def webhook_pods(cluster: Cluster) -> list[dict[str, Any]]:
    pods = cluster.kubectl_json("get", "pods", "-n", "kube-system", "-l", LABEL)
    return list(pods["items"])


def _ready(pods: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [p for p in pods if any(c.get("ready") for c in p.get("status", {}).get("containerStatuses", []))]


def _pods_and_logs(cluster: Cluster) -> str:
    pods = cluster.kubectl("get", "pods", "-n", "kube-system", "-l", LABEL, "-o", "wide", check=False).stdout
    logs = cluster.kubectl("logs", "-n", "kube-system", "-l", LABEL, "--tail=5", check=False).stdout
    return f"{pods.strip()} | logs: {' | '.join(logs.strip().splitlines())}"
