"""The fleet's verdict on the ConfigMap, written by one agent: the holder of a Lease.

Every agent is a candidate; the one holding the Lease (ipmasq.kube.lease) is woken by its own follower when a new
content of the ConfigMap arrives (ipmasq.agent.api.config hands it the content with its digest, computed once:
nothing is polled or hashed again here), waits SETTLE_SECONDS for the nodes to say what they did with it, lists the
IPMasqAgentStatus objects (in pages) and writes the tally's summaries (ipmasq.fleet.tally) as Events on the
ConfigMap, through the agent's one Event writer (ipmasq.kube.events): one Warning "rejected on 998 of 1,000 nodes:
<line>", one Normal "enforced on 2 of 1,000 nodes". Each Event's name comes from the holder, the ConfigMap's uid, the
content's digest and the reason, so a later tally of the same content (nodes still reporting) patches the same
Event: a bad edit leaves two Events on the ConfigMap per holder at most, however many nodes reject it. A new holder
after a takeover writes its own (the node-trust admission policy lets no node patch another's Event); the newest
is the current tally.

Why in the agent and not in the webhook's Deployment: the summary matters most when a bad edit got past admission,
which is when the webhook is down or ignored (failurePolicy: Ignore); the agents are there whenever a config reaches
a node. The cost: every agent asks for the Lease now and then (CANDIDATE_SECONDS, jittered: one GET per node per 2-3
minutes, less than the node's own watch restarts), the holder renews it (one PATCH per RENEW_SECONDS) and lists the
statuses after a change. A node's own work for a change stays one status write.

Only real nodes are counted: a status object counts when it is owned by the Node it is named after (the agent sets
that ownerReference from the Node it reads; the API server's garbage collector deletes an object whose owner does
not exist), so objects written for nodes that do not exist do not inflate the tally. The holder publishes the count
on the Lease; every candidate reads it there and spreads its status writes by it (ipmasq.agent.api.report). Only a
settled count is published: two tallies in a row that agree. While a fleet starts, its status objects appear over
minutes and a tally counts only those written so far; a candidate that heard such a count (and keeps it until its
next ask, minutes later) would spread a thousand nodes' writes as if they were a few hundred, faster than the fixed
2 s ever did. Until the count settles every agent spreads as for a fleet of unknown size.

What the tally counts is what each node's agent wrote, which only the node-trust admission policy keeps to its own
node (ipmasq.fleet.nodetrust): the holder reads the policy and its binding by name at every renewal of the Lease,
and while they are not in force every summary says its counts are unverified, and why (the same line as `ipmasq
status`), and ipmasq_node_trust_verified is 0. A holder that finds the Lease taken before it could expire (the
policy cannot refuse that: it has no clock) says so once: a warning in its log, a Warning Event on its own Node and
ipmasq_summary_lease_lost_early_total; the new holder tallies from then on.
"""

from __future__ import annotations

import contextlib
import logging
import random
import threading
import time
from collections.abc import Callable
from typing import Protocol

from ipmasq.agent.api.config import ApiContent
from ipmasq.agent.api.report import RETRY_INITIAL, RETRY_MAX, FleetSize, retry_wait
from ipmasq.agent.trouble import Trouble
from ipmasq.backoff import Backoff
from ipmasq.errors import ApiError, clip, one_line
from ipmasq.fleet.nodetrust import NodeTrust, read_node_trust
from ipmasq.fleet.tally import Tally, tally
from ipmasq.kube import objects, paths
from ipmasq.kube.agentstatus import NodeStatus, status_from_json
from ipmasq.kube.client import ApiClient, list_items
from ipmasq.kube.events import EventRecorder, ObjectRef, Occurrence
from ipmasq.kube.lease import LeaseElector, Lost

__all__ = ["LEASE_SECONDS", "SummaryFacts", "SummaryWriter", "real_nodes"]

LEASE_SECONDS = 120  # the holder's record unchanged this long: a candidate takes over
RENEW_SECONDS = 40.0
CANDIDATE_SECONDS = 120.0  # a candidate asks again after 1-1.5 times this (and hears the fleet's size then)
FIRST_TRY_SECONDS = 5.0  # the first ask after start, drawn from [0, this): agents started together do not ask together
SETTLE_SECONDS = 2.0  # after a new content is seen, before the first tally
RETALLY_MAX = 60.0  # tallies again while nodes have not reported, at 2, 4, 8 ... this many seconds
RETALLY_FOR = 600.0  # and stops after this long (a node that is down never reports; its row in `ipmasq status` says so)
PAGE = 500  # status objects per list request
IDLE_WAKE_SECONDS = 1.0  # the holder looks at its stop at least this often (nothing else is done on such a wakeup)
CANDIDATE_WAKE_SECONDS = 5.0  # and a candidate, which has no Lease to give up when it stops


class SummaryFacts(Protocol):
    """What the summary tells the agent's metrics (ipmasq.agent.metrics AgentVitals), from its own thread."""

    def node_trust(self, verified: bool | None) -> None:
        """Holding the Lease: whether the node-trust policy was in force at the last look (None: not holding)."""

    def lease_lost_early(self) -> None:
        """The Lease was taken from this holder before it could have expired."""


def real_nodes(statuses: list[NodeStatus]) -> list[NodeStatus]:
    """The statuses that speak for a real node: owned by the Node they are named after (see the module's doc)."""
    return [s for s in statuses if s.node and s.owner == s.node]


class SummaryWriter:
    def __init__(self, client: ApiClient, elector: LeaseElector, events: EventRecorder, *, log: logging.Logger,
                 stop: threading.Event, clock: Callable[[], float] = time.monotonic,
                 fleet: FleetSize | None = None, facts: SummaryFacts | None = None) -> None:
        self.client, self.elector, self.events = client, elector, events
        self.facts = facts
        self.log, self.stop, self.clock = log, stop, clock
        self.fleet = fleet if fleet is not None else FleetSize()  # told the size the Lease says, or this tally's
        self.last: Tally | None = None  # the last tally written
        self._counted: int | None = None  # the nodes the tally before counted: a count is settled when two agree
        self._settled = False  # the last tally's count was settled (and so published)
        self._content: ApiContent | None = None  # the followed ConfigMaps' content, as last handed in
        self._wake = threading.Event()
        self._target: tuple[str, ...] | None = None  # (ConfigMap uid, digest) being summarized
        self._seen_at = 0.0
        self._next_tally: float | None = None
        self._interval = SETTLE_SECONDS
        self._written: dict[str, str] = {}  # Event key -> message written
        self.trust: NodeTrust | None = None  # holding: the node-trust policy as last read
        self._next_lease = clock() + random.uniform(0.0, FIRST_TRY_SECONDS)
        self._backoff = Backoff(RETRY_INITIAL, RETRY_MAX, jitter=0.5)  # after a failed ask (the reporter's steps)
        self._trouble = Trouble(log, said="fleet summary: %s (the rules are not affected; retrying)",
                                over="fleet summary: the API answers again")
        self._thread = threading.Thread(target=self._run, name="fleet-summary", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def content_changed(self, content: ApiContent) -> None:
        """A new content of the followed ConfigMaps (called from a follower's thread): wakes the holder. A candidate
        only keeps it (it tallies what is there when it takes the Lease): a change must not wake every node's thread
        for nothing."""
        self._content = content
        if self.elector.leading:
            self._wake.set()

    def _run(self) -> None:
        while not self.stop.is_set():
            self._wake.wait(self._sleep())
            self._wake.clear()
            if self.stop.is_set():
                break
            self.attempt()
        if self.elector.leading:
            with contextlib.suppress(ApiError):
                self.elector.release()

    def attempt(self) -> None:
        """One step, whatever goes wrong in it said once and held off (never raises)."""
        try:
            self.step()
            self._trouble.ended()
        except ApiError as exc:
            self._trouble(str(exc))
            self._hold_off(retry_wait(exc))
        except Exception as exc:  # a bug here must not end the thread
            self._trouble(f"{type(exc).__name__}: {exc}")
            self._hold_off(None)

    def _hold_off(self, said: float | None) -> None:
        """After a failed step nothing is due again before the server's Retry-After (`said`) or the backoff's next
        wait: a tally is due until it succeeds, and while a Retry-After runs the client refuses at once, so without
        this the holder asked again at once, in a loop (measured: ten refusals a second under load)."""
        until = self.clock() + (said if said is not None else self._backoff.next())
        self._next_lease = max(self._next_lease, until)
        if self._next_tally is not None:
            self._next_tally = max(self._next_tally, until)

    def _sleep(self) -> float:
        """Until the next thing due (an ask of the Lease, a tally), at most IDLE_WAKE_SECONDS (a candidate:
        CANDIDATE_WAKE_SECONDS): a new content wakes the holder at once."""
        due = [self._next_lease] + ([self._next_tally] if self._next_tally is not None else [])
        idle = IDLE_WAKE_SECONDS if self.elector.leading else CANDIDATE_WAKE_SECONDS
        return min(idle, max(0.0, min(due) - self.clock()))

    def step(self) -> None:
        """One look: the Lease when due, then, holding it, a tally when due. Raises ApiError."""
        now = self.clock()
        if now >= self._next_lease:
            self._next_lease = now + self._candidate_wait()  # if the ask raises
            was = self.elector.leading
            leading = self.elector.try_lead()
            self._backoff.reset()
            if self.elector.nodes is not None:
                self.fleet.heard(self.elector.nodes)
            self._next_lease = now + (RENEW_SECONDS if leading else self._candidate_wait())
            lost, self.elector.lost = self.elector.lost, None
            if lost is not None:
                self._lost(lost)
            if leading and not was:
                self.log.info("holding Lease %s/%s: this agent tallies the fleet (its summary is an Event on the "
                              "ConfigMap, where there is one: EKS's inputs are a DaemonSet's)",
                              self.elector.namespace, self.elector.name)
                self._target = None  # tally what is there now: the previous holder may not have
            if leading:
                self._look_at_trust(now)
            elif was:
                self.trust = None
                if self.facts is not None:
                    self.facts.node_trust(None)
        if not self.elector.leading:
            return
        content = self._content
        target = content.target if content is not None else None
        if content is None or target is None or target.uid is None or content.origin.digest is None:
            return
        digest = content.origin.digest
        if (target.uid, digest) != self._target:
            self._target = (target.uid, digest)
            self._written.clear()  # a new content's Events have names of their own: remember only the current ones
            self._seen_at, self._next_tally, self._interval = now, now + SETTLE_SECONDS, SETTLE_SECONDS
        if self._next_tally is None or now < self._next_tally:
            return
        result = self._tally(digest)
        self._write(result, ObjectRef("ConfigMap", target.name, target.namespace, target.uid), digest)
        self._backoff.reset()
        self.last = result
        self._interval = min(self._interval * 2, RETALLY_MAX)
        # tallied again until the count has settled too, so that the fleet's size gets published (see _tally)
        done = (result.pending == 0 and self._settled) or now - self._seen_at >= RETALLY_FOR
        self._next_tally = None if done else now + self._interval

    def _lost(self, lost: Lost) -> None:
        """Said once per loss: early, a warning, an Event on this node's Node and the counter; else a line."""
        where = f"{self.elector.namespace}/{self.elector.name}"
        holder = clip(one_line(lost.holder), 80) if lost.holder else None  # the Lease says it: anyone could write it
        if not lost.early:
            self.log.info("no longer holding Lease %s, now held by %s (this agent had not renewed it for %.0f s)",
                          where, holder or "nobody", lost.since_renewal)
            return
        how = f"taken from this agent by {holder}" if holder else "released for this agent by another node"
        line = (f"Lease {where} {how} {lost.since_renewal:.0f} s after it renewed it, before it could expire "
                f"({self.elector.duration} s): a node that does not wait for expiry. The fleet's summary goes on "
                "with the new holder")
        self.log.warning("%s", line)
        if self.facts is not None:
            self.facts.lease_lost_early()
        node = self.elector.identity
        self.events.record(Occurrence(ObjectRef("Node", node, uid=node), "Warning", "SummaryLeaseLostEarly", line))

    def _look_at_trust(self, now: float) -> None:
        """Holding: the node-trust policy read again (two GETs per renewal); a change is said, and the current
        content tallied again so that its summaries say it."""
        trust = read_node_trust(self.client)
        if trust == self.trust:
            return
        if not trust.verified:
            self.log.warning("fleet summary: the nodes' statuses are unverified: %s", trust.why)
        elif self.trust is not None:
            self.log.info("fleet summary: the node-trust admission policy is in force again")
        self.trust = trust
        if self.facts is not None:
            self.facts.node_trust(trust.verified)
        if self._target is not None and self._next_tally is None:
            self._next_tally = now

    def _candidate_wait(self) -> float:
        # not sooner while the fleet's size is unknown: on a new cluster a thousand candidates asking every few
        # seconds were shed with 429 beside their own first lists (measured); the Lease keeps the size across
        # restarts, so a restarted agent hears it at its first ask
        return CANDIDATE_SECONDS * random.uniform(1.0, 1.5)

    def _tally(self, digest: str) -> Tally:
        listing = list_items(self.client, paths.statuses(), objects.agent_status, page=PAGE)
        statuses = [status_from_json(item) for item in listing.items]
        trust = self.trust
        result = tally(digest, real_nodes(statuses),
                       unverified=None if trust is None or trust.verified else trust.why)
        before = self._counted if self._counted is not None else self.elector.nodes  # a new holder: the Lease's
        self._counted = result.nodes
        self._settled = result.nodes == before
        if not self._settled:
            return result  # a fleet still starting (see the module's doc), or nodes joining or leaving: not yet
        self.fleet.heard(result.nodes)
        if self.elector.publish != result.nodes:  # a new size: said on the Lease now, not at the next renewal
            self.elector.publish = result.nodes
            self._next_lease = self.clock()
        return result

    def _write(self, result: Tally, configmap: ObjectRef, digest: str) -> None:
        for summary in result.summaries:
            # named by the content and the reason (and, in the Event writer, this holder), not the message: a later
            # tally of the same content (counts moved on) patches the same Event
            key = "\0".join((configmap.uid, digest, summary.reason))
            if self._written.get(key) == summary.message:
                continue
            self.events.state(Occurrence(configmap, summary.type, summary.reason, summary.message), key)
            self._written[key] = summary.message
