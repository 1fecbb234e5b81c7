"""One reconcile pass, backend-agnostic: config -> Policy -> desired State -> compare -> apply once -> verify.

The Reconciler keeps the last good Policy: a bad config is logged once per change and makes the agent
not-ready, while the last good config keeps being enforced (drift repaired). Until a first good config is
seen the kernel is left untouched. It performs no I/O of its own beyond the injected backend and logger.

`others` are every place our objects can be that the agent does not write: the other backend, and the other
iptables variant (a node moved from iptables-legacy to iptables-nft, a changed --iptables-variant). EVERY pass looks
at each of them (one cheap read: `survey()`) and removes what it holds, but only AFTER this backend's objects were
applied and verified: make before break, so a switch never leaves the node without rules, even if the agent dies in
between. While both are installed both hold our rules, so the same policy decides. Anything that stays (a failed
removal) is named in the PassReport's `leftovers` and keeps the agent not ready. Only what carries ipmasq's ownership
marker, and still holds what the marker records ipmasq wrote, is removed (ipmasq.backends.base): a chain another
program wrote with the reference agent's comments (AKS's agent on iptables while this one uses nftables), or rewrote
since ipmasq wrote it (its stale marker goes), stays as it is, named once in the log (`kept ...`), and is not a
leftover. A family the policy does not manage (IPv6 off) loses only what carries the marker, likewise.

An idle pass need not read anything: `fingerprint` (a backends.base.Fingerprint: on a node the kernel's, built by
`ipmasq agent`; in tests ipmasq.testing.FakeFingerprint) is a cheap kernel fact that changes whenever any NAT rule
the pass would read changes (the nf_tables generation, a digest of the iptables-legacy nat tables). It is taken at
the START of every pass; when a pass read everything, found it equal to the policy and wrote nothing, that
fingerprint is kept. A later pass whose fingerprint equals the kept one, for the
same policy, is IN_SYNC without a read: nothing has been written since a read that verified it. Any write by
anyone (our rules deleted, a foreign rule added, even a no-op transaction) changes the fingerprint, and that pass
reads everything as before; a fingerprint that cannot be read (None) always means a full read.

Two writers never fight. Another program may own the same chain (GKE's managed ip-masq-agent writes `IP-MASQ` beside
an agent deployed with the gke overlay): each would "repair" the other's rules every resync, for ever. A pass that
finds the policy it verified before replaced by objects it does not want (a rewrite: a deletion or a flush is plain
drift) counts one foreign rewrite; FOREIGN_REWRITES of them in a row, each within two resync periods of the repair
before, and the Reconciler stops repairing: it writes nothing at all (the rules the other writer left keep working),
reports `ForeignWriter` (the pass's `foreign_writer`: which chain, what differs, how many rewrites; the readiness
reason the status carries; SyncResult.FOREIGN_WRITER; one log line) and only reads. When the kernel has not changed
for FOREIGN_QUIET_PERIODS resync periods it repairs once more; a rewrite found at the next pass holds again at once
(and the quiet period doubles, up to FOREIGN_QUIET_MAX_PERIODS), a clean pass ends the episode. Reads show only
content: a writer that rewrites the very same rules unseen is found again by that one repair.

What happened is handed out as values, never as the Reconciler itself: `take_config` returns a ConfigReport (what one
read of the config did), `reconcile` a PassReport (what one pass found, wrote and verified). Metrics, health and
the `--once` exit code only read those; nothing downstream asks the backend again or re-derives a fact.

The values it hands out are in ipmasq.agent.reports.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import replace

from ipmasq.agent.last_good import LastGoodConfig
from ipmasq.agent.reports import (
    ConfigReport,
    FamilyWrite,
    ForeignWriter,
    ObjectCount,
    PassReport,
    ProbeVerdict,
    RuleCount,
    SyncResult,
    count_objects,
)
from ipmasq.backends.base import Adopt, Backend, Fingerprint, Removable, State, take_fingerprint
from ipmasq.config.model import MasqConfig
from ipmasq.config.source import ConfigInput, config_from_bytes
from ipmasq.errors import BackendError, ConfigError, IpmasqError
from ipmasq.netfilter.nft import TABLE as NFT_TABLE
from ipmasq.options import PolicyOptions
from ipmasq.policy.policy import Policy
from ipmasq.prefix import Family

__all__ = [
    "FOREIGN_QUIET_MAX_PERIODS",
    "FOREIGN_QUIET_PERIODS",
    "FOREIGN_REWRITES",
    "Reconciler",
]


# An idle pass recounts the node's foreign NAT rules only this often (a change by this agent recounts at once).
FOREIGN_RECOUNT_PASSES = 10
# Rewrites of our verified rules by someone else, in a row, before the agent stops repairing (one could be an
# operator's edit, two a tool's one-off run; three rewrites each within two resync periods of our repair is a writer
# that runs on a loop, as ours does).
FOREIGN_REWRITES = 3
# Resync periods without any change to the kernel's objects before the agent repairs once more; doubled after each
# repair the other writer undid at once (a writer that rewrites identical rules is seen only by that repair).
FOREIGN_QUIET_PERIODS = 3
FOREIGN_QUIET_MAX_PERIODS = 48
# How many differing objects a ForeignWriter quotes (the counts say how many there are).
_QUOTED_OBJECTS = 3


class Reconciler:
    def __init__(self, backend: Backend, options: PolicyOptions, *, log: logging.Logger,
                 others: Sequence[Removable] = (),
                 on_policy_change: Callable[[Policy, Policy], None] | None = None,
                 count_foreign: Callable[[], int] | None = None,
                 fingerprint: Fingerprint | None = None,
                 load: Callable[[ConfigInput, PolicyOptions], MasqConfig] = config_from_bytes,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.backend = backend
        self.clock = clock
        # two writers: the rewrites seen in a row, when we last repaired, and while holding what the kernel held
        self._streak = 0
        self._last_repair: float | None = None
        self._holding = False  # not repairing: another writer owns the chain
        # the episode's other writer, as last seen: reported from the first hold until a pass finds our rules intact
        self._writer: ForeignWriter | None = None
        self._held: dict[Family, State] = {}
        self._last_change = 0.0  # clock: when the held objects last changed
        self._quiet_periods = FOREIGN_QUIET_PERIODS
        # a cheap kernel fact that changes with any NAT rule a pass reads (see the module docstring); None: unknown
        self.fingerprint = fingerprint
        self._quiet_fingerprint: Hashable | None = None  # taken at the start of the last pass that read, matched
        self._count_fingerprint: Hashable | None = None  # taken right before the last count of foreign rules
        # read-only count of the node's NAT rules that are not ours and masquerade/SNAT (the fleet's alert)
        self.count_foreign = count_foreign
        self._foreign: int | None = None
        self._passes_since_count = 0
        self._rule_counts: tuple[RuleCount, ...] = ()
        # called after the kernel was verified to hold a new policy, with the one it replaced (conntrack cleanup)
        self.on_policy_change = on_policy_change
        self._enforced: Policy | None = None  # the policy the kernel was last verified to hold
        self._objects: tuple[ObjectCount, ...] = ()  # counted from _enforced's desired States
        self.others = tuple(others)
        self._leftovers: tuple[str, ...] = ()  # others found holding our objects that could not be removed
        self._kept: tuple[str, ...] = ()  # the others' unmarked look-alikes, as last logged (once per change)
        self.log = log
        # the last good policy, enforced even while the config is bad (shared with observe mode)
        self.config = LastGoodConfig(options, log=log, load=load)
        self.backend_error: str | None = None

    @property
    def policy(self) -> Policy | None:
        return self.config.policy

    @property
    def config_error(self) -> str | None:
        return self.config.error

    @property
    def ready(self) -> bool:
        return self.readiness().ok

    def readiness(self) -> ProbeVerdict:
        """Ready: the current config is good and the kernel was verified to hold it."""
        if self.config_error is not None:
            return ProbeVerdict(False, f"not ready: config error: {self.config_error}")
        if self.policy is None:
            return ProbeVerdict(False, "not ready: no config loaded yet")
        if self._writer is not None:
            return ProbeVerdict(False, f"not ready: {self._writer.describe()}")
        if self._leftovers:
            detail = f" ({self.backend_error})" if self.backend_error is not None else ""
            return ProbeVerdict(False, f"not ready: our objects are still in {', '.join(self._leftovers)}, which this "
                                    f"agent does not use (it uses {self.backend.name}){detail}")
        if self.backend_error is not None:
            return ProbeVerdict(False, f"not ready: {self.backend.name}: {self.backend_error}")
        if self._enforced is not self.policy:
            return ProbeVerdict(False, "not ready: the current config is not applied yet")
        return ProbeVerdict(True, "ready: the kernel matches the current config")

    @property
    def resync_interval(self) -> float:
        return self.config.resync_interval

    def take_config(self, config_input: ConfigInput | ConfigError) -> ConfigReport:
        """Take a freshly read config (or the error reading it); the report says whether it changed."""
        return self._config_report(changed=self.config.take(config_input))

    def _config_report(self, *, changed: bool) -> ConfigReport:
        return ConfigReport(changed=changed, config_error=self.config_error, policy_hash=self.config.policy_hash,
                            resync_interval=self.resync_interval, readiness=self.readiness(),
                            config_digest=self.config.config_digest)

    def reconcile(self) -> PassReport:
        """Make the kernel match the last good policy; write only where it differs, then read back and verify."""
        policy = self.policy
        if policy is None:
            return self._pass_report(SyncResult.NO_POLICY)
        fingerprint = self._take_fingerprint()
        probe = False  # the repair after a quiet spell: what it overwrites is the rewrite already counted
        if self._holding:
            try:
                held = self._held_pass(policy)
            except IpmasqError as exc:
                self._backend_failed(str(exc))
                return self._pass_report(SyncResult.FAILED)
            if held == "hold":
                return self._pass_report(SyncResult.FOREIGN_WRITER)
            probe = held == "probe"
        if (fingerprint is not None and fingerprint == self._quiet_fingerprint and self._enforced is policy
                and self.backend_error is None and not self._leftovers):
            # nothing was written anywhere since a pass read everything and found it matching: skip the reads
            self._count_foreign(changed=False, fingerprint=fingerprint)
            self._read_rule_counts(policy, reread=True)  # traffic does not change the fingerprint
            return self._pass_report(SyncResult.IN_SYNC)
        self._quiet_fingerprint = None
        # the kernel was verified to hold this very config before: a difference now is someone else's doing
        drift = self._enforced is not None and self._enforced.config == policy.config
        writes: list[FamilyWrite] = []
        wanted: list[State] = []
        rewritten = 0
        try:
            for family in policy.families:
                current = self.backend.read(family)
                want = self.backend.desired(policy, family)
                wanted.append(want)
                if current == want:
                    continue
                if drift and not probe and _rewritten(current, want):
                    rewritten += 1
                    if self._foreign_rewrite(policy, current, want):
                        return self._pass_report(SyncResult.FOREIGN_WRITER, writes=writes, rewrites=rewritten)
                self.backend.apply(policy, family, current)
                self._last_repair = self.clock()
                after = self.backend.read(family)
                if after != want:
                    if _rewritten(after, want):  # someone wrote between our transaction and the read back
                        rewritten += 1
                        if self._foreign_rewrite(policy, after, want):
                            return self._pass_report(SyncResult.FOREIGN_WRITER, writes=writes, rewrites=rewritten)
                    raise BackendError(f"IPv{family.value} rules differ from the desired ones right after applying "
                                       f"them (someone else is writing, or the kernel rewrote a rule)")
                write = _family_write(family, current, want)
                writes.append(write)
                self.log.info("applied IPv%d rules with %s (%s)", family.value, self.backend.name,
                              _describe(write, len(want.objects), drift=drift))
            writes.extend(self._clear_unmanaged(policy))
        except IpmasqError as exc:
            self._backend_failed(str(exc))
            return self._pass_report(SyncResult.FAILED, writes=writes, rewrites=rewritten)
        if not drift or not writes:
            self._clean_pass()
        previous, self._enforced = self._enforced, policy
        if previous is not policy:
            # counted once per policy, from the desired States just verified (equal to what the kernel holds)
            self._objects = tuple(ObjectCount(want.family, *count_objects(want)) for want in wanted)
        if previous is not None and previous is not policy and self.on_policy_change is not None:
            self.on_policy_change(previous, policy)
        # only now, with ours verified in place, do the other places' objects go (make before break)
        removed, error = self._remove_others()
        if error is not None:
            self._backend_failed(error)
            return self._pass_report(SyncResult.FAILED, writes=writes, removed=removed)
        if self.backend_error is not None:
            self.log.info("%s: recovered", self.backend.name)
        self.backend_error = None
        result = SyncResult.APPLIED if writes else SyncResult.IN_SYNC
        if not writes and not removed:
            self._quiet_fingerprint = fingerprint  # taken before the reads that just verified everything
        self._count_foreign(changed=bool(writes or removed), fingerprint=fingerprint)
        self._read_rule_counts(policy, reread=False)  # from the reads this pass made
        return self._pass_report(result, writes=writes, removed=removed, drift_repair=drift and bool(writes),
                                 rewrites=rewritten)

    # ---- two writers ----

    def _chain_name(self, policy: Policy) -> str:
        return f"table {NFT_TABLE}" if self.backend.name == "nftables" else policy.options.masq_chain

    def _foreign_rewrite(self, policy: Policy, current: State, want: State) -> bool:
        """Count a rewrite of our verified rules; True when that makes FOREIGN_REWRITES in a row (now holding)."""
        now = self.clock()
        within = self._last_repair is not None and now - self._last_repair <= 2 * self.resync_interval
        self._streak = self._streak + 1 if within else 1
        if self._streak < FOREIGN_REWRITES:
            return False
        had, wanted = set(current.objects), set(want.objects)
        missing = [line for line in want.objects if line not in had]
        extra = [line for line in current.objects if line not in wanted]
        first = self._writer is None
        rewrites = self._streak if self._writer is None else self._writer.rewrites + 1
        self._writer = ForeignWriter(self._chain_name(policy), current.family, rewrites,
                                     tuple(missing[:_QUOTED_OBJECTS]), len(missing),
                                     tuple(extra[:_QUOTED_OBJECTS]), len(extra))
        self._holding, self._held, self._last_change = True, {}, now
        self.backend_error = None  # a read-back that differed was the other writer's doing: nothing to retry
        if first:
            self.log.warning("%s (it resumes once the rules stay unchanged for %d resync periods)",
                             self._writer.describe(), self._quiet_periods)
        else:  # the repair after a quiet spell was undone at once: the other writer is still there
            self._quiet_periods = min(self._quiet_periods * 2, FOREIGN_QUIET_MAX_PERIODS)
            self.log.debug("the other writer undid the repair at once: waiting %d quiet resync periods",
                           self._quiet_periods)
        return True

    def _held_pass(self, policy: Policy) -> str:
        """While another writer owns the chain: read only ("hold"). "ours": the kernel holds our rules again (the
        pass that follows finds them in sync); "probe": nothing changed for the quiet period, time for one repair
        (and a rewrite found at the next pass holds again at once)."""
        assert self._writer is not None
        now = self.clock()
        states = {family: self.backend.read(family) for family in policy.families}
        if all(state == self.backend.desired(policy, state.family) for state in states.values()):
            self._holding, self._held = False, {}
            return "ours"
        if self._held and states != self._held:
            self._last_change = now
            self._writer = replace(self._writer, rewrites=self._writer.rewrites + 1)
        self._held = states
        if now - self._last_change >= self._quiet_periods * self.resync_interval:
            self._holding, self._held = False, {}
            self._streak, self._last_repair = FOREIGN_REWRITES - 1, now  # one more rewrite holds again at once
            return "probe"
        return "hold"

    def _clean_pass(self) -> None:
        """A pass that found our rules as verified, or changed them for a new config: no writer fights this one."""
        if self._writer is not None:
            self.log.info("the other writer of our rules is gone: repairing drift as usual again")
            self._writer = None
        self._streak, self._quiet_periods = 0, FOREIGN_QUIET_PERIODS

    def _read_rule_counts(self, policy: Policy, *, reread: bool) -> None:
        """The config rules' counters, for ipmasq_rule_packets_total: only when the policy has rules on this node
        (a config without rules reads nothing more), from this pass's reads where it made them. A failed read keeps
        the last values."""
        rules = [(rule, family) for family in policy.families for rule in policy.rules(family)]
        if not rules:
            self._rule_counts = ()
            return
        try:
            counts = self.backend.rule_counters(sorted({family for _, family in rules}), reread=reread)
        except IpmasqError as exc:
            self.log.debug("reading the config rules' counters failed: %s", exc)
            return
        self._rule_counts = tuple(RuleCount(rule.name, family, *counts[rule.name])
                                  for rule, family in rules if rule.name in counts)

    def _clear_unmanaged(self, policy: Policy) -> list[FamilyWrite]:
        """Remove our objects of each family the policy does not manage (IPv6 switched off by the config or the
        flag): the backend's desired State for such a family holds none of its own. A family that cannot be read
        (no IPv6 on this node) holds nothing this agent could have written."""
        writes = []
        for family in Family:
            if family in policy.families:
                continue
            try:
                # only what carries our marker: the chain of the same name another program writes there stays
                current = self.backend.read(family, adopt=Adopt.NONE)
            except BackendError as exc:
                self.log.debug("IPv%d is not managed and cannot be read: %s", family.value, exc)
                continue
            want = self.backend.desired(policy, family)
            if current == want:
                continue
            self.backend.apply(policy, family, current)
            if self.backend.read(family, adopt=Adopt.NONE) != want:
                raise BackendError(f"our IPv{family.value} objects are still there right after removing them "
                                   "(IPv6 is not managed)")
            write = _family_write(family, current, want)
            self.log.info("removed our IPv%d objects with %s (IPv6 is not managed now): %d removed", family.value,
                          self.backend.name, write.removed)
            writes.append(write)
        return writes

    def _take_fingerprint(self) -> Hashable | None:
        return take_fingerprint(self.fingerprint, self.log)

    def _count_foreign(self, *, changed: bool, fingerprint: Hashable | None) -> None:
        """Recount the foreign NAT rules when this pass changed the kernel, at the first pass, and every
        FOREIGN_RECOUNT_PASSES passes otherwise: a full read of the node's nat rules is not an idle pass's cost.
        Never while the kernel's fingerprint equals the one taken right before the last count: no rule changed."""
        if self.count_foreign is None:
            return
        if not changed and self._foreign is not None and fingerprint is not None \
                and fingerprint == self._count_fingerprint:
            return
        self._passes_since_count += 1
        if not changed and self._foreign is not None and self._passes_since_count < FOREIGN_RECOUNT_PASSES:
            return
        self._passes_since_count = 0
        # taken again now: this pass's own writes came after the pass's first fingerprint
        self._count_fingerprint = self._take_fingerprint() if changed else fingerprint
        try:
            self._foreign = self.count_foreign()
        except IpmasqError as exc:
            self._count_fingerprint = None
            self.log.warning("counting foreign NAT rules failed: %s", exc)

    def _backend_failed(self, message: str) -> None:
        if message != self.backend_error:
            self.log.error("%s: %s (will retry)", self.backend.name, message)
        self.backend_error = message

    def _pass_report(self, result: SyncResult, *, writes: Sequence[FamilyWrite] = (), removed: Sequence[str] = (),
                     drift_repair: bool = False, rewrites: int = 0) -> PassReport:
        return PassReport(result=result, config_error=self.config_error, backend_error=self.backend_error,
                          drift_repair=drift_repair, writes=tuple(writes), removed_leftovers=tuple(removed),
                          leftovers=self._leftovers,
                          policy_hash=self.config.policy_hash, objects=self._objects,
                          resync_interval=self.resync_interval, readiness=self.readiness(),
                          foreign_masquerade_rules=self._foreign, rule_counters=self._rule_counts,
                          config_digest=self.config.config_digest, foreign_writer=self._writer,
                          foreign_rewrites=rewrites)

    def _remove_others(self) -> tuple[list[str], str | None]:
        """Look at every other place (one read each) and remove our objects there, by their ownership markers;
        (removed, first error). What looks like ours without a marker is another program's: named in the log once
        per change, never removed.

        Each place is handled on its own: one that cannot be read or cleaned does not keep the others' objects.
        """
        removed: list[str] = []
        left: list[str] = []
        kept: list[str] = []
        error: str | None = None
        for other in self.others:
            try:
                found = other.survey()
                kept.extend(line for o in found if o.unmarked or o.changed for line in replace(o, owned=()).lines())
                if not any(o.owned or o.changed for o in found):
                    continue
                # a changed chain stays, and only its marker goes (it no longer tells the truth)
                other.remove_all()
            except IpmasqError as exc:
                left.append(other.name)
                error = error or f"removing our objects from {other.name}: {exc}"
                continue
            if not any(o.owned for o in found):
                continue
            removed.append(other.name)
            self.log.info("removed the objects of %s (left by an earlier run or another agent; this agent uses %s)",
                          other.name, self.backend.name)
        self._leftovers = tuple(left)
        if tuple(kept) != self._kept:
            self._kept = tuple(kept)
            for line in kept:
                self.log.info("%s (this agent uses %s and removes only what ipmasq wrote)", line, self.backend.name)
        return removed, error


def _rewritten(current: State, want: State) -> bool:
    """The kernel holds objects in our place that the policy does not want: someone wrote their own version (a
    deletion or a flush only lacks ours, and is plain drift)."""
    wanted = set(want.objects)
    return any(line not in wanted for line in current.objects)


def _family_write(family: Family, before: State, after: State) -> FamilyWrite:
    had, want = set(before.objects), set(after.objects)
    return FamilyWrite(family, added=len(want - had), removed=len(had - want), installed=not before.objects)


def _describe(write: FamilyWrite, objects: int, *, drift: bool) -> str:
    """drift: the kernel was verified to hold this config before, so someone else changed it (not a config change)."""
    if write.installed:
        return f"installed {objects} objects"
    if not drift:
        return f"config change: {write.added} added, {write.removed} removed"
    if not write.added and not write.removed:
        return "repaired order"
    return f"repaired drift: {write.added} missing, {write.removed} unexpected"
