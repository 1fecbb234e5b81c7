"""What in the API is ipmasq's: the labels ipmasq puts on everything it ships and creates, and how an object found in
a cluster is judged ipmasq's or another program's. Pure: JSON objects in, values out.

A name proves nothing: GKE deploys its own `kube-system/ip-masq-agent` DaemonSet and ServiceAccount (labelled
`addonmanager.kubernetes.io/mode: Reconcile`: the addon manager puts them back if deleted), the reference manifests
and ipmasq's drop-in use the same name and the same `k8s-app: ip-masq-agent` label, and a Helm chart may own a
ClusterRole of that name. So everything ipmasq ships (deploy/, by kustomize's `labels:`) and creates at run time
(`labels()`: the status objects, the webhook's certificate Secret, the Lease, Events, the uninstall's and the
plugin's pods) carries Kubernetes' recommended label `app.kubernetes.io/part-of: ipmasq`, and `judge` reads one
object in this order:

    1. labelled by a provider's addon manager (addonmanager.kubernetes.io/mode)   another's, whatever else it says
    2. app.kubernetes.io/part-of=ipmasq                                           ipmasq's
    3. managed by another tool (app.kubernetes.io/managed-by other than ipmasq,
       kubectl or kustomize; a Helm release's annotation; AKS's managedby label)   another's
    4. unmistakably ipmasq's without the label (what 0.2.0 shipped): labelled
       app.kubernetes.io/name=ipmasq*, named ipmasq-*, of the ipmasq.dev API (the
       CRD, its objects), a label or annotation of the ipmasq.dev domain, RBAC rules
       or an admission policy about the ipmasq.dev API, a workload running ipmasq's
       own image                                                                   ipmasq's
    5. anything else                                                               undecided

`decide` then looks at what the undecided objects are to ipmasq's own (an older install's shared names): a
ServiceAccount used only by ipmasq's workloads, the Lease an ipmasq agent is told to hold (--summary-lease), a
binding whose every subject is ipmasq's ServiceAccount, a role bound only by ipmasq's bindings, an admission policy
binding of ipmasq's policy are ipmasq's; what is still undecided merely shares a name and is another's.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from ipmasq.errors import clip, one_line
from ipmasq.version import IMAGE_REPOSITORY

__all__ = ["ADDON_MANAGER", "APPLICATION", "BARE_POD_COMPONENTS", "COMPONENT", "DEBUG_COMPONENT", "MANAGED_BY", "NAME",
           "PART_OF", "PART_OF_SELECTOR", "UNINSTALL_COMPONENT", "AgentFacts", "Belonging", "ObjectFacts", "decide",
           "facts_of", "judge", "labels", "without_others_pods"]

_P = TypeVar("_P")  # a pod as the caller read it

PART_OF = "app.kubernetes.io/part-of"
NAME = "app.kubernetes.io/name"
COMPONENT = "app.kubernetes.io/component"
MANAGED_BY = "app.kubernetes.io/managed-by"
APPLICATION = "ipmasq"
PART_OF_SELECTOR = f"{PART_OF}={APPLICATION}"
ADDON_MANAGER = "addonmanager.kubernetes.io/mode"
AKS_MANAGED_BY = "kubernetes.azure.com/managedby"
HELM_RELEASE = "meta.helm.sh/release-name"
DOMAIN = "ipmasq.dev"  # the API group of the status objects, and the prefix of ipmasq's own annotations
# the tools that apply what ipmasq ships, and ipmasq itself: managing an object does not make it another's
OUR_MANAGERS = frozenset({APPLICATION, "kubectl", "kustomize"})
DEFAULT_SUMMARY_LEASE = "ip-masq-agent"  # the agent's --summary-lease default (commands/agent.py)
WORKLOADS = frozenset({"DaemonSet", "Deployment"})
BINDINGS = frozenset({"RoleBinding", "ClusterRoleBinding"})
ROLES = frozenset({"Role", "ClusterRole"})
VALUE_CHARS = 60  # what a reason quotes of a label's value
# The components of the pods ipmasq's tools create without an owner, each deleted by the run that made it: the
# removal pods of `kubectl ipmasq uninstall` and the plugin's debug pod. One an interrupted run left behind is
# removed by the next uninstall.
UNINSTALL_COMPONENT = "uninstall"
DEBUG_COMPONENT = "debug"
BARE_POD_COMPONENTS = (UNINSTALL_COMPONENT, DEBUG_COMPONENT)


def labels(component: str | None = None, *, name: str = APPLICATION) -> dict[str, str]:
    """The labels of an object ipmasq's code creates at run time (what deploy/'s kustomizations give what ships)."""
    out = {NAME: name, PART_OF: APPLICATION, MANAGED_BY: APPLICATION}
    if component is not None:
        out[COMPONENT] = component
    return out


@dataclass(frozen=True, slots=True)
class AgentFacts:
    """A workload's container that runs `ipmasq agent`: what it does and what it holds."""

    container: str
    image: str
    observes: bool  # --observe: reads the rules another program writes, writes none
    chain_flags: tuple[str, ...]  # its --masq-chain, as `--masq-chain=NAME`
    summary_lease: str  # the Lease it takes part in ("" when none)
    writer: str = ""  # --observe's value: whose rules it observes (gke, aks, eks, reference; "" when it enforces)


@dataclass(frozen=True, slots=True)
class ObjectFacts:
    """What one object says of whose it is, read from its JSON (a field of the wrong type reads as absent)."""

    kind: str
    namespace: str  # "" for a cluster-scoped object
    name: str
    uid: str = ""
    labels: tuple[tuple[str, str], ...] = ()
    annotations: tuple[tuple[str, str], ...] = ()
    images: tuple[str, ...] = ()  # a workload's containers'
    agent: AgentFacts | None = None  # a workload's `ipmasq agent` container
    service_account: str = ""  # a workload's
    selector: tuple[tuple[str, str], ...] = ()  # a workload's spec.selector.matchLabels
    subjects: tuple[tuple[str, str, str], ...] = ()  # a binding's (kind, namespace, name)
    role_ref: tuple[str, str] | None = None  # a binding's (kind, name)
    api_groups: frozenset[str] = field(default_factory=frozenset)  # a role's rules', an admission policy's
    policy_name: str = ""  # a ValidatingAdmissionPolicyBinding's
    group: str = ""  # a CustomResourceDefinition's

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.kind, self.namespace, self.name)

    @property
    def label(self) -> str:
        """As people name it: `daemonset/kube-system/ip-masq-agent`, `clusterrole/ip-masq-agent` (escaped)."""
        where = f"{self.namespace}/" if self.namespace else ""
        return one_line(clip(f"{self.kind.lower()}/{where}{self.name}", 200))

    def label_value(self, key: str) -> str | None:
        return dict(self.labels).get(key)


@dataclass(frozen=True, slots=True)
class Belonging:
    ours: bool
    why: str  # one line, its values escaped


# ---- reading an object --------------------------------------------------------------------------------------------


def _dict(value: object) -> Mapping[str, object]:
    return value if isinstance(value, dict) else {}


def _list(value: object) -> Sequence[object]:
    return value if isinstance(value, list) else ()


def _text(value: object) -> str:
    return value if isinstance(value, str) else ""


def _pairs(value: object) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((k, v) for k, v in _dict(value).items() if isinstance(v, str)))


def _agent(container: Mapping[str, object]) -> AgentFacts | None:
    args = [a for a in _list(container.get("args")) if isinstance(a, str)]
    command = [a for a in _list(container.get("command")) if isinstance(a, str)]
    words = [*command, *args]
    if "agent" not in words[:3]:  # `ipmasq agent ...`: args [agent, ...] under the image's entrypoint, or a command
        return None
    observes = any(w == "--observe" or w.startswith("--observe=") for w in words)
    chains: list[str] = []
    lease = DEFAULT_SUMMARY_LEASE
    writer = ""
    for index, word in enumerate(words):
        following = words[index + 1] if index + 1 < len(words) else ""
        if word.startswith("--observe="):
            writer = word.split("=", 1)[1]
        elif word == "--observe":
            writer = following
        elif word.startswith("--masq-chain="):
            chains.append(word)
        elif word == "--masq-chain" and following:
            chains.append(f"--masq-chain={following}")
        elif word.startswith("--summary-lease="):
            lease = word.split("=", 1)[1]
        elif word == "--summary-lease":
            lease = following
    return AgentFacts(_text(container.get("name")), _text(container.get("image")), observes, tuple(chains), lease,
                      writer)


def facts_of(kind: str, obj: Mapping[str, object]) -> ObjectFacts:
    """The facts of one object of `kind` as the API server answered it."""
    meta = _dict(obj.get("metadata"))
    spec = _dict(obj.get("spec"))
    images: tuple[str, ...] = ()
    agent = None
    service_account = ""
    selector: tuple[tuple[str, str], ...] = ()
    if kind in WORKLOADS:
        pod = _dict(_dict(spec.get("template")).get("spec"))
        containers = [_dict(c) for c in _list(pod.get("containers"))]
        images = tuple(_text(c.get("image")) for c in containers if _text(c.get("image")))
        agent = next((found for found in map(_agent, containers) if found is not None), None)
        service_account = _text(pod.get("serviceAccountName")) or "default"
        selector = _pairs(_dict(spec.get("selector")).get("matchLabels"))
    subjects = tuple((_text(s.get("kind")), _text(s.get("namespace")), _text(s.get("name")))
                     for s in map(_dict, _list(obj.get("subjects"))))
    role = _dict(obj.get("roleRef"))
    groups: set[str] = set()
    if kind in ROLES:
        for rule in map(_dict, _list(obj.get("rules"))):
            groups.update(g for g in _list(rule.get("apiGroups")) if isinstance(g, str))
    if kind == "ValidatingAdmissionPolicy":
        for rule in map(_dict, _list(_dict(spec.get("matchConstraints")).get("resourceRules"))):
            groups.update(g for g in _list(rule.get("apiGroups")) if isinstance(g, str))
    return ObjectFacts(
        kind=kind, namespace=_text(meta.get("namespace")), name=_text(meta.get("name")), uid=_text(meta.get("uid")),
        labels=_pairs(meta.get("labels")), annotations=_pairs(meta.get("annotations")), images=images, agent=agent,
        service_account=service_account, selector=selector,
        subjects=subjects if kind in BINDINGS else (),
        role_ref=(_text(role.get("kind")), _text(role.get("name"))) if kind in BINDINGS and role else None,
        api_groups=frozenset(groups), policy_name=_text(spec.get("policyName")) if kind.endswith("Binding") else "",
        group=_text(spec.get("group")) if kind == "CustomResourceDefinition" else "")


# ---- judging --------------------------------------------------------------------------------------------------------


def _said(key: str, value: str) -> str:
    return one_line(clip(f"{key}={value}", VALUE_CHARS + len(key) + 1))


def _repository(image: str) -> str:
    """An image reference without its tag and digest (a registry's port is not a tag)."""
    name = image.split("@", 1)[0]
    head, _, last = name.rpartition("/")
    return f"{head}/{last.split(':', 1)[0]}" if head else last.split(":", 1)[0]


def judge(facts: ObjectFacts) -> Belonging | None:
    """Whose the object is by what it says itself (the module's docstring: steps 1-4); None when it does not say."""
    own_labels = dict(facts.labels)
    annotations = dict(facts.annotations)
    addon = own_labels.get(ADDON_MANAGER)
    if addon is not None:
        return Belonging(False, f"not ipmasq's ({_said(ADDON_MANAGER, addon)})")
    if own_labels.get(PART_OF) == APPLICATION:
        return Belonging(True, PART_OF_SELECTOR)
    manager = own_labels.get(MANAGED_BY)
    if manager is not None and manager not in OUR_MANAGERS:
        return Belonging(False, f"not ipmasq's ({_said(MANAGED_BY, manager)})")
    if HELM_RELEASE in annotations:
        return Belonging(False, f"not ipmasq's ({_said(HELM_RELEASE, annotations[HELM_RELEASE])})")
    if AKS_MANAGED_BY in own_labels:
        return Belonging(False, f"not ipmasq's ({_said(AKS_MANAGED_BY, own_labels[AKS_MANAGED_BY])})")
    name_label = own_labels.get(NAME, "")
    if name_label == APPLICATION or name_label.startswith(f"{APPLICATION}-"):
        return Belonging(True, f"{_said(NAME, name_label)} (ipmasq's own label before {PART_OF})")
    if facts.name.startswith(f"{APPLICATION}-"):
        return Belonging(True, f"named {APPLICATION}-*")
    if (facts.kind == "CustomResourceDefinition" and facts.group == DOMAIN) or facts.kind == "IPMasqAgentStatus":
        return Belonging(True, f"the {DOMAIN} API")
    domain_keys = sorted(k for k in (*own_labels, *annotations) if k.split("/", 1)[0] == DOMAIN)
    if domain_keys:
        return Belonging(True, f"carries {one_line(clip(domain_keys[0], VALUE_CHARS))}")
    if DOMAIN in facts.api_groups:
        return Belonging(True, f"its rules are about the {DOMAIN} API")
    ours = sorted({_repository(i) for i in facts.images} & {IMAGE_REPOSITORY})
    if ours:
        return Belonging(True, f"runs ipmasq's image ({ours[0]})")
    return None


def without_others_pods(daemonsets: Sequence[object], pods: Sequence[_P]) -> list[_P]:
    """`pods` less those owned by a DaemonSet that says it is another program's (GKE's addon-managed ip-masq-agent,
    whose pods carry the same k8s-app label as ipmasq's). A pod of a DaemonSet that says nothing is kept (ipmasq
    0.2.0's, from a registry of the user's). Pure."""
    others = set()
    for item in daemonsets:
        if isinstance(item, Mapping):
            facts = facts_of("DaemonSet", item)
            verdict = judge(facts)
            if verdict is not None and not verdict.ours and facts.uid:
                others.add(facts.uid)

    def owners(pod: object) -> set[str]:
        meta = _dict(_dict(pod).get("metadata"))
        return {_text(_dict(ref).get("uid")) for ref in _list(meta.get("ownerReferences"))}

    return [pod for pod in pods if not owners(pod) & others]


def _shares_a_name(facts: ObjectFacts) -> Belonging:
    return Belonging(False, f"not ipmasq's alone (no {PART_OF_SELECTOR} label; other programs use the name "
                            f"{one_line(clip(facts.name, VALUE_CHARS))} too)")


def _by_reference(facts: ObjectFacts, found: Sequence[ObjectFacts],
                  verdicts: Mapping[tuple[str, str, str], Belonging | None]) -> str | None:
    """Why an undecided object is ipmasq's by what ipmasq's own objects make of it, or None."""
    def ours(other: ObjectFacts) -> bool:
        verdict = verdicts.get(other.key)
        return verdict is not None and verdict.ours

    if facts.kind == "ServiceAccount":
        users = [w for w in found if w.kind in WORKLOADS and w.namespace == facts.namespace
                 and w.service_account == facts.name]
        if users and all(map(ours, users)):
            return f"the service account of ipmasq's {users[0].label}"
    elif facts.kind == "Lease":
        holders = [w for w in found if w.agent is not None and w.namespace == facts.namespace
                   and w.agent.summary_lease == facts.name and ours(w)]
        if holders:
            return f"the summary Lease of ipmasq's {holders[0].label}"
    elif facts.kind in BINDINGS:
        accounts = [ObjectFacts(kind, namespace, name) for kind, namespace, name in facts.subjects]
        if accounts and all(a.kind == "ServiceAccount" and ours(a) for a in accounts):
            return f"binds only ipmasq's {accounts[0].label}"
    elif facts.kind in ROLES:
        binders = [b for b in found if b.kind in BINDINGS and b.role_ref == (facts.kind, facts.name)
                   and (facts.kind == "ClusterRole" or b.namespace == facts.namespace)]
        if binders and all(map(ours, binders)):
            return f"bound only by ipmasq's {binders[0].label}"
    elif facts.kind == "ValidatingAdmissionPolicyBinding":
        policy = ObjectFacts("ValidatingAdmissionPolicy", "", facts.policy_name)
        if ours(policy):
            return f"binds ipmasq's {policy.label}"
    return None


def decide(found: Iterable[ObjectFacts]) -> dict[tuple[str, str, str], Belonging]:
    """Every object's verdict: by what it says itself, else by what ipmasq's own objects make of it, else another's
    (it only shares a name)."""
    objects = list(found)
    verdicts: dict[tuple[str, str, str], Belonging | None] = {f.key: judge(f) for f in objects}
    changed = True
    while changed:  # each pass can only turn an undecided object into ipmasq's: it ends
        changed = False
        for facts in objects:
            if verdicts[facts.key] is None:
                why = _by_reference(facts, objects, verdicts)
                if why is not None:
                    verdicts[facts.key] = Belonging(True, why)
                    changed = True
    return {f.key: verdicts[f.key] or _shares_a_name(f) for f in objects}
