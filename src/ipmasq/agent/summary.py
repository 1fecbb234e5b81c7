"""The fleet's verdict on the ConfigMap, written by one agent: the holder of a Lease.

Every agent is a candidate; the one holding the Lease (ipmasq.kube.lease) watches for a new content of the ConfigMap
(its own follower already sees it), waits SETTLE_SECONDS for the nodes to say what they did with it, lists the
IPMasqAgentStatus objects (in pages) and writes the tally's summaries (ipmasq.kube.summary) as Events on the
ConfigMap: one Warning "rejected on 998 of 1,000 nodes: <line>", one Normal "enforced on 2 of 1,000 nodes". Each
Event's name comes from the ConfigMap's uid, the content's digest and the reason, so a later tally of the same
content (nodes still reporting, or a new holder after a takeover) patches the same Event: a bad edit leaves two
Events on the ConfigMap at most, however many nodes reject it.

Why in the agent and not in the webhook's Deployment: the summary matters most when a bad edit got past admission,
which is when the webhook is down or ignored (failurePolicy: Ignore); the agents are there whenever a config reaches
a node. The cost: every agent asks for the Lease now and then (CANDIDATE_SECONDS, jittered: one GET per node per
2-3 minutes, less than the node's own watch restarts), the holder renews it (one PATCH per RENEW_SECONDS) and lists
the statuses after a change. A node's own work for a change stays one status write.
"""

from __future__ import annotations

import contextlib
import logging
import random
import threading
import time
from collections.abc import Callable

from ipmasq.errors import ApiError, Conflict, NotFound
from ipmasq.kube import objects
from ipmasq.kube.agentstatus import status_from_json, status_path
from ipmasq.kube.client import ApiClient, list_items
from ipmasq.kube.configmaps import ConfigMapState
from ipmasq.kube.events import ObjectRef, Occurrence, event_object, timestamp
from ipmasq.kube.lease import LeaseElector
from ipmasq.kube.summary import Tally, tally
from ipmasq.sha256 import sha256

__all__ = ["LEASE_SECONDS", "SummaryWriter"]

LEASE_SECONDS = 120  # the holder's record unchanged this long: a candidate takes over
RENEW_SECONDS = 40.0
CANDIDATE_SECONDS = 120.0  # a candidate asks again after 1-1.5 times this
FIRST_TRY_SECONDS = 5.0  # the first ask after start, drawn from [0, this): agents started together do not ask together
SETTLE_SECONDS = 2.0  # after a new content is seen, before the first tally
RETALLY_MAX = 60.0  # tallies again while nodes have not reported, at 2, 4, 8 ... this many seconds
RETALLY_FOR = 600.0  # and stops after this long (a node that is down never reports; its row in `ipmasq status` says so)
PAGE = 500  # status objects per list request


class SummaryWriter:
    def __init__(self, client: ApiClient, elector: LeaseElector, configmaps: Callable[[], dict[str, ConfigMapState]],
                 digest: Callable[[], str | None], *, component: str, host: str, log: logging.Logger,
                 stop: threading.Event, clock: Callable[[], float] = time.monotonic) -> None:
        self.client, self.elector = client, elector
        # the followed ConfigMaps as last seen, and their content's digest
        self.configmaps, self.digest = configmaps, digest
        self.component, self.host = component, host
        self.log, self.stop, self.clock = log, stop, clock
        self.last: Tally | None = None  # the last tally written
        self._target: tuple[str, ...] | None = None  # (ConfigMap uid, digest) being summarized
        self._seen_at = 0.0
        self._next_tally: float | None = None
        self._interval = SETTLE_SECONDS
        self._written: dict[str, str] = {}  # Event name -> message written
        self._next_lease = clock() + random.uniform(0.0, FIRST_TRY_SECONDS)
        self._trouble: str | None = None
        self._thread = threading.Thread(target=self._run, name="fleet-summary", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while not self.stop.wait(self._sleep()):
            try:
                self.step()
                if self._trouble is not None:
                    self.log.info("fleet summary: the API answers again")
                    self._trouble = None
            except ApiError as exc:
                if str(exc) != self._trouble:
                    self.log.warning("fleet summary: %s (the rules are not affected; retrying)", exc)
                    self._trouble = str(exc)
            except Exception as exc:  # a bug here must not end the thread
                self.log.warning("fleet summary: %s: %s", type(exc).__name__, exc)
        if self.elector.leading:
            with contextlib.suppress(ApiError):
                self.elector.release()

    def _sleep(self) -> float:
        """The holder looks twice a second for a new content (its own follower's view: no request); a candidate
        sleeps until its next ask, at most 5 s at a time."""
        if self.elector.leading:
            return 0.5
        return min(5.0, max(0.5, self._next_lease - self.clock()))

    def step(self) -> None:
        """One look: the Lease when due, then, holding it, a tally when due. Raises ApiError."""
        now = self.clock()
        if now >= self._next_lease:
            self._next_lease = now + CANDIDATE_SECONDS * random.uniform(1.0, 1.5)  # if the ask raises
            was = self.elector.leading
            leading = self.elector.try_lead()
            self._next_lease = now + (RENEW_SECONDS if leading else CANDIDATE_SECONDS * random.uniform(1.0, 1.5))
            if leading and not was:
                self.log.info("holding Lease %s/%s: this agent writes the fleet's summary on the ConfigMap",
                              self.elector.namespace, self.elector.name)
                self._target = None  # tally what is there now: the previous holder may not have
        if not self.elector.leading:
            return
        target = self._current()
        if target is None:
            return
        if target[:2] != self._target:
            self._target = target[:2]
            self._written.clear()  # a new content's Events have names of their own: remember only the current ones
            self._seen_at, self._next_tally, self._interval = now, now + SETTLE_SECONDS, SETTLE_SECONDS
        if self._next_tally is None or now < self._next_tally:
            return
        result = self._tally(target[1])
        self._write(result, target)
        self.last = result
        self._interval = min(self._interval * 2, RETALLY_MAX)
        done = result.pending == 0 or now - self._seen_at >= RETALLY_FOR
        self._next_tally = None if done else now + self._interval

    def _current(self) -> tuple[str, str, str, str] | None:
        """(uid, digest, name, namespace) of the first followed ConfigMap that exists, with the content's digest."""
        digest = self.digest()
        if digest is None:
            return None
        for state in sorted(self.configmaps().values(), key=lambda s: s.name):
            if state.exists and state.uid:
                return state.uid, digest, state.name, state.namespace
        return None

    def _tally(self, digest: str) -> Tally:
        listing = list_items(self.client, status_path(), objects.agent_status, page=PAGE)
        return tally(digest, [status_from_json(item) for item in listing.items])

    def _write(self, result: Tally, target: tuple[str, str, str, str]) -> None:
        uid, digest, name, namespace = target
        configmap = ObjectRef("ConfigMap", name, namespace, uid)
        path = f"/api/v1/namespaces/{namespace}/events"
        for summary in result.summaries:
            # named by the content and the reason, not the message: a later tally of the same content (counts moved
            # on, or a new holder) patches the same Event
            key = "\0".join((uid, digest, summary.reason)).encode()
            event = f"{name}.{sha256(key).hexdigest()[:16]}"
            if self._written.get(event) == summary.message:
                continue
            said = Occurrence(configmap, summary.type, summary.reason, summary.message)
            fresh = event_object(said, event, namespace, component=self.component, host=self.host)
            try:
                self.client.create(path, fresh)
            except Conflict:  # an earlier tally of the same content (by this holder or one before it)
                try:
                    self.client.patch(f"{path}/{event}", {"message": fresh["message"], "lastTimestamp": timestamp()})
                except NotFound:  # expired meanwhile
                    self.client.create(path, fresh)
            self._written[event] = summary.message
