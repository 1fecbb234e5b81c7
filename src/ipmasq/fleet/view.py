"""The whole cluster at a glance: does every node enforce the ConfigMap's current content? (`ipmasq status`)

Pure: the API's objects in (the ConfigMaps, the nodes' IPMasqAgentStatus objects, the agent's pods, the Nodes),
one row per node out. A node is current when its agent's pod is ready, and the content its rules were verified to
enforce has the ConfigMap's own digest (config_digest: equal for the mounted file and the ConfigMap it came from):
verified by its agent's own pass (mode enforce: the status also says ready), or observed in the rules another program
writes (mode observe: nothing mismatched). An observer of a provider whose agent reads inputs of its own (AKS's two
ConfigMaps, aws-node's env) is compared with those inputs' current content instead (WriterContent: read by the
caller as the observer reads them), never with the ip-masq-agent ConfigMap, which that provider does not read.

Rows are the cluster's Nodes, and a node's status is the object named after it (never what an object's body claims
of itself): an object for a node that does not exist is counted aside, never a row, so that no object anyone can
write makes a node look current or adds one. `only` limits the rows to the nodes named.

What a row says is what the node's agent wrote, and only the node-trust admission policy keeps another node's token
from writing it (ipmasq.fleet.nodetrust): the caller reads whether it is in force, and where it is not every row is
marked unverified and the view says why (`ok` is then False, whatever the rows say).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TypedDict

from ipmasq.config.source import config_digest
from ipmasq.errors import ApiMalformed
from ipmasq.fleet.nodetrust import TRUSTED, NodeTrust, NodeTrustReport
from ipmasq.kube import objects
from ipmasq.kube.agentstatus import NodeStatus, status_from_json
from ipmasq.kube.configmaps import ConfigMapState

__all__ = ["ConfigMapReport", "FleetReport", "FleetView", "NodeRow", "RowReport", "WriterContent", "WriterReport",
           "fleet_view"]


# what `ipmasq status -o json` prints (the StatusReport's fields), typed as written
class WriterReport(TypedDict):
    writer: str
    sources: list[str]
    config_digest: str | None
    error: str | None


class RowReport(TypedDict):
    node: str
    pod: str | None
    pod_ready: bool
    current: bool
    why: str
    verified: bool
    ready: bool | None
    policy_hash: str | None
    config_source: str | None
    backend: str | None
    mode: str | None
    writer: str | None
    chain: str | None
    mismatch: str | None
    ignored_by_writer: str | None
    last_rejection: str | None
    drift_repairs: int | None
    updated: str | None


class ConfigMapReport(TypedDict):
    namespace: str
    name: str
    exists: bool
    resource_version: str | None


class FleetReport(TypedDict):
    configmaps: list[ConfigMapReport]
    config_digest: str
    all_current: bool
    node_trust: NodeTrustReport
    nodes: list[RowReport]
    ignored_status_objects: int
    writer_inputs: list[WriterReport]


@dataclass(frozen=True, slots=True)
class WriterContent:
    """A provider's own inputs (observe mode for aks, eks) as the API holds them now."""

    writer: str
    sources: tuple[str, ...]  # what they are: configmap/NAME, daemonset/NAME
    digest: str | None  # config_digest of their content as the observer reads it (None: not readable)
    error: str | None = None  # why not readable (one line)

    def as_json(self) -> WriterReport:
        return {"writer": self.writer, "sources": list(self.sources), "config_digest": self.digest,
                "error": self.error}


@dataclass(frozen=True, slots=True)
class NodeRow:
    node: str
    pod: str | None  # the agent's pod on the node (None: no agent pod)
    pod_ready: bool
    status: NodeStatus | None  # what the node's agent wrote (None: nothing)
    current: bool  # enforces the ConfigMap's current content, verified in its kernel
    why: str  # one line: why not current ("" when current)
    exists: bool = True  # the node exists (False: named on the command line, no such Node)
    verified: bool = True  # only this node's agent could have written its status (the node-trust policy holds)

    def as_json(self) -> RowReport:
        status = self.status
        return {
            "node": self.node, "pod": self.pod, "pod_ready": self.pod_ready, "current": self.current, "why": self.why,
            "verified": self.verified,
            "ready": status.ready if status else None, "policy_hash": status.policy_hash if status else None,
            "config_source": status.config_source if status else None,
            "backend": status.backend if status else None,
            "mode": status.mode if status else None, "writer": status.writer if status else None,
            "chain": (status.chain or None) if status else None, "mismatch": status.mismatch if status else None,
            "ignored_by_writer": status.ignored if status else None,
            "last_rejection": status.last_rejection if status else None,
            "drift_repairs": status.drift_repairs if status else None,
            "updated": status.updated if status else None,
        }


@dataclass(frozen=True, slots=True)
class FleetView:
    configmaps: tuple[ConfigMapState, ...]
    digest: str  # config_digest of the ConfigMaps' current content (no ConfigMap: the defaults' empty content)
    rows: tuple[NodeRow, ...]
    ignored: int = 0  # status objects named after no node of the cluster (not rows)
    writers: tuple[WriterContent, ...] = ()  # the providers' own inputs the observers among the rows compare with
    trust: NodeTrust = TRUSTED  # whether the rows can be believed (the node-trust policy in force)

    @property
    def all_current(self) -> bool:
        return bool(self.rows) and all(row.current for row in self.rows)

    @property
    def ok(self) -> bool:
        """Every node enforces the current config, and the rows saying so were written by their own nodes."""
        return self.all_current and self.trust.verified

    def as_json(self) -> FleetReport:
        return {
            "configmaps": [{"namespace": c.namespace, "name": c.name, "exists": c.exists,
                            "resource_version": c.resource_version} for c in self.configmaps],
            "config_digest": self.digest, "all_current": self.all_current, "node_trust": self.trust.as_json(),
            "nodes": [row.as_json() for row in self.rows], "ignored_status_objects": self.ignored,
            "writer_inputs": [w.as_json() for w in self.writers],
        }


def _pod_ready(pod: objects.Pod) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True"
               for c in (pod.get("status") or {}).get("conditions") or [])


def _agent_pod(pods: Sequence[objects.Pod], named: str | None) -> objects.Pod | None:
    """The node's agent pod: the one its status names when there are several (an observer beside an agent)."""
    for pod in pods:
        if named is not None and pod["metadata"]["name"] == named:
            return pod
    return pods[0] if pods else None


def _statuses(statuses: Sequence[object]) -> list[NodeStatus]:
    """The status objects read (objects.agent_status: list_items has checked each already, and checking again returns
    it as it is); one of another shape, which no list hands over, counts as no status written."""
    read = []
    for index, obj in enumerate(statuses):
        try:
            read.append(status_from_json(objects.agent_status(obj, f"status object {index}")))
        except ApiMalformed:
            continue
    return read


def _why(status: NodeStatus | None, pod: objects.Pod | None, pod_ready: bool, digest: str,
         writers: Mapping[str, WriterContent]) -> str:
    if pod is None:
        return "no agent pod on this node"
    if status is None:
        return "its agent wrote no status (API off, or no rights to write it)"
    observing = status.mode == "observe"
    own = writers.get(status.writer or "") if observing else None
    if own is not None:
        if own.digest is None:
            return f"{own.writer}'s inputs cannot be read: {own.error or 'unknown'}"
        if status.config_digest != own.digest:
            if status.last_rejection:
                return f"rejects {own.writer}'s current inputs: {status.last_rejection}"
            return f"observed against other inputs than {own.writer}'s current ones ({', '.join(own.sources)})"
    elif status.config_digest != digest:
        if status.last_rejection and not (status.ready and not observing):
            return f"rejects the current config: {status.last_rejection}"
        return "enforces another config than the ConfigMap's current one"
    if status.mismatch is not None:
        writer = f"{status.writer or 'another agent'}'s rules in {status.chain or 'its chain'}"
        return f"observed: {writer} do not enforce the current config: {status.mismatch}"
    if not status.ready:
        return status.reason or "not ready"
    if not pod_ready:
        return "its pod is not ready"
    return ""


def fleet_view(configmaps: Sequence[ConfigMapState], statuses: Sequence[object], pods: Sequence[objects.Pod],
               nodes: Sequence[str], *, only: Sequence[str] = (), writers: Sequence[WriterContent] = (),
               trust: NodeTrust = TRUSTED) -> FleetView:
    digest = config_digest(tuple(c.content for c in sorted(configmaps, key=lambda c: c.name)
                                 if c.exists and c.content is not None))
    by_node = {s.node: s for s in _statuses(statuses) if s.node}
    known = set(nodes)
    pods_on: dict[str, list[objects.Pod]] = {}
    for item in pods:
        node_name = (item.get("spec") or {}).get("nodeName")
        if node_name is not None:
            pods_on.setdefault(node_name, []).append(item)
    rows = []
    for node in sorted(set(only) if only else known):
        if node not in known:
            rows.append(NodeRow(node, None, False, None, False, "no such node", exists=False))
            continue
        status = by_node.get(node)
        pod = _agent_pod(pods_on.get(node, []), status.pod if status is not None else None)
        pod_ready = _pod_ready(pod) if pod else False
        why = _why(status, pod, pod_ready, digest, {w.writer: w for w in writers})
        rows.append(NodeRow(node, pod["metadata"]["name"] if pod else None, pod_ready, status, not why, why,
                            verified=trust.verified))
    return FleetView(tuple(configmaps), digest, tuple(rows), ignored=len(set(by_node) - known),
                     writers=tuple(writers), trust=trust)
