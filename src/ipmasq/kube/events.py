"""Kubernetes Events, aggregated as Kubernetes aggregates them: a repeat is a count, not another object.

An occurrence (what happened, to which object, on which node) is one Event object whose name is derived from all of
that, so every agent, and the same agent after a restart, finds its own. A repeat raises the count and
lastTimestamp, and is written at most once per REPEAT_WRITE_SECONDS: a bad edit is one Event on each rejecting
node's Node (`kubectl describe node` lists it with the reason), and a resync writes nothing more. Events are written
by the agent's reporter thread, never by its loop; what the ConfigMap shows is the fleet's summary
(ipmasq.agent.api.summary), written here too (`state`: one Event per key whose message is kept current). This is the one
place Events are written; every message is made one line (ipmasq.errors.one_line: it quotes what API objects and
configs say) and clipped.

What the node-trust admission policy (deploy/base/admission-policy.yaml) lets an agent's token write, and so what
this writer writes: Events about its own Node or a ConfigMap, that say who wrote them (reportingComponent, and
reportingInstance and source.host the node), messages of at most MESSAGE_CHARS characters, and patches of its own
Events only (every Event name here includes the node's name, so no two nodes ever write the same Event, not even
the fleet's summary after the Lease changed hands).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from ipmasq.errors import Conflict, NotFound, clip, one_line
from ipmasq.kube import objects, paths
from ipmasq.kube.client import ApiClient
from ipmasq.ownership import labels
from ipmasq.sha256 import sha256

__all__ = ["REPEAT_WRITE_SECONDS", "EventRecorder", "ObjectRef", "Occurrence", "event_object", "timestamp"]

REPEAT_WRITE_SECONDS = 300.0
REMEMBERED = 256  # occurrences whose Event this agent remembers (older ones are found again by name)
MESSAGE_CHARS = 1024  # what the admission policy lets an agent write (as events.k8s.io's limit on a note)


def timestamp(seconds: float | None = None) -> str:
    """RFC 3339 in UTC, to the second (what Event timestamps hold)."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds))


@dataclass(frozen=True, slots=True)
class ObjectRef:
    """The object an Event is about, as `kubectl describe` matches it (kind, namespace, name, uid)."""

    kind: str
    name: str
    namespace: str = ""
    uid: str = ""
    api_version: str = "v1"

    def as_json(self) -> objects.ObjectReference:
        ref: objects.ObjectReference = {"kind": self.kind, "name": self.name, "apiVersion": self.api_version}
        if self.namespace:
            ref["namespace"] = self.namespace
        if self.uid:
            ref["uid"] = self.uid
        return ref


@dataclass(frozen=True, slots=True)
class Occurrence:
    target: ObjectRef
    type: Literal["Normal", "Warning"]
    reason: str  # UpperCamelCase, as Kubernetes' own reasons
    message: str


@dataclass(slots=True)
class _Recorded:
    name: str
    count: int
    written_at: float  # monotonic
    unwritten: int = 0  # repeats not yet counted in the API


class EventRecorder:
    def __init__(self, client: ApiClient, *, component: str, host: str,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.client = client
        self.component, self.host = component, host
        self.clock = clock
        self._written: OrderedDict[Occurrence, _Recorded] = OrderedDict()
        # the reporter's thread and the summary's (a Lease lost early, said on the Node) both record
        self._lock = threading.RLock()

    def event_name(self, occurrence: Occurrence) -> str:
        key = "\0".join((self.host, occurrence.target.kind, occurrence.target.namespace, occurrence.target.name,
                         occurrence.target.uid, occurrence.type, occurrence.reason, occurrence.message))
        return f"{occurrence.target.name}.{sha256(key.encode()).hexdigest()[:16]}"

    def namespace(self, occurrence: Occurrence) -> str:
        # cluster-scoped objects (a Node) have their Events in default, as the kubelet writes them
        return occurrence.target.namespace or "default"

    def record(self, occurrence: Occurrence) -> None:
        """Write the occurrence (or count a repeat); raises ApiError when the API refuses or cannot be reached."""
        with self._lock:
            self._record(occurrence)

    def _record(self, occurrence: Occurrence) -> None:
        known = self._written.get(occurrence)
        now = self.clock()
        if known is not None:
            self._written.move_to_end(occurrence)
            known.unwritten += 1
            if now - known.written_at >= REPEAT_WRITE_SECONDS:
                self._write_count(occurrence, known)
            return
        name, path = self.event_name(occurrence), self._path(occurrence)
        try:
            self.client.create(path, self._event(occurrence, name))
            count = 1
        except Conflict:
            # this agent before a restart, or its predecessor on the node, wrote it: say it happened again (the
            # count it had is not read back: the agent may create and patch Events, not read them)
            self.client.patch(paths.events(self.namespace(occurrence), name), {"lastTimestamp": timestamp()})
            count = 1
        self._remember(occurrence, _Recorded(name, count, now))

    def state(self, occurrence: Occurrence, key: str) -> None:
        """Say the occurrence as the one Event named by `key` (and its target): created, or its message patched when
        it exists already (an earlier tally of the same content by this agent: a new holder of the Lease writes its
        own, the policy lets no node patch another's Event). Raises ApiError."""
        name = f"{occurrence.target.name}.{sha256(chr(0).join((self.host, key)).encode()).hexdigest()[:16]}"
        path = self._path(occurrence)
        fresh = self._event(occurrence, name)
        try:
            self.client.create(path, fresh)
        except Conflict:
            try:
                self.client.patch(paths.events(self.namespace(occurrence), name),
                                  {"message": fresh["message"], "lastTimestamp": timestamp()})
            except NotFound:  # expired meanwhile
                self.client.create(path, fresh)

    def flush(self) -> None:
        """Write the repeats held back by the rate limit whose time has come."""
        with self._lock:
            now = self.clock()
            for occurrence, known in list(self._written.items()):
                if known.unwritten and now - known.written_at >= REPEAT_WRITE_SECONDS:
                    self._write_count(occurrence, known)

    def _write_count(self, occurrence: Occurrence, known: _Recorded) -> None:
        count = known.count + known.unwritten
        try:
            self.client.patch(paths.events(self.namespace(occurrence), known.name),
                              {"count": count, "lastTimestamp": timestamp()})
        except NotFound:  # expired (Events live an hour): a new one
            self._written.pop(occurrence, None)
            self._record(occurrence)
            return
        known.count, known.unwritten, known.written_at = count, 0, self.clock()

    def _remember(self, occurrence: Occurrence, written: _Recorded) -> None:
        self._written[occurrence] = written
        while len(self._written) > REMEMBERED:
            self._written.popitem(last=False)

    def _path(self, occurrence: Occurrence) -> str:
        return paths.events(self.namespace(occurrence))

    def _event(self, occurrence: Occurrence, name: str) -> objects.Event:
        return event_object(occurrence, name, self.namespace(occurrence), component=self.component, host=self.host)


def event_object(occurrence: Occurrence, name: str, namespace: str, *, component: str, host: str) -> objects.Event:
    """A new core/v1 Event for the occurrence (count 1, first and last seen now), its message clipped."""
    now = timestamp()
    return {
        "apiVersion": "v1", "kind": "Event",
        "metadata": {"name": name, "namespace": namespace, "labels": labels()},
        "involvedObject": occurrence.target.as_json(),
        "type": occurrence.type, "reason": occurrence.reason,
        "message": clip(one_line(occurrence.message), MESSAGE_CHARS - 1),  # the ellipsis is one more
        "source": {"component": component, "host": host},
        "reportingComponent": component, "reportingInstance": host,
        "firstTimestamp": now, "lastTimestamp": now, "count": 1,
    }
