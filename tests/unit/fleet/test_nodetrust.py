"""Whether the rows of `ipmasq status` can be believed: the node-trust policy and its binding, as shipped, installed."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import yaml

from ipmasq.errors import ApiServerError, Forbidden
from ipmasq.fleet.nodetrust import POLICY, NodeTrust, judge, read_node_trust
from ipmasq.kube import paths
from ipmasq.testing.kube import FakeKubeClient
from tests.conftest import ROOT


def shipped() -> tuple[dict[str, Any], dict[str, Any]]:
    docs = list(yaml.safe_load_all((ROOT / "deploy" / "base" / "admission-policy.yaml").read_text()))
    (policy,) = [d for d in docs if d["kind"] == "ValidatingAdmissionPolicy"]
    (binding,) = [d for d in docs if d["kind"] == "ValidatingAdmissionPolicyBinding"]
    return policy, binding


def test_the_shipped_policy_and_binding_are_trusted_under_the_names_checked() -> None:
    policy, binding = shipped()
    assert policy["metadata"]["name"] == binding["metadata"]["name"] == POLICY
    assert judge(policy, binding) == NodeTrust(True)


def test_as_the_api_server_returns_them_with_its_defaults_they_are_trusted() -> None:
    policy, binding = shipped()
    policy["spec"]["matchConstraints"].update(matchPolicy="Equivalent", namespaceSelector={}, objectSelector={})
    binding["spec"]["matchResources"] = {"matchPolicy": "Equivalent", "namespaceSelector": {}, "objectSelector": {}}
    assert judge(policy, binding).verified


def changed(obj: dict[str, Any], **spec: Any) -> dict[str, Any]:
    obj = copy.deepcopy(obj)
    obj["spec"].update(spec)
    return obj


@pytest.mark.parametrize(("case", "policy_change", "binding_change", "why"), [
    ("no policy", None, {}, "is not installed"),
    ("no binding", {}, None, "has no binding"),
    ("warn only", {}, {"validationActions": ["Warn", "Audit"]}, "does not deny (validationActions: Warn, Audit)"),
    ("no actions", {}, {"validationActions": None}, "does not deny (validationActions: none)"),
    ("binds another", {}, {"policyName": "something-else\x1b[2J"}, "binds 'something-else\\x1b[2J'"),
    ("narrowed", {}, {"matchResources": {"namespaceSelector": {"matchLabels": {"x": "y"}}}}, "narrowed"),
    ("statuses not judged", {"matchConstraints": {"resourceRules": [
        {"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE", "UPDATE"], "resources": ["events"]}]}}, {},
     "does not judge IPMasqAgentStatus writes"),
    ("create only", {"matchConstraints": {"resourceRules": [
        {"apiGroups": ["ipmasq.dev"], "apiVersions": ["*"], "operations": ["CREATE"],
         "resources": ["ipmasqagentstatuses"]}]}}, {}, "does not judge IPMasqAgentStatus writes"),
])
def test_anything_less_than_the_policy_bound_to_deny_leaves_the_rows_unverified(
        case: str, policy_change: dict[str, Any] | None, binding_change: dict[str, Any] | None, why: str) -> None:
    policy, binding = shipped()
    trust = judge(None if policy_change is None else changed(policy, **policy_change),
                  None if binding_change is None else changed(binding, **binding_change))
    assert not trust.verified and why in trust.why and "\x1b" not in trust.why, (case, trust.why)
    assert "any agent's token can write any node's status" in trust.why


def test_read_by_name_a_missing_object_or_a_403_is_unverified_other_errors_are_raised() -> None:
    policy, binding = shipped()
    client = FakeKubeClient()
    assert "is not installed" in read_node_trust(client).why
    client.put(paths.admission_policies(POLICY), policy)
    assert "has no binding" in read_node_trust(client).why
    client.put(paths.admission_policy_bindings(POLICY), binding)
    assert read_node_trust(client).verified
    client.refuse(paths.admission_policies(POLICY), Forbidden(403, "forbidden"))
    trust = read_node_trust(client)
    assert not trust.verified and "cannot be read with these credentials (403)" in trust.why
    client.refuse(paths.admission_policy_bindings(POLICY), ApiServerError(503, "unavailable"))
    with pytest.raises(ApiServerError):
        read_node_trust(client)


def test_an_answer_of_another_shape_is_unverified_in_one_line() -> None:
    """What a hostile or broken server sends in place of the policy cannot be judged: unverified, said, not raised."""
    policy, binding = shipped()
    client = FakeKubeClient()
    client.put(paths.admission_policies(POLICY), policy)
    binding["spec"]["validationActions"] = "Deny"  # a string, not the list the API server holds
    client.put(paths.admission_policy_bindings(POLICY), binding)
    trust = read_node_trust(client)
    assert not trust.verified and "validationActions is not a list" in trust.why and "\n" not in trust.why
    assert "the rows cannot be verified" in trust.why
