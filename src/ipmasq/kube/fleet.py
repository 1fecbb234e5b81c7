"""The whole cluster at a glance: does every node enforce the ConfigMap's current content? (`ipmasq status`)

Pure: the API's objects in (the ConfigMaps, the nodes' IPMasqAgentStatus objects, the agent's pods, the Nodes),
one row per node out. A node is current when its agent's pod is ready, its status says ready, and the content it
enforces has the ConfigMap's own digest (config_digest: equal for the mounted file and the ConfigMap it came from).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ipmasq.config.source import config_digest
from ipmasq.kube.agentstatus import NodeStatus, status_from_json
from ipmasq.kube.configmaps import ConfigMapState

__all__ = ["FleetView", "NodeRow", "fleet_view"]


@dataclass(frozen=True, slots=True)
class NodeRow:
    node: str
    pod: str | None  # the agent's pod on the node (None: no agent pod)
    pod_ready: bool
    status: NodeStatus | None  # what the node's agent wrote (None: nothing)
    current: bool  # enforces the ConfigMap's current content, verified in its kernel
    why: str  # one line: why not current ("" when current)

    def as_json(self) -> dict[str, Any]:
        status = self.status
        return {
            "node": self.node, "pod": self.pod, "pod_ready": self.pod_ready, "current": self.current, "why": self.why,
            "ready": status.ready if status else None, "policy_hash": status.policy_hash if status else None,
            "config_source": status.config_source if status else None,
            "backend": status.backend if status else None,
            "last_rejection": status.last_rejection if status else None,
            "drift_repairs": status.drift_repairs if status else None,
            "updated": status.updated if status else None,
        }


@dataclass(frozen=True, slots=True)
class FleetView:
    configmaps: tuple[ConfigMapState, ...]
    digest: str  # config_digest of the ConfigMaps' current content (no ConfigMap: the defaults' empty content)
    rows: tuple[NodeRow, ...]

    @property
    def all_current(self) -> bool:
        return bool(self.rows) and all(row.current for row in self.rows)

    def as_json(self) -> dict[str, Any]:
        return {
            "configmaps": [{"namespace": c.namespace, "name": c.name, "exists": c.exists,
                            "resource_version": c.resource_version} for c in self.configmaps],
            "config_digest": self.digest, "all_current": self.all_current,
            "nodes": [row.as_json() for row in self.rows],
        }


def _pod_ready(pod: dict[str, Any]) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(isinstance(c, dict) and c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def fleet_view(configmaps: Sequence[ConfigMapState], statuses: Sequence[dict[str, Any]],
               pods: Sequence[dict[str, Any]], nodes: Sequence[str]) -> FleetView:
    digest = config_digest(tuple(c.content for c in sorted(configmaps, key=lambda c: c.name)
                                 if c.exists and c.content is not None))
    by_node = {s.node: s for s in (status_from_json(obj) for obj in statuses)}
    pod_on: dict[str, dict[str, Any]] = {}
    for item in pods:
        node_name = (item.get("spec") or {}).get("nodeName")
        if isinstance(node_name, str):
            pod_on[node_name] = item
    rows = []
    for node in sorted(set(nodes) | set(by_node)):
        status, pod = by_node.get(node), pod_on.get(node)
        pod_name = (pod.get("metadata") or {}).get("name") if pod else None
        pod_ready = _pod_ready(pod) if pod else False
        if pod is None:
            why = "no agent pod on this node"
        elif status is None:
            why = "its agent wrote no status (API off, or no rights to write it)"
        elif status.config_digest != digest:
            why = (f"rejects the current config: {status.last_rejection}" if status.last_rejection
                   and not status.ready else "enforces another config than the ConfigMap's current one")
        elif not status.ready:
            why = status.reason or "not ready"
        elif not pod_ready:
            why = "its pod is not ready"
        else:
            why = ""
        rows.append(NodeRow(node, pod_name if isinstance(pod_name, str) else None, pod_ready, status, not why, why))
    return FleetView(tuple(configmaps), digest, tuple(rows))
