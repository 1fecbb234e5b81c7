"""The Kubernetes objects ipmasq reads, as typed values: one TypedDict per shape and one function that checks an API
answer against it before anything uses it.

What the API server sends is JSON; a hostile or broken server (or a proxy before it) can send any JSON. Each
function here takes the decoded value and where it came from ("GET /api/v1/nodes: items[3]"), checks every field
the shape names (its type; a field that must be there is there; null is absent), and returns the same value, now
typed; a field of the wrong type is ApiMalformed, one line naming the call and the field. Fields the shape does not
name are kept as they are and not looked at (what a later version of ipmasq writes, what Kubernetes adds).

Shapes: ObjectMeta and ListMeta, ConfigMap, Status, Lease, Node, Pod (what `ipmasq status` reads of the agents'
pods), AgentStatusObject (the IPMasqAgentStatus object the CRD in deploy/base defines), Event, and KubeObject: an
object of any kind by its metadata alone, with what says whose it is (labels, annotations, ownerReferences), which
`kubectl ipmasq uninstall` lists (ipmasq.ownership reads the rest of it, each field's type checked there).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NotRequired, TypedDict, cast

from ipmasq.errors import ApiMalformed, clip, one_line

__all__ = ["AgentStatusObject", "Check", "ConfigMap", "ConfigMapSeen", "Event", "EventSource", "KubeObject",
           "KubeObjectMeta", "Lease", "LeaseSpec", "ListMeta", "Node", "NodeObjectStatus", "ObjectMeta",
           "ObjectReference", "OwnerReference", "Pod", "PodSpec", "PodStatus", "Status", "StatusCondition",
           "agent_status", "configmap", "event", "kube_object", "lease", "list_meta", "node", "object_meta", "pod",
           "status"]

Check = Callable[[Any, str], Any]  # (value, where) -> the value, checked; ApiMalformed when it is not


class ObjectMeta(TypedDict):
    name: str
    namespace: NotRequired[str]
    uid: NotRequired[str]
    resourceVersion: NotRequired[str]
    labels: NotRequired[dict[str, str]]


# the functional form: "continue" is a Python keyword
ListMeta = TypedDict("ListMeta", {"resourceVersion": str, "continue": str}, total=False)


class ConfigMap(TypedDict):
    metadata: ObjectMeta
    data: NotRequired[dict[str, str]]
    binaryData: NotRequired[dict[str, str]]


class Status(TypedDict, total=False):
    kind: str
    code: int
    reason: str
    message: str


class LeaseSpec(TypedDict, total=False):
    holderIdentity: str
    leaseDurationSeconds: int
    acquireTime: str
    renewTime: str
    leaseTransitions: int


class Lease(TypedDict):
    metadata: ObjectMeta
    spec: NotRequired[LeaseSpec]


class StatusCondition(TypedDict):
    """One of an object's status.conditions (a Pod's Ready, a Node's Ready)."""

    type: str
    status: str


class NodeObjectStatus(TypedDict, total=False):
    """A Node's status as the API server holds it (ipmasq.kube.agentstatus.NodeStatus is the agent's report)."""

    conditions: list[StatusCondition]


class Node(TypedDict):
    metadata: ObjectMeta
    status: NotRequired[NodeObjectStatus]


class PodSpec(TypedDict, total=False):
    nodeName: str


class PodStatus(TypedDict, total=False):
    conditions: list[StatusCondition]


class Pod(TypedDict):
    metadata: ObjectMeta
    spec: NotRequired[PodSpec]
    status: NotRequired[PodStatus]


class ConfigMapSeen(TypedDict):
    name: str
    resourceVersion: str


class AgentStatusObject(TypedDict):
    """An IPMasqAgentStatus as the CRD defines it (nullable fields may be absent)."""

    metadata: ObjectMeta
    nodeName: NotRequired[str]
    agentPod: NotRequired[str]
    version: NotRequired[str]
    backend: NotRequired[str]
    ready: NotRequired[bool]
    reason: NotRequired[str]
    policyHash: NotRequired[str]
    hash: NotRequired[str]
    configDigest: NotRequired[str]
    configSource: NotRequired[str]
    configMaps: NotRequired[list[ConfigMapSeen]]
    lastRejection: NotRequired[str]
    lastRejectionTime: NotRequired[str]
    rejectedDigest: NotRequired[str]
    driftRepairs: NotRequired[int]
    foreignMasqueradeRules: NotRequired[int]
    updateTime: NotRequired[str]
    mode: NotRequired[str]  # enforce, or observe (another program writes the rules)
    writer: NotRequired[str]
    chain: NotRequired[str]
    mismatch: NotRequired[str]
    ignoredByWriter: NotRequired[str]


class ObjectReference(TypedDict, total=False):
    kind: str
    name: str
    namespace: str
    uid: str
    apiVersion: str


class EventSource(TypedDict, total=False):
    component: str
    host: str


class Event(TypedDict):
    metadata: ObjectMeta
    involvedObject: ObjectReference
    type: NotRequired[str]
    reason: NotRequired[str]
    message: NotRequired[str]
    count: NotRequired[int]
    firstTimestamp: NotRequired[str]
    lastTimestamp: NotRequired[str]
    source: NotRequired[EventSource]
    reportingComponent: NotRequired[str]
    reportingInstance: NotRequired[str]


class OwnerReference(TypedDict, total=False):
    apiVersion: str
    kind: str
    name: str
    uid: str
    controller: bool


class KubeObjectMeta(TypedDict):
    name: str
    namespace: NotRequired[str]
    uid: NotRequired[str]
    resourceVersion: NotRequired[str]
    labels: NotRequired[dict[str, str]]
    annotations: NotRequired[dict[str, str]]
    ownerReferences: NotRequired[list[OwnerReference]]


class KubeObject(TypedDict):
    """An object of any kind: its metadata checked, the rest (spec, rules, subjects...) left to its reader."""

    metadata: KubeObjectMeta


# ---- the checks ------------------------------------------------------------------------------------------------


def _wrong(where: str, expected: str, value: object) -> ApiMalformed:
    shown = clip(one_line(repr(value)), 40)
    return ApiMalformed(one_line(f"{where} is not {expected} ({shown}): not an answer the API server sends"))


def _text(value: object, where: str) -> str:
    if not isinstance(value, str):
        raise _wrong(where, "a string", value)
    return value


def _integer(value: object, where: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise _wrong(where, "an integer", value)
    return value


def _boolean(value: object, where: str) -> bool:
    if not isinstance(value, bool):
        raise _wrong(where, "true or false", value)
    return value


def _strings(value: object, where: str) -> dict[str, str]:
    """A map of strings to strings (labels, a ConfigMap's data)."""
    if not isinstance(value, dict):
        raise _wrong(where, "an object", value)
    for key, item in value.items():
        if not isinstance(item, str):
            raise _wrong(f"{where}.{clip(one_line(key), 60)}", "a string", item)
    return value


def _list(item: Check) -> Check:
    def check(value: object, where: str) -> list[Any]:
        if not isinstance(value, list):
            raise _wrong(where, "a list", value)
        for index, member in enumerate(value):
            item(member, f"{where}[{index}]")
        return value
    return check


def _shape(fields: Mapping[str, Check], required: tuple[str, ...] = ()) -> Check:
    """An object whose named fields pass their checks (null: absent), the `required` ones present."""
    def check(value: object, where: str) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise _wrong(where, "an object", value)
        for key, field in fields.items():
            member = value.get(key)
            if member is None:
                if key in required:
                    raise ApiMalformed(f"{where}.{key} is missing: not an answer the API server sends")
                continue
            field(member, f"{where}.{key}")
        return value
    return check


_OBJECT_META = _shape({"name": _text, "namespace": _text, "uid": _text, "resourceVersion": _text,
                       "labels": _strings}, required=("name",))
_LIST_META = _shape({"resourceVersion": _text, "continue": _text})
_CONFIGMAP = _shape({"metadata": _OBJECT_META, "data": _strings, "binaryData": _strings}, required=("metadata",))
_STATUS = _shape({"kind": _text, "code": _integer, "reason": _text, "message": _text})
_LEASE = _shape({"metadata": _OBJECT_META,
                 "spec": _shape({"holderIdentity": _text, "leaseDurationSeconds": _integer, "acquireTime": _text,
                                 "renewTime": _text, "leaseTransitions": _integer})}, required=("metadata",))
_CONDITIONS = _list(_shape({"type": _text, "status": _text}, required=("type", "status")))
_NODE = _shape({"metadata": _OBJECT_META, "status": _shape({"conditions": _CONDITIONS})}, required=("metadata",))
_POD = _shape({"metadata": _OBJECT_META, "spec": _shape({"nodeName": _text}),
               "status": _shape({"conditions": _CONDITIONS})}, required=("metadata",))
_AGENT_STATUS = _shape({
    "metadata": _OBJECT_META, "nodeName": _text, "agentPod": _text, "version": _text, "backend": _text,
    "ready": _boolean, "reason": _text, "policyHash": _text, "hash": _text, "configDigest": _text,
    "configSource": _text,
    "configMaps": _list(_shape({"name": _text, "resourceVersion": _text}, required=("name", "resourceVersion"))),
    "lastRejection": _text, "lastRejectionTime": _text, "rejectedDigest": _text, "driftRepairs": _integer,
    "foreignMasqueradeRules": _integer, "updateTime": _text, "mode": _text, "writer": _text, "chain": _text,
    "mismatch": _text, "ignoredByWriter": _text}, required=("metadata",))
_KUBE_OBJECT = _shape({"metadata": _shape({
    "name": _text, "namespace": _text, "uid": _text, "resourceVersion": _text, "labels": _strings,
    "annotations": _strings,
    "ownerReferences": _list(_shape({"apiVersion": _text, "kind": _text, "name": _text, "uid": _text,
                                     "controller": _boolean}))}, required=("name",))}, required=("metadata",))
_REFERENCE = _shape({"kind": _text, "name": _text, "namespace": _text, "uid": _text, "apiVersion": _text})
_EVENT = _shape({"metadata": _OBJECT_META, "involvedObject": _REFERENCE, "type": _text, "reason": _text,
                 "message": _text, "count": _integer, "firstTimestamp": _text, "lastTimestamp": _text,
                 "source": _shape({"component": _text, "host": _text}), "reportingComponent": _text,
                 "reportingInstance": _text}, required=("metadata", "involvedObject"))


def object_meta(value: object, where: str) -> ObjectMeta:
    return cast(ObjectMeta, _OBJECT_META(value, where))


def list_meta(value: object, where: str) -> ListMeta:
    return cast(ListMeta, _LIST_META(value, where))


def configmap(value: object, where: str) -> ConfigMap:
    return cast(ConfigMap, _CONFIGMAP(value, where))


def status(value: object, where: str) -> Status:
    return cast(Status, _STATUS(value, where))


def lease(value: object, where: str) -> Lease:
    return cast(Lease, _LEASE(value, where))


def node(value: object, where: str) -> Node:
    return cast(Node, _NODE(value, where))


def pod(value: object, where: str) -> Pod:
    return cast(Pod, _POD(value, where))


def agent_status(value: object, where: str) -> AgentStatusObject:
    return cast(AgentStatusObject, _AGENT_STATUS(value, where))


def event(value: object, where: str) -> Event:
    return cast(Event, _EVENT(value, where))


def kube_object(value: object, where: str) -> KubeObject:
    return cast(KubeObject, _KUBE_OBJECT(value, where))
