"""What the agent knows about itself, for /metrics, /healthz and /readyz: counters fed by the loop, read at scrape time.

`AgentVitals` is pure bookkeeping (no HTTP): the loop hands its hooks (`heartbeat`, `took_config`, `reconciled`) the
Reconciler's reports, values it only reads, from the loop's one thread; the HTTP thread reads `snapshot()`,
`readiness()` and `liveness()` under the same lock. `render_metrics(status)` writes one scrape's Prometheus text
(ipmasq.agent.exposition) from a snapshot and the process's own figures read from /proc/self.

Metrics (all prefixed `ipmasq_`):

    syncs_total{result}                  reconcile passes by SyncResult: in-sync, applied, failed, no-policy
    sync_duration_seconds                histogram of one pass (read, compare, apply, verify)
    config_load_errors_total             config changes that did not load (bad YAML, CIDR, ...; the last good is kept)
    config_reloads_total                 config changes that loaded (the first load included)
    drift_repairs_total                  passes that rewrote the kernel although the policy had not changed
    foreign_rewrites_total               rewrites of our verified rules by another writer that passes found
    foreign_writer{chain}                1 while another writer keeps rewriting our rules and the agent stopped
                                         repairing them (absent otherwise)
    loop_errors_total                    loop iterations ended by an unexpected exception (the loop went on)
    seconds_since_last_successful_sync   computed at scrape; since the agent started while it never synced
    last_successful_sync_timestamp_seconds  unix time of the last in-sync or applied pass (0: never)
    rules{family}                        our rules the kernel was last verified to hold (iptables rules, nft rules)
    set_elements{family}                 our nftables set elements (0 with iptables)
    ready                                1 when the kernel matches the current, good config
    config_valid                         0 while the current config is bad
    enforced_config_info{config_hash}    1, labelled with the short policy hash the kernel was last verified to hold
    resync_interval_seconds              the enforced config's resync interval
    foreign_masquerade_rules             NAT rules not ours that masquerade or SNAT (recounted on change, and every
                                         few passes)
    build_info{version,backend}          always 1
    rule_packets_total{rule,family}      packets through a config rule (its kernel rules' counters, summed), as read by
    rule_bytes_total{rule,family}        the last pass (never by a scrape); a rewrite of the rule starts them at 0.
                                         Served on the loopback listener; on the node-address scrape listener
                                         (--prometheus-address) only with --prometheus-rule-metrics=true: the rules'
                                         names and traffic are the config's, not the pod network's to read
    node_trust_verified                  the Lease's holder: 1 while the node-trust admission policy and its binding
                                         are in force, 0 while the nodes' statuses are unverified (absent elsewhere)
    summary_lease_lost_early_total       times the summary Lease was taken from this agent before it could expire

and the process's: process_resident_memory_bytes, process_virtual_memory_bytes, process_cpu_seconds_total,
process_start_time_seconds, process_open_fds, process_max_fds (the names prometheus-client's process collector
uses, so existing dashboards keep working).
"""

from __future__ import annotations

import os
import resource
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import cache

from ipmasq.agent import exposition
from ipmasq.agent.exposition import MetricFamily
from ipmasq.agent.reports import ConfigReport, PassReport, ProbeVerdict, RuleCount, SyncResult
from ipmasq.policy.hash import config_hash

__all__ = ["DURATION_BUCKETS", "LIVENESS_GRACE_SECONDS", "READINESS_GRACE_SECONDS", "AgentVitals", "Snapshot",
           "metric_families", "process_metric_families", "render_metrics"]

# A pass is a few tool runs: milliseconds when idle, seconds with 100,000 CIDRs or a contended xtables lock.
DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# The loop wakes at least once per resync interval; one pass may wait on a few tool runs (each bounded by the
# runner's 60 s timeout, e.g. behind kube-proxy's xtables lock), so a beat older than 3 intervals plus this is wedged.
LIVENESS_GRACE_SECONDS = 120.0
# Readiness is a claim about now: a pass completes at least once per resync interval (sooner while retrying), so a
# last completed pass older than 2 intervals plus this (a slow pass: 100,000 CIDRs, a contended lock) is stale.
READINESS_GRACE_SECONDS = 60.0


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
    loop_errors: int
    seconds_since_last_success: float
    last_success_unix: float
    rules: dict[int, int]
    set_elements: dict[int, int]
    ready: bool
    config_valid: bool
    enforced_config_hash: str | None  # short policy hash of the config the kernel was last verified to hold
    resync_interval: float
    foreign_masquerade_rules: int | None
    rule_counters: tuple[RuleCount, ...] = ()
    foreign_rewrites: int = 0
    foreign_writer_chain: str | None = None  # the chain another writer owns now (None: nobody fights us)
    node_trust_verified: bool | None = None  # holding the summary Lease: the node-trust policy in force (else None)
    lease_lost_early: int = 0


@dataclass
class _Counters:
    """The agent's running totals since start: passes by result, their durations, errors, reloads."""

    syncs: dict[str, int] = field(default_factory=lambda: {r.value: 0 for r in SyncResult})
    duration_counts: list[int] = field(default_factory=lambda: [0] * (len(DURATION_BUCKETS) + 1))
    duration_sum: float = 0.0
    config_load_errors: int = 0
    config_reloads: int = 0
    drift_repairs: int = 0
    loop_errors: int = 0
    foreign_rewrites: int = 0
    lease_lost_early: int = 0


class AgentVitals:
    """The loop's observer: counts what the reports say and answers "alive?" and "ready?" for the HTTP thread."""

    def __init__(self, *, version: str, backend: str, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time) -> None:
        self.version = version
        self.backend = backend
        # what the agent was started with (config path, policy flags, node name): served at /settings
        self.settings: dict[str, object] = {}
        self._clock = clock
        self._wall = wall
        self._lock = threading.Lock()
        self._started = clock()
        self._beat = self._started
        self._resync_interval = 60.0
        self._counters = _Counters()
        self._last_success: float | None = None  # monotonic
        self._last_pass: float | None = None  # monotonic: when the last pass, of any result, completed
        self._last_success_unix = 0.0
        self._rules: dict[int, int] = {}
        self._elements: dict[int, int] = {}
        self._ready = ProbeVerdict(False, "not ready: starting, no reconcile yet")
        self._config_valid = True
        self._enforced_hash: str | None = None
        self._foreign: int | None = None
        self._rule_counters: tuple[RuleCount, ...] = ()
        self._foreign_writer: str | None = None
        self._node_trust: bool | None = None

    # ---- hooks, called by the summary's thread (ipmasq.agent.api.summary SummaryFacts) ----

    def node_trust(self, verified: bool | None) -> None:
        with self._lock:
            self._node_trust = verified

    def lease_lost_early(self) -> None:
        with self._lock:
            self._counters.lease_lost_early += 1

    # ---- hooks, called by the loop's thread ----

    def heartbeat(self) -> None:
        with self._lock:
            self._beat = self._clock()

    def took_config(self, report: ConfigReport) -> None:
        """After the loop read the config; counted only when it changed (a load or a load error)."""
        if not report.changed:
            return
        with self._lock:
            if report.config_error is not None:
                self._counters.config_load_errors += 1
            else:
                self._counters.config_reloads += 1
            self._config_valid = report.config_error is None
            self._resync_interval = report.resync_interval
            self._ready = report.readiness

    def waiting(self, why: str) -> None:
        """The agent waits for the node lock (another agent writes): not ready, for this reason."""
        with self._lock:
            self._ready = ProbeVerdict(False, why)

    def failed(self, why: str) -> None:
        """An iteration of the loop ended in an unexpected exception: counted, not ready until a pass completes."""
        with self._lock:
            self._counters.loop_errors += 1
            self._ready = ProbeVerdict(False, why)

    def reconciled(self, report: PassReport, seconds: float) -> None:
        """After one pass; `seconds`: how long it took."""
        with self._lock:
            self._last_pass = self._clock()
            c = self._counters
            c.syncs[report.result.value] += 1
            c.duration_sum += seconds
            for i, bound in enumerate(DURATION_BUCKETS):
                if seconds <= bound:
                    c.duration_counts[i] += 1
                    break
            else:
                c.duration_counts[-1] += 1
            if report.drift_repair:
                c.drift_repairs += 1
            c.foreign_rewrites += report.foreign_rewrites
            self._foreign_writer = report.foreign_writer.chain if report.foreign_writer is not None else None
            if report.result.verified:
                self._last_success = self._clock()
                self._last_success_unix = self._wall()
                if report.policy_hash is not None:
                    self._enforced_hash = config_hash(report.policy_hash)
            if report.foreign_masquerade_rules is not None:
                self._foreign = report.foreign_masquerade_rules
            self._rule_counters = report.rule_counters
            self._rules = {count.family.value: count.rules for count in report.objects}
            self._elements = {count.family.value: count.set_elements for count in report.objects}
            self._resync_interval = report.resync_interval
            self._ready = report.readiness

    # ---- reads, from any thread ----

    def readiness(self) -> ProbeVerdict:
        with self._lock:
            return self._readiness(self._clock())

    def _readiness(self, now: float) -> ProbeVerdict:
        """The last pass's verdict, unless that pass is too old to speak for the kernel now (the lock is held)."""
        if self._last_pass is not None:
            age = now - self._last_pass
            limit = 2 * self._resync_interval + READINESS_GRACE_SECONDS
            if age > limit:
                return ProbeVerdict(False, f"not ready: stale: the loop's last completed pass was {age:.0f}s ago "
                                    f"(limit {limit:.0f}s; resync every {self._resync_interval:g}s)")
        return self._ready

    def liveness(self) -> ProbeVerdict:
        with self._lock:
            age = self._clock() - self._beat
            limit = 3 * self._resync_interval + LIVENESS_GRACE_SECONDS
        if age > limit:
            return ProbeVerdict(False, f"wedged: the loop's last heartbeat was {age:.0f}s ago (limit {limit:.0f}s)")
        return ProbeVerdict(True, f"alive: the loop's last heartbeat was {age:.1f}s ago")

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
                drift_repairs=c.drift_repairs, loop_errors=c.loop_errors, seconds_since_last_success=since,
                last_success_unix=self._last_success_unix, rules=dict(self._rules),
                set_elements=dict(self._elements), ready=self._readiness(now).ok, config_valid=self._config_valid,
                enforced_config_hash=self._enforced_hash, resync_interval=self._resync_interval,
                foreign_masquerade_rules=self._foreign, rule_counters=self._rule_counters,
                foreign_rewrites=c.foreign_rewrites, foreign_writer_chain=self._foreign_writer,
                node_trust_verified=self._node_trust, lease_lost_early=c.lease_lost_early,
            )


def render_metrics(status: AgentVitals, *, rule_series: bool = True) -> bytes:
    """One scrape of /metrics: the agent's families, then the process's; `rule_series` False leaves out the
    per-rule families (the node-address scrape listener, unless opted in)."""
    return exposition.render([*metric_families(status.snapshot(), rule_series=rule_series),
                              *process_metric_families()])


def metric_families(s: Snapshot, *, rule_series: bool = True) -> Iterator[MetricFamily]:
    yield exposition.counter("ipmasq_syncs_total", "Reconcile passes, by result.",
                             (({"result": result}, count) for result, count in sorted(s.syncs.items())))
    yield exposition.histogram("ipmasq_sync_duration_seconds", "Duration of one reconcile pass.", DURATION_BUCKETS,
                               s.duration_buckets, s.duration_sum)
    yield exposition.counter("ipmasq_config_load_errors_total", "Config changes that failed to load (the last good "
                             "config stays enforced).", s.config_load_errors)
    yield exposition.counter("ipmasq_config_reloads_total", "Config changes that loaded, the first load included.",
                             s.config_reloads)
    yield exposition.counter("ipmasq_drift_repairs_total", "Passes that rewrote our rules although the config had "
                             "not changed (someone else changed them).", s.drift_repairs)
    yield exposition.counter("ipmasq_foreign_rewrites_total", "Rewrites of our verified rules by another writer "
                             "that the passes found (a deletion is drift, not a rewrite).", s.foreign_rewrites)
    yield exposition.gauge("ipmasq_foreign_writer", "1 while another writer keeps rewriting our rules and the agent "
                           "has stopped repairing them (its rules stay in place); absent otherwise.",
                           [] if s.foreign_writer_chain is None else [({"chain": s.foreign_writer_chain}, 1)])
    yield exposition.counter("ipmasq_loop_errors_total", "Loop iterations ended by an unexpected exception (logged "
                             "once per distinct error; the loop retried with backoff).", s.loop_errors)
    yield exposition.gauge("ipmasq_seconds_since_last_successful_sync", "Seconds since the kernel was last verified "
                           "to match the config (since the agent started, if never).", s.seconds_since_last_success)
    yield exposition.gauge("ipmasq_last_successful_sync_timestamp_seconds", "Unix time of the last successful "
                           "sync (0: never).", s.last_success_unix)
    families = sorted(s.rules)
    yield exposition.gauge("ipmasq_rules", "Our rules the kernel was last verified to hold.",
                           (({"family": f"ipv{family}"}, s.rules[family]) for family in families))
    yield exposition.gauge("ipmasq_set_elements", "Our nftables set elements the kernel was last verified to hold.",
                           (({"family": f"ipv{family}"}, s.set_elements[family]) for family in families))
    yield exposition.gauge("ipmasq_ready", "1 when the kernel matches the current, good config.", int(s.ready))
    yield exposition.gauge("ipmasq_config_valid", "0 while the current config does not load.", int(s.config_valid))
    yield exposition.gauge("ipmasq_enforced_config_info", "The config the kernel was last verified to enforce, by its "
                           "short policy hash (`ipmasq render --print-hash` prints the same for a config file).",
                           [] if s.enforced_config_hash is None else [({"config_hash": s.enforced_config_hash}, 1)])
    yield exposition.gauge("ipmasq_foreign_masquerade_rules", "NAT rules on the node that are not ours and masquerade "
                           "or SNAT (they can override the config); absent until first counted.",
                           [] if s.foreign_masquerade_rules is None else [({}, s.foreign_masquerade_rules)])
    yield exposition.gauge("ipmasq_resync_interval_seconds", "The resync interval of the enforced config: the "
                           "longest the kernel can differ from it unnoticed.", s.resync_interval)
    if rule_series:
        yield exposition.counter("ipmasq_rule_packets_total", "Packets through a config rule (the kernel's counters "
                                 "of its rules, summed), as the last pass read them; a rewrite of the rule resets it.",
                                 (({"rule": c.rule, "family": f"ipv{c.family.value}"}, c.packets)
                                  for c in s.rule_counters))
        yield exposition.counter("ipmasq_rule_bytes_total", "Bytes through a config rule (the kernel's counters of "
                                 "its rules, summed), as the last pass read them; a rewrite of the rule resets it.",
                                 (({"rule": c.rule, "family": f"ipv{c.family.value}"}, c.bytes)
                                  for c in s.rule_counters))
    yield exposition.gauge("ipmasq_node_trust_verified", "The summary Lease's holder: 1 while the node-trust "
                           "admission policy and its binding are in force, 0 while the nodes' statuses are "
                           "unverified; absent on other agents.",
                           [] if s.node_trust_verified is None else [({}, int(s.node_trust_verified))])
    yield exposition.counter("ipmasq_summary_lease_lost_early_total", "Times the summary Lease was taken from this "
                             "agent before it could have expired (a node that did not wait).", s.lease_lost_early)
    yield exposition.info("ipmasq_build", "The agent's version and backend.",
                          {"version": s.version, "backend": s.backend})


@cache
def _boot_time() -> float:
    """Unix time the machine booted (/proc/stat btime): process start times are counted from it, in clock ticks."""
    with open("/proc/stat", "rb") as f:
        for line in f:
            if line.startswith(b"btime "):
                return float(line.split()[1])
    raise OSError("no btime in /proc/stat")


def process_metric_families() -> list[MetricFamily]:
    """The process's own figures, from /proc (none where there is no /proc: the agent's metrics still answer)."""
    try:
        with open("/proc/self/stat", "rb") as f:
            # the command name (field 2) may hold spaces and parentheses: split after its last closing parenthesis
            stat = f.read().rsplit(b")", 1)[1].split()
        open_fds = len(os.listdir("/proc/self/fd"))
        boot = _boot_time()
    except (OSError, IndexError, ValueError):
        return []
    ticks = os.sysconf("SC_CLK_TCK")
    page = os.sysconf("SC_PAGE_SIZE")
    # fields after the name, 0-based from field 3: utime 11, stime 12, starttime 19, vsize 20 (bytes), rss 21 (pages)
    cpu = (int(stat[11]) + int(stat[12])) / ticks
    max_fds = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return [
        exposition.gauge("process_virtual_memory_bytes", "Virtual memory size in bytes.", int(stat[20])),
        exposition.gauge("process_resident_memory_bytes", "Resident memory size in bytes.", int(stat[21]) * page),
        exposition.gauge("process_start_time_seconds", "Start time of the process since unix epoch in seconds.",
                         boot + int(stat[19]) / ticks),
        exposition.counter("process_cpu_seconds_total", "Total user and system CPU time spent in seconds.", cpu),
        exposition.gauge("process_open_fds", "Number of open file descriptors.", open_fds),
        exposition.gauge("process_max_fds", "Maximum number of open file descriptors.",
                         max_fds if max_fds != resource.RLIM_INFINITY else float("inf")),
    ]
