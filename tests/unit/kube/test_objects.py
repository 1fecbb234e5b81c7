"""Every shape of ipmasq.kube.objects: an answer of the right shape comes back as it is (typed), one of the wrong
shape is one line naming the call and the field."""

from __future__ import annotations

from typing import Any

import pytest

from ipmasq.errors import ApiMalformed, ApiUnreachable
from ipmasq.kube import admission, objects

META = {"name": "node-a", "uid": "u", "resourceVersion": "5", "labels": {"a": "b"}, "generation": 3}


def test_right_shapes_come_back_unchanged_with_fields_the_shape_does_not_name() -> None:
    good: dict[Any, dict[str, Any]] = {
        objects.configmap: {"metadata": META, "data": {"config": "x"}, "binaryData": {"b": "eA=="}},
        objects.lease: {"metadata": META, "spec": {"holderIdentity": None, "leaseDurationSeconds": 120,
                                                   "renewTime": "2026-11-26T18:00:00.000000Z"}},
        objects.node: {"metadata": META, "status": {"addresses": []}},
        objects.pod: {"metadata": META, "spec": {"nodeName": "node-a"},
                      "status": {"conditions": [{"type": "Ready", "status": "True", "reason": None}]}},
        objects.agent_status: {"metadata": META, "nodeName": "node-a", "ready": True, "agentPod": None,
                               "configMaps": [{"name": "ip-masq-agent", "resourceVersion": "9"}],
                               "driftRepairs": 0, "mode": "observe"},
        objects.event: {"metadata": META, "involvedObject": {"kind": "Node", "name": "node-a"}, "count": 2,
                        "source": {"component": "ipmasq", "host": "node-a"}},
        objects.status: {"kind": "Status", "code": 410, "reason": "Expired", "message": "too old"},
    }
    for check, value in good.items():
        assert check(value, "GET /x") is value


@pytest.mark.parametrize(("check", "value", "field"), [
    (objects.node, [], "GET /x is not an object"),
    (objects.node, {}, r"GET /x\.metadata is missing"),
    (objects.node, {"metadata": {"name": "a", "labels": {"k": 1}}}, r"metadata\.labels\.k is not a string"),
    (objects.configmap, {"metadata": META, "data": {"config": {"nested": 1}}}, r"data\.config is not a string"),
    (objects.lease, {"metadata": META, "spec": {"leaseDurationSeconds": "2147483647"}},
     r"spec\.leaseDurationSeconds is not an integer"),
    (objects.lease, {"metadata": META, "spec": {"leaseTransitions": True}}, r"spec\.leaseTransitions is not an int"),
    (objects.pod, {"metadata": META, "status": {"conditions": [{"type": "Ready"}]}},
     r"status\.conditions\[0\]\.status is missing"),
    (objects.agent_status, {"metadata": META, "ready": "yes"}, r"\.ready is not true or false"),
    (objects.agent_status, {"metadata": META, "configMaps": [{"name": "a", "resourceVersion": 1}]},
     r"configMaps\[0\]\.resourceVersion is not a string"),
    (objects.event, {"metadata": META}, r"involvedObject is missing"),
    (objects.status, {"code": "410"}, r"\.code is not an integer"),
    (objects.object_meta, {"name": "\x1b]0;owned\x07" * 100}, None),
])
def test_a_wrong_shape_is_one_line_naming_the_field(check: objects.Check, value: object, field: str | None) -> None:
    if field is None:  # a name with escapes is still a string: checked, not judged
        assert check(value, "GET /x") is value
        return
    with pytest.raises(ApiMalformed, match=field) as raised:
        check(value, "GET /x")
    text = str(raised.value)
    assert text.isprintable() and len(text) < 300 and isinstance(raised.value, ApiUnreachable)


def test_what_a_wrong_value_shows_is_escaped_and_clipped() -> None:
    with pytest.raises(ApiMalformed) as raised:
        objects.node({"metadata": {"name": ["\x1b[2J\u202e" * 1000]}}, "GET /x")
    assert str(raised.value).isprintable() and len(str(raised.value)) < 200


# ---- the shapes of every other object ipmasq reads: a DaemonSet's environment, the webhook's Secret and
# configuration, the node-trust policy and binding, what an AdmissionReview carries, a watch event's version ----

AWS_NODE = {"metadata": {"name": "aws-node", "uid": "u"}, "spec": {"template": {"spec": {"containers": [
    {"name": "aws-node", "image": "x", "env": [{"name": "AWS_VPC_K8S_CNI_EXTERNALSNAT", "value": "false"},
                                               {"name": "X", "valueFrom": {"fieldRef": {"fieldPath": "a"}}}]}]}}}}
REVIEW = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
    "uid": "0b2c", "kind": {"group": "", "version": "v1", "kind": "ConfigMap"}, "operation": "CREATE",
    "resource": {"group": "", "version": "v1", "resource": "configmaps"}, "namespace": "kube-system",
    "userInfo": ["anything"], "object": ["any kind, read once the request says it is a ConfigMap"]}}


def test_the_other_shapes_come_back_unchanged() -> None:
    good: dict[Any, object] = {
        objects.daemonset: AWS_NODE,
        objects.secret: {"metadata": META, "type": "kubernetes.io/tls", "data": {"tls.crt": "eA=="}},
        objects.webhook_configuration: {"metadata": META, "webhooks": [
            {"name": "w", "clientConfig": {"service": {"name": "s", "namespace": "n", "port": 443}, "caBundle": "eA=="},
             "timeoutSeconds": 5}]},
        admission.admission_policy: {"metadata": META, "spec": {"matchConstraints": {"resourceRules": [
            {"apiGroups": ["ipmasq.dev"], "operations": ["CREATE"], "resources": ["ipmasqagentstatuses"]}],
            "namespaceSelector": {}}}},
        admission.admission_policy_binding: {"metadata": META, "spec": {
            "policyName": "p", "validationActions": ["Deny"],
            "matchResources": {"objectSelector": {"matchLabels": {"a": "b"}}}}},
        admission.admission_review: REVIEW,
        admission.admitted_configmap: {"metadata": {"generateName": "ip-masq-"}, "data": {"config": "x"}},
        objects.versioned: {"metadata": {"resourceVersion": "160"}},  # a BOOKMARK: no name
        objects.lease: {"metadata": {**META, "annotations": {"ipmasq.dev/nodes": "1000"}}},
    }
    for check, value in good.items():
        assert check(value, "GET /x") is value


@pytest.mark.parametrize(("check", "value", "field"), [
    (objects.daemonset, {"metadata": {}, "spec": {"template": {"spec": {"containers": {"name": "aws-node"}}}}},
     r"spec\.template\.spec\.containers is not a list"),
    (objects.daemonset, {"metadata": {}, "spec": {"template": {"spec": {"containers": [{"image": "x"}]}}}},
     r"containers\[0\]\.name is missing"),
    (objects.daemonset, {"metadata": {}, "spec": {"template": {"spec": {"containers": [
        {"name": "aws-node", "env": [{"name": "A", "value": 5}]}]}}}}, r"env\[0\]\.value is not a string"),
    (objects.daemonset, {"metadata": "garbage"}, r"\.metadata is not an object"),
    (objects.secret, {"metadata": META, "data": {"tls.crt": ["x"]}}, r"data\.tls\.crt is not a string"),
    (objects.secret, {"data": {}}, r"\.metadata is missing"),
    (objects.webhook_configuration, {"metadata": META, "webhooks": [{"clientConfig": {"caBundle": 7}}]},
     r"webhooks\[0\]\.clientConfig\.caBundle is not a string"),
    (admission.admission_policy, {"metadata": META, "spec": {"matchConstraints": {"resourceRules": [
        {"resources": "ipmasqagentstatuses"}]}}}, r"resourceRules\[0\]\.resources is not a list"),
    (admission.admission_policy_binding, {"metadata": META, "spec": {"validationActions": "Deny"}},
     r"validationActions is not a list"),
    (admission.admission_policy_binding, {"metadata": META, "spec": {"validationActions": ["Deny", 1]}},
     r"validationActions\[1\] is not a string"),
    (admission.admission_review, {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview"},
     r"\.request is missing"),
    (admission.admission_review, {**REVIEW, "request": {"uid": 5}}, r"request\.uid is not a string"),
    (admission.admission_review, {**REVIEW, "request": {"uid": "u", "operation": ["CREATE"]}},
     r"request\.operation is not a string"),
    (admission.admission_review, {**REVIEW, "request": {"uid": "u", "kind": "ConfigMap"}},
     r"request\.kind is not an object"),
    (admission.admitted_configmap, {"data": {"config": {"nonMasqueradeCIDRs": []}}}, r"data\.config is not a string"),
    (admission.admitted_configmap, {"metadata": {"name": 7}}, r"metadata\.name is not a string"),
    (objects.versioned, {"metadata": {"resourceVersion": 160}}, r"metadata\.resourceVersion is not a string"),
    (objects.lease, {"metadata": {**META, "annotations": {"ipmasq.dev/nodes": 1000}}},
     r"annotations\.ipmasq\.dev/nodes is not a string"),
    (objects.node, {"metadata": {**META, "ownerReferences": [{"uid": ["u"]}]}},
     r"ownerReferences\[0\]\.uid is not a string"),
])
def test_each_other_shape_refuses_a_wrong_field_in_one_line(check: objects.Check, value: object, field: str) -> None:
    with pytest.raises(ApiMalformed, match=field) as raised:
        check(value, "GET /x")
    text = str(raised.value)
    assert text.isprintable() and len(text) < 300 and isinstance(raised.value, ApiUnreachable)
