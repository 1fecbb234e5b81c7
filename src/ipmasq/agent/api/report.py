"""What the agent tells the API server: Events where `kubectl describe` looks, and its node's IPMasqAgentStatus.

Narrator (pure) turns the loop's reports into occurrences and the node's status value, once per change: a config
rejected (the log's one line: file, line, value), no ConfigMap (the defaults in force), drift repaired, foreign
masquerade rules found, another writer rewriting our rules (ForeignWriter, once per episode), waiting for the node
lock, a backend failure, each on the node's Node. A config applied is
said by the status object alone (its policy hash, digest and the ConfigMap's resourceVersion): a change costs each
node one status write, and a rejection one Event more. What the ConfigMap itself shows (`kubectl describe configmap`)
is a fleet summary written by one elected agent (ipmasq.agent.api.summary): a bad edit on 1,000 nodes is one Event there
("rejected on 998 of 1,000 nodes: ..."), not 1,000.

ApiReporter is a LoopListener: the loop hands it reports and goes on at once; a thread of its own writes to the API.
Nothing here can stop or slow the loop: the API down, slow or refusing only delays (or, past a bounded backlog,
drops) what is written, and is logged once per distinct trouble. Readiness never depends on it.
"""

from __future__ import annotations

import logging
import queue
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from ipmasq.agent.reports import ConfigReport, PassReport, SyncResult
from ipmasq.agent.trouble import Trouble
from ipmasq.backoff import Backoff
from ipmasq.errors import ApiError, ApiRefused, Forbidden, one_line
from ipmasq.kube.agentstatus import NodeStatus, StatusWriter
from ipmasq.kube.events import EventRecorder, ObjectRef, Occurrence, timestamp

__all__ = ["ApiReporter", "FleetSize", "Narrator", "Note", "retry_wait", "spread_seconds"]

BACKLOG = 200  # occurrences waiting to be written while the API is away; older ones are dropped beyond it
RETRY_INITIAL, RETRY_MAX = 1.0, 60.0  # the wait after a failed write, jittered: nodes do not retry in step
# How long the writer waits for more notes after one: a config change makes two (the config seen: not ready yet; the
# pass: ready), and one status write of the second is what each node should cost the API server per change.
COALESCE_SECONDS = 0.25
# Every node of a fleet hears of a ConfigMap change in the same second and has its status (after a bad edit, a Node
# Event too) to write about it. One burst from all of them, all one user and so one flow of the API server's priority
# and fairness, is shed with 429 beyond what that flow may queue (measured: 2,000 nodes at once, half their first
# writes refused, and the server's Retry-After raised to tens of seconds). Each node waits a random part of a spread
# more, so that the server gets a stream; the kernel is never waited for, only what is said about it. The spread
# grows with the fleet: the writes arrive at about SPREAD_RATE a second whatever its size (the rate the 2 s spread
# gave 1,000 nodes, which the API server took without shedding), so two nodes say a change at once and 2,000 within
# 4 s. The fleet's size is what the summary's Lease holder counted (ipmasq.agent.api.summary publishes it on the Lease,
# which keeps it across restarts; a candidate reads it at each ask, every 2-3 minutes); until an agent has heard it,
# SPREAD_SECONDS, the spread for a fleet of unknown size.
SPREAD_SECONDS = 2.0
SPREAD_RATE = 500.0  # status writes per second the fleet's spread aims at
SPREAD_MAX = 10.0


def spread_seconds(nodes: int | None) -> float:
    """The spread of the fleet's status writes after a change, for a fleet of `nodes` (None: not known yet)."""
    if nodes is None or nodes <= 0:
        return SPREAD_SECONDS
    return min(SPREAD_MAX, nodes / SPREAD_RATE)


class FleetSize:
    """The fleet's size as this agent last heard it (from the summary's Lease); read by the reporter's thread."""

    def __init__(self) -> None:
        self.nodes: int | None = None

    def heard(self, nodes: int) -> None:
        self.nodes = nodes

    def spread(self) -> float:
        return spread_seconds(self.nodes)


@dataclass(frozen=True, slots=True)
class Note:
    """What the narrator says after one report: occurrences to record, and the node's status if it changed."""

    occurrences: tuple[Occurrence, ...]
    status: NodeStatus | None


class Narrator:
    """Reports in, occurrences and status out, once per change (no I/O, no clock but the injected one).

    Everything it says comes from the reports: where the enforced content came from is the report's origin (a
    value the loop set), never a call back into the followers. `mode` is "enforce" or "observe"
    (ipmasq.observe.observer: then `writer` names the program whose rules in `chain` are observed)."""

    def __init__(self, node: str, *, pod: str | None, version: str, backend: str, now: Callable[[], str] = timestamp,
                 mode: str = "enforce", writer: str | None = None, chain: str = "") -> None:
        self.node_ref = ObjectRef(kind="Node", name=node, uid=node)  # kubelet's own reference to its Node
        self.status = NodeStatus(node=node, pod=pod, version=version, backend=backend, ready=False,
                                 reason="not ready: starting", policy_hash=None, config_digest=None,
                                 config_source="file", configmaps=(), last_rejection=None, last_rejection_time=None,
                                 drift_repairs=0, foreign_masquerade_rules=None, updated="", mode=mode,
                                 writer=writer, chain=chain)
        self.now = now
        self._said: dict[str, str] = {}  # topic -> what was last said of it: say only what changed

    def set_backend(self, backend: str) -> None:
        """The backend is chosen once the node lock is held, after the narrator started."""
        self.status = replace(self.status, backend=backend)

    def _once(self, topic: str, value: str) -> bool:
        if self._said.get(topic) == value:
            return False
        self._said[topic] = value
        return True

    def took_config(self, report: ConfigReport) -> Note:
        said: list[Occurrence] = []
        error = one_line(report.config_error) if report.config_error is not None else None
        if report.changed and error is None:
            # a good new config: the loop's pass follows at once, and its report says what the node enforces (the
            # moment between, "not applied yet", is not worth a status write on every node of the fleet)
            return Note((), None)
        status = self.status
        if error is not None and self._once("config", f"rejected {error}"):
            keeping = (f"keeping policy {report.policy_hash[:12]}" if report.policy_hash
                       else "leaving the rules untouched (no good config yet)")
            if self.status.mode == "observe":
                keeping = "observing the rules against the last good config"
            said.append(Occurrence(self.node_ref, "Warning", "ConfigRejected",
                                   f"node {self.node_ref.name} rejected the config: {error} ({keeping})"))
            origin = report.origin
            rejected = origin.digest if origin is not None and origin.source == "api" else None
            status = replace(status, last_rejection=error, last_rejection_time=self.now(), rejected_digest=rejected)
        return self._note(said, replace(status, ready=report.readiness.ok, reason=report.readiness.why))

    def reconciled(self, report: PassReport) -> Note:
        said: list[Occurrence] = []
        status = replace(self.status, ready=report.readiness.ok, reason=report.readiness.why,
                         foreign_masquerade_rules=report.foreign_masquerade_rules)
        node = self.node_ref.name
        origin = report.origin
        compared = report.result.verified or report.result is SyncResult.OUT_OF_SYNC
        if compared and report.policy_hash is not None:
            mismatch = one_line(report.mismatch) if report.mismatch is not None else None
            status = replace(status, policy_hash=report.policy_hash, config_digest=report.config_digest,
                             config_source=origin.source if origin is not None else "file",
                             configmaps=origin.configmaps if origin is not None else (), mismatch=mismatch,
                             ignored=one_line(report.ignored) if report.ignored is not None else None)
            if report.ignored is not None and self._once("ignored", report.ignored):
                said.append(Occurrence(self.node_ref, "Warning", "IgnoredByWriter",
                                       f"node {node}: {one_line(report.ignored)}"))
            elif report.ignored is None:
                self._said.pop("ignored", None)
            if mismatch is not None and self._once("mismatch", mismatch):
                said.append(Occurrence(self.node_ref, "Warning", "ConfigNotEnforced",
                                       f"node {node}: the rules {self.status.writer or 'another agent'} writes in "
                                       f"{self.status.chain} do not enforce policy {report.policy_hash[:12]}: "
                                       f"{mismatch}"))
            elif mismatch is None:
                self._said.pop("mismatch", None)
            # applied from a ConfigMap: the status above says so, and the elected writer's summary on the ConfigMap
            # counts it (no Event per node: a change costs each node one write)
            if (report.config_error is None and mismatch is None
                    and self._once("config", f"applied {report.policy_hash}")
                    and origin is not None and origin.exists is False):
                rules = sum(o.rules for o in report.objects)
                elements = sum(o.set_elements for o in report.objects)
                counts = f"{rules} rules" + (f", {elements} set elements" if elements else "")
                said.append(Occurrence(self.node_ref, "Normal", "NoConfigMap",
                                       f"node {node}: no ConfigMap, the reference's defaults are in force "
                                       f"(policy {report.policy_hash[:12]}, {counts})"))
        if report.drift_repair:
            status = replace(status, drift_repairs=status.drift_repairs + 1)
            said.append(Occurrence(self.node_ref, "Warning", "DriftRepaired",
                                   f"the node's nat rules were changed by someone else; rewritten to policy "
                                   f"{(report.policy_hash or '')[:12]}"))
        foreign = report.foreign_masquerade_rules
        if foreign and self._once("foreign", str(foreign)):
            said.append(Occurrence(self.node_ref, "Warning", "ForeignMasqueradeRules",
                                   f"{foreign} NAT rules not written by this agent masquerade or SNAT on this node "
                                   "(they may decide before ours do)"))
        writer = report.foreign_writer
        if writer is None:
            self._said.pop("foreign-writer", None)  # the episode is over: the next one is news
        elif self._once("foreign-writer", f"{writer.chain} {writer.family.value}"):  # once per episode
            said.append(Occurrence(self.node_ref, "Warning", "ForeignWriter", f"node {node}: {writer.describe()}"))
        if report.result is SyncResult.FAILED and report.backend_error is not None:
            if self._once("backend", report.backend_error):
                said.append(Occurrence(self.node_ref, "Warning", "ApplyFailed",
                                       f"{self.status.backend}: {one_line(report.backend_error)} (retrying)"))
        else:
            self._said.pop("backend", None)
        return self._note(said, status)

    def waiting(self, why: str) -> Note:
        said = []
        if self._once("waiting", why):
            said.append(Occurrence(self.node_ref, "Normal", "WaitingForNodeLock", why))
        return self._note(said, replace(self.status, ready=False, reason=why))

    def failed(self, why: str) -> Note:
        return self._note([], replace(self.status, ready=False, reason=one_line(why)))

    def _note(self, said: list[Occurrence], status: NodeStatus) -> Note:
        status = replace(status, reason=one_line(status.reason))
        changed = replace(status, updated="") != replace(self.status, updated="")
        if changed:
            status = replace(status, updated=self.now())
            self.status = status
        return Note(tuple(said), status if changed else None)


class ApiReporter:
    """A LoopListener that has the Narrator's notes written to the API by a thread of its own."""

    def __init__(self, narrator: Narrator, events: EventRecorder, status: StatusWriter, *, log: logging.Logger,
                 stop: threading.Event, fleet: FleetSize | None = None) -> None:
        self.narrator, self.events, self.status_writer = narrator, events, status
        self.log = log
        self.stop = stop
        self.fleet = fleet if fleet is not None else FleetSize()
        self._queue: queue.Queue[Note | None] = queue.Queue()
        self._backlog: list[Occurrence] = []
        self._status: NodeStatus | None = None  # the newest status not yet written
        self._trouble = Trouble(log, said="cannot write events or status to the API: %s (the rules are not "
                                          "affected; retrying)")
        self._dropped = 0
        self._thread = threading.Thread(target=self._run, name="api-reporter", daemon=True)

    def start(self) -> None:
        self._thread.start()

    # ---- LoopListener: called by the loop, never blocks ------------------------------------------------------

    def heartbeat(self) -> None:
        pass

    def took_config(self, report: ConfigReport) -> None:
        self._hand_over(self.narrator.took_config(report))

    def reconciled(self, report: PassReport, seconds: float) -> None:
        self._hand_over(self.narrator.reconciled(report))

    def waiting(self, why: str) -> None:
        self._hand_over(self.narrator.waiting(why))

    def failed(self, why: str) -> None:
        self._hand_over(self.narrator.failed(why))

    def _hand_over(self, note: Note) -> None:
        if note.occurrences or note.status is not None:  # most wakeups change nothing: nothing to write
            self._queue.put(note)

    # ---- the writer thread -----------------------------------------------------------------------------------

    def _run(self) -> None:
        backoff = Backoff(RETRY_INITIAL, RETRY_MAX, jitter=0.5)
        wait = RETRY_INITIAL  # before the next write while one is pending
        while not self.stop.is_set():
            try:
                note = self._queue.get(timeout=wait if self._pending() else 30.0)
                self._take(note)
                until = time.monotonic() + COALESCE_SECONDS + random.uniform(0.0, self.fleet.spread())
                while True:  # what the same change says next (its pass), then one write of the newest status
                    self._take(self._queue.get(timeout=max(0.0, until - time.monotonic())))
            except queue.Empty:
                pass
            try:
                self._write()
                backoff.reset()
                wait = RETRY_INITIAL
                self._recovered()
            except Exception as exc:  # an ApiError; and a bug here must not end the thread (nor ever the loop)
                self._troubled(exc)
                said = retry_wait(exc)
                wait = said if said is not None else backoff.next()

    def _pending(self) -> bool:
        return bool(self._backlog) or self._status is not None

    def _take(self, note: Note | None) -> None:
        if note is None:
            return
        self._backlog.extend(note.occurrences)
        if len(self._backlog) > BACKLOG:
            self._dropped += len(self._backlog) - BACKLOG
            del self._backlog[:-BACKLOG]
        if note.status is not None:
            self._status = note.status

    def _write(self) -> None:
        while self._backlog:
            occurrence = self._backlog[0]
            try:
                self.events.record(occurrence)
            except Forbidden as exc:  # RBAC will not change by retrying this one: say it, drop it
                self._troubled(exc)
            self._backlog.pop(0)
        self.events.flush()
        if self._status is not None:
            self.status_writer.write(self._status)
            self._status = None

    def _troubled(self, exc: Exception) -> None:
        self._trouble(str(exc) if isinstance(exc, ApiError) else f"{type(exc).__name__}: {exc}")

    def _recovered(self) -> None:
        if self._trouble.current is not None:
            self._trouble.ended()
            dropped = f" ({self._dropped} events dropped meanwhile)" if self._dropped else ""
            self.log.info("writing events and status to the API again%s", dropped)
            self._dropped = 0


def retry_wait(error: Exception, uniform: Callable[[float, float], float] = random.uniform) -> float | None:
    """The seconds to wait before writing again when the API server said when (a 429's or 503's Retry-After, which
    priority and fairness raise while it sheds, or what is left of it when the client did not even ask), with up to
    a quarter more so that a fleet told the same does not come back together; None: it did not say, back off.

    Our own doubling backoff is not added on top: the client refuses locally while a Retry-After runs, and backing off
    on those refusals (not the server's answers) left nodes asking a minute after the server would have taken them.
    Never sooner than the first backoff step, whatever a server says."""
    if isinstance(error, ApiRefused) and error.retry_after is not None:
        return max(error.retry_after, RETRY_INITIAL) * uniform(1.0, 1.25)
    return None
