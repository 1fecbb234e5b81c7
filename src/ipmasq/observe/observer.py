"""Observe mode: the agent beside another program that writes the node's nat rules (a provider's ip-masq-agent, a
hand-made fix-nat DaemonSet), saying whether those rules enforce the ConfigMap's intent, and never writing anything.

The Observer takes the Reconciler's place in the agent's loop (ipmasq.agent.loop drives either): its config half is
the one the Reconciler holds (ipmasq.agent.last_good: the same loader, the same last good policy, the same one-line
errors); its pass reads the node's
rules as `ipmasq check` reads them (ipmasq.diagnose.sources.read_node_rules: both iptables variants, nftables, the
chains beside them) and compares them with `check`'s comparison (ipmasq.diagnose.check.check_node: structure, the
config's rules, and every class of pod packet traced through postrouting), under the writer's flags (its chain, its
reserved ranges: the policy options). Its reports are the enforcing agent's values: IN_SYNC when the rules enforce
the policy, OUT_OF_SYNC with the first findings as one line (PassReport.mismatch) when not; they reach the node's
status object, the summary Event on the ConfigMap, the metrics (ipmasq_syncs_total{result="out-of-sync"}) and
`ipmasq status` by the same path as the enforcing agent's.

What it never does: write netfilter (it holds no backend, only the config half it shares with the Reconciler:
ipmasq.agent.last_good.LastGoodConfig, so a bug cannot write either), flush
conntrack, or take the node lock (the writer owns the node). Drift is what it reports, never a reason to be not
ready: it is not ready only while it cannot read the rules at all, or before a first good config.

An agent of the reference's reading (`--observe=reference` or `gke`) reads fewer keys than ipmasq: its config is
loaded its way (`reference_reading`), and each key it ignores (masqueradeCIDRs, rules, enableIPv6) is said beside
the comparison, with what happens to its traffic (PassReport.ignored: the status's ignoredByWriter, an Event),
never as a mismatch: that agent will not write it on any sync.

A provider's agent that reads more than the ip-masq-agent ConfigMap (AKS's fragments, EKS's aws-node env) is observed
with its inputs (ipmasq.observe.provider_inputs: `load` reads them as that writer does, `compare` is `check --writer`'s
comparison; until every one is listed, an InputsPending stands in for the content).

Cost: a pass is due every `poll` seconds (OBSERVE_POLL_SECONDS), so that a change of the rules shows within it; an
idle pass reads nothing while the kernel's fingerprint (ipmasq.backends.generation: the nf_tables generation over
netlink, the iptables-legacy nat tables' digest) is the one of its last read, and a read whose rules equal the last
ones is not compared again (a writer that re-applies the same rules in a loop bumps the generation each time).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

from ipmasq.agent.last_good import LastGoodConfig
from ipmasq.agent.reports import ConfigReport, PassReport, ProbeVerdict, SyncResult
from ipmasq.backends.base import Fingerprint, Runner, take_fingerprint
from ipmasq.backends.iptables import Variant, detect_variant
from ipmasq.config.model import MasqConfig
from ipmasq.config.source import ConfigInput, config_from_bytes
from ipmasq.diagnose.check import FindingId, NodeRules, check_node, ignored_findings
from ipmasq.diagnose.sources import read_node_rules
from ipmasq.errors import ConfigError, InputsPending, IpmasqError, clip, one_line
from ipmasq.findings import Finding, Severity
from ipmasq.options import PolicyOptions
from ipmasq.policy.policy import Policy
from ipmasq.writers import Writer, ignored, reading

__all__ = ["MISMATCH_CHARS", "OBSERVE_POLL_SECONDS", "Observer", "ignored_line", "mismatch_line",
           "reference_reading"]

# How often the rules are looked at (a look is one netlink request and the legacy tables' digest when nothing
# changed): a change of a node's rules shows in its status within this plus the status write's spread.
OBSERVE_POLL_SECONDS = 2.0
MISMATCH_CHARS = 600  # what a status's mismatch line holds: the first findings, clipped
REDETECT_READS = 30  # reads of the rules between two detections of the iptables variant (a minute at 2 s)
_SHOWN = 2  # findings named in the line; the others counted


def mismatch_line(findings: Sequence[Finding]) -> str | None:
    """The error findings as one line, most telling first (None: the rules enforce the policy). A key the writer
    ignores is not one of them: the writer enforces what it reads (ignored_line says the rest)."""
    errors = [f for f in findings if f.severity is Severity.ERROR and f.id != FindingId.IGNORED_BY_WRITER]
    if not errors:
        return None
    shown = "; ".join(f"{f.id}: {f.message}" for f in errors[:_SHOWN])
    more = f" (and {len(errors) - _SHOWN} more)" if len(errors) > _SHOWN else ""
    return clip(one_line(shown), MISMATCH_CHARS - len(more) - 1) + more  # clip adds its ellipsis


def ignored_line(findings: Sequence[Finding]) -> str | None:
    """The keys the writer ignores (ignored-by-writer findings) as one line, those that change traffic first (None:
    it reads every key the config sets)."""
    found = sorted((f for f in findings if f.id == FindingId.IGNORED_BY_WRITER),
                   key=lambda f: f.severity is not Severity.ERROR)
    if not found:
        return None
    return clip(one_line("; ".join(f.message for f in found)), MISMATCH_CHARS)


def reference_reading(writer: Writer) -> tuple[Callable[[ConfigInput, PolicyOptions], MasqConfig], Compare]:
    """The loader and comparison for a writer that reads the ip-masq-agent ConfigMap the reference's way (reference,
    gke) under the flags given: its reading (the keys it ignores left out: the node is compared with what it really
    writes), check's comparison, and one ignored-by-writer finding per key it ignores."""
    def load(config_input: ConfigInput, options: PolicyOptions) -> MasqConfig:
        return reading(writer, config_input, options)

    def compare(policy: Policy, rules: NodeRules, config_input: ConfigInput | None) -> Sequence[Finding]:
        said = ignored(writer, config_input.files, policy.config, policy.options) if config_input else ()
        return [*ignored_findings(said), *check_node(policy, rules, writer=writer.called or writer.name).findings]
    return load, compare


@dataclass(frozen=True, slots=True)
class _Watching:
    """What the loop names as the pass's backend (its log lines, the metrics' backend label): the writer observed.
    The Observer holds no backend at all, so it cannot write the node's rules whatever happens."""

    name: str


ReadRules = Callable[[Policy], NodeRules]
# the findings of the node's rules against the policy; the input is the last good config input (a writer's inputs
# may hold what the policy does not: EKS's env)
Compare = Callable[[Policy, NodeRules, ConfigInput | None], Sequence[Finding]]


def compare_rules(policy: Policy, rules: NodeRules, config_input: ConfigInput | None) -> Sequence[Finding]:
    """check's comparison under the policy's own options (the agent's flags)."""
    return check_node(policy, rules).findings


class Observer:
    def __init__(self, options: PolicyOptions, runner: Runner, *, log: logging.Logger, writer: str,
                 backend: str = "auto", fingerprint: Fingerprint | None = None, poll: float = OBSERVE_POLL_SECONDS,
                 load: Callable[[ConfigInput, PolicyOptions], MasqConfig] = config_from_bytes,
                 read_rules: ReadRules | None = None, compare: Compare = compare_rules) -> None:
        """`writer`: the program observed (a name said in status); `backend`: which rules it writes (iptables,
        nftables, or auto: whichever holds its chain); `read_rules` replaces the live read (tests); `compare` and
        `load`: the writer's own comparison and reading of its inputs (an InputsPending in their place says why they
        are not known yet: nothing is loaded or compared while it lasts)."""
        self.writer, self.chain, self.log, self.poll = writer, options.masq_chain, log, poll
        self.backend = _Watching(f"observe ({writer})")
        self._config = LastGoodConfig(options, log=log, load=load)
        self.fingerprint = fingerprint
        self._variant: Variant | None = None  # the iptables variant the writer's rules were last found in
        self._reads_since_detect = 0

        def read_live(policy: Policy) -> NodeRules:
            # the variant is detected (every variant's save of every family) only now and then, and again
            # whenever the rules do not enforce the policy: the writer may have moved to the other variant
            if self._variant is None or self._mismatch is not None or self._reads_since_detect >= REDETECT_READS:
                self._variant, self._reads_since_detect = detect_variant(runner), 0
            self._reads_since_detect += 1
            return read_node_rules(runner, policy.families, chain=options.masq_chain, backend=backend,
                                   variant=self._variant)

        self._read_rules: ReadRules = read_rules or read_live
        self._compare_rules = compare
        self._waiting: str | None = None  # why the writer's inputs are not known yet (an InputsPending's line)
        self._input: ConfigInput | None = None  # the last good config input
        self._seen: ConfigReport | None = None  # the last config read's report
        self._compared: tuple[Policy, ConfigInput | None, NodeRules] | None = None  # the last comparison's inputs
        # the policy, input and fingerprint of the last full read (the input too: two inputs the writer reads alike
        # may differ in what it ignores)
        self._quiet: tuple[Policy, ConfigInput | None, Hashable] | None = None
        self._mismatch: str | None = None
        self._ignored: str | None = None  # the keys the writer ignores (a fact of the config, not a mismatch)
        self._error: str | None = None  # the rules could not be read
        self._passes = 0
        self.reads = 0  # full reads of the node's rules (the cost a fingerprint saves)
        self.comparisons = 0

    def readiness(self) -> ProbeVerdict:
        if self._error is not None:
            return ProbeVerdict(False, f"not ready: cannot read the node's rules: {self._error}")
        if self._config.policy is None:
            # what stands in the way, in one line: the writer's inputs not listed yet, or not readable (a provider's
            # DaemonSet that is not there is said here, not guessed at)
            error = self._config.error
            return ProbeVerdict(False, self._waiting or (f"not ready: {error}" if error is not None
                                                         else "not ready: no config loaded yet"))
        if not self._passes:
            return ProbeVerdict(False, "not ready: the node's rules not looked at yet")
        return ProbeVerdict(True, f"ready: observing the rules {self.writer} writes in {self.chain} (this agent "
                                  "writes nothing)")

    def take_config(self, config_input: ConfigInput | ConfigError) -> ConfigReport:
        pending = config_input.message if isinstance(config_input, InputsPending) else None
        self._waiting = pending if self._config.policy is None else None
        changed = False if pending is not None else self._config.take(config_input)  # no content yet: nothing loaded
        if self._config.error is None and isinstance(config_input, ConfigInput):
            self._input = config_input
        self._seen = report = ConfigReport(changed=changed, config_error=self._config.error,
                                           policy_hash=self._config.policy_hash, resync_interval=self.poll,
                                           readiness=self.readiness(), config_digest=self._config.config_digest)
        return report

    def reconcile(self) -> PassReport:
        """One look at the node's rules against the last good policy; nothing is written."""
        policy = self._config.policy
        if policy is None:
            return self._report(SyncResult.NO_POLICY)
        fingerprint = take_fingerprint(self.fingerprint, self.log)
        if fingerprint is None or self._quiet != (policy, self._input, fingerprint) or self._error is not None:
            self._quiet = None
            try:
                rules = self._read_rules(policy)
            except IpmasqError as exc:
                if one_line(str(exc)) != self._error:
                    self.log.error("observe: cannot read the node's rules: %s (not ready; will retry)", exc)
                self._error = one_line(str(exc))
                return self._report(SyncResult.FAILED)
            self.reads += 1
            if self._error is not None:
                self.log.info("observe: the node's rules can be read again")
            self._error = None
            if (self._compared is None or self._compared[0] is not policy or self._compared[1] != self._input
                    or self._compared[2] != rules):
                self._compare(policy, rules)
            self._quiet = (policy, self._input, fingerprint) if fingerprint is not None else None
        self._passes += 1
        return self._report(SyncResult.IN_SYNC if self._mismatch is None else SyncResult.OUT_OF_SYNC)

    def _compare(self, policy: Policy, rules: NodeRules) -> None:
        self.comparisons += 1
        findings = self._compare_rules(policy, rules, self._input)
        mismatch = mismatch_line(findings)
        ignored_keys = ignored_line(findings)
        if ignored_keys != self._ignored and ignored_keys is not None:
            self.log.warning("observe: %s", ignored_keys)
        self._ignored = ignored_keys
        if mismatch != self._mismatch:
            if mismatch is None:
                self.log.info("observe: the rules %s writes in %s enforce the config (policy %s)", self.writer,
                              self.chain, (self._seen.policy_hash or "")[:12] if self._seen else "")
            else:
                self.log.warning("observe: the rules %s writes in %s do not enforce the config: %s", self.writer,
                                 self.chain, mismatch)
        self._compared, self._mismatch = (policy, self._input, rules), mismatch

    def _report(self, result: SyncResult) -> PassReport:
        seen = self._seen
        return PassReport(result=result, config_error=seen.config_error if seen else None,
                          backend_error=self._error if result is SyncResult.FAILED else None, drift_repair=False,
                          writes=(), removed_leftovers=(), leftovers=(),
                          policy_hash=seen.policy_hash if seen else None, objects=(), resync_interval=self.poll,
                          readiness=self.readiness(), config_digest=seen.config_digest if seen else None,
                          mismatch=self._mismatch if result is SyncResult.OUT_OF_SYNC else None,
                          ignored=self._ignored if result.verified or result is SyncResult.OUT_OF_SYNC else None)
