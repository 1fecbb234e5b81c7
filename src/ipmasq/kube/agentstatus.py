"""IPMasqAgentStatus: one small cluster-scoped object per node, named after it and owned by its Node (so it goes with
the Node), that `kubectl get ipmasqagentstatuses` (short: `kubectl get ipmasq`) shows with printer columns: ready,
the enforced policy hash, backend, where the config came from, the reason. The CRD ships in deploy/base.

The object is a value (NodeStatus) turned into JSON here, written by the agent's reporter thread when it changes, and
read back by `ipmasq status`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ipmasq.errors import Conflict, Forbidden, NotFound
from ipmasq.kube import paths
from ipmasq.kube.client import ApiClient
from ipmasq.kube.paths import GROUP, KIND, VERSION
from ipmasq.ownership import labels

__all__ = ["NodeStatus", "StatusWriter", "status_from_json"]


@dataclass(frozen=True, slots=True)
class NodeStatus:
    """What one node's agent enforces and why, as of `updated`."""

    node: str
    pod: str | None
    version: str
    backend: str
    ready: bool
    reason: str
    policy_hash: str | None  # what `ipmasq render --print-hash` prints for the enforced config
    config_digest: str | None  # config_digest of the enforced config's content (compared with the ConfigMap's)
    config_source: str  # "api" or "file": which one the enforced content came from
    configmaps: tuple[tuple[str, str], ...]  # (name, resourceVersion) of each followed ConfigMap as last seen
    last_rejection: str | None  # the last rejected config's one line (file, line, value)
    last_rejection_time: str | None
    drift_repairs: int
    foreign_masquerade_rules: int | None
    updated: str
    # config_digest of the API content the last rejection was about (None: not known, or the file's): the elected
    # summary writer counts the nodes that rejected the ConfigMap's current content with it
    rejected_digest: str | None = None
    # "enforce" (this agent writes the rules) or "observe" (another program does: `writer`, in `chain`)
    mode: str = "enforce"
    writer: str | None = None
    chain: str = ""
    # observe mode: why the node's rules do not enforce the config of config_digest, one line (None: they do)
    mismatch: str | None = None
    # observe mode: the config keys the writer ignores, and what that does to traffic (not a mismatch), one line
    ignored: str | None = None
    # read back only: the Node named by the object's ownerReferences (the agent sets it when it can read the Node)
    owner: str | None = None

    @property
    def enforces(self) -> bool:
        """The node's rules were verified to hold the config of config_digest (by this agent's pass, or observed)."""
        return self.config_digest is not None and self.mismatch is None

    def as_json(self) -> dict[str, Any]:
        return {
            "nodeName": self.node, "agentPod": self.pod, "version": self.version, "backend": self.backend,
            "ready": self.ready, "reason": self.reason,
            "policyHash": self.policy_hash, "hash": (self.policy_hash or "")[:12] or None,
            "configDigest": self.config_digest, "configSource": self.config_source,
            "configMaps": [{"name": name, "resourceVersion": version} for name, version in self.configmaps],
            "lastRejection": self.last_rejection, "lastRejectionTime": self.last_rejection_time,
            "rejectedDigest": self.rejected_digest,
            "driftRepairs": self.drift_repairs, "foreignMasqueradeRules": self.foreign_masquerade_rules,
            "updateTime": self.updated,
            "mode": self.mode, "writer": self.writer, "chain": self.chain or None, "mismatch": self.mismatch,
            "ignoredByWriter": self.ignored,
        }


def _owner(meta: dict[str, Any]) -> str | None:
    """The Node the object is owned by (its ownerReferences), None when none is named."""
    owners = meta.get("ownerReferences")
    for owner in owners if isinstance(owners, list) else []:
        if isinstance(owner, dict) and owner.get("kind") == "Node" and isinstance(owner.get("name"), str):
            return str(owner["name"])
    return None


def status_from_json(obj: Mapping[str, Any]) -> NodeStatus:
    """Read back what an agent wrote (missing or wrongly typed fields as their empty values: never a traceback).

    The node a status speaks for is the object's name, never the body's nodeName: each node's agent writes the object
    named after its node, and the object's name is what an admission policy can tie to the writer's credentials."""
    def text(key: str) -> str | None:
        value = obj.get(key)
        return value if isinstance(value, str) else None

    def number(key: str) -> int | None:
        value = obj.get(key)
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    meta = obj.get("metadata") if isinstance(obj.get("metadata"), dict) else {}
    assert isinstance(meta, dict)
    maps = obj.get("configMaps") if isinstance(obj.get("configMaps"), list) else []
    assert isinstance(maps, list)
    name = meta.get("name")
    return NodeStatus(
        node=name if isinstance(name, str) else "", pod=text("agentPod"), version=text("version") or "",
        backend=text("backend") or "", ready=obj.get("ready") is True, reason=text("reason") or "",
        policy_hash=text("policyHash"), config_digest=text("configDigest"), config_source=text("configSource") or "",
        configmaps=tuple((str(m.get("name")), str(m.get("resourceVersion"))) for m in maps if isinstance(m, dict)),
        last_rejection=text("lastRejection"), last_rejection_time=text("lastRejectionTime"),
        drift_repairs=number("driftRepairs") or 0, foreign_masquerade_rules=number("foreignMasqueradeRules"),
        updated=text("updateTime") or "", rejected_digest=text("rejectedDigest"), mode=text("mode") or "enforce",
        writer=text("writer"), chain=text("chain") or "", mismatch=text("mismatch"), ignored=text("ignoredByWriter"),
        owner=_owner(meta))


# ipmasq's labels (ipmasq.ownership): given at creation, and by the first patch of an object an earlier release made
# without them (an upgrade adopts it)
LABELS = labels()


class StatusWriter:
    """Creates the node's status object once (owned by the Node when its uid can be read), then patches it."""

    def __init__(self, client: ApiClient, node: str) -> None:
        self.client = client
        self.node = node
        self._exists = False
        self._owner: dict[str, Any] | None = None

    def write(self, status: NodeStatus) -> None:
        body = status.as_json()
        if self._exists:
            try:
                self.client.patch(paths.statuses(self.node), body)
                return
            except NotFound:  # deleted (by hand, or with a Node of the same name): make it again
                self._exists = False
        self._create(body)

    def _create(self, body: dict[str, Any]) -> None:
        metadata: dict[str, Any] = {"name": self.node, "labels": dict(LABELS)}
        owner = self._node_owner()
        if owner is not None:
            metadata["ownerReferences"] = [owner]
        try:
            self.client.create(paths.statuses(), {"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND,
                                               "metadata": metadata, **body})
        except Conflict:  # written before this agent started (its predecessor, an earlier release, a restart)
            self.client.patch(paths.statuses(self.node), {"metadata": {"labels": dict(LABELS)}, **body})
        self._exists = True

    def _node_owner(self) -> dict[str, Any] | None:
        if self._owner is None:
            try:
                node = self.client.get(paths.nodes(self.node))
            except (NotFound, Forbidden):
                return None  # no such Node, or no right to read it: the status without an owner, rather than none
            uid = (node.get("metadata") or {}).get("uid")
            if isinstance(uid, str):
                self._owner = {"apiVersion": "v1", "kind": "Node", "name": self.node, "uid": uid,
                               "blockOwnerDeletion": False}
        return self._owner
