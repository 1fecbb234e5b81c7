"""What an uninstall does, decided from what was read of the cluster (values in, a Plan out; nothing here asks the
API): which objects are ipmasq's and go, in which order, which are kept and why (ipmasq.ownership judges each), and
on which nodes the rules are removed, with which image and chain.

ipmasq's Events (its agents' on their Nodes, the fleet's summary on the ConfigMap, all labelled part-of=ipmasq) go
too, last: kept, they would go on saying for an hour what an ipmasq that is gone saw (on the user's ConfigMap, a
"not enforced on N nodes" of an observer no longer there).

Rules are removed only where ipmasq's enforcing agent ran: the nodes of its DaemonSets' pods, and the nodes whose
IPMasqAgentStatus says an agent enforced there (a pod that is gone left its rules). An observer writes no rules: an
observe-only install visits no node, and a node that is not Ready is not visited (its kubelet may start no pod): it is
named, its rules stay. The removal pods run ipmasq's own image (the enforcing DaemonSet's, else the
release's; `--image` overrides), never a provider's.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace

from ipmasq.errors import UsageError, clip, one_line
from ipmasq.kube import paths
from ipmasq.ownership import PART_OF_SELECTOR, Belonging, ObjectFacts, decide
from ipmasq.version import IMAGE

__all__ = ["CONFIGMAP", "EVENTS", "KINDS", "LEGACY", "NAMESPACE", "NOT_READY", "OTHER_AGENTS", "ApiKind",
           "ClusterSeen", "NodeVisit", "PodSeen", "Removal", "StatusSeen", "UninstallPlan", "command_of",
           "describe", "events_line", "kept_lines", "kind_of", "plan_of", "removed_line", "stray_label",
           "unready_line"]

NAMESPACE = "kube-system"
CONFIGMAP = "ip-masq-agent"  # the user's config: never removed


@dataclass(frozen=True, slots=True)
class ApiKind:
    kind: str
    api_version: str
    plural: str
    namespaced: bool

    @property
    def info(self) -> paths.ApiInfo:
        return paths.ApiInfo.of(self.api_version, self.plural, namespaced=self.namespaced)

    def path(self, namespace: str = "", name: str | None = None) -> str:
        """The kind's collection (across namespaces when `namespace` is ""), or one object."""
        return self.info.path(namespace or None, name)


_ADMISSION, _RBAC = "admissionregistration.k8s.io/v1", "rbac.authorization.k8s.io/v1"
# Every kind ipmasq ships or creates and an uninstall removes, in the order removed: the webhook's configuration
# first (no call to a webhook being removed), the workloads, what serves them, the admission policy once no agent
# writes through it, the CRD (its status objects go with it), the Lease, the rights, the accounts last. (The pods
# ipmasq creates go with their own run; its Events are EVENTS, below; ConfigMaps are the user's.)
# tests/unit/test_deploy_labels.py keeps it equal to the kinds deploy/ renders.
KINDS = (
    ApiKind("ValidatingWebhookConfiguration", _ADMISSION, "validatingwebhookconfigurations", False),
    ApiKind("DaemonSet", "apps/v1", "daemonsets", True),
    ApiKind("Deployment", "apps/v1", "deployments", True),
    ApiKind("PodDisruptionBudget", "policy/v1", "poddisruptionbudgets", True),
    ApiKind("Service", "v1", "services", True),
    ApiKind("NetworkPolicy", "networking.k8s.io/v1", "networkpolicies", True),
    ApiKind("Secret", "v1", "secrets", True),
    ApiKind("PodMonitor", "monitoring.coreos.com/v1", "podmonitors", True),
    ApiKind("PrometheusRule", "monitoring.coreos.com/v1", "prometheusrules", True),
    ApiKind("ValidatingAdmissionPolicyBinding", _ADMISSION, "validatingadmissionpolicybindings", False),
    ApiKind("ValidatingAdmissionPolicy", _ADMISSION, "validatingadmissionpolicies", False),
    ApiKind("CustomResourceDefinition", "apiextensions.k8s.io/v1", "customresourcedefinitions", False),
    ApiKind("Lease", "coordination.k8s.io/v1", "leases", True),
    ApiKind("RoleBinding", _RBAC, "rolebindings", True),
    ApiKind("Role", _RBAC, "roles", True),
    ApiKind("ClusterRoleBinding", _RBAC, "clusterrolebindings", False),
    ApiKind("ClusterRole", _RBAC, "clusterroles", False),
    ApiKind("ServiceAccount", "v1", "serviceaccounts", True),
)
_ORDER = {k.kind: index for index, k in enumerate(KINDS)}
# ipmasq's Events: what it wrote, not what it ships; removed after everything else, once nothing of ipmasq writes more
EVENTS = ApiKind("Event", "v1", "events", True)


def kind_of(name: str) -> ApiKind:
    (found,) = [k for k in KINDS if k.kind == name]
    return found


# What 0.2.0 shipped and made, by name (it carried no part-of label): each is read by name and judged (an upgrade's
# `kubectl apply` labels them; until then they are recognised as ipmasq.ownership says, or kept).
_O = "ipmasq-observer"
LEGACY = (
    ("DaemonSet", NAMESPACE, "ip-masq-agent"), ("DaemonSet", NAMESPACE, _O),
    ("ValidatingWebhookConfiguration", "", "ipmasq-webhook"), ("Deployment", NAMESPACE, "ipmasq-webhook"),
    ("PodDisruptionBudget", NAMESPACE, "ipmasq-webhook"), ("Service", NAMESPACE, "ipmasq-webhook"),
    ("Secret", NAMESPACE, "ipmasq-webhook-certificate"), ("RoleBinding", NAMESPACE, "ipmasq-webhook"),
    ("Role", NAMESPACE, "ipmasq-webhook"), ("ClusterRoleBinding", "", "ipmasq-webhook"),
    ("ClusterRole", "", "ipmasq-webhook"), ("ServiceAccount", NAMESPACE, "ipmasq-webhook"),
    ("PodMonitor", NAMESPACE, "ip-masq-agent"), ("PrometheusRule", NAMESPACE, "ip-masq-agent"),
    ("ValidatingAdmissionPolicyBinding", "", "ip-masq-agent-own-node"),
    ("ValidatingAdmissionPolicy", "", "ip-masq-agent-own-node"),
    ("CustomResourceDefinition", "", f"{paths.PLURAL}.{paths.GROUP}"), ("Lease", NAMESPACE, "ip-masq-agent"),
    ("RoleBinding", NAMESPACE, "ip-masq-agent"), ("Role", NAMESPACE, "ip-masq-agent"),
    ("RoleBinding", "default", "ip-masq-agent-node-events"), ("Role", "default", "ip-masq-agent-node-events"),
    ("ClusterRoleBinding", "", "ip-masq-agent"), ("ClusterRole", "", "ip-masq-agent"),
    ("ServiceAccount", NAMESPACE, "ip-masq-agent"),
    ("RoleBinding", NAMESPACE, _O), ("Role", NAMESPACE, _O), ("RoleBinding", NAMESPACE, f"{_O}-aws-node"),
    ("Role", NAMESPACE, f"{_O}-aws-node"), ("RoleBinding", "default", f"{_O}-node-events"),
    ("Role", "default", f"{_O}-node-events"), ("ClusterRoleBinding", "", _O), ("ClusterRole", "", _O),
    ("ServiceAccount", NAMESPACE, _O),
)

# The DaemonSets of the agents that write the same text as ipmasq (the reference agent's comments, without ipmasq's
# marker): GKE's ip-masq-agent (also 0.2.0's name, in LEGACY) and AKS's azure-ip-masq-agent. Read by name: while one
# is there, --remove-unmarked would remove its rules on every node visited, and is refused.
OTHER_AGENTS = (("DaemonSet", NAMESPACE, "ip-masq-agent"), ("DaemonSet", NAMESPACE, "azure-ip-masq-agent"))


@dataclass(frozen=True, slots=True)
class PodSeen:
    """A pod of one of ipmasq's workloads (listed by its selector)."""

    namespace: str
    name: str
    node: str
    owner: tuple[str, str, str]  # the workload's key (ObjectFacts.key)


@dataclass(frozen=True, slots=True)
class StatusSeen:
    """An IPMasqAgentStatus: the node it speaks for, its mode and the chain its agent wrote."""

    node: str
    mode: str
    chain: str


@dataclass(frozen=True, slots=True)
class ClusterSeen:
    """Everything an uninstall reads, once, before it changes anything."""

    objects: tuple[ObjectFacts, ...]  # those labelled part-of=ipmasq, and those of LEGACY that exist
    pods: tuple[PodSeen, ...]
    nodes: tuple[str, ...]
    statuses: tuple[StatusSeen, ...]
    configmap: bool  # the user's ip-masq-agent ConfigMap exists
    # nodes whose Ready condition is not True (False, Unknown): a pod there may not start, nor be seen to end
    unready: tuple[str, ...] = ()
    # (namespace, name, component): pods ipmasq's tools made without an owner (a removal pod, the plugin's debug
    # pod) that an interrupted run left behind
    strays: tuple[tuple[str, str, str], ...] = ()
    events: tuple[tuple[str, str], ...] = ()  # ipmasq's Events (labelled part-of=ipmasq): namespace, name


@dataclass(frozen=True, slots=True)
class NodeVisit:
    node: str
    namespace: str  # where its removal pod runs: the enforcing agent's (a namespace that admits privileged pods)
    image: str
    chain_flags: tuple[str, ...]
    why: str


@dataclass(frozen=True, slots=True)
class Removal:
    facts: ObjectFacts
    why: str

    @property
    def path(self) -> str:
        return kind_of(self.facts.kind).path(self.facts.namespace, self.facts.name)


@dataclass(frozen=True, slots=True)
class UninstallPlan:
    enforcing: tuple[Removal, ...]  # ipmasq's enforcing DaemonSets: deleted first, their pods waited for
    visits: tuple[NodeVisit, ...]
    removals: tuple[Removal, ...]  # everything else of ipmasq, in KINDS' order
    kept: tuple[tuple[str, str], ...]  # (label, why)
    pods: tuple[PodSeen, ...]  # the pods of what is removed (waited for until gone, except on `unready` nodes)
    statuses: int  # IPMasqAgentStatus objects, which go with their CRD
    notes: tuple[str, ...]
    # where rules should be removed but no pod can run: the node is not Ready (reported as not cleaned)
    unreachable: tuple[NodeVisit, ...] = ()
    unready: frozenset[str] = frozenset()
    strays: tuple[tuple[str, str, str], ...] = ()  # ClusterSeen.strays: removed
    events: tuple[tuple[str, str], ...] = ()  # ipmasq's Events, when read (the run lists them again at its end)


_CHAIN = re.compile(r"[A-Za-z0-9_.-]{1,28}")  # what the agent's --masq-chain accepts, and no more


def _askable(facts: ObjectFacts) -> bool:
    """Its path can be built (names checked as paths.py checks them): a name that cannot is never asked for."""
    try:
        kind_of(facts.kind).path(facts.namespace, facts.name)
    except UsageError:
        return False
    return True


def plan_of(seen: ClusterSeen, *, image: str | None = None, all_nodes: bool = False,
            remove_unmarked: bool = False) -> UninstallPlan:
    """The uninstall of what `seen` holds (`image`: --image; `all_nodes`: --all-nodes; `remove_unmarked`:
    --remove-unmarked, passed to each node's `ipmasq uninstall`)."""
    verdicts = decide(seen.objects)
    ours: list[tuple[ObjectFacts, Belonging]] = []
    kept_facts: list[tuple[ObjectFacts, str]] = []
    for facts in sorted(seen.objects, key=lambda f: (_ORDER.get(f.kind, len(_ORDER)), f.namespace, f.name)):
        verdict = verdicts[facts.key]
        if verdict.ours and not _askable(facts):
            kept_facts.append((facts, "its name is not one ipmasq asks the API server for"))
        elif verdict.ours:
            ours.append((facts, verdict))
        else:
            kept_facts.append((facts, verdict.why))
    kept = [(facts.label, why) for facts, why in kept_facts]
    if seen.configmap:
        kept.append((f"configmap/{NAMESPACE}/{CONFIGMAP}", "yours: the agents' config (the reference agent reads it "
                                                         "too)"))
    enforcing = [Removal(f, v.why) for f, v in ours
                 if f.kind == "DaemonSet" and f.agent is not None and not f.agent.observes]
    removals = [Removal(f, v.why) for f, v in ours if Removal(f, v.why) not in enforcing]
    visits = _visits(seen, enforcing, image, all_nodes)
    others = [f for f, _ in kept_facts if f.kind == "DaemonSet" and not verdicts[f.key].ours]
    notes = []
    if others and not enforcing and not all_nodes and visits:
        # ipmasq's agent is gone and another agent runs: where it writes the chain ipmasq once wrote, with the same
        # rules, ipmasq's marker still matches them, and the node's uninstall would take that agent's working rules
        notes.append(f"no node visited: ipmasq's agent is gone and {others[0].label} runs, which may now write the "
                     f"chain ipmasq wrote there ({len(visits)} node{'s' if len(visits) != 1 else ''} its status "
                     "objects name); its rules are left: run `ipmasq uninstall` on a node it does not run on, or "
                     "`kubectl ipmasq uninstall --all-nodes` once it is gone")
        visits = []
    if remove_unmarked:
        visits = [replace(v, chain_flags=(*v.chain_flags, "--remove-unmarked")) for v in visits]
    if remove_unmarked and others and visits:
        raise UsageError(f"--remove-unmarked would also remove the rules {others[0].label} writes (ip-masq-agent's "
                         "text, without ipmasq's marker) on every node visited: not while it is installed; on a node "
                         "it does not run on, run `ipmasq uninstall --remove-unmarked` there")
    unready = frozenset(seen.unready)
    unreachable = [v for v in visits if v.node in unready]
    visits = [v for v in visits if v.node not in unready]
    removed = {r.facts.key for r in (*enforcing, *removals)}
    if not visits and not unreachable and not notes:
        notes.append("no node to clean: ipmasq's enforcing agent runs on none, and no IPMasqAgentStatus says it "
                     "enforced anywhere (an observer writes no rules); --all-nodes cleans every node")
    crd = any(r.facts.kind == "CustomResourceDefinition" and r.facts.name == f"{paths.PLURAL}.{paths.GROUP}"
              for r in removals)
    return UninstallPlan(tuple(enforcing), tuple(visits), tuple(removals), tuple(kept),
                         tuple(p for p in seen.pods if p.owner in removed), len(seen.statuses) if crd else 0,
                         tuple(notes), tuple(unreachable), unready, seen.strays, seen.events)


def _visits(seen: ClusterSeen, enforcing: Sequence[Removal], image: str | None,
            all_nodes: bool) -> list[NodeVisit]:
    existing = set(seen.nodes)
    visits: dict[str, NodeVisit] = {}
    for removal in enforcing:
        agent = removal.facts.agent
        assert agent is not None
        for pod in sorted(seen.pods, key=lambda p: p.name):
            if pod.owner == removal.facts.key and pod.node in existing and pod.node not in visits:
                visits[pod.node] = NodeVisit(
                    pod.node, removal.facts.namespace, image or agent.image or IMAGE, agent.chain_flags,
                    f"ipmasq's agent ran there (pod {one_line(clip(pod.name, 80))} of {removal.facts.label})")
    first = enforcing[0].facts if enforcing else None
    default_image = image or (first.agent.image if first and first.agent else "") or IMAGE
    namespace = first.namespace if first else NAMESPACE
    for status in sorted(seen.statuses, key=lambda s: s.node):
        if status.mode in ("", "enforce") and status.node in existing and status.node not in visits:
            flags = (f"--masq-chain={status.chain}",) if _CHAIN.fullmatch(status.chain) else ()
            visits[status.node] = NodeVisit(status.node, namespace, default_image, flags,
                                            "its IPMasqAgentStatus says ipmasq's agent enforced there")
    for node in sorted(existing) if all_nodes else ():
        visits.setdefault(node, NodeVisit(node, namespace, default_image, (), "--all-nodes"))
    return [visits[node] for node in sorted(visits)]


def command_of(visit: NodeVisit) -> str:
    """What the removal pod runs, as said to people: `ipmasq uninstall --masq-chain=IP-MASQ`."""
    return " ".join(["ipmasq", "uninstall", *(one_line(clip(f, 60)) for f in visit.chain_flags)])


def _crd_note(plan: UninstallPlan, removal: Removal) -> str:
    if removal.facts.kind == "CustomResourceDefinition" and plan.statuses:
        return f" (and its {plan.statuses} IPMasqAgentStatus object{'s' if plan.statuses != 1 else ''})"
    return ""


# Ready False or Unknown: its kubelet may start no pod, nor confirm that one ended (an agent's pod deleted there stays
# Terminating until it is back), so the run neither sends one nor waits for one
NOT_READY = "the node is not Ready: no pod is sent there"


def unready_line(visit: NodeVisit) -> str:
    """What is said of a node whose rules stay because it is not Ready, and what to do about it."""
    return (f"node {one_line(clip(visit.node, 200))}: NOT CLEANED: {NOT_READY} ({visit.why}); its rules stay until "
            f"`{command_of(visit)}` runs there, or `kubectl ipmasq uninstall --all-nodes` once it is Ready")


def stray_label(stray: tuple[str, str, str]) -> str:
    namespace, name, component = stray
    return one_line(clip(f"pod/{namespace}/{name}", 200)) + f" (left by an interrupted {component} run)"


def describe(plan: UninstallPlan) -> list[str]:
    """The --dry-run's lines: what would be removed, where the rules would be removed, what is kept; each why."""
    lines = []
    for removal in plan.enforcing:
        running = sum(1 for p in plan.pods if p.owner == removal.facts.key and p.node not in plan.unready)
        lines.append(f"would remove {removal.facts.label}: {removal.why}; then wait for its {running} pod(s) to go")
    lines += [f"would remove {stray_label(stray)}" for stray in plan.strays]
    lines += [f"would run `{command_of(v)}` on node {one_line(clip(v.node, 200))} (image "
              f"{one_line(clip(v.image, 200))}): {v.why}" for v in plan.visits]
    lines += [unready_line(v) for v in plan.unreachable]
    lines += list(plan.notes)
    lines += [f"would remove {r.facts.label}: {r.why}{_crd_note(plan, r)}" for r in plan.removals]
    lines += [events_line(plan.events, "would remove")] if plan.events else []
    lines += kept_lines(plan)
    return lines


def events_line(events: Sequence[tuple[str, str]], verb: str) -> str:
    """One line for ipmasq's Events, however many nodes wrote them: how many, in which namespaces."""
    where = ", ".join(f"{one_line(clip(namespace, 80))}: {count}"
                      for namespace, count in sorted(Counter(ns for ns, _ in events).items()))
    return (f"{verb} {len(events)} Event{'s' if len(events) != 1 else ''} of ipmasq ({where}): {PART_OF_SELECTOR} "
            "(what its agents saw, of an install that is gone)")


def removed_line(plan: UninstallPlan, removal: Removal) -> str:
    return f"removed {removal.facts.label}: {removal.why}{_crd_note(plan, removal)}"


def kept_lines(plan: UninstallPlan) -> list[str]:
    return [f"kept {label}: {why}" for label, why in plan.kept]
