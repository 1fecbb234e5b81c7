"""The node-trust admission policy (deploy/base/admission-policy.yaml): each node's agent writes only for its own
node, only Events it wrote, a Lease it may hold, and small objects.

Its CEL is evaluated here by cel-python as the API server evaluates it (matchConditions, then variables, then each
validation in order, on `object` and, for an update, `oldObject`: the stored object a merge patch changes); the
agents' own writers (ipmasq.kube.events, ipmasq.kube.lease, the summary) run against a fake API server that judges
every write by the same oracle. The real API server's verdict on real pod-bound tokens is the Kubernetes lab's test
(tests/kernel/lab/kubernetes/test_admission_policy.py).
"""

from __future__ import annotations

import copy
import logging
import threading
from collections.abc import Mapping
from typing import Any

import celpy
import pytest

from ipmasq.agent.api.summary import LEASE_SECONDS
from ipmasq.agent.api.wiring import COMPONENT
from ipmasq.errors import Forbidden
from ipmasq.kube import paths
from ipmasq.kube.events import MESSAGE_CHARS, EventRecorder, ObjectRef, Occurrence, event_object
from ipmasq.kube.lease import NODES_ANNOTATION, LeaseElector
from ipmasq.testing.kube import FakeKubeClient
from tests.unit.test_deploy import DEPLOY, kustomize

AGENT_USER = "system:serviceaccount:kube-system:ip-masq-agent"
NODE_CLAIM = "authentication.kubernetes.io/node-name"


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386, as the API server applies a merge patch."""
    if not isinstance(patch, Mapping):
        return copy.deepcopy(patch)
    result = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


class Policy:
    """The shipped ValidatingAdmissionPolicy, compiled once; `judge` is the API server's verdict on one request."""

    def __init__(self, policy: dict[str, Any]) -> None:
        self.spec = policy["spec"]
        self.environment = celpy.Environment()
        self.programs: dict[str, celpy.Runner] = {}

    def _run(self, expression: str, activation: dict[str, Any]) -> Any:
        if expression not in self.programs:
            self.programs[expression] = self.environment.program(self.environment.compile(expression))
        return self.programs[expression].evaluate(activation)

    def judge(self, resource: str, obj: dict[str, Any], *, old: dict[str, Any] | None = None, user: str = AGENT_USER,
              node: str | None = "node-a") -> str | None:
        """None when the policy admits the request, else the message of the first validation that refused it."""
        extra = {NODE_CLAIM: [node]} if node is not None else {}
        request = {"operation": "CREATE" if old is None else "UPDATE", "resource": {"resource": resource},
                   "namespace": (obj.get("metadata") or {}).get("namespace", ""),
                   "userInfo": {"username": user, "extra": extra}}
        activation: dict[str, Any] = {"request": celpy.json_to_cel(request), "object": celpy.json_to_cel(obj),
                                      "oldObject": celpy.json_to_cel(old)}
        if not all(self._run(condition["expression"], activation) for condition in self.spec["matchConditions"]):
            return None
        variables = celpy.celtypes.MapType()
        activation["variables"] = variables
        for variable in self.spec["variables"]:  # each may use those before it
            value = self._run(variable["expression"], activation)
            assert not isinstance(value, celpy.CELEvalError), (variable["name"], value)
            variables[celpy.celtypes.StringType(variable["name"])] = value
        for validation in self.spec["validations"]:
            verdict = self._run(validation["expression"], activation)
            assert isinstance(verdict, celpy.celtypes.BoolType), verdict  # an error would be a denial (Fail)
            if not verdict:
                if "messageExpression" in validation:
                    return str(self._run(validation["messageExpression"], activation))
                return str(validation["message"])
        return None

    def patched(self, resource: str, old: dict[str, Any], patch: dict[str, Any], **kwargs: Any) -> str | None:
        return self.judge(resource, merge_patch(old, patch), old=old, **kwargs)


@pytest.fixture(scope="module")
def policy() -> Policy:
    docs = kustomize(DEPLOY)
    (shipped,) = [d for d in docs if d["kind"] == "ValidatingAdmissionPolicy"]
    (binding,) = [d for d in docs if d["kind"] == "ValidatingAdmissionPolicyBinding"]
    assert binding["spec"] == {"policyName": shipped["metadata"]["name"], "validationActions": ["Deny"]}
    return Policy(shipped)


def status_object(name: str, node_name: str | None = None) -> dict[str, Any]:
    return {"apiVersion": "ipmasq.dev/v1alpha1", "kind": "IPMasqAgentStatus", "metadata": {"name": name},
            **({"nodeName": node_name} if node_name else {})}


def agent_event(kind: str, name: str, *, host: str = "node-a", namespace: str = "default",
                message: str = "config rejected") -> dict[str, Any]:
    """An Event exactly as the agent on `host` writes it (ipmasq.kube.events)."""
    target = ObjectRef(kind, name, namespace if kind == "ConfigMap" else "", uid="uid-1")
    return event_object(Occurrence(target, "Warning", "ConfigRejected", message), f"{name}.0123456789abcdef",
                        namespace, component=COMPONENT, host=host)


def kubelet_event() -> dict[str, Any]:
    """What the kubelet writes about a pod it runs: the same node in source.host and reportingInstance."""
    return {"apiVersion": "v1", "kind": "Event", "metadata": {"name": "coredns-1.17f3", "namespace": "kube-system"},
            "involvedObject": {"kind": "Pod", "name": "coredns-1", "namespace": "kube-system", "uid": "u-7"},
            "reason": "Started", "message": "Started container coredns", "type": "Normal",
            "source": {"component": "kubelet", "host": "node-a"}, "reportingComponent": "kubelet",
            "reportingInstance": "node-a", "count": 1}


def lease(holder: str | None, seconds: int | None = 120, **metadata: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {"renewTime": "2026-11-26T18:00:00.000000Z"}
    if holder is not None:
        spec["holderIdentity"] = holder
    if seconds is not None:
        spec["leaseDurationSeconds"] = seconds
    return {"metadata": {"name": "ip-masq-agent", "namespace": "kube-system", **metadata}, "spec": spec}


def refused(message: str | None, *words: str) -> bool:
    return message is not None and all(word in message for word in words)


# --- status objects ------------------------------------------------------------------------------------------------


def test_an_agent_writes_only_its_own_nodes_status(policy: Policy) -> None:
    assert policy.judge("ipmasqagentstatuses", status_object("node-a", "node-a")) is None
    assert policy.judge("ipmasqagentstatuses", status_object("node-a")) is None
    for obj in (status_object("node-b", "node-b"), status_object("zzz-forged", "node-b"),
                status_object("node-a", "node-b")):
        assert refused(policy.judge("ipmasqagentstatuses", obj), "on node node-a may write only the IPMasqAgentStatus")
    # an update is judged on the object it makes: a patch naming another node in nodeName is refused
    mine = status_object("node-a", "node-a")
    assert refused(policy.patched("ipmasqagentstatuses", mine, {"nodeName": "node-b"}), "IPMasqAgentStatus")


def test_an_agents_token_without_its_node_writes_nothing_and_others_are_not_looked_at(policy: Policy) -> None:
    assert refused(policy.judge("ipmasqagentstatuses", status_object("node-a"), node=None), NODE_CLAIM)
    in_another_namespace = "system:serviceaccount:ipmasq:ip-masq-agent"
    assert policy.judge("events", agent_event("Node", "node-b"), user=in_another_namespace) is not None
    for user in ("kubernetes-admin", "system:serviceaccount:kube-system:ip-masq-agent-webhook", "system:node:node-b",
                 "system:serviceaccount:kube-system:ip-masq-agent-x"):
        assert policy.judge("ipmasqagentstatuses", status_object("node-b"), user=user) is None
        assert policy.patched("events", kubelet_event(), {"message": "all good"}, user=user) is None


def test_an_observers_token_is_held_to_the_same_policy(policy: Policy) -> None:
    observer = "system:serviceaccount:kube-system:ipmasq-observer"
    assert policy.judge("ipmasqagentstatuses", status_object("node-a"), user=observer) is None
    assert refused(policy.judge("ipmasqagentstatuses", status_object("node-b"), user=observer), "on node node-a")
    assert refused(policy.patched("events", agent_event("Node", "node-b", host="node-b"), {"message": "ok"},
                                  user=observer), "changes only its own")


# --- Events --------------------------------------------------------------------------------------------------------


def test_an_agent_creates_events_about_its_own_node_and_a_configmap_as_itself(policy: Policy) -> None:
    assert policy.judge("events", agent_event("Node", "node-a")) is None
    assert policy.judge("events", agent_event("ConfigMap", "ip-masq-agent", namespace="kube-system")) is None
    about = "may write Events only about its own Node or a ConfigMap"
    assert refused(policy.judge("events", agent_event("Node", "node-b")), about)
    pod = agent_event("Pod", "coredns-1", namespace="kube-system")
    assert refused(policy.judge("events", pod), about)
    elsewhere = agent_event("ConfigMap", "ip-masq-agent", namespace="kube-system")
    elsewhere["metadata"]["namespace"] = "default"  # a ConfigMap's Events live in its namespace
    assert refused(policy.judge("events", elsewhere), about)
    # written as another node or another component: refused
    as_itself = "writes Events only as itself"
    for field, value in (("reportingInstance", "node-b"), ("reportingComponent", "kubelet"),
                         ("source", {"component": COMPONENT, "host": "node-b"})):
        forged = {**agent_event("Node", "node-a"), field: value}
        assert refused(policy.judge("events", forged), as_itself), field
    unsigned = agent_event("Node", "node-a")
    del unsigned["reportingInstance"]
    assert refused(policy.judge("events", unsigned), as_itself)


def test_an_agent_patches_its_own_events_as_the_event_writer_does(policy: Policy) -> None:
    for old in (agent_event("Node", "node-a"), agent_event("ConfigMap", "ip-masq-agent", namespace="kube-system")):
        for patch in ({"lastTimestamp": "2026-11-26T18:05:00Z"},
                      {"count": 7, "lastTimestamp": "2026-11-26T18:05:00Z"},
                      {"message": "enforced on 2 of 2 nodes", "lastTimestamp": "2026-11-26T18:05:00Z"}):
            assert policy.patched("events", old, patch) is None, (old["involvedObject"], patch)


def test_no_agent_rewrites_another_nodes_event_or_the_kubelets_into_a_summary(policy: Policy) -> None:
    """The attack: a merge patch turning someone else's Event into one about the ConfigMap saying "all good"."""
    into_summary = {"involvedObject": {"kind": "ConfigMap", "name": "ip-masq-agent", "namespace": "kube-system",
                                       "apiVersion": "v1"},
                    "type": "Normal", "reason": "ConfigApplied", "message": "all good",
                    "reportingComponent": COMPONENT, "reportingInstance": "node-a",
                    "source": {"component": COMPONENT, "host": "node-a"}}
    theirs = agent_event("Node", "node-b", host="node-b")
    assert refused(policy.patched("events", theirs, into_summary), "changes only its own, never what they are about")
    assert refused(policy.patched("events", theirs, {"message": "all good"}), "changes only its own")
    kubelets = kubelet_event()
    assert refused(policy.patched("events", kubelets, into_summary), "changes only its own")
    assert refused(policy.patched("events", kubelets, {"message": "all good"}), "writes Events only as itself")


def test_an_update_never_changes_what_an_agents_own_event_is_about(policy: Policy) -> None:
    mine = agent_event("ConfigMap", "ip-masq-agent", namespace="kube-system")
    for changed in ({"name": "coredns"}, {"uid": "another-uid"}, {"kind": "Node", "name": "node-a",
                                                                   "namespace": None}):
        assert refused(policy.patched("events", mine, {"involvedObject": changed}), "never what they are about"), \
            changed
    own_node = agent_event("Node", "node-a")
    assert refused(policy.patched("events", own_node, {"involvedObject": {"kind": "ConfigMap", "name": "x",
                                                                          "namespace": "default"}}),
                   "never what they are about")


def test_events_are_small_and_the_writer_clips_to_what_the_policy_allows(policy: Policy) -> None:
    small = "ip-masq-agent writes Events of at most 1024 characters"
    assert MESSAGE_CHARS == 1024
    assert policy.judge("events", {**agent_event("Node", "node-a"), "message": "x" * MESSAGE_CHARS}) is None
    assert refused(policy.judge("events", {**agent_event("Node", "node-a"), "message": "x" * (MESSAGE_CHARS + 1)}),
                   small)
    assert refused(policy.patched("events", agent_event("Node", "node-a"), {"message": "x" * 2**20}), small)
    # what the writer makes of a 1 MiB message (of wide and unprintable characters too) passes
    for message in ("x" * 2**20, "\u00e9\x1b" * 2**19):
        written = agent_event("Node", "node-a", message=message)
        assert len(written["message"]) <= MESSAGE_CHARS and policy.judge("events", written) is None
    # the labels the writer puts on what ipmasq creates (ipmasq.ownership): a few, each bounded by the API server
    assert agent_event("Node", "node-a")["metadata"]["labels"] and policy.judge("events", agent_event("Node",
                                                                                                      "node-a")) is None
    for extra in ({"reason": "R" * 129}, {"action": "a" * 129},
                  {"metadata": {"name": "node-a.1", "namespace": "default", "annotations": {"a": "b"}}},
                  {"metadata": {"name": "node-a.1", "namespace": "default",
                                "labels": {f"l{i}": "x" for i in range(9)}}},
                  {"metadata": {"name": "node-a.1", "namespace": "default", "finalizers": ["x.io/y"]}},
                  {"related": {"kind": "Pod", "name": "p"}},
                  {"series": {"count": 2, "lastObservedTime": "2026-11-26T18:05:00.000000Z"}},
                  {"involvedObject": {"kind": "Node", "name": "node-a", "fieldPath": "f" * 129}},
                  {"involvedObject": {"kind": "Node", "name": "node-a", "uid": "u" * 65}}):
        assert refused(policy.judge("events", {**agent_event("Node", "node-a"), **extra}), small), extra
    assert refused(policy.patched("events", agent_event("Node", "node-a"),
                                  {"metadata": {"annotations": {"junk": "x" * 200_000}}}), small)


# --- the Lease -----------------------------------------------------------------------------------------------------


def test_the_lease_is_held_only_by_its_writer_released_only_by_its_holder(policy: Policy) -> None:
    itself = "may hold the Lease only for itself, and release only its own hold"
    # taken: nobody held it, or another held it (expired or not: CEL has no clock, the displaced holder says so)
    assert policy.patched("leases", lease(None, None), {"spec": lease("node-a")["spec"]}) is None
    assert policy.patched("leases", lease("node-b"), {"spec": {"holderIdentity": "node-a", "leaseDurationSeconds": 120,
                                                               "acquireTime": "2026-11-26T18:01:00.000000Z"}}) is None
    # renewed, released by its holder
    assert policy.patched("leases", lease("node-a"), {"spec": {"renewTime": "2026-11-26T18:01:00.000000Z"}}) is None
    assert policy.patched("leases", lease("node-a"), {"spec": {"holderIdentity": None}}) is None
    assert policy.patched("leases", lease(""), {"spec": {"holderIdentity": ""}}) is None
    # another named as holder, another's hold released or touched
    assert refused(policy.patched("leases", lease(None), {"spec": {"holderIdentity": "node-b"}}), itself)
    assert refused(policy.patched("leases", lease("node-a"), {"spec": {"holderIdentity": "node-b"}}), itself)
    assert refused(policy.patched("leases", lease("node-b"), {"spec": {"holderIdentity": None}}), itself)
    assert refused(policy.patched("leases", lease("node-b"), {"spec": {"holderIdentity": ""}}), itself)
    assert refused(policy.patched("leases", lease("node-b"), {"spec": {"leaseDurationSeconds": 1}}), itself)
    assert refused(policy.judge("leases", lease("node-b")), itself)


def test_a_holder_says_how_long_for_at_most_what_the_agents_write(policy: Policy) -> None:
    duration = "may hold the Lease for 1 to 120 seconds, and says how long"
    assert policy.judge("leases", lease("node-a", LEASE_SECONDS)) is None
    for seconds in (LEASE_SECONDS + 1, 2147483647, 0, -5):
        assert refused(policy.judge("leases", lease("node-a", seconds)), duration), seconds
    assert refused(policy.patched("leases", lease("node-a"), {"spec": {"leaseDurationSeconds": None}}), duration)
    assert refused(policy.patched("leases", lease("node-b"), {"spec": {"holderIdentity": "node-a",
                                                                      "leaseDurationSeconds": None}}), duration)
    # released, the duration may stay or go: nobody holds it
    assert policy.patched("leases", lease("node-a"), {"spec": {"holderIdentity": None,
                                                               "leaseDurationSeconds": None}}) is None


def test_the_lease_keeps_its_labels_and_annotations_but_the_fleets_size(policy: Policy) -> None:
    others = "no annotation but ipmasq.dev/nodes"
    applied = {"kubectl.kubernetes.io/last-applied-configuration": '{"kind":"Lease"}'}
    stored = lease("node-a", annotations=applied, labels={"k8s-app": "ip-masq-agent"})
    for size in ("1", "1000", "9999999"):
        assert policy.patched("leases", stored, {"metadata": {"annotations": {NODES_ANNOTATION: size}}}) is None
    assert policy.patched("leases", stored, {"metadata": {"annotations": {NODES_ANNOTATION: None}}}) is None
    created = lease("node-a", labels={f"app.kubernetes.io/l{i}": "ipmasq" for i in range(4)})
    assert policy.judge("leases", created) is None  # a create (RBAC grants none): labelled as ipmasq labels it
    too_many = lease("node-a", labels={f"l{i}": "x" for i in range(9)})
    assert refused(policy.judge("leases", too_many), others)
    for patch in ({"annotations": {NODES_ANNOTATION: "12345678"}}, {"annotations": {"junk": "x" * 100_000}},
                  {"annotations": {"kubectl.kubernetes.io/last-applied-configuration": "x" * 100_000}},
                  {"labels": {"k8s-app": "forged"}}, {"labels": {"extra": "x"}}, {"labels": None}):
        assert refused(policy.patched("leases", stored, {"metadata": patch}), others), patch


# --- the agents' own writers, judged by the policy -----------------------------------------------------------------


class AdmittingFake(FakeKubeClient):
    """The fake API server, every create and patch judged by the policy as sent with `node`'s pod-bound token; the
    nodes' clients share one store (`shared`)."""

    def __init__(self, policy: Policy, node: str, shared: FakeKubeClient | None = None) -> None:
        super().__init__()
        self.policy, self.node = policy, node
        if shared is not None:
            self.objects = shared.objects

    @staticmethod
    def _resource(path: str) -> str:
        parts = path.strip("/").split("/")
        return parts[parts.index("namespaces") + 2] if "namespaces" in parts else parts[3]

    def _judge(self, verb: str, path: str, obj: dict[str, Any], old: dict[str, Any] | None) -> None:
        message = self.policy.judge(self._resource(path), obj, old=old, node=self.node)
        if message is not None:
            raise Forbidden(403, f'admission policy "ip-masq-agent-own-node" denied: {message}', verb=verb, path=path)

    def create(self, path: str, body: Mapping[str, Any]) -> dict[str, Any]:
        self._judge("POST", path, dict(body), None)
        return super().create(path, body)

    def patch(self, path: str, body: Mapping[str, Any]) -> dict[str, Any]:
        stored = self.objects.get(path)
        expected = (body.get("metadata") or {}).get("resourceVersion")
        # the API server's order: the patch applied, its resourceVersion precondition (409), then validation
        if stored is not None and expected in (None, stored["metadata"].get("resourceVersion")):
            self._judge("PATCH", path, merge_patch(stored, body), stored)
        return super().patch(path, body)


def test_the_event_writer_keeps_working_under_the_policy(policy: Policy) -> None:
    store = FakeKubeClient()
    node_a, node_b = AdmittingFake(policy, "node-a", store), AdmittingFake(policy, "node-b", store)
    clock = [0.0]
    writer_a = EventRecorder(node_a, component=COMPONENT, host="node-a", clock=lambda: clock[0])
    writer_b = EventRecorder(node_b, component=COMPONENT, host="node-b", clock=lambda: clock[0])
    about_a = Occurrence(ObjectRef("Node", "node-a", uid="n-a"), "Warning", "ConfigRejected", "bad\x1b[2J" * 10_000)
    writer_a.record(about_a)
    writer_a.record(about_a)
    clock[0] += 3600
    writer_a.flush()  # the repeat's count, patched
    EventRecorder(node_a, component=COMPONENT, host="node-a").record(about_a)  # a restarted agent: lastTimestamp
    configmap = ObjectRef("ConfigMap", "ip-masq-agent", "kube-system", "cm-1")
    # the fleet's summary, by one holder then another (after the Lease changed hands): each writes and patches its own
    for writer in (writer_a, writer_b, writer_a):
        for message in ("enforced on 1 of 2 nodes", "enforced on 2 of 2 nodes"):
            writer.state(Occurrence(configmap, "Normal", "ConfigApplied", message), "cm-1\0digest\0ConfigApplied")
    events = [obj for path, obj in store.objects.items() if "/events/" in path]
    assert len(events) == 3  # one about node-a, one summary per holder
    assert {e["reportingInstance"] for e in events if e["involvedObject"]["kind"] == "ConfigMap"} == {"node-a",
                                                                                                        "node-b"}
    node_event = next(e for e in events if e["involvedObject"]["kind"] == "Node")
    assert node_event["count"] == 2
    # and node-b cannot touch node-a's, which the policy shows by refusing its write of the same Event
    name = next(path for path, e in store.objects.items() if "/events/" in path and e is node_event)
    with pytest.raises(Forbidden):
        node_b.patch(name, {"message": "all good"})


def test_the_lease_elector_keeps_working_under_the_policy(policy: Policy) -> None:
    store = FakeKubeClient()
    store.put(paths.leases("kube-system", "ip-masq-agent"),
              {"metadata": {"namespace": "kube-system", "labels": {"k8s-app": "ip-masq-agent"},
                            "annotations": {"kubectl.kubernetes.io/last-applied-configuration": "{}"}},
               "spec": {}})
    clock = [0.0]
    electors = {node: LeaseElector(AdmittingFake(policy, node, store), "kube-system", "ip-masq-agent", node,
                                   duration=LEASE_SECONDS, clock=lambda: clock[0]) for node in ("node-a", "node-b")}
    a, b = electors["node-a"], electors["node-b"]
    assert a.try_lead() and not b.try_lead()
    a.publish = 1000
    clock[0] += 40
    assert a.try_lead()  # renewed, the fleet's size said
    clock[0] += LEASE_SECONDS
    assert not b.try_lead()  # the record moved: a renewed
    clock[0] += LEASE_SECONDS  # a stopped renewing: b takes over after the duration
    assert b.try_lead() and not a.try_lead()
    b.release()
    assert a.try_lead()
    stored = store.objects[paths.leases("kube-system", "ip-masq-agent")]
    assert stored["metadata"]["annotations"][NODES_ANNOTATION] == "1000"


def test_the_summary_writer_keeps_working_under_the_policy(policy: Policy) -> None:
    from ipmasq.agent.api.summary import SummaryWriter

    store = FakeKubeClient()
    store.put(paths.leases("kube-system", "ip-masq-agent"), {"metadata": {"namespace": "kube-system"}, "spec": {}})
    client = AdmittingFake(policy, "node-a", store)
    elector = LeaseElector(client, "kube-system", "ip-masq-agent", "node-a", duration=LEASE_SECONDS)
    events = EventRecorder(client, component=COMPONENT, host="node-a")
    writer = SummaryWriter(client, elector, events, log=logging.getLogger("test"), stop=threading.Event())
    writer._next_lease = 0.0
    writer.step()
    assert elector.leading
