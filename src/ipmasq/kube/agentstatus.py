"""IPMasqAgentStatus: one small cluster-scoped object per node, named after it and owned by its Node (so it goes with
the Node), that `kubectl get ipmasqagentstatuses` (short: `kubectl get ipmasq`) shows with printer columns: ready,
the enforced policy hash, backend, where the config came from, the reason. The CRD ships in deploy/base.

The object is a value (NodeStatus) turned into JSON here, written by the agent's reporter thread when it changes, and
read back by `ipmasq status`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypedDict

from ipmasq.errors import Conflict, Forbidden, NotFound
from ipmasq.kube import objects, paths
from ipmasq.kube.client import ApiClient
from ipmasq.kube.paths import GROUP, KIND, VERSION
from ipmasq.ownership import labels

__all__ = ["NodeStatus", "StatusBody", "StatusWriter", "status_from_json"]


class StatusBody(TypedDict):
    """The fields an agent writes of its IPMasqAgentStatus (objects.AgentStatusObject, as written: None is null)."""

    nodeName: str
    agentPod: str | None
    version: str
    backend: str
    ready: bool
    reason: str
    policyHash: str | None
    hash: str | None
    configDigest: str | None
    configSource: str
    configMaps: list[objects.ConfigMapSeen]
    lastRejection: str | None
    lastRejectionTime: str | None
    rejectedDigest: str | None
    driftRepairs: int
    foreignMasqueradeRules: int | None
    updateTime: str
    mode: str
    writer: str | None
    chain: str | None
    mismatch: str | None
    ignoredByWriter: str | None


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

    def as_json(self) -> StatusBody:
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


def _owner(meta: objects.ObjectMeta) -> str | None:
    """The Node the object is owned by (its ownerReferences), None when none is named."""
    for owner in meta.get("ownerReferences") or []:
        name = owner.get("name")
        if owner.get("kind") == "Node" and name is not None:
            return name
    return None


def status_from_json(obj: objects.AgentStatusObject) -> NodeStatus:
    """Read back what an agent wrote, checked by ipmasq.kube.objects.agent_status (a field of the wrong type is
    ApiMalformed there); a nullable field that is null or missing is its empty value.

    The node a status speaks for is the object's name, never the body's nodeName: each node's agent writes the object
    named after its node, and the object's name is what an admission policy can tie to the writer's credentials."""
    return NodeStatus(
        node=obj["metadata"]["name"], pod=obj.get("agentPod"), version=obj.get("version") or "",
        backend=obj.get("backend") or "", ready=obj.get("ready") is True, reason=obj.get("reason") or "",
        policy_hash=obj.get("policyHash"), config_digest=obj.get("configDigest"),
        config_source=obj.get("configSource") or "",
        configmaps=tuple((m["name"], m["resourceVersion"]) for m in obj.get("configMaps") or []),
        last_rejection=obj.get("lastRejection"), last_rejection_time=obj.get("lastRejectionTime"),
        drift_repairs=obj.get("driftRepairs") or 0, foreign_masquerade_rules=obj.get("foreignMasqueradeRules"),
        updated=obj.get("updateTime") or "", rejected_digest=obj.get("rejectedDigest"),
        mode=obj.get("mode") or "enforce", writer=obj.get("writer"), chain=obj.get("chain") or "",
        mismatch=obj.get("mismatch"), ignored=obj.get("ignoredByWriter"), owner=_owner(obj["metadata"]))


# ipmasq's labels (ipmasq.ownership): given at creation, and by the first patch of an object an earlier release made
# without them (an upgrade adopts it)
LABELS = labels()


class StatusWriter:
    """Creates the node's status object once (owned by the Node when its uid can be read), then patches it."""

    def __init__(self, client: ApiClient, node: str) -> None:
        self.client = client
        self.node = node
        self._exists = False
        self._owner: objects.OwnerReference | None = None

    def write(self, status: NodeStatus) -> None:
        body = status.as_json()
        if self._exists:
            try:
                self.client.patch(paths.statuses(self.node), body)
                return
            except NotFound:  # deleted (by hand, or with a Node of the same name): make it again
                self._exists = False
        self._create(body)

    def _create(self, body: StatusBody) -> None:
        metadata: objects.ObjectMeta = {"name": self.node, "labels": dict(LABELS)}
        owner = self._node_owner()
        if owner is not None:
            metadata["ownerReferences"] = [owner]
        try:
            self.client.create(paths.statuses(), {"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND,
                                               "metadata": metadata, **body})
        except Conflict:  # written before this agent started (its predecessor, an earlier release, a restart)
            self.client.patch(paths.statuses(self.node), {"metadata": {"labels": dict(LABELS)}, **body})
        self._exists = True

    def _node_owner(self) -> objects.OwnerReference | None:
        if self._owner is None:
            path = paths.nodes(self.node)
            try:
                node = objects.node(self.client.get(path), f"GET {path}")
            except (NotFound, Forbidden):
                return None  # no such Node, or no right to read it: the status without an owner, rather than none
            uid = node["metadata"].get("uid")
            if uid is not None:
                self._owner = {"apiVersion": "v1", "kind": "Node", "name": self.node, "uid": uid,
                               "blockOwnerDeletion": False}
        return self._owner
