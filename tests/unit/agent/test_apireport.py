"""What the agent tells the API: occurrences and the node's status, once per change, written off the loop."""

from __future__ import annotations

import itertools
import logging
import threading
import time
from dataclasses import replace

import pytest

from ipmasq.agent.api import report as apireport
from ipmasq.agent.api.report import RETRY_INITIAL, ApiReporter, Narrator, Note, retry_wait
from ipmasq.agent.origin import ConfigOrigin
from ipmasq.agent.reports import ConfigReport, ObjectCount, PassReport, ProbeVerdict, SyncResult
from ipmasq.errors import ApiServerError, ApiUnreachable, NotFound, TooManyRequests
from ipmasq.kube import paths
from ipmasq.kube.agentstatus import StatusWriter, status_from_json
from ipmasq.kube.events import EventRecorder
from ipmasq.prefix import Family
from ipmasq.testing.kube import FakeKubeClient
from tests.eventually import eventually

READY = ProbeVerdict(True, "ready: the kernel matches the current config")


def narrator() -> Narrator:
    return Narrator("node-a", pod="ip-masq-agent-x1", version="0.1.0", backend="iptables-nft",
                    now=lambda: "2026-11-24T10:00:00Z")


def origin(exists: bool | None = True, digest: str = "d" * 64) -> ConfigOrigin:
    return ConfigOrigin("api", digest=digest, configmaps=(("ip-masq-agent", "41"),), exists=exists)


def applied(policy: str = "a" * 64, *, drift: bool = False, error: str | None = None,
            result: SyncResult = SyncResult.APPLIED, foreign: int | None = 0, exists: bool | None = True,
            mismatch: str | None = None) -> PassReport:
    return PassReport(result=result, config_error=error, backend_error=None, drift_repair=drift, writes=(),
                      removed_leftovers=(), leftovers=(), policy_hash=policy,
                      objects=(ObjectCount(Family.V4, 5, 0),), resync_interval=60.0,
                      readiness=READY if error is None else ProbeVerdict(False, f"not ready: config error: {error}"),
                      foreign_masquerade_rules=foreign, config_digest="d" * 64, origin=origin(exists),
                      mismatch=mismatch)


def test_applied_is_said_by_the_status_alone_then_silent_until_something_changes() -> None:
    teller = narrator()
    note = teller.reconciled(applied())
    assert note.occurrences == ()  # no Event per node: the elected writer's summary on the ConfigMap counts it
    assert note.status is not None and note.status.ready and note.status.config_source == "api"
    assert note.status.policy_hash == "a" * 64 and note.status.config_digest == "d" * 64
    quiet = teller.reconciled(applied(result=SyncResult.IN_SYNC))
    assert quiet.occurrences == () and quiet.status is None
    # a good new config seen: nothing until its pass says what the node enforces (one status write per change)
    seen = ConfigReport(changed=True, config_error=None, policy_hash="b" * 64, resync_interval=60.0,
                        readiness=ProbeVerdict(False, "not ready: the current config is not applied yet"))
    assert teller.took_config(seen) == Note((), None)
    assert teller.reconciled(applied("b" * 64)).status is not None


def test_a_rejected_config_is_said_once_with_its_line_and_the_policy_kept() -> None:
    teller = narrator()
    teller.reconciled(applied())
    bad = "configmap/ip-masq-agent[config]:3: nonMasqueradeCIDRs[0]: invalid CIDR '10.0.0.0/33'"
    report = ConfigReport(changed=True, config_error=bad, policy_hash="a" * 64, resync_interval=60.0,
                          readiness=ProbeVerdict(False, f"not ready: config error: {bad}"),
                          origin=origin(digest="c" * 64))
    (said,) = teller.took_config(report).occurrences
    assert said.reason == "ConfigRejected" and said.type == "Warning"
    assert said.target == teller.node_ref  # on the Node: the ConfigMap gets the fleet's summary instead
    assert teller.status.rejected_digest == "c" * 64  # the content rejected, for the summary's tally
    assert said.message == f"node node-a rejected the config: {bad} (keeping policy aaaaaaaaaaaa)"
    assert teller.took_config(report).occurrences == ()
    assert teller.status.last_rejection == bad
    # the passes that keep enforcing the last good policy meanwhile say nothing more
    assert teller.reconciled(applied(error=bad, result=SyncResult.IN_SYNC)).occurrences == ()


def test_no_configmap_is_said_on_the_node_drift_and_foreign_rules_too() -> None:
    teller = narrator()
    (said,) = teller.reconciled(applied(exists=False)).occurrences
    assert (said.target.kind, said.reason) == ("Node", "NoConfigMap")
    reasons = [o.reason for o in teller.reconciled(applied(drift=True, foreign=3, exists=False)).occurrences]
    assert reasons == ["DriftRepaired", "ForeignMasqueradeRules"]
    assert teller.status.drift_repairs == 1


def started_reporter(client: FakeKubeClient, teller: Narrator, stop: threading.Event) -> ApiReporter:
    """A reporter for node-a writing through `client`, its thread started; it ends when `stop` is set."""
    client.put("/api/v1/nodes/node-a", {"metadata": {"name": "node-a", "uid": "node-uid"}})
    reporter = ApiReporter(teller, EventRecorder(client, component="ip-masq-agent", host="node-a"),
                           StatusWriter(client, "node-a"), log=logging.getLogger("test"), stop=stop)
    reporter.start()
    return reporter


def test_the_reporter_writes_events_and_status_and_catches_up_after_the_api_returns() -> None:
    client = FakeKubeClient()
    client.refuse("/api/v1/namespaces/default/events", ApiUnreachable("connection refused"))
    stop = threading.Event()
    teller = narrator()
    reporter = started_reporter(client, teller, stop)
    reporter.reconciled(applied(exists=False), 0.01)  # hands over and returns: the writing is the thread's
    eventually(lambda: paths.statuses("node-a") in client.objects and any("/events/" in p for p in client.objects),
               lambda: f"the status and an Event written; calls: {client.calls}")
    stop.set()
    written = client.objects[paths.statuses("node-a")]
    assert written["metadata"]["ownerReferences"][0]["uid"] == "node-uid"
    assert status_from_json(written) == replace(teller.status, owner="node-a")  # read back, owned by its Node


def test_a_config_change_costs_one_status_write_not_one_per_report() -> None:
    client = FakeKubeClient()
    stop = threading.Event()
    reporter = started_reporter(client, narrator(), stop)
    try:
        reporter.reconciled(applied(), 0.01)
        eventually(lambda: paths.statuses("node-a") in client.objects,
                   lambda: f"the status written; calls: {client.calls}")
        client.calls.clear()
        # a new config: seen (not ready: not applied yet), then its pass (ready); the writer waits for the second
        changed = ConfigReport(changed=True, config_error=None, policy_hash="a" * 64, resync_interval=60.0,
                               readiness=ProbeVerdict(False, "not ready: the current config is not applied yet"))
        reporter.took_config(changed)
        reporter.reconciled(applied("b" * 64), 0.01)
        eventually(lambda: client.objects[paths.statuses("node-a")]["policyHash"] == "b" * 64,
                   lambda: f"the new policy's hash written; calls: {client.calls}")
        assert client.calls == [("PATCH", paths.statuses("node-a"))]
    finally:
        stop.set()


def test_after_a_429_the_writer_asks_again_when_the_server_said_not_later_by_its_own_backoff() -> None:
    highest = lambda low, high: high  # noqa: E731 - the jitter's upper end
    # the server's Retry-After (priority and fairness raise it to 32 s while they shed), a quarter more at most
    assert retry_wait(TooManyRequests(429, "slow down", retry_after=16.0), highest) == 20.0
    assert retry_wait(TooManyRequests(429, "slow down", retry_after=16.0), lambda low, high: low) == 16.0
    assert retry_wait(ApiServerError(503, "later", retry_after=5.0), highest) == 6.25
    # never sooner than the first backoff step, whatever a server says
    assert retry_wait(TooManyRequests(429, "slow down", retry_after=0.0), highest) == RETRY_INITIAL * 1.25
    # said nothing: the writer's own doubling backoff decides
    for error in (ApiServerError(500, "oops"), ApiUnreachable("connection refused"), NotFound(404, "no"),
                  ValueError("a bug")):
        assert retry_wait(error) is None


def test_a_status_write_refused_by_priority_and_fairness_is_asked_again_at_the_servers_pace(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # scaled down to keep the test short: a first backoff step of 0.05 s, a Retry-After of 0.5 s, no spread
    monkeypatch.setattr(apireport, "RETRY_INITIAL", 0.05)
    monkeypatch.setattr(apireport, "SPREAD_SECONDS", 0.0)
    asked: list[float] = []

    class TimedClient(FakeKubeClient):
        def _check(self, verb: str, path: str) -> None:
            if verb == "POST" and path == statuses:
                asked.append(time.monotonic())
            super()._check(verb, path)

    client = TimedClient()
    statuses = paths.statuses("node-a").rsplit("/", 1)[0]  # a node's first status is created there
    # refused six times in a row, as a client does while the server's Retry-After runs
    client.refuse(statuses, *[TooManyRequests(429, "the API server asked to wait", retry_after=0.5)] * 6)
    stop = threading.Event()
    reporter = started_reporter(client, narrator(), stop)
    try:
        reporter.reconciled(applied(), 0.01)
        eventually(lambda: paths.statuses("node-a") in client.objects,
                   lambda: f"the status written; calls: {client.calls}")
    finally:
        stop.set()
    gaps = [later - earlier for earlier, later in itertools.pairwise(asked)]
    assert len(gaps) == 6, gaps
    # never sooner than the server said; and not later and later: the writer's own doubling backoff (0.05 s, 0.1 s,
    # ... 1.6 s from its first step) is not stacked on the server's time
    assert all(gap >= 0.49 for gap in gaps), gaps
    assert max(gaps) < 0.5 * 1.25 + 0.9, gaps


def test_the_spread_of_status_writes_grows_with_the_fleet() -> None:
    assert apireport.spread_seconds(None) == apireport.SPREAD_SECONDS  # not known yet: as for a large fleet
    assert apireport.spread_seconds(2) < 0.01  # the lab's two nodes say a change at once
    assert apireport.spread_seconds(1000) == 2.0  # the rate the fixed 2 s gave 1,000 nodes
    assert apireport.spread_seconds(2000) == 4.0 and apireport.spread_seconds(10**6) == apireport.SPREAD_MAX


def test_an_observed_mismatch_is_in_the_status_and_one_node_event_escaped() -> None:
    teller = Narrator("node-a", pod=None, version="0.1.0", backend="iptables-nft", now=lambda: "t",
                      mode="observe", writer="gke", chain="IP-MASQ")
    note = teller.reconciled(applied(result=SyncResult.OUT_OF_SYNC, mismatch="IP-MASQ: missing\x1b[2K"))
    assert note.status is not None and note.status.mismatch == "IP-MASQ: missing\\x1b[2K"
    assert note.status.config_digest == "d" * 64 and not note.status.enforces
    (said,) = note.occurrences
    assert said.reason == "ConfigNotEnforced" and "gke writes in IP-MASQ" in said.message
    assert teller.reconciled(applied(result=SyncResult.OUT_OF_SYNC, mismatch="IP-MASQ: missing\x1b[2K")) \
        .occurrences == ()  # once per change
    back = teller.reconciled(applied(result=SyncResult.IN_SYNC))
    assert back.status is not None and back.status.enforces and back.status.mode == "observe"


def test_a_key_the_writer_ignores_is_in_the_status_and_one_event_and_the_node_still_enforces() -> None:
    teller = Narrator("node-a", pod=None, version="0.1.0", backend="iptables-nft", now=lambda: "t",
                      mode="observe", writer="gke", chain="IP-MASQ")
    line = "GKE's managed agent ignores masqueradeCIDRs: 10.11.0.0/24 stays un-masqueraded\x1b[2K"
    note = teller.reconciled(replace(applied(result=SyncResult.IN_SYNC), ignored=line))
    assert note.status is not None and note.status.enforces and note.status.mismatch is None
    assert note.status.ignored == "GKE's managed agent ignores masqueradeCIDRs: 10.11.0.0/24 stays un-masqueraded" \
        "\\x1b[2K"
    assert status_from_json(note.status.as_json() | {"metadata": {"name": "node-a"}}).ignored == note.status.ignored
    (said,) = note.occurrences
    assert said.reason == "IgnoredByWriter" and said.type == "Warning" and "\x1b" not in said.message
    assert teller.reconciled(replace(applied(result=SyncResult.IN_SYNC), ignored=line)).occurrences == ()
    cleared = teller.reconciled(applied(result=SyncResult.IN_SYNC))
    assert cleared.status is not None and cleared.status.ignored is None


def test_another_writer_rewriting_our_rules_is_one_event_per_episode_escaped() -> None:
    from ipmasq.agent.reports import ForeignWriter

    teller = narrator()
    teller.reconciled(applied())
    writer = ForeignWriter(chain="IP-MASQ-AGENT", family=Family.V4, rewrites=3,
                           missing=("-A IP-MASQ-AGENT -d 10.0.0.0/8 -j RETURN",), missing_count=1,
                           extra=('-A IP-MASQ-AGENT -m comment --comment "\x1b]0;pwned\x07" -j RETURN',),
                           extra_count=4)
    held = replace(applied(result=SyncResult.FOREIGN_WRITER), foreign_writer=writer,
                   readiness=ProbeVerdict(False, f"not ready: {writer.describe()}"))
    (said,) = teller.reconciled(held).occurrences
    assert said.reason == "ForeignWriter" and said.type == "Warning" and said.target == teller.node_ref
    assert "IP-MASQ-AGENT (IPv4)" in said.message and "10.0.0.0/8" in said.message and "3 more" in said.message
    assert "\x1b" not in said.message and "\\x1b" in said.message  # what the other writer wrote, escaped
    # the same episode, more rewrites: nothing more said (the status and the metrics count them)
    again = replace(held, foreign_writer=replace(writer, rewrites=5))
    assert [o.reason for o in teller.reconciled(again).occurrences] == []
    # our rules intact again: the episode is over, and the next one is news
    teller.reconciled(applied(result=SyncResult.IN_SYNC))
    assert [o.reason for o in teller.reconciled(again).occurrences] == ["ForeignWriter"]
