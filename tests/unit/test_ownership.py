"""What is ipmasq's in the API: every object ipmasq's code creates carries app.kubernetes.io/part-of=ipmasq (an
object an earlier release made is labelled by the next write), and an object found in a cluster is judged by what it
says, never by its name alone (GKE's addon, a Helm chart's ClusterRole, the reference agent share ipmasq's names)."""

from __future__ import annotations

import copy
import datetime
from typing import Any

import pytest

from ipmasq.kube import paths
from ipmasq.kube.agentstatus import NodeStatus, StatusWriter
from ipmasq.kube.events import EventRecorder, ObjectRef, Occurrence
from ipmasq.kube.lease import LeaseElector
from ipmasq.ownership import PART_OF, ObjectFacts, decide, facts_of, judge, labels
from ipmasq.testing.kube import FakeKubeClient
from ipmasq.version import IMAGE
from tests.clock import Clock

PART_OF_IPMASQ = {PART_OF: "ipmasq"}


def _status(node: str) -> NodeStatus:
    return NodeStatus(node=node, pod="p", version="0", backend="iptables", ready=True, reason="", policy_hash=None,
                      config_digest=None, config_source="api", configmaps=(), last_rejection=None,
                      last_rejection_time=None, drift_repairs=0, foreign_masquerade_rules=None, updated="now")


def _labels(obj: dict[str, Any]) -> dict[str, str]:
    return dict(obj["metadata"].get("labels") or {})


def test_the_status_object_carries_part_of_and_one_an_earlier_release_made_is_adopted() -> None:
    client = FakeKubeClient()
    client.put(paths.nodes("node-a"), {"metadata": {"name": "node-a"}})
    StatusWriter(client, "node-a").write(_status("node-a"))
    assert _labels(client.objects[paths.statuses("node-a")]).items() >= PART_OF_IPMASQ.items()
    # 0.2.0's object, labelled only app.kubernetes.io/name: the next agent's first write labels it
    client.put(paths.statuses("node-b"), {"metadata": {"labels": {"app.kubernetes.io/name": "ipmasq"}}})
    StatusWriter(client, "node-b").write(_status("node-b"))
    assert _labels(client.objects[paths.statuses("node-b")]) == labels()


def test_the_lease_and_the_events_ipmasq_creates_carry_part_of() -> None:
    client = FakeKubeClient()
    assert LeaseElector(client, "kube-system", "ip-masq-agent", "node-a", duration=120, clock=Clock()).try_lead()
    assert _labels(client.objects[paths.leases("kube-system", "ip-masq-agent")]) == labels()
    EventRecorder(client, component="ip-masq-agent", host="node-a").record(
        Occurrence(ObjectRef("Node", "node-a"), "Warning", "ConfigRejected", "bad"))
    (event,) = [o for path, o in client.objects.items() if path.startswith(paths.events("default"))]
    assert _labels(event)[PART_OF] == "ipmasq"


def test_the_webhooks_certificate_secret_carries_part_of() -> None:
    pytest.importorskip("cryptography")
    from ipmasq.webhook.keeper import CertificateKeeper, KeeperSettings

    class Api:
        secret: dict[str, Any] | None = None

        def get_secret(self, namespace: str, name: str) -> dict[str, Any] | None:
            return copy.deepcopy(self.secret)

        def create_secret(self, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
            self.secret = copy.deepcopy(body)
            return body

        def replace_secret(self, namespace: str, name: str, body: dict[str, Any]) -> dict[str, Any]:
            raise AssertionError("not renewed here")

        def get_webhook_configuration(self, name: str) -> dict[str, Any] | None:
            return {"webhooks": []}

        def patch_webhook_configuration(self, name: str, patch: list[dict[str, Any]]) -> None:
            raise AssertionError("no webhook of ours in it")

    api = Api()
    now = datetime.datetime(2024, 5, 1, tzinfo=datetime.UTC)
    CertificateKeeper(api, KeeperSettings("kube-system", "ipmasq-webhook", "ipmasq-webhook-certificate",
                                          "ipmasq-webhook"), clock=lambda: now).sync()
    assert api.secret is not None
    assert _labels(api.secret) == labels("webhook", name="ipmasq-webhook")


# ---- judging one object -----------------------------------------------------------------------------------------


def _daemonset(name: str, labels: dict[str, str], image: str, args: list[str]) -> ObjectFacts:
    return facts_of("DaemonSet", {"metadata": {"name": name, "namespace": "kube-system", "labels": labels},
                                  "spec": {"template": {"spec": {"serviceAccountName": name, "containers": [
                                      {"name": "ip-masq-agent", "image": image, "args": args}]}}}})


GKE = {"k8s-app": "ip-masq-agent", "addonmanager.kubernetes.io/mode": "Reconcile"}


@pytest.mark.parametrize(("facts", "ours", "why"), [
    (_daemonset("ip-masq-agent", GKE, "gke.gcr.io/ip-masq-agent:v2", []), False,
     "not ipmasq's (addonmanager.kubernetes.io/mode=Reconcile)"),
    # the addon manager puts back whatever it reconciles: a part-of label does not make it ipmasq's to delete
    (_daemonset("ip-masq-agent", {**GKE, PART_OF: "ipmasq"}, IMAGE, ["agent"]), False,
     "not ipmasq's (addonmanager.kubernetes.io/mode=Reconcile)"),
    (_daemonset("whatever", {PART_OF: "ipmasq"}, "x", []), True, "app.kubernetes.io/part-of=ipmasq"),
    (facts_of("ClusterRole", {"metadata": {"name": "ip-masq-agent", "labels": {
        "app.kubernetes.io/managed-by": "Helm"}}, "rules": [{"apiGroups": ["ipmasq.dev"]}]}), False,
     "not ipmasq's (app.kubernetes.io/managed-by=Helm)"),
    (facts_of("ClusterRole", {"metadata": {"name": "ip-masq-agent", "annotations": {
        "meta.helm.sh/release-name": "masq"}}}), False, "not ipmasq's (meta.helm.sh/release-name=masq)"),
    (facts_of("DaemonSet", {"metadata": {"name": "azure-ip-masq-agent", "labels": {
        "kubernetes.azure.com/managedby": "aks"}}}), False, "not ipmasq's (kubernetes.azure.com/managedby=aks)"),
    # what 0.2.0 shipped, without part-of
    (_daemonset("ip-masq-agent", {"k8s-app": "ip-masq-agent", "app.kubernetes.io/name": "ipmasq"}, "r/x:1", []),
     True, "app.kubernetes.io/name=ipmasq (ipmasq's own label before app.kubernetes.io/part-of)"),
    (facts_of("Role", {"metadata": {"name": "ipmasq-observer", "namespace": "kube-system"}}), True,
     "named ipmasq-*"),
    (facts_of("CustomResourceDefinition", {"metadata": {"name": "ipmasqagentstatuses.ipmasq.dev"},
                                           "spec": {"group": "ipmasq.dev"}}), True, "the ipmasq.dev API"),
    (facts_of("Lease", {"metadata": {"name": "ip-masq-agent", "annotations": {"ipmasq.dev/nodes": "3"}}}), True,
     "carries ipmasq.dev/nodes"),
    (facts_of("ValidatingAdmissionPolicy", {"metadata": {"name": "ip-masq-agent-own-node"}, "spec": {
        "matchConstraints": {"resourceRules": [{"apiGroups": ["ipmasq.dev"]}]}}}), True,
     "its rules are about the ipmasq.dev API"),
    (_daemonset("ip-masq-agent", {"k8s-app": "ip-masq-agent"}, f"{IMAGE}@sha256:{'a' * 64}", ["agent"]), True,
     "runs ipmasq's image (ghcr.io/ipmasq/ipmasq)"),
    # the name and k8s-app label alone say nothing: the reference agent's own DaemonSet
    (_daemonset("ip-masq-agent", {"k8s-app": "ip-masq-agent"}, "registry.k8s.io/networking/ip-masq-agent:v2.9",
                ["--masq-chain=IP-MASQ"]), None, ""),
])
def test_one_object_is_judged_by_what_it_says(facts: ObjectFacts, ours: bool | None, why: str) -> None:
    verdict = judge(facts)
    assert (verdict.ours, verdict.why) == (ours, why) if verdict is not None else ours is None


def test_shared_names_of_an_older_install_are_ipmasqs_through_what_ipmasqs_own_objects_make_of_them() -> None:
    agent = _daemonset("ip-masq-agent", {"app.kubernetes.io/name": "ipmasq"}, "r/ipmasq:1", ["agent"])
    found = [
        agent,
        facts_of("ServiceAccount", {"metadata": {"name": "ip-masq-agent", "namespace": "kube-system"}}),
        facts_of("Lease", {"metadata": {"name": "ip-masq-agent", "namespace": "kube-system"}}),
        facts_of("RoleBinding", {"metadata": {"name": "ip-masq-agent", "namespace": "kube-system"},
                                 "roleRef": {"kind": "Role", "name": "ip-masq-agent"},
                                 "subjects": [{"kind": "ServiceAccount", "name": "ip-masq-agent",
                                               "namespace": "kube-system"}]}),
        facts_of("Role", {"metadata": {"name": "ip-masq-agent", "namespace": "kube-system"}}),
        facts_of("ValidatingAdmissionPolicy", {"metadata": {"name": "own-node"}, "spec": {
            "matchConstraints": {"resourceRules": [{"apiGroups": ["ipmasq.dev"]}]}}}),
        facts_of("ValidatingAdmissionPolicyBinding", {"metadata": {"name": "own-node"},
                                                      "spec": {"policyName": "own-node"}}),
        # a binding of someone else's account to the same Role: neither it nor the Role is only ipmasq's
        facts_of("ClusterRole", {"metadata": {"name": "ip-masq-agent"}}),
        facts_of("ClusterRoleBinding", {"metadata": {"name": "ip-masq-agent"},
                                        "roleRef": {"kind": "ClusterRole", "name": "ip-masq-agent"},
                                        "subjects": [{"kind": "ServiceAccount", "name": "prometheus",
                                                      "namespace": "monitoring"}]}),
    ]
    verdicts = {key[0]: v for key, v in decide(found).items()}
    assert verdicts["ServiceAccount"].why == "the service account of ipmasq's daemonset/kube-system/ip-masq-agent"
    assert verdicts["Lease"].why == "the summary Lease of ipmasq's daemonset/kube-system/ip-masq-agent"
    assert verdicts["RoleBinding"].why == "binds only ipmasq's serviceaccount/kube-system/ip-masq-agent"
    assert verdicts["Role"].why == "bound only by ipmasq's rolebinding/kube-system/ip-masq-agent"
    assert verdicts["ValidatingAdmissionPolicyBinding"].why == "binds ipmasq's validatingadmissionpolicy/own-node"
    for kind in ("ClusterRole", "ClusterRoleBinding"):
        assert not verdicts[kind].ours
        assert verdicts[kind].why.startswith("not ipmasq's alone (no app.kubernetes.io/part-of=ipmasq label")


def test_a_service_account_a_providers_workload_uses_is_never_ipmasqs() -> None:
    google = _daemonset("ip-masq-agent", GKE, "gke.gcr.io/ip-masq-agent:v2", [])
    account = facts_of("ServiceAccount", {"metadata": {"name": "ip-masq-agent", "namespace": "kube-system"}})
    assert not decide([google, account])[account.key].ours


def test_whatever_the_json_holds_the_facts_are_read_without_an_error() -> None:
    for hostile in ({}, {"metadata": "x"}, {"metadata": {"labels": {"a": 1}, "name": 3}, "spec": []},
                    {"spec": {"template": {"spec": {"containers": [None, {"args": "agent"}, {"args": [1, "agent"]}]}}}},
                    {"subjects": "x", "roleRef": [], "rules": [{"apiGroups": None}]}):
        for kind in ("DaemonSet", "RoleBinding", "ClusterRole", "ValidatingAdmissionPolicy", "Lease"):
            facts = facts_of(kind, hostile)
            judge(facts)
            decide([facts])


def test_what_is_said_of_an_object_is_one_escaped_line() -> None:
    facts = facts_of("ClusterRole", {"metadata": {"name": "a\x1b[2J\nb", "labels": {
        "app.kubernetes.io/managed-by": "Helm\x1b[31m\n" + "x" * 500}}})
    verdict = judge(facts)
    assert verdict is not None and verdict.why.isprintable() and len(verdict.why) < 200
    assert facts.label.isprintable()
