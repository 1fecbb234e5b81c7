"""The Kubernetes objects ipmasq reads, as typed values: one TypedDict per shape and one function that checks an API
answer against it before anything uses it.

What the API server sends is JSON; a hostile or broken server (or a proxy before it) can send any JSON. Each
function here takes the decoded value and where it came from ("GET /api/v1/nodes: items[3]"), checks every field
the shape names (its type; a field that must be there is there; null is absent), and returns the same value, now
typed; a field of the wrong type is ApiMalformed, one line naming the call and the field. Fields the shape does not
name are kept as they are and not looked at (what a later version of ipmasq writes, what Kubernetes adds).

Shapes: ObjectMeta and ListMeta, ConfigMap, Status, Lease, Node, Pod (what `ipmasq status` reads of the agents'
pods), DaemonSet (its containers' environment), Secret, WebhookConfiguration (the webhook's caBundle),
AgentStatusObject (the IPMasqAgentStatus object the CRD in deploy/base defines), Event, KubeObject: an object of any
kind by its metadata alone, with what says whose it is (labels, annotations, ownerReferences), which `kubectl ipmasq
uninstall` lists (ipmasq.ownership reads the rest of it, each field's type checked there); VersionedObject (a watch
event's resourceVersion). The admission machinery's (an AdmissionReview, the node-trust policy) are in
ipmasq.kube.admission; the checks they are all made of in ipmasq.kube.shapes.
"""

from __future__ import annotations

from typing import NotRequired, TypedDict, cast

from ipmasq.kube.shapes import Check
from ipmasq.kube.shapes import boolean as _boolean
from ipmasq.kube.shapes import integer as _integer
from ipmasq.kube.shapes import list_of as _list
from ipmasq.kube.shapes import shape as _shape
from ipmasq.kube.shapes import strings as _strings
from ipmasq.kube.shapes import text as _text

__all__ = ["AgentStatusObject", "ByNameMeta", "Check", "ConfigMap", "ConfigMapSeen", "Container", "DaemonSet",
           "DaemonSetSpec", "EnvVar", "EnvVarSource", "Event", "EventSource", "KubeObject", "KubeObjectMeta", "Lease",
           "LeaseSpec", "ListMeta", "Node", "NodeObjectStatus", "ObjectMeta", "ObjectReference", "OwnerReference",
           "Pod", "PodSpec", "PodStatus", "PodTemplate", "Secret", "ServiceReference", "Status", "StatusCondition",
           "Versioned", "VersionedObject", "Webhook", "WebhookClientConfig", "WebhookConfiguration", "agent_status",
           "configmap", "daemonset", "event", "kube_object", "lease", "list_meta", "node", "object_meta", "pod",
           "secret", "status", "versioned", "webhook_configuration"]



class OwnerReference(TypedDict, total=False):
    apiVersion: str
    kind: str
    name: str
    uid: str
    controller: bool
    blockOwnerDeletion: bool


class ObjectMeta(TypedDict):
    name: str
    namespace: NotRequired[str]
    uid: NotRequired[str]
    resourceVersion: NotRequired[str]
    labels: NotRequired[dict[str, str]]
    annotations: NotRequired[dict[str, str]]
    ownerReferences: NotRequired[list[OwnerReference]]


class Versioned(TypedDict, total=False):
    """What every object of a watch carries, a BOOKMARK's too (which has no name): its resourceVersion."""

    resourceVersion: str


class VersionedObject(TypedDict, total=False):
    metadata: Versioned


# the functional form: "continue" is a Python keyword
ListMeta = TypedDict("ListMeta", {"resourceVersion": str, "continue": str}, total=False)


class ByNameMeta(TypedDict, total=False):
    """The metadata of an object read by its name (a GET of its path, a list by metadata.name): the name is the one
    asked for, and what is read is its uid and resourceVersion."""

    name: str
    namespace: str
    uid: str
    resourceVersion: str


class ConfigMap(TypedDict):
    metadata: ByNameMeta
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


class EnvVarSource(TypedDict, total=False):
    """Where an environment variable's value comes from (a ConfigMap, a Secret, a field): only its presence is read."""


class EnvVar(TypedDict):
    name: str
    value: NotRequired[str]
    valueFrom: NotRequired[EnvVarSource]


class Container(TypedDict):
    name: str
    env: NotRequired[list[EnvVar]]


class PodSpec(TypedDict, total=False):
    nodeName: str
    containers: list[Container]


class PodStatus(TypedDict, total=False):
    conditions: list[StatusCondition]


class Pod(TypedDict):
    metadata: ObjectMeta
    spec: NotRequired[PodSpec]
    status: NotRequired[PodStatus]


class PodTemplate(TypedDict, total=False):
    spec: PodSpec


class DaemonSetSpec(TypedDict, total=False):
    template: PodTemplate


class DaemonSet(TypedDict):
    """What ipmasq reads of a DaemonSet: its pods' containers and their environment (aws-node's SNAT settings)."""

    metadata: ByNameMeta
    spec: NotRequired[DaemonSetSpec]


class Secret(TypedDict):
    apiVersion: NotRequired[str]
    kind: NotRequired[str]
    metadata: ObjectMeta
    type: NotRequired[str]
    data: NotRequired[dict[str, str]]


class ServiceReference(TypedDict, total=False):
    name: str
    namespace: str


class WebhookClientConfig(TypedDict, total=False):
    service: ServiceReference
    caBundle: str


class Webhook(TypedDict, total=False):
    name: str
    clientConfig: WebhookClientConfig


class WebhookConfiguration(TypedDict):
    """A ValidatingWebhookConfiguration: the webhooks that call a Service, and the CAs each trusts."""

    metadata: ObjectMeta
    webhooks: NotRequired[list[Webhook]]


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
    apiVersion: NotRequired[str]
    kind: NotRequired[str]
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


KubeObjectMeta = ObjectMeta  # any kind's metadata: what says whose it is is in every ObjectMeta


class KubeObject(TypedDict):
    """An object of any kind: its metadata checked, the rest (spec, rules, subjects...) left to its reader."""

    metadata: KubeObjectMeta


# ---- the checks ------------------------------------------------------------------------------------------------


_OWNERS = _list(_shape({"apiVersion": _text, "kind": _text, "name": _text, "uid": _text, "controller": _boolean,
                        "blockOwnerDeletion": _boolean}))
_OBJECT_META = _shape({"name": _text, "namespace": _text, "uid": _text, "resourceVersion": _text,
                       "labels": _strings, "annotations": _strings, "ownerReferences": _OWNERS}, required=("name",))
_LIST_META = _shape({"resourceVersion": _text, "continue": _text})
_BY_NAME_META = _shape({"name": _text, "namespace": _text, "uid": _text, "resourceVersion": _text})
_CONFIGMAP = _shape({"metadata": _BY_NAME_META, "data": _strings, "binaryData": _strings}, required=("metadata",))
_STATUS = _shape({"kind": _text, "code": _integer, "reason": _text, "message": _text})
_LEASE = _shape({"metadata": _OBJECT_META,
                 "spec": _shape({"holderIdentity": _text, "leaseDurationSeconds": _integer, "acquireTime": _text,
                                 "renewTime": _text, "leaseTransitions": _integer})}, required=("metadata",))
_CONDITIONS = _list(_shape({"type": _text, "status": _text}, required=("type", "status")))
_NODE = _shape({"metadata": _OBJECT_META, "status": _shape({"conditions": _CONDITIONS})}, required=("metadata",))
_ENV = _list(_shape({"name": _text, "value": _text, "valueFrom": _shape({})}, required=("name",)))
_POD_SPEC = _shape({"nodeName": _text,
                    "containers": _list(_shape({"name": _text, "env": _ENV}, required=("name",)))})
_POD = _shape({"metadata": _OBJECT_META, "spec": _POD_SPEC,
               "status": _shape({"conditions": _CONDITIONS})}, required=("metadata",))
_AGENT_STATUS = _shape({
    "metadata": _OBJECT_META, "nodeName": _text, "agentPod": _text, "version": _text, "backend": _text,
    "ready": _boolean, "reason": _text, "policyHash": _text, "hash": _text, "configDigest": _text,
    "configSource": _text,
    "configMaps": _list(_shape({"name": _text, "resourceVersion": _text}, required=("name", "resourceVersion"))),
    "lastRejection": _text, "lastRejectionTime": _text, "rejectedDigest": _text, "driftRepairs": _integer,
    "foreignMasqueradeRules": _integer, "updateTime": _text, "mode": _text, "writer": _text, "chain": _text,
    "mismatch": _text, "ignoredByWriter": _text}, required=("metadata",))
_KUBE_OBJECT = _shape({"metadata": _OBJECT_META}, required=("metadata",))
_VERSIONED = _shape({"metadata": _shape({"resourceVersion": _text})})
_DAEMONSET = _shape({"metadata": _BY_NAME_META, "spec": _shape({"template": _shape({"spec": _POD_SPEC})})},
                    required=("metadata",))
_SECRET = _shape({"metadata": _OBJECT_META, "type": _text, "data": _strings}, required=("metadata",))
_WEBHOOK_CONFIGURATION = _shape({"metadata": _OBJECT_META, "webhooks": _list(_shape({
    "name": _text, "clientConfig": _shape({"service": _shape({"name": _text, "namespace": _text}),
                                           "caBundle": _text})}))}, required=("metadata",))
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


def versioned(value: object, where: str) -> VersionedObject:
    """A watch event's object as far as where the watch goes on from (a BOOKMARK carries nothing else)."""
    return cast(VersionedObject, _VERSIONED(value, where))


def daemonset(value: object, where: str) -> DaemonSet:
    return cast(DaemonSet, _DAEMONSET(value, where))


def secret(value: object, where: str) -> Secret:
    return cast(Secret, _SECRET(value, where))


def webhook_configuration(value: object, where: str) -> WebhookConfiguration:
    return cast(WebhookConfiguration, _WEBHOOK_CONFIGURATION(value, where))
