"""The uninstall's walk of the API, through ipmasq.kube.client (the one client; every path from kube/paths.py, every
collection through its one pager, `list_items`, bounded): `read` what is there once, then `run` the plan
(ipmasq.uninstall.plan decides it) in order:

    1. ipmasq's enforcing DaemonSets deleted, and their pods waited for until gone: nothing re-adds the rules (not
       those on a node that is not Ready: no kubelet there confirms their end, and no pod starts there either);
       the bare pods an interrupted run left deleted;
    2. on each node the plan names, a short-lived pod (ipmasq.uninstall.nodepod) runs `ipmasq uninstall`; every line
       it printed is relayed, and the pod is deleted and waited for;
    3. the rest of ipmasq's objects, in the plan's order; then the pods those owned (the webhook's, the observers')
       and the CRD (its status objects go with it) waited for until gone, 60 s at most;
    4. ipmasq's Events, listed again now that nothing of ipmasq writes more, one line for them all.

An object already gone is not an error (an uninstall run twice). A node whose pod does not finish is reported and
makes the run fail, with what to run on that node by hand; the rest goes on. The clock and the wait are injected, so
the unit tests run it against ipmasq.testing.kube's fake API at once.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from ipmasq.errors import ApiError, NotFound, UsageError, clip, one_line
from ipmasq.kube import objects, paths
from ipmasq.kube.client import ApiAnswer, ApiClient, list_items
from ipmasq.ownership import BARE_POD_COMPONENTS, COMPONENT, PART_OF_SELECTOR, WORKLOADS, ObjectFacts, decide, facts_of
from ipmasq.uninstall.nodepod import POD_SELECTOR, NodeOutcome, ended, removal_pod
from ipmasq.uninstall.plan import (
    CONFIGMAP,
    EVENTS,
    KINDS,
    LEGACY,
    NAMESPACE,
    NOT_READY,
    OTHER_AGENTS,
    ClusterSeen,
    PodSeen,
    StatusSeen,
    UninstallPlan,
    events_line,
    kept_lines,
    kind_of,
    removed_line,
    stray_label,
    unready_line,
)

__all__ = ["GONE_SECONDS", "UninstallClient", "UninstallReport", "read", "run"]

GONE_SECONDS = 60.0  # how long the pods and the CRD of what was deleted are waited for, at the end
POLL_SECONDS = 0.5
PAGE = 500  # objects per page of a list (ipmasq.kube.client.list_items bounds the whole list)


def _pause(listed: int) -> float:
    """The time between two looks that listed `listed` pods, in full each time: POLL_SECONDS per page of them, so
    that a large cluster's API server serves about two pages a second (5,000 agent pods of ~8 KiB are 40 MiB an
    answer: every half second, 80 MiB/s)."""
    return POLL_SECONDS * max(1, -(-listed // PAGE))


class UninstallClient(ApiClient, Protocol):
    """What the uninstall asks of the API server (ipmasq.kube.client.KubeClient has it, and the fake)."""

    def delete(self, path: str) -> ApiAnswer: ...


@dataclass(frozen=True, slots=True)
class UninstallReport:
    nodes: tuple[NodeOutcome, ...]
    removed: tuple[str, ...]  # the objects removed, as labelled
    seconds: float

    @property
    def ok(self) -> bool:
        return all(node.ok for node in self.nodes)


# ---- reading --------------------------------------------------------------------------------------------------------


def _listed(client: ApiClient, path: str, item: objects.Check, query: dict[str, str] | None = None) -> list[Any]:
    try:
        return list_items(client, path, item, query=query, page=PAGE).items
    except NotFound:  # a kind this cluster does not serve (the Prometheus Operator's, the status objects')
        return []


def _selector(pairs: Sequence[tuple[str, str]]) -> str:
    return ",".join(f"{key}={value}" for key, value in pairs)


def _owners(pod: objects.Pod) -> set[str]:
    return {uid for ref in pod["metadata"].get("ownerReferences") or [] if (uid := ref.get("uid")) is not None}


def _pods_of(client: ApiClient, workload: ObjectFacts) -> list[PodSeen]:
    """The workload's pods: by its selector, and for a DaemonSet only those it owns (a provider's DaemonSet may select
    the same label)."""
    if not workload.selector:
        return []
    found = []
    pods: list[objects.Pod] = _listed(client, paths.pods(workload.namespace), objects.pod,
                                      {"labelSelector": _selector(workload.selector)})
    for pod in pods:
        if workload.kind == "DaemonSet" and workload.uid not in _owners(pod):
            continue
        node = (pod.get("spec") or {}).get("nodeName") or ""
        found.append(PodSeen(workload.namespace, pod["metadata"]["name"], node, workload.key))
    return found


# the bare pods of ipmasq's tools (ipmasq.ownership.BARE_POD_COMPONENTS), in every namespace
STRAY_SELECTOR = f"{PART_OF_SELECTOR},{COMPONENT} in ({','.join(BARE_POD_COMPONENTS)})"


def _ready(node: objects.Node) -> bool:
    """Whether a Node is Ready: False only when its Ready condition says otherwise (False, Unknown: the kubelet
    stopped posting), so a node that reports no conditions is still tried."""
    conditions = node.get("status", {}).get("conditions") or []
    return all(c["status"] == "True" for c in conditions if c["type"] == "Ready")


def _strays(client: ApiClient) -> list[tuple[str, str, str]]:
    """The bare pods an interrupted `kubectl ipmasq` run left (labelled so, and owned by nothing)."""
    found = []
    strays: list[objects.KubeObject] = _listed(client, paths.PODS.path(), objects.kube_object,
                                               {"labelSelector": STRAY_SELECTOR})
    for pod in strays:
        meta = pod["metadata"]
        component = (meta.get("labels") or {}).get(COMPONENT, "")
        namespace = meta.get("namespace")
        if not meta.get("ownerReferences") and namespace is not None and component in BARE_POD_COMPONENTS:
            found.append((namespace, meta["name"], component))
    return sorted(found)


def _events(client: ApiClient) -> list[tuple[str, str]]:
    """ipmasq's Events, every namespace's: (namespace, name); one whose name cannot be asked for is left."""
    found = []
    events: list[objects.KubeObject] = _listed(client, EVENTS.path(), objects.kube_object,
                                               {"labelSelector": PART_OF_SELECTOR})
    for event in events:
        meta = event["metadata"]
        namespace = meta.get("namespace") or ""
        try:
            EVENTS.path(namespace, meta["name"])
        except UsageError:
            continue
        found.append((namespace, meta["name"]))
    return found


def read(client: ApiClient) -> ClusterSeen:
    """What the uninstall needs to know, read once: ipmasq's labelled objects of every kind, 0.2.0's by name, the
    pods of ipmasq's workloads, the nodes (which are Ready), the status objects, the user's ConfigMap, the bare pods
    an interrupted run left, ipmasq's Events. Writes nothing."""
    found: dict[tuple[str, str, str], ObjectFacts] = {}
    for kind in KINDS:
        for obj in _listed(client, kind.path(), objects.kube_object, {"labelSelector": PART_OF_SELECTOR}):
            facts = facts_of(kind.kind, obj)
            found[facts.key] = facts
    for kind_name, namespace, name in (*LEGACY, *OTHER_AGENTS):
        if (kind_name, namespace, name) in found:
            continue
        try:
            obj = objects.kube_object(client.get(kind_of(kind_name).path(namespace, name)), f"GET {name}")
        except NotFound:
            continue
        found[(kind_name, namespace, name)] = facts_of(kind_name, obj)
    verdicts = decide(found.values())
    pods = [pod for facts in found.values() if verdicts[facts.key].ours and facts.kind in WORKLOADS
            for pod in _pods_of(client, facts)]
    listed = _listed(client, paths.nodes(), objects.node)
    nodes = [n["metadata"]["name"] for n in listed]
    unready = [n["metadata"]["name"] for n in listed if not _ready(n)]
    statuses = []
    for status in _listed(client, paths.statuses(), objects.kube_object):  # any node's agent writes these: read
        mode, chain = status.get("mode"), status.get("chain")                # only the two fields, each checked
        statuses.append(StatusSeen(status["metadata"]["name"], mode if isinstance(mode, str) else "",
                                   chain if isinstance(chain, str) else ""))
    try:
        client.get(paths.configmaps(NAMESPACE, CONFIGMAP))
        configmap = True
    except NotFound:
        configmap = False
    return ClusterSeen(tuple(found.values()), tuple(pods), tuple(nodes), tuple(statuses), configmap,
                       tuple(unready), tuple(_strays(client)), tuple(_events(client)))


# ---- acting ---------------------------------------------------------------------------------------------------------


Clock = Callable[[], float]
Sleep = Callable[[float], None]


def _delete(client: UninstallClient, path: str) -> bool:
    try:
        client.delete(path)
    except NotFound:
        return False
    return True


def _pods_left(client: ApiClient, workloads: Sequence[ObjectFacts], unready: frozenset[str]) -> list[str]:
    """The pods of `workloads` the API still holds (one paged list per workload, however many nodes), but for those
    on a node that is not Ready: no kubelet there confirms their end until it is back."""
    return [pod.name for workload in workloads for pod in _pods_of(client, workload) if pod.node not in unready]


def _wait(until: Callable[[], list[str]], deadline: float, clock: Clock, sleep: Sleep) -> list[str]:
    """Ask `until` until it answers nothing or the deadline passes; what it last answered."""
    while True:
        left = until()
        if not left or clock() >= deadline:
            return left
        sleep(_pause(len(left)))


def run(client: UninstallClient, plan: UninstallPlan, *, timeout: float = 180.0, clock: Clock = time.monotonic,
        sleep: Sleep = time.sleep, say: Callable[[str], None] = lambda line: None) -> UninstallReport:
    """Do what `plan` says, in the module's order; `say` hears each line as it happens."""
    started = clock()
    removed: list[str] = []
    for removal in plan.enforcing:
        deleted = _delete(client, removal.path)
        if deleted:
            removed.append(removal.facts.label)
        left = _wait(lambda: _pods_left(client, [removal.facts], plan.unready),  # noqa: B023
                     started + timeout, clock, sleep)
        if left:
            raise ApiError(f"the pods of {removal.facts.label} are still running {timeout:.0f} s after it was "
                           f"deleted: {one_line(clip(', '.join(left), 400))}; nothing else was removed")
        say(f"{removed_line(plan, removal)} (its pods are gone, {clock() - started:.1f} s)" if deleted else
            f"{removal.facts.label}: already gone")
    for stray in plan.strays:
        namespace, name, _ = stray
        if _delete(client, paths.pods(namespace, name)):
            say(f"removed {stray_label(stray)}")
    for note in plan.notes:
        say(note)
    outcomes = _clean_nodes(client, plan, timeout, clock, sleep)
    for outcome in outcomes:
        for line in _node_lines(outcome):
            say(line)
    for visit in plan.unreachable:
        say(unready_line(visit))
    for removal in plan.removals:
        if _delete(client, removal.path):
            removed.append(removal.facts.label)
            say(removed_line(plan, removal))
        else:  # deleted meanwhile (by the garbage collector, by hand, a second uninstall)
            say(f"{removal.facts.label}: already gone")
    gone_by = clock() + GONE_SECONDS
    workloads = [r.facts for r in plan.removals if r.facts.kind in WORKLOADS]
    left = _wait(lambda: _pods_left(client, workloads, plan.unready), gone_by, clock, sleep)
    if left:  # the objects are deleted: kubelet is still ending these
        say(f"pods still terminating {GONE_SECONDS:.0f} s later: {one_line(clip(', '.join(left), 400))}")
    crds = [r for r in plan.removals if r.facts.kind == "CustomResourceDefinition"]
    left = _wait(lambda: [r.facts.label for r in crds if _present(client, r.path)], gone_by, clock, sleep)
    if left:  # the API server deletes the CRD's objects first, then the CRD
        say(f"still being deleted {GONE_SECONDS:.0f} s later: {', '.join(left)}")
    events = [(ns, name) for ns, name in _events(client) if _delete(client, EVENTS.path(ns, name))]
    if events:
        removed.extend(f"event/{ns}/{name}" for ns, name in events)
        say(events_line(events, "removed"))
    for line in kept_lines(plan):
        say(line)
    unreachable = tuple(NodeOutcome(v.node, False, (), NOT_READY, 0.0) for v in plan.unreachable)
    return UninstallReport((*outcomes, *unreachable), tuple(removed), clock() - started)


def _present(client: ApiClient, path: str) -> bool:
    try:
        client.get(path)
    except NotFound:
        return False
    return True


def _removal_pods(client: ApiClient, namespaces: Sequence[str], names: set[str]) -> dict[str, objects.KubeObject]:
    """This run's removal pods (`names`) the API still holds: one paged list per namespace, however many nodes (a
    pod of another run is no concern of this one's)."""
    return {pod["metadata"]["name"]: pod for namespace in namespaces
            for pod in _listed(client, paths.pods(namespace), objects.kube_object, {"labelSelector": POD_SELECTOR})
            if pod["metadata"]["name"] in names}


def _clean_nodes(client: UninstallClient, plan: UninstallPlan, timeout: float, clock: Clock,
                 sleep: Sleep) -> list[NodeOutcome]:
    started = clock()
    created: dict[str, str] = {}  # node -> its pod's name
    outcomes: dict[str, NodeOutcome] = {}
    namespaces = sorted({v.namespace for v in plan.visits})
    for visit in plan.visits:
        try:
            path = paths.pods(visit.namespace)
            made = objects.kube_object(client.create(path, removal_pod(visit)), f"POST {path}")
            created[visit.node] = made["metadata"]["name"]
        except ApiError as exc:  # ApiMalformed too: an answer without the pod's name
            outcomes[visit.node] = NodeOutcome(visit.node, False, (), "its pod could not be created: "
                                               f"{one_line(clip(str(exc), 400))}", 0.0)
    names = set(created.values())
    # from the last pod's creation: on a large cluster the creations alone take a while, and no pod is given less
    deadline = clock() + timeout
    try:
        while len(outcomes) < len(plan.visits):
            listed = _removal_pods(client, namespaces, names)
            for node, name in created.items():
                if node in outcomes:
                    continue
                if name not in listed:
                    outcomes[node] = NodeOutcome(node, False, (), f"its pod {one_line(clip(name, 200))} was deleted "
                                                 "before it ended", clock() - started)
                    continue
                result = ended(listed[name])
                if result is not None:
                    code, lines = result
                    outcomes[node] = NodeOutcome(node, code == 0, lines,
                                                 "" if code == 0 else f"ipmasq uninstall exited {code}",
                                                 clock() - started)
            if len(outcomes) < len(plan.visits):
                if clock() >= deadline:
                    for visit in plan.visits:
                        outcomes.setdefault(visit.node, NodeOutcome(
                            visit.node, False, (), f"its pod did not finish within {timeout:.0f} s (node down or "
                            "the image not pullable?)", clock() - started))
                    break
                sleep(_pause(len(listed)))
    finally:
        pods = {v.node: v.namespace for v in plan.visits}
        for node, name in created.items():
            with contextlib.suppress(ApiError):  # reported by the node's outcome already, or gone
                client.delete(paths.pods(pods[node], name))
    # gone before the run goes on: nothing of the uninstall is left in the API (kubelet confirms each deletion)
    _wait(lambda: list(_removal_pods(client, namespaces, names)), clock() + GONE_SECONDS, clock, sleep)
    return [outcomes[visit.node] for visit in plan.visits]


def _node_lines(outcome: NodeOutcome) -> list[str]:
    """Every line `ipmasq uninstall` printed on the node, each as `node NAME: line`, the time on the last."""
    node = one_line(clip(outcome.node, 200))
    if outcome.ok:
        said = list(outcome.lines) or ["no report"]
        return [f"node {node}: {line}" for line in said[:-1]] + [f"node {node}: {said[-1]} ({outcome.seconds:.1f} s)"]
    return [*(f"node {node}: {line}" for line in outcome.lines),
            f"node {node}: FAILED: {outcome.why}; on that node run `ipmasq uninstall` (its rules stay until then), "
            "or `kubectl ipmasq uninstall --all-nodes` once it is back"]

