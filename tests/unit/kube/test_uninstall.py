"""The fleet uninstall over a fake API server: the order (the agent gone before the rules, the rules before the API
objects, the webhook's configuration before its Deployment, the status objects before their CRD), the user's
ConfigMap kept, a report per node, a dry run that writes nothing, a node that fails named. The real cluster's proof
is tests/kernel/lab/kubernetes/test_day_two.py."""

from __future__ import annotations

import subprocess
from typing import Any

import pytest
import yaml

from ipmasq.errors import NotFound
from ipmasq.kube.uninstall import API_OBJECTS, CONFIGMAP, CRD, STATUS_PATH, describe, plan, uninstall
from tests.clock import Clock
from tests.conftest import ROOT

PODS = "/api/v1/namespaces/kube-system/pods"
DS = "/apis/apps/v1/namespaces/kube-system/daemonsets/ip-masq-agent"


class Cluster:
    """Objects by path; the agent's pods go once the DaemonSet is deleted; an uninstall pod ends after two polls
    with the message its node is given (a node missing from `messages` never runs it)."""

    def __init__(self, nodes: dict[str, tuple[int, str] | None]) -> None:
        self.messages = nodes
        self.log: list[tuple[str, str]] = []
        self.objects: dict[str, dict[str, Any]] = {obj.path: {"metadata": {"name": obj.name}} for obj in API_OBJECTS}
        self.objects[DS] = {"metadata": {"name": "ip-masq-agent"}, "spec": {"template": {"spec": {"containers": [
            {"image": "ghcr.io/acme/ipmasq:0.2.0@sha256:" + "a" * 64,
             "args": ["agent", "--masq-chain=IP-MASQ", "--backend=iptables"]}]}}}}
        self.objects["/api/v1/namespaces/kube-system/configmaps/" + CONFIGMAP] = {"metadata": {"name": CONFIGMAP}}
        for node in nodes:
            self.objects[f"{STATUS_PATH}/{node}"] = {"metadata": {"name": node}}
            self.objects[f"{PODS}/ip-masq-agent-{node}"] = {"metadata": {"name": f"ip-masq-agent-{node}",
                                                                         "labels": {"k8s-app": "ip-masq-agent"}}}
        self.polls: dict[str, int] = {}
        self.serial = 0

    def get(self, path: str, *, query: dict[str, str] | None = None) -> dict[str, Any]:
        self.log.append(("get", path))
        if path == "/api/v1/nodes":
            return {"items": [{"metadata": {"name": n}} for n in self.messages]}
        if path == PODS:
            wanted = (query or {}).get("labelSelector", "").split("=")
            return {"items": [o for p, o in self.objects.items() if p.startswith(PODS + "/")
                              and o["metadata"].get("labels", {}).get(wanted[0]) == wanted[-1]]}
        if path == STATUS_PATH:
            if CRD.path not in self.objects:  # the kind went with its CRD
                raise NotFound(404, "no such kind")
            return {"items": [o for p, o in self.objects.items() if p.startswith(STATUS_PATH + "/")]}
        if path not in self.objects:
            raise NotFound(404, f"{path} not found")
        obj = self.objects[path]
        node = obj.get("spec", {}).get("nodeName")
        if node is not None:
            self.polls[path] = self.polls.get(path, 0) + 1
            if self.polls[path] >= 2 and self.messages[node] is not None:
                code, message = self.messages[node]  # type: ignore[misc]
                obj["status"] = {"containerStatuses": [{"state": {"terminated": {"exitCode": code,
                                                                                  "message": message}}}]}
        return obj

    def create(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        assert path == PODS
        assert not any("ip-masq-agent-" in p for p in self.objects if p.startswith(PODS)), "the agent still runs"
        self.serial += 1
        name = body["metadata"]["generateName"] + str(self.serial)
        obj = {**body, "metadata": {**body["metadata"], "name": name}}
        self.objects[f"{PODS}/{name}"] = obj
        self.log.append(("create", name))
        return obj

    def delete(self, path: str) -> dict[str, Any]:
        self.log.append(("delete", path))
        if path not in self.objects:
            raise NotFound(404, f"{path} not found")
        del self.objects[path]
        if path == DS:
            for pod in [p for p in self.objects if p.startswith(f"{PODS}/ip-masq-agent-")]:
                del self.objects[pod]
        return {}


def _run(cluster: Cluster, **kwargs: Any) -> Any:
    clock = Clock()
    lines: list[str] = []

    def sleep(seconds: float) -> None:
        clock.now += seconds

    report = uninstall(cluster, clock=clock, sleep=sleep, say=lines.append, **kwargs)
    return report, lines


def test_every_node_cleaned_then_every_object_removed_in_order_and_the_configmap_kept() -> None:
    cluster = Cluster({"node-a": (0, "removed: iptables (nft)\n"), "node-b": (0, "nothing to remove\n")})
    report, lines = _run(cluster)
    assert report.ok
    assert {n.node: n.removed for n in report.nodes} == {"node-a": ("removed: iptables (nft)",),
                                                       "node-b": ("nothing to remove",)}
    deletes = [path for verb, path in cluster.log if verb == "delete"]
    assert deletes[0] == DS
    first_create = next(i for i, (verb, _) in enumerate(cluster.log) if verb == "create")
    first_object = cluster.log.index(("delete", API_OBJECTS[1].path))
    last_pod_delete = max(i for i, (verb, p) in enumerate(cluster.log) if verb == "delete" and "uninstall" in p)
    assert first_create < last_pod_delete < first_object  # the rules before the API objects
    # the uninstall pods waited for until gone (listed after their deletion), before any object is removed
    assert any(verb == "get" and path == PODS for verb, path in cluster.log[last_pod_delete:first_object])
    order = [p for p in deletes if not p.startswith(PODS)]
    webhook_config = next(p for p in order if "validatingwebhookconfigurations" in p)
    assert order.index(webhook_config) < order.index(next(p for p in order if "deployments/ipmasq-webhook" in p))
    crd = next(p for p in order if "customresourcedefinitions" in p)
    assert all(order.index(p) < order.index(crd) for p in order if p.startswith(STATUS_PATH))
    left = set(cluster.objects)
    assert left == {"/api/v1/namespaces/kube-system/configmaps/" + CONFIGMAP}
    assert "ipmasqagentstatus/node-a" in report.removed and len(report.removed) == len(API_OBJECTS) + 2
    assert any(line.startswith("node node-a: removed: iptables (nft)") for line in lines)
    assert lines[-1] == "kept configmap/kube-system/ip-masq-agent (yours)"
    pod = next(body for verb, body in cluster.log if verb == "create")
    assert pod.startswith("ipmasq-uninstall-")


def test_the_pods_run_the_agents_image_chain_and_privileges_on_their_node() -> None:
    cluster = Cluster({"node-a": (0, "removed: nftables\n")})
    created: list[dict[str, Any]] = []
    original = cluster.create

    def create(path: str, body: dict[str, Any]) -> dict[str, Any]:
        created.append(body)
        return original(path, body)

    cluster.create = create  # type: ignore[method-assign]
    _run(cluster)
    (pod,) = created
    spec = pod["spec"]
    assert spec["nodeName"] == "node-a" and spec["hostNetwork"] is True and spec["restartPolicy"] == "Never"
    (container,) = spec["containers"]
    assert container["image"] == "ghcr.io/acme/ipmasq:0.2.0@sha256:" + "a" * 64
    assert "ipmasq uninstall --masq-chain=IP-MASQ" in container["command"][-1]
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["NET_ADMIN", "NET_RAW"]}
    assert container["securityContext"]["privileged"] is False


def test_a_hostile_chain_flag_in_the_daemonset_is_one_word_to_the_shell() -> None:
    cluster = Cluster({"node-a": (0, "removed: nftables\n")})
    container = cluster.objects[DS]["spec"]["template"]["spec"]["containers"][0]
    container["args"] = ["agent", "--masq-chain=X; touch /pwned $(id)"]
    created: list[dict[str, Any]] = []
    original = cluster.create
    cluster.create = lambda path, body: (created.append(body), original(path, body))[1]  # type: ignore[method-assign]
    _run(cluster)
    script = created[0]["spec"]["containers"][0]["command"][-1]
    assert script == "ipmasq uninstall '--masq-chain=X; touch /pwned $(id)' >/dev/termination-log 2>&1"


def test_a_node_that_fails_or_never_runs_is_named_and_the_rest_goes_on() -> None:
    cluster = Cluster({"good": (0, "removed: nftables\n"), "broken": (1, "iptables-restore: \x1b[31mlocked\n"),
                       "down": None})
    report, lines = _run(cluster, timeout=30)
    assert not report.ok
    outcomes = {n.node: n for n in report.nodes}
    assert outcomes["good"].ok and not outcomes["broken"].ok and not outcomes["down"].ok
    assert "within 30 s" in outcomes["down"].why
    broken = next(line for line in lines if line.startswith("node broken"))
    assert "\x1b" not in broken and "\\x1b[31mlocked" in broken  # escaped, one line
    assert not any(p.startswith(PODS + "/ipmasq-uninstall") for p in cluster.objects)  # every pod deleted
    assert set(cluster.objects) == {"/api/v1/namespaces/kube-system/configmaps/" + CONFIGMAP}


def test_dry_run_writes_nothing_and_lists_what_would_go() -> None:
    cluster = Cluster({"node-a": (0, ""), "node-b": (0, "")})
    lines = describe(plan(cluster))
    assert all(verb == "get" for verb, _ in cluster.log)
    text = "\n".join(lines)
    assert "would run `ipmasq uninstall --masq-chain=IP-MASQ` on node node-a" in text and "node node-b" in text
    assert "would delete validatingwebhookconfiguration/ipmasq-webhook" in text
    assert "customresourcedefinition/ipmasqagentstatuses.ipmasq.dev and its 2 status object(s)" in text
    assert "configmap" not in text.replace("would keep configmap/kube-system/ip-masq-agent (yours)", "")


def test_a_second_run_finds_nothing_and_says_so() -> None:
    cluster = Cluster({"node-a": (0, "removed: nftables\n")})
    _run(cluster)
    report, _ = _run(cluster)
    assert report.removed == () and report.ok
    assert [n.removed for n in report.nodes] == [("removed: nftables",)]  # the node is asked again all the same


def test_the_objects_removed_are_exactly_what_deploy_installs() -> None:
    """A manifest added to deploy/ without a line here would stay behind after an uninstall."""
    rendered = set()
    for path in ("deploy", "deploy/webhook", "deploy/monitoring", "deploy/overlays/observe",
                 "deploy/overlays/observe/eks", "deploy/overlays/observe/aks"):
        built = subprocess.run(["kubectl", "kustomize", str(ROOT / path)], capture_output=True, text=True,
                               check=False, timeout=60)
        if built.returncode != 0:
            pytest.skip("kubectl is missing")
        for doc in yaml.safe_load_all(built.stdout):
            if doc:
                namespace = doc["metadata"].get("namespace")
                rendered.add((doc["kind"], f"{namespace}/{doc['metadata']['name']}" if namespace
                              else doc["metadata"]["name"]))
    listed = {(obj.kind, obj.name) for obj in API_OBJECTS}
    assert listed - rendered == {("Secret", "kube-system/ipmasq-webhook-certificate")}  # the webhook makes it
    assert rendered <= listed


class WithWebhookPods(Cluster):
    """The webhook's two pods, ended by kubelet `polls` lists after their Deployment is deleted (None: never)."""

    WEBHOOK = "/apis/apps/v1/namespaces/kube-system/deployments/ipmasq-webhook"

    def __init__(self, polls: int | None) -> None:
        super().__init__({"node-a": (0, "removed: iptables (nft)\n")})
        self.left = polls
        self.deleted = False
        for i in range(2):
            self.objects[f"{PODS}/ipmasq-webhook-{i}"] = {"metadata": {
                "name": f"ipmasq-webhook-{i}", "labels": {"app.kubernetes.io/name": "ipmasq-webhook"}}}

    def get(self, path: str, *, query: dict[str, str] | None = None) -> dict[str, Any]:
        if path == PODS and self.deleted and self.left is not None and "ipmasq-webhook" in str(query):
            self.left -= 1
            if self.left <= 0:
                for pod in [p for p in self.objects if p.startswith(f"{PODS}/ipmasq-webhook-")]:
                    del self.objects[pod]
        return super().get(path, query=query)

    def delete(self, path: str) -> dict[str, Any]:
        self.deleted = self.deleted or path == self.WEBHOOK
        return super().delete(path)


def test_the_webhooks_pods_are_waited_for_until_gone_after_their_deployment() -> None:
    cluster = WithWebhookPods(polls=3)
    report, lines = _run(cluster)
    assert report.ok
    assert not [p for p in cluster.objects if "ipmasq-webhook-" in p]  # gone when the run ends
    assert not any("still terminating" in line for line in lines)


def test_pods_that_never_end_are_said_and_the_run_still_ends() -> None:
    cluster = WithWebhookPods(polls=None)
    report, lines = _run(cluster)
    assert report.ok  # the objects are deleted: kubelet ending the pods is not the uninstall's failure
    (said,) = [line for line in lines if "still terminating" in line]
    assert "ipmasq-webhook-0" in said and "ipmasq-webhook-1" in said
    assert lines[-1] == "kept configmap/kube-system/ip-masq-agent (yours)"
