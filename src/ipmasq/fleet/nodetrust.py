"""Can the nodes' status objects be believed? Only while the node-trust admission policy is installed and bound.

Every agent writes with one service account, and RBAC cannot tell one node's agent from another's: what keeps a
node's token to its own node's IPMasqAgentStatus (and Events, and the summary Lease) is the ValidatingAdmissionPolicy
deploy/base/admission-policy.yaml installs with its binding, both named POLICY. Where either is missing (skipped at
install, deleted since, bound only to warn, or narrowed), any agent could have written any row: `ipmasq status`, the
summary Event and the holder's ipmasq_node_trust_verified say so instead of vouching for rows nobody verified.

`judge` is pure (the two objects as the API server returns them, or None when absent, in; a NodeTrust out);
`read_node_trust` asks the API server for both by name (the agents' RBAC grants exactly that `get`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypedDict

from ipmasq.errors import ApiMalformed, Forbidden, NotFound, clip, one_line
from ipmasq.kube import admission, paths
from ipmasq.kube.client import ApiClient

__all__ = ["POLICY", "TRUSTED", "NodeTrust", "NodeTrustReport", "judge", "read_node_trust"]

POLICY = "ip-masq-agent-own-node"  # the policy's and its binding's name (deploy/base/admission-policy.yaml)
_INSTALL = "kubectl apply -k deploy/ installs it"


class NodeTrustReport(TypedDict):
    """NodeTrust as `ipmasq status -o json` prints it."""

    verified: bool
    why: str | None


@dataclass(frozen=True, slots=True)
class NodeTrust:
    verified: bool  # the policy and its binding hold every agent's token to its own node
    why: str = ""  # one line: why the rows are not verified ("" when they are)

    def as_json(self) -> NodeTrustReport:
        return {"verified": self.verified, "why": self.why or None}


TRUSTED = NodeTrust(True)


def _rules_cover_statuses(policy: admission.AdmissionPolicy) -> bool:
    rules = ((policy.get("spec") or {}).get("matchConstraints") or {}).get("resourceRules") or []
    for rule in rules:
        groups, resources, operations = (rule.get("apiGroups") or [], rule.get("resources") or [],
                                         rule.get("operations") or [])
        if (any(g in (paths.GROUP, "*") for g in groups) and any(r in (paths.PLURAL, "*") for r in resources)
                and ("*" in operations or {"CREATE", "UPDATE"} <= set(operations))):
            return True
    return False


def _narrowed(binding_spec: admission.AdmissionPolicyBindingSpec) -> bool:
    """A binding that matches fewer requests than its policy: any selector or rule in its matchResources."""
    match = binding_spec.get("matchResources") or {}
    return bool(match.get("namespaceSelector") or match.get("objectSelector") or match.get("resourceRules")
                or match.get("excludeResourceRules"))


def judge(policy: admission.AdmissionPolicy | None, binding: admission.AdmissionPolicyBinding | None,
          name: str = POLICY) -> NodeTrust:
    """Whether `policy` and `binding` (as read, None when absent) hold the agents' tokens to their own nodes."""
    unverified = "any agent's token can write any node's status"
    if policy is None:
        return NodeTrust(False, f"the admission policy {name} is not installed: {unverified} ({_INSTALL})")
    if not _rules_cover_statuses(policy):
        return NodeTrust(False, f"the admission policy {name} does not judge IPMasqAgentStatus writes: {unverified} "
                                f"({_INSTALL})")
    if binding is None:
        return NodeTrust(False, f"the admission policy {name} has no binding {name}, so it is not enforced: "
                                f"{unverified} ({_INSTALL})")
    spec = binding.get("spec") or {}
    if spec.get("policyName") != name:
        bound = spec.get("policyName")
        return NodeTrust(False, f"the binding {name} binds '{clip(one_line(str(bound)), 80)}', not the policy "
                                f"{name}: {unverified}")
    actions = spec.get("validationActions")
    if actions is None or "Deny" not in actions:
        shown = ", ".join(clip(one_line(a), 20) for a in actions) if actions is not None else "none"
        return NodeTrust(False, f"the binding {name} does not deny (validationActions: {shown}): {unverified}")
    if _narrowed(spec):
        return NodeTrust(False, f"the binding {name} is narrowed by matchResources: {unverified} where it does not "
                                "match")
    return TRUSTED


def read_node_trust(client: ApiClient, name: str = POLICY) -> NodeTrust:
    """Both objects read by name (each through its shape). A 404 is an absent object; a 403 says the caller may not
    look, and an answer of another shape cannot be judged (both unverified, said); any other ApiError is raised (the
    API could not be asked)."""
    try:
        policy_path, binding_path = paths.admission_policies(name), paths.admission_policy_bindings(name)
        policy = _read(client, policy_path)
        binding = _read(client, binding_path)
    except Forbidden:
        return NodeTrust(False, f"the admission policy {name} and its binding cannot be read with these "
                                "credentials (403), so the rows cannot be verified")
    try:
        return judge(None if policy is None else admission.admission_policy(policy, f"GET {policy_path}"),
                     None if binding is None else admission.admission_policy_binding(binding, f"GET {binding_path}"),
                     name)
    except ApiMalformed as exc:  # nothing to judge: said, as a policy that does not hold
        return NodeTrust(False, f"{exc}: the rows cannot be verified")


def _read(client: ApiClient, path: str) -> object | None:
    try:
        return client.get(path)
    except NotFound:
        return None
