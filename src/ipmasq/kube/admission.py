"""What ipmasq reads of the admission machinery, as typed values (the way of ipmasq.kube.objects): what the webhook
is sent (an AdmissionReview, its AdmissionRequest and the ConfigMap in it, AdmittedConfigMap) and the node-trust
policy and binding (ipmasq.fleet.nodetrust judges them). Each function checks a decoded value against its shape and
returns it typed; a field of the wrong type is ApiMalformed, one line naming the call and the field.
"""

from __future__ import annotations

from typing import NotRequired, TypedDict, cast

from ipmasq.kube import objects
from ipmasq.kube.shapes import anything, list_of, shape, strings, text

__all__ = ["AdmissionPolicy", "AdmissionPolicyBinding", "AdmissionPolicyBindingSpec", "AdmissionPolicySpec",
           "AdmissionRequest", "AdmissionReview", "AdmittedConfigMap", "AdmittedMeta", "GroupVersionKind",
           "GroupVersionResource", "LabelSelector", "MatchResources", "ResourceRule", "SelectorRequirement",
           "admission_policy", "admission_policy_binding", "admission_review", "admitted_configmap"]


class ResourceRule(TypedDict, total=False):
    apiGroups: list[str]
    apiVersions: list[str]
    operations: list[str]
    resources: list[str]


class SelectorRequirement(TypedDict, total=False):
    key: str
    operator: str
    values: list[str]


class LabelSelector(TypedDict, total=False):
    matchLabels: dict[str, str]
    matchExpressions: list[SelectorRequirement]


class MatchResources(TypedDict, total=False):
    namespaceSelector: LabelSelector
    objectSelector: LabelSelector
    resourceRules: list[ResourceRule]
    excludeResourceRules: list[ResourceRule]


class AdmissionPolicySpec(TypedDict, total=False):
    matchConstraints: MatchResources


class AdmissionPolicy(TypedDict):
    """A ValidatingAdmissionPolicy, as far as the node-trust judgement reads it (ipmasq.fleet.nodetrust)."""

    metadata: objects.ObjectMeta
    spec: NotRequired[AdmissionPolicySpec]


class AdmissionPolicyBindingSpec(TypedDict, total=False):
    policyName: str
    validationActions: list[str]
    matchResources: MatchResources


class AdmissionPolicyBinding(TypedDict):
    metadata: objects.ObjectMeta
    spec: NotRequired[AdmissionPolicyBindingSpec]


class GroupVersionKind(TypedDict, total=False):
    group: str
    version: str
    kind: str


class GroupVersionResource(TypedDict, total=False):
    group: str
    version: str
    resource: str


class AdmittedMeta(TypedDict, total=False):
    """An admitted object's metadata: a CREATE by generateName has no name yet."""

    name: str
    namespace: str


class AdmittedConfigMap(TypedDict, total=False):
    metadata: AdmittedMeta
    data: dict[str, str]
    binaryData: dict[str, str]


class AdmissionRequest(TypedDict):
    """An AdmissionReview's request; its object (and oldObject) of any kind, read as a ConfigMap (admitted_configmap)
    only once the request says it is one. Its userInfo is not read here (the log line shows what it can of it)."""

    uid: str
    kind: NotRequired[GroupVersionKind]
    resource: NotRequired[GroupVersionResource]
    subResource: NotRequired[str]
    name: NotRequired[str]
    namespace: NotRequired[str]
    operation: NotRequired[str]
    object: NotRequired[object]
    oldObject: NotRequired[object]


class AdmissionReview(TypedDict):
    apiVersion: str
    kind: str
    request: AdmissionRequest


_TEXTS = list_of(text)
_RULES = list_of(shape({"apiGroups": _TEXTS, "apiVersions": _TEXTS, "operations": _TEXTS, "resources": _TEXTS}))
_SELECTOR = shape({"matchLabels": strings,
                   "matchExpressions": list_of(shape({"key": text, "operator": text, "values": _TEXTS}))})
_MATCH = shape({"namespaceSelector": _SELECTOR, "objectSelector": _SELECTOR, "resourceRules": _RULES,
                "excludeResourceRules": _RULES})
_ADMISSION_POLICY = shape({"metadata": objects.object_meta, "spec": shape({"matchConstraints": _MATCH})},
                          required=("metadata",))
_ADMISSION_POLICY_BINDING = shape({"metadata": objects.object_meta, "spec": shape({
    "policyName": text, "validationActions": _TEXTS, "matchResources": _MATCH})}, required=("metadata",))
_ADMISSION_REQUEST = shape({
    "uid": text, "kind": shape({"group": text, "version": text, "kind": text}),
    "resource": shape({"group": text, "version": text, "resource": text}), "subResource": text,
    "name": text, "namespace": text, "operation": text, "object": anything, "oldObject": anything},
    required=("uid",))
_ADMISSION_REVIEW = shape({"apiVersion": text, "kind": text, "request": _ADMISSION_REQUEST},
                          required=("apiVersion", "kind", "request"))
_ADMITTED_CONFIGMAP = shape({"metadata": shape({"name": text, "namespace": text}), "data": strings,
                             "binaryData": strings})


def admission_review(value: object, where: str) -> AdmissionReview:
    """An AdmissionReview as the API server sends it to a webhook (its request's object not looked at yet)."""
    return cast(AdmissionReview, _ADMISSION_REVIEW(value, where))


def admitted_configmap(value: object, where: str) -> AdmittedConfigMap:
    """The ConfigMap an AdmissionRequest carries (object or oldObject): no name yet when made by generateName."""
    return cast(AdmittedConfigMap, _ADMITTED_CONFIGMAP(value, where))


def admission_policy(value: object, where: str) -> AdmissionPolicy:
    return cast(AdmissionPolicy, _ADMISSION_POLICY(value, where))


def admission_policy_binding(value: object, where: str) -> AdmissionPolicyBinding:
    return cast(AdmissionPolicyBinding, _ADMISSION_POLICY_BINDING(value, where))
