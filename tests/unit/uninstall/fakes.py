"""A cluster in ipmasq.testing.kube's fake API for the uninstall's tests: deploy/'s kustomizations rendered by kubectl
and stored as `kubectl apply` would store them (or as 0.2.0 shipped them, without the part-of label), a provider's
agent beside them, Nodes, status objects, and what the cluster does by itself: a deleted workload's pods go, a
deleted CRD's objects go, a removal pod ends after two looks with the report its node is given."""

from __future__ import annotations

import copy
import shutil
import tempfile
from pathlib import Path
from typing import Any

import yaml

from ipmasq.kube import paths
from ipmasq.testing.kube import FakeKubeClient
from ipmasq.uninstall.plan import kind_of
from tests.unit.test_deploy import DEPLOY, kustomize

GKE_LABELS = {"k8s-app": "ip-masq-agent", "addonmanager.kubernetes.io/mode": "Reconcile",
              "kubernetes.io/cluster-service": "true"}
GKE_IMAGE = "gke.gcr.io/ip-masq-agent:v2.9.3-gke.5"
CONFIGMAP = paths.configmaps("kube-system", "ip-masq-agent")
PODS = paths.pods("kube-system")


def path_of(doc: dict[str, Any]) -> str:
    meta = doc["metadata"]
    return kind_of(doc["kind"]).path(meta.get("namespace", ""), meta["name"])


# Manifests this release added, relative to deploy/: 0.2.0 did not ship them
SINCE_0_2_0 = {"webhook/networkpolicy.yaml"}


def render_without_labels(kustomization: str) -> list[dict[str, Any]]:
    """deploy/KUSTOMIZATION rendered as 0.2.0 shipped it: every kustomization's `labels:` and the manifests this
    release added (SINCE_0_2_0) taken out of a copy of deploy/."""
    with tempfile.TemporaryDirectory() as directory:
        copied = Path(directory) / "deploy"
        shutil.copytree(DEPLOY, copied)
        for path in copied.rglob("kustomization.yaml"):
            spec = yaml.safe_load(path.read_text())
            spec.pop("labels", None)
            folder = path.parent.relative_to(copied)
            spec["resources"] = [entry for entry in spec.get("resources", [])
                                 if (folder / entry).as_posix() not in SINCE_0_2_0]
            path.write_text(yaml.safe_dump(spec))
        return kustomize(copied / kustomization)


class FakeCluster(FakeKubeClient):
    def __init__(self, nodes: list[str]) -> None:
        super().__init__()
        self.reports: dict[str, tuple[int, str] | None] = {}  # node -> its removal pod's (exit code, message)
        self.polls: dict[str, int] = {}
        self.created: list[dict[str, Any]] = []
        self.order: list[str] = []  # "delete PATH" / "create NAME", in order
        self.enforcing_pods: set[str] = set()
        self.unready: set[str] = set()  # nodes whose kubelet answers nothing (not_ready)
        for node in nodes:
            self.put(paths.nodes(node), {"metadata": {"name": node}})

    # ---- what a test sets up ---------------------------------------------------------------------------------

    def install(self, kustomization: str, *, as_0_2_0: bool = False, image: str | None = None) -> list[str]:
        """`kubectl apply -k deploy/KUSTOMIZATION` (as_0_2_0: without the labels this release added); the paths."""
        stored = []
        for doc in render_without_labels(kustomization) if as_0_2_0 else kustomize(DEPLOY / kustomization):
            if image and doc["kind"] in ("DaemonSet", "Deployment"):
                doc["spec"]["template"]["spec"]["containers"][0]["image"] = image
            self.put(path_of(doc), doc)
            stored.append(path_of(doc))
        return stored

    def gke_agent(self) -> str:
        """GKE's own ip-masq-agent as its addon manifest has it: DaemonSet and ServiceAccount."""
        self.put(paths.resource("v1", "serviceaccounts", namespace="kube-system", name="ip-masq-agent"),
                 {"metadata": {"namespace": "kube-system", "labels": dict(GKE_LABELS)}})
        path = paths.daemonsets("kube-system", "ip-masq-agent")
        self.put(path, {"metadata": {"namespace": "kube-system", "labels": dict(GKE_LABELS)}, "spec": {
            "selector": {"matchLabels": {"k8s-app": "ip-masq-agent"}},
            "template": {"metadata": {"labels": {"k8s-app": "ip-masq-agent"}}, "spec": {
                "serviceAccountName": "ip-masq-agent", "containers": [{
                    "name": "ip-masq-agent", "image": GKE_IMAGE,
                    "args": ["--masq-chain=IP-MASQ", "--nomasq-all-reserved-ranges"]}]}}}})
        return path

    def helm_cluster_role(self) -> str:
        path = paths.resource("rbac.authorization.k8s.io/v1", "clusterroles", name="ip-masq-agent")
        self.put(path, {"metadata": {"labels": {"app.kubernetes.io/managed-by": "Helm"},
                                     "annotations": {"meta.helm.sh/release-name": "masq",
                                                     "meta.helm.sh/release-namespace": "kube-system"}},
                        "rules": [{"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get"]}]})
        return path

    def run_pods(self, workload: str, nodes: list[str]) -> list[str]:
        """The workload's pods on these nodes, owned by it (a DaemonSet's) as the API server shows them."""
        obj = self.objects[workload]
        template = obj["spec"]["template"]["metadata"]
        made = []
        for node in nodes:
            name = f"{obj['metadata']['name']}-{node}"
            path = f"/api/v1/namespaces/{obj['metadata']['namespace']}/pods/{name}"
            self.put(path, {"metadata": {"name": name, "namespace": obj["metadata"]["namespace"],
                                         "labels": dict(template.get("labels") or {}),
                                         "ownerReferences": [{"kind": "DaemonSet", "name": obj["metadata"]["name"],
                                                              "uid": obj["metadata"]["uid"], "controller": True}]},
                            "spec": {"nodeName": node}})
            made.append(path)
        return made

    def status(self, node: str, mode: str = "enforce", chain: str = "") -> None:
        self.put(paths.statuses(node), {"metadata": {"name": node}, "mode": mode, "chain": chain})

    def event(self, namespace: str, name: str, *, ours: bool = True) -> str:
        """An Event: ipmasq's (labelled as ipmasq.kube.events writes it), or another's (kubelet's, no label)."""
        path = paths.events(namespace, name)
        labels = {"app.kubernetes.io/part-of": "ipmasq"} if ours else {}
        self.put(path, {"metadata": {"name": name, "namespace": namespace, "labels": labels}, "reason": "X"})
        return path

    def not_ready(self, node: str) -> None:
        """The node's kubelet stopped posting: Ready Unknown, and a pod deleted there stays (Terminating) until the
        kubelet confirms it."""
        self.unready.add(node)
        self.objects[paths.nodes(node)]["status"] = {"conditions": [
            {"type": "MemoryPressure", "status": "Unknown"}, {"type": "Ready", "status": "Unknown"}]}

    def configmap(self) -> None:
        self.put(CONFIGMAP, {"metadata": {"name": "ip-masq-agent", "namespace": "kube-system"},
                             "data": {"config": "nonMasqueradeCIDRs: [10.0.0.0/8]\n"}})

    # ---- what the cluster does -------------------------------------------------------------------------------

    def delete(self, path: str) -> dict[str, Any]:
        gone = super().delete(path)
        self.order.append(f"delete {path}")
        uid = gone["metadata"].get("uid")
        selector = (gone.get("spec") or {}).get("selector", {}).get("matchLabels") if isinstance(
            gone.get("spec"), dict) else None
        for pod in [p for p, o in self.objects.items() if p.startswith("/api/v1/namespaces/")]:
            if "/pods/" not in pod:
                continue
            meta = self.objects[pod]["metadata"]
            owned = any(ref.get("uid") == uid for ref in meta.get("ownerReferences") or [])
            # a Deployment's pods are its ReplicaSet's: gone with it all the same
            selected = gone.get("kind") == "Deployment" and selector and all(
                (meta.get("labels") or {}).get(k) == v for k, v in selector.items())
            on_unready = (self.objects[pod].get("spec") or {}).get("nodeName") in self.unready
            if (owned or selected) and not on_unready:
                del self.objects[pod]
        if path.endswith(f"customresourcedefinitions/{paths.PLURAL}.{paths.GROUP}"):
            for status in [p for p in self.objects if p.startswith(paths.statuses() + "/")]:
                del self.objects[status]
        return gone

    def create(self, path: str, body: Any) -> dict[str, Any]:
        if path.endswith("/pods"):
            left = [p for p in self.enforcing_pods if p in self.objects
                    and self.objects[p]["spec"]["nodeName"] not in self.unready]
            assert not left, f"a removal pod while the agent still runs: {left}"
            assert body["spec"]["nodeName"] not in self.unready, "a removal pod for a node that is not Ready"
        made = super().create(path, body)
        self.created.append(copy.deepcopy(made))
        self.order.append(f"create {made['metadata']['name']}")
        return made

    def get(self, path: str, *, query: Any = None) -> dict[str, Any]:
        if path.endswith("/pods") and "component=uninstall" in str(query):  # the uninstall looks at its pods
            for pod, obj in self.objects.items():
                node = (obj.get("spec") or {}).get("nodeName")
                if pod.startswith(path + "/ipmasq-uninstall-") and node is not None:
                    self.polls[pod] = self.polls.get(pod, 0) + 1
                    report = self.reports.get(node)
                    if self.polls[pod] >= 2 and report is not None:
                        code, message = report
                        obj["status"] = {"containerStatuses": [{"state": {"terminated": {
                            "exitCode": code, "message": message}}}]}
        return super().get(path, query=query)
