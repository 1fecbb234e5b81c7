"""One holder among many candidates: a coordination.k8s.io/v1 Lease, as client-go's leader election uses it.

A candidate reads the Lease; it takes it when nobody holds it, or when the holder's record has not moved for the
lease's duration as measured on this candidate's own clock (client-go's rule: no comparison of clocks between nodes).
The holder renews it with a merge patch that carries the resourceVersion it last saw, so two candidates never both
win: the second one's patch is a 409. Everything goes through the ApiClient seam; the caller decides how often to ask.

The Lease is an object any agent may patch, so what it says is bounded by what the candidates accept: a
leaseDurationSeconds longer than their own (say 2147483647, patched in by hand or by a hostile node) counts as
theirs, so a holder that stopped renewing is replaced after `duration` whatever the Lease claims; and the fleet's size
the holder publishes on it (NODES_ANNOTATION: the nodes it counted, read by every candidate to spread its status
writes, ipmasq.agent.api.report) is read only as up to seven ASCII digits.

Where the node-trust admission policy is installed (deploy/base/admission-policy.yaml) no node's token names another
as the holder, releases another's hold or drops the duration; what it cannot refuse, having no clock, is a candidate
taking the Lease before it expired. The holder notices at its next renewal: an honest candidate takes over at least
`duration` after the record it last saw changed, which is no earlier than this holder's last renewal, so a Lease
found held by another sooner than that after the renewal was taken early (`Lost.early`). The caller says so once
(ipmasq.agent.api.summary); this candidate goes on asking as any other.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypedDict

from ipmasq.errors import Conflict, Forbidden, NotFound
from ipmasq.kube import objects, paths
from ipmasq.kube.client import ApiClient
from ipmasq.ownership import labels

__all__ = ["NODES_ANNOTATION", "LeaseElector", "Lost", "microtime"]

NODES_ANNOTATION = "ipmasq.dev/nodes"


def microtime(seconds: float | None = None) -> str:
    """A Lease's MicroTime: RFC 3339 in UTC with microseconds."""
    now = time.time() if seconds is None else seconds
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now)) + f".{int(now % 1 * 1e6):06d}Z"


@dataclass(frozen=True, slots=True)
class Lost:
    """This candidate held the Lease and found it held by another (or by nobody: released by another)."""

    holder: str | None  # who holds it now
    since_renewal: float  # seconds from this holder's last renewal (as sent) to finding it lost
    early: bool  # before it could have expired: taken (or released) by a node that did not wait


class LeasePatchMeta(TypedDict, total=False):
    resourceVersion: str | None  # None (null): written on no version
    annotations: dict[str, str]


class LeasePatch(TypedDict, total=False):
    """A merge patch of the Lease: its spec, and the resourceVersion it was written on (a 409 when another wrote)."""

    metadata: LeasePatchMeta
    spec: objects.LeaseSpec


class LeaseElector:
    def __init__(self, client: ApiClient, namespace: str, name: str, identity: str, *, duration: int,
                 clock: Callable[[], float] = time.monotonic, now: Callable[[], str] = microtime) -> None:
        self.client = client
        self.namespace, self.name, self.identity = namespace, name, identity
        self.duration = duration  # seconds the holder's record must stay unchanged before another takes over
        self.clock, self.now = clock, now
        self.holder: str | None = None  # as last seen
        self._version: str | None = None  # the Lease's resourceVersion when this candidate last held it
        self._observed: tuple[Any, ...] | None = None  # the holder's record as last seen, and since when (clock)
        self._observed_at = 0.0
        self.nodes: int | None = None  # the fleet's size as the Lease last said it (NODES_ANNOTATION)
        self.publish: int | None = None  # holding: the fleet's size to say on the Lease at the next renewal
        self.lost: Lost | None = None  # set when this holder found the Lease held by another; the caller clears it
        self._renewed_at: float | None = None  # clock when the last write that held it was sent

    @property
    def path(self) -> str:
        return paths.leases(self.namespace)

    @property
    def leading(self) -> bool:
        return self.holder == self.identity

    def try_lead(self) -> bool:
        """One attempt (one request when renewing, at most two otherwise); True when this candidate holds it now.

        Raises ApiError when the API cannot be asked (the caller retries later)."""
        held = self.leading and self._renewed_at is not None
        if self.leading and self._version is not None:
            try:  # renew blind, on the version held: a 409 means someone else wrote it, so read it again
                renewal = self._spec(renew_only=True)
                sent = self.clock()
                if self._took(self.client.patch(paths.leases(self.namespace, self.name), renewal)):
                    self._renewed_at = sent
                    return True
            except (Conflict, NotFound, Forbidden):  # Forbidden: the node-trust policy, on a Lease now another's
                self.holder, self._version = None, None
        try:
            lease = self._read(self.client.get(paths.leases(self.namespace, self.name)), "GET")
        except NotFound:
            sent = self.clock()
            try:
                took = self._took(self.client.create(self.path, {
                    "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                    "metadata": {"name": self.name, "namespace": self.namespace, "labels": labels()},
                    "spec": self._spec()["spec"]}), "POST")
            except Conflict:
                return False  # created by another candidate meanwhile
            if took:
                self._renewed_at = sent
            return took
        self._heard(lease)
        spec = lease.get("spec") or {}
        holder = spec.get("holderIdentity") or None
        record = (holder, spec.get("renewTime"), spec.get("acquireTime"), spec.get("leaseTransitions"))
        now = self.clock()
        if record != self._observed:
            self._observed, self._observed_at = record, now
        self.holder = holder
        if held and self.holder != self.identity and self._renewed_at is not None:
            since = now - self._renewed_at
            self.lost = Lost(self.holder, since, early=since < self.duration)
            self._renewed_at = None
        version = lease["metadata"].get("resourceVersion")
        duration = spec.get("leaseDurationSeconds")
        # never longer than this candidate's own duration: no Lease is held for ever by what it claims
        bounded = min(duration, self.duration) if duration is not None and duration > 0 else self.duration
        expired = now - self._observed_at >= bounded
        if holder is not None and holder != self.identity and not expired:
            return False
        transitions = (spec.get("leaseTransitions") or 0) + (holder is not None and holder != self.identity)
        body = self._spec(transitions=transitions, renew_only=holder == self.identity)
        body.setdefault("metadata", {})["resourceVersion"] = version
        sent = self.clock()
        try:
            took = self._took(self.client.patch(paths.leases(self.namespace, self.name), body))
        except Conflict:
            return False  # another candidate took it first
        if took:
            self._renewed_at = sent
        return took

    def release(self) -> None:
        """Give the Lease up (stopping): the next candidate to look takes it at once."""
        if not self.leading or self._version is None:
            return
        self.client.patch(paths.leases(self.namespace, self.name),
                          {"metadata": {"resourceVersion": self._version}, "spec": {"holderIdentity": None}})
        self.holder, self._version, self._renewed_at = None, None, None

    def _spec(self, *, transitions: int = 0, renew_only: bool = False) -> LeasePatch:
        spec: objects.LeaseSpec = {"renewTime": self.now()}
        if not renew_only:
            spec.update({"holderIdentity": self.identity, "acquireTime": spec["renewTime"],
                         "leaseDurationSeconds": self.duration, "leaseTransitions": transitions})
        body: LeasePatch = {"spec": spec}
        if renew_only and self._version is not None:
            body["metadata"] = {"resourceVersion": self._version}
        if self.publish is not None:
            body.setdefault("metadata", {})["annotations"] = {NODES_ANNOTATION: str(self.publish)}
        return body

    def _read(self, answer: object, verb: str) -> objects.Lease:
        return objects.lease(answer, f"{verb} {paths.leases(self.namespace, self.name)}")

    def _heard(self, lease: objects.Lease) -> None:
        said = lease["metadata"].get("annotations", {}).get(NODES_ANNOTATION)
        if said is not None and 0 < len(said) <= 7 and said.isascii() and said.isdigit():
            self.nodes = int(said)

    def _took(self, answer: object, verb: str = "PATCH") -> bool:
        lease = self._read(answer, verb)
        self._heard(lease)
        self.holder = (lease.get("spec") or {}).get("holderIdentity")
        version = lease["metadata"].get("resourceVersion")
        self._version = version if self.leading else None
        return self.leading
