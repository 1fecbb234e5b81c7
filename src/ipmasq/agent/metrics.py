"""What the agent knows about itself, for /metrics, /healthz and /readyz: counters fed by the loop, read at scrape time.

`AgentStatus` is pure bookkeeping (no HTTP, no prometheus-client): the loop calls its hooks (`heartbeat`,
`observed`, `reconciled`) from its one thread; the HTTP thread reads `snapshot()`, `readiness()` and `liveness()`
under the same lock. `collect(status)` turns a snapshot into Prometheus metric families; it is the only place that
imports prometheus-client, so the agent (and its health endpoints) run without the library.

Metrics (all prefixed `ipmasq_`):

    syncs_total{result}                  reconcile passes by Outcome: in-sync, applied, failed, no-policy
    sync_duration_seconds                histogram of one pass (read, compare, apply, verify)
    config_load_errors_total             config changes that did not load (bad YAML, CIDR, ...; the last good is kept)
    config_reloads_total                 config changes that loaded (the first load included)
    drift_repairs_total                  passes that rewrote the kernel although the policy had not changed
    seconds_since_last_successful_sync   computed at scrape; since the agent started while it never synced
    last_successful_sync_timestamp_seconds  unix time of the last in-sync or applied pass (0: never)
    rules{family}                        our rules the kernel was last verified to hold (iptables rules, nft rules)
    set_elements{family}                 our nftables set elements (0 with iptables)
    ready                                1 when the kernel matches the current, good config
    config_valid                         0 while the current config is bad
    build_info{version,backend}          always 1
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ipmasq.agent.reconcile import Outcome

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

    from ipmasq.agent.reconcile import Reconciler
    from ipmasq.backends.base import State
    from ipmasq.policy import Policy

__all__ = ["DURATION_BUCKETS", "LIVENESS_GRACE_SECONDS", "AgentStatus", "Check", "Snapshot", "collect",
           "count_objects"]

# A pass is a few tool runs: milliseconds when idle, seconds with 100,000 CIDRs or a contended xtables lock.
DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# The loop wakes at least once per resync interval; one pass may wait on a few tool runs (each bounded by the
# runner's 60 s timeout, e.g. behind kube-proxy's xtables lock), so a beat older than 3 intervals plus this is wedged.
LIVENESS_GRACE_SECONDS = 120.0


@dataclass(frozen=True, slots=True)
class Check:
    """A health verdict and its one-line reason (the body of /healthz and /readyz)."""

    ok: bool
    why: str


@dataclass(frozen=True, slots=True)
class Snapshot:
    """A consistent copy of the counters, taken under the lock at scrape time."""

    version: str
    backend: str
    syncs: dict[str, int]
    duration_buckets: tuple[int, ...]  # cumulative counts per DURATION_BUCKETS bound, then +Inf
    duration_sum: float
    config_load_errors: int
    config_reloads: int
    drift_repairs: int
    seconds_since_last_success: float
    last_success_unix: float
    rules: dict[int, int]
    set_elements: dict[int, int]
    ready: bool
    config_valid: bool


def count_objects(state: State) -> tuple[int, int]:
    """(rules, set elements) among a backend State's lines (see ipmasq.backends.base.State)."""
    rules = sum(1 for line in state.objects if line.startswith(("-A ", "rule ")))
    elements = sum(1 for line in state.objects if line.startswith("element "))
    return rules, elements


@dataclass
class _Counters:
    syncs: dict[str, int] = field(default_factory=lambda: {o.value: 0 for o in Outcome})
    duration_counts: list[int] = field(default_factory=lambda: [0] * (len(DURATION_BUCKETS) + 1))
    duration_sum: float = 0.0
    config_load_errors: int = 0
    config_reloads: int = 0
    drift_repairs: int = 0


class AgentStatus:
    """The loop's observer: counts what the loop does and answers "alive?" and "ready?" for the HTTP thread."""

    def __init__(self, *, version: str, backend: str, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time) -> None:
        self.version = version
        self.backend = backend
        self._clock = clock
        self._wall = wall
        self._lock = threading.Lock()
        self._started = clock()
        self._beat = self._started
        self._resync_interval = 60.0
        self._counters = _Counters()
        self._last_success: float | None = None  # monotonic
        self._last_success_unix = 0.0
        self._verified: Policy | None = None  # the policy the kernel was last verified to hold
        self._counted: Policy | None = None  # the policy `_rules`/`_elements` were counted for
        self._rules: dict[int, int] = {}
        self._elements: dict[int, int] = {}
        self._ready = Check(False, "not ready: starting, no reconcile yet")
        self._config_valid = True

    # ---- hooks, called by the loop's thread ----

    def heartbeat(self) -> None:
        with self._lock:
            self._beat = self._clock()

    def observed(self, reconciler: Reconciler, *, changed: bool) -> None:
        """After the loop read the config; `changed`: it differed from the last read (a load or a load error)."""
        if not changed:
            return
        with self._lock:
            if reconciler.config_error is not None:
                self._counters.config_load_errors += 1
                self._config_valid = False
            else:
                self._counters.config_reloads += 1
                self._config_valid = True
            self._resync_interval = reconciler.resync_interval
            self._ready = self._readiness(reconciler)

    def reconciled(self, reconciler: Reconciler, outcome: Outcome, seconds: float) -> None:
        """After one pass; `seconds`: how long it took."""
        policy = reconciler.policy
        counts = None
        if outcome in (Outcome.IN_SYNC, Outcome.APPLIED) and policy is not None and policy is not self._counted:
            # counted from the desired State (equal to what was just verified), once per policy: backends build it once
            counts = {f.value: count_objects(reconciler.backend.desired(policy, f)) for f in policy.families}
        with self._lock:
            c = self._counters
            c.syncs[outcome.value] += 1
            c.duration_sum += seconds
            for i, bound in enumerate(DURATION_BUCKETS):
                if seconds <= bound:
                    c.duration_counts[i] += 1
                    break
            else:
                c.duration_counts[-1] += 1
            if outcome in (Outcome.IN_SYNC, Outcome.APPLIED):
                verified = self._verified
                if outcome is Outcome.APPLIED and verified is not None and policy is not None \
                        and verified.config == policy.config:
                    c.drift_repairs += 1  # this config was verified before, yet the kernel differed: someone changed it
                self._verified = policy
                self._last_success = self._clock()
                self._last_success_unix = self._wall()
            if counts is not None:
                self._counted = policy
                self._rules = {family: r for family, (r, _) in counts.items()}
                self._elements = {family: e for family, (_, e) in counts.items()}
            self._resync_interval = reconciler.resync_interval
            self._ready = self._readiness(reconciler)

    def _readiness(self, reconciler: Reconciler) -> Check:
        if reconciler.config_error is not None:
            return Check(False, f"not ready: config error: {reconciler.config_error}")
        if reconciler.policy is None:
            return Check(False, "not ready: no config loaded yet")
        if reconciler.backend_error is not None:
            return Check(False, f"not ready: {reconciler.backend.name}: {reconciler.backend_error}")
        if self._verified is not reconciler.policy:
            return Check(False, "not ready: the current config is not applied yet")
        return Check(True, "ready: the kernel matches the current config")

    # ---- reads, from any thread ----

    def readiness(self) -> Check:
        with self._lock:
            return self._ready

    def liveness(self) -> Check:
        with self._lock:
            age = self._clock() - self._beat
            limit = 3 * self._resync_interval + LIVENESS_GRACE_SECONDS
        if age > limit:
            return Check(False, f"wedged: the loop's last heartbeat was {age:.0f}s ago (limit {limit:.0f}s)")
        return Check(True, f"alive: the loop's last heartbeat was {age:.1f}s ago")

    def snapshot(self) -> Snapshot:
        with self._lock:
            c = self._counters
            now = self._clock()
            cumulative, total = [], 0
            for count in c.duration_counts:
                total += count
                cumulative.append(total)
            since = now - (self._last_success if self._last_success is not None else self._started)
            return Snapshot(
                version=self.version, backend=self.backend, syncs=dict(c.syncs),
                duration_buckets=tuple(cumulative), duration_sum=c.duration_sum,
                config_load_errors=c.config_load_errors, config_reloads=c.config_reloads,
                drift_repairs=c.drift_repairs, seconds_since_last_success=since,
                last_success_unix=self._last_success_unix, rules=dict(self._rules),
                set_elements=dict(self._elements), ready=self._ready.ok, config_valid=self._config_valid,
            )


def collect(status: AgentStatus) -> Iterator[Metric]:
    """The metric families of one scrape (a prometheus-client custom collector's `collect`)."""
    from prometheus_client.core import (
        CounterMetricFamily,
        GaugeMetricFamily,
        HistogramMetricFamily,
        InfoMetricFamily,
    )

    s = status.snapshot()
    syncs = CounterMetricFamily("ipmasq_syncs", "Reconcile passes, by result.", labels=["result"])
    for result, count in sorted(s.syncs.items()):
        syncs.add_metric([result], count)
    yield syncs
    bounds = [*(repr(b) for b in DURATION_BUCKETS), "+Inf"]
    yield HistogramMetricFamily("ipmasq_sync_duration_seconds", "Duration of one reconcile pass.",
                                buckets=list(zip(bounds, s.duration_buckets, strict=True)), sum_value=s.duration_sum)
    yield CounterMetricFamily("ipmasq_config_load_errors", "Config changes that failed to load (the last good config "
                              "stays enforced).", value=s.config_load_errors)
    yield CounterMetricFamily("ipmasq_config_reloads", "Config changes that loaded, the first load included.",
                              value=s.config_reloads)
    yield CounterMetricFamily("ipmasq_drift_repairs", "Passes that rewrote our rules although the config had not "
                              "changed (someone else changed them).", value=s.drift_repairs)
    yield GaugeMetricFamily("ipmasq_seconds_since_last_successful_sync", "Seconds since the kernel was last verified "
                            "to match the config (since the agent started, if never).",
                            value=s.seconds_since_last_success)
    yield GaugeMetricFamily("ipmasq_last_successful_sync_timestamp_seconds", "Unix time of the last successful "
                            "sync (0: never).", value=s.last_success_unix)
    rules = GaugeMetricFamily("ipmasq_rules", "Our rules the kernel was last verified to hold.", labels=["family"])
    elements = GaugeMetricFamily("ipmasq_set_elements", "Our nftables set elements the kernel was last verified "
                                 "to hold.", labels=["family"])
    for family in sorted(s.rules):
        rules.add_metric([f"ipv{family}"], s.rules[family])
        elements.add_metric([f"ipv{family}"], s.set_elements[family])
    yield rules
    yield elements
    yield GaugeMetricFamily("ipmasq_ready", "1 when the kernel matches the current, good config.",
                            value=1.0 if s.ready else 0.0)
    yield GaugeMetricFamily("ipmasq_config_valid", "0 while the current config does not load.",
                            value=1.0 if s.config_valid else 0.0)
    yield InfoMetricFamily("ipmasq_build", "The agent's version and backend.",
                           value={"version": s.version, "backend": s.backend})
