"""What the reconciler hands out, as values: a ConfigReport for one read of the config, a PassReport for one pass
over the kernel (what it found, wrote and verified), a ProbeVerdict for readiness. Metrics, health, the status the
agent writes and the `--once` exit code read only these (ipmasq.agent.reconcile makes them)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from ipmasq.agent.origin import ConfigOrigin
from ipmasq.backends.base import State
from ipmasq.errors import one_line
from ipmasq.netfilter.iptables import is_marker_rule
from ipmasq.prefix import Family

__all__ = ["ConfigReport", "FamilyWrite", "ForeignWriter", "ObjectCount", "PassReport", "ProbeVerdict", "RuleCount",
           "SyncResult", "count_objects"]


class SyncResult(Enum):
    IN_SYNC = "in-sync"  # the kernel already matched: nothing written
    APPLIED = "applied"  # one transaction written per differing family, and verified
    NO_POLICY = "no-policy"  # no good config seen yet: nothing touched
    FAILED = "failed"  # a backend error: retry with backoff
    OUT_OF_SYNC = "out-of-sync"  # observe mode: the node's rules do not enforce the policy (nothing is written)
    FOREIGN_WRITER = "foreign-writer"  # another program keeps rewriting our rules: read, nothing written

    @property
    def verified(self) -> bool:
        """The kernel was read back and holds the policy."""
        return self in (SyncResult.IN_SYNC, SyncResult.APPLIED)


@dataclass(frozen=True, slots=True)
class ProbeVerdict:
    """A health verdict and its one-line reason: the Reconciler's readiness (the kernel was verified to hold the
    current, good config), the agent's liveness; the bodies of /readyz and /healthz."""

    ok: bool
    why: str


@dataclass(frozen=True, slots=True)
class FamilyWrite:
    """One transaction a pass wrote: a family's objects made equal to the desired ones, then verified."""

    family: Family
    added: int  # desired objects the kernel did not hold
    removed: int  # objects of ours the kernel held that the policy does not want
    installed: bool  # the kernel held none of our objects for this family before


@dataclass(frozen=True, slots=True)
class ObjectCount:
    """Our objects in one family of the desired State the kernel was last verified to hold."""

    family: Family
    rules: int  # iptables rules (the POSTROUTING jump included) or nftables rules
    set_elements: int  # nftables set elements (0 with iptables)


@dataclass(frozen=True, slots=True)
class RuleCount:
    """A config rule's kernel counters (summed over its kernel rules), as last read; a rewrite of the rule (a config
    change, a drift repair) starts them again from zero, which a Prometheus counter takes as a reset."""

    rule: str
    family: Family
    packets: int
    bytes: int


@dataclass(frozen=True, slots=True)
class ForeignWriter:
    """Another program keeps rewriting our rules: what was seen, for the status, the log and the metrics."""

    chain: str  # our chain (iptables) or table (nftables) that it rewrites
    family: Family
    rewrites: int  # rewrites seen in this episode (the ones that stopped the repairs, and any since)
    missing: tuple[str, ...]  # the first of our objects its version lacks
    missing_count: int
    extra: tuple[str, ...]  # the first objects it holds that the policy does not want
    extra_count: int

    def describe(self) -> str:
        """One line (the objects are the kernel's text: escaped)."""
        def quoted(items: tuple[str, ...], count: int) -> str:
            shown = "; ".join(items) or "none"
            return shown + (f" and {count - len(items)} more" if count > len(items) else "")
        return one_line(
            f"ForeignWriter: {self.chain} (IPv{self.family.value}) was rewritten by another writer {self.rewrites} "
            f"times after this agent's repairs; not repairing while it writes (its rules stay in place). It lacks "
            f"{self.missing_count} of ours ({quoted(self.missing, self.missing_count)}) and holds "
            f"{self.extra_count} others ({quoted(self.extra, self.extra_count)})")


@dataclass(frozen=True, slots=True)
class ConfigReport:
    """What one read of the config did (Reconciler.take_config)."""

    changed: bool  # the input differed from the last read: it loaded, or failed to load
    config_error: str | None  # the current config's error, located (file:line: message); None: it is good
    policy_hash: str | None  # policy_hash of the last good policy (enforced even while the config is bad)
    resync_interval: float  # seconds, from the last good config (the default before one)
    readiness: ProbeVerdict
    config_digest: str | None = None  # config_digest of the last good config's content (None: none yet)
    origin: ConfigOrigin | None = None  # where this read came from (set by the loop, which made the read)


@dataclass(frozen=True, slots=True)
class PassReport:
    """The facts of one reconcile pass, for whoever reports on it (metrics, health, the --once exit code)."""

    result: SyncResult
    config_error: str | None  # the current config's error, if it is bad (the last good one was enforced)
    backend_error: str | None  # the backend's error when result is FAILED
    drift_repair: bool  # the kernel differed although the config verified before had not changed: someone else wrote
    writes: tuple[FamilyWrite, ...]  # the transactions this pass wrote (a FAILED pass may have written some)
    removed_leftovers: tuple[str, ...]  # the other backends/variants whose objects this pass removed
    leftovers: tuple[str, ...]  # the other backends/variants still holding our objects after this pass
    policy_hash: str | None  # policy_hash of the policy this pass enforced (None: no good config yet)
    objects: tuple[ObjectCount, ...]  # per family, of the policy the kernel was last verified to hold
    resync_interval: float
    readiness: ProbeVerdict
    foreign_masquerade_rules: int | None = None  # NAT rules not ours that masquerade/SNAT (None: not counted yet)
    rule_counters: tuple[RuleCount, ...] = ()  # the enforced policy's config rules on this node, as last read
    config_digest: str | None = None  # config_digest of the content of the config this pass enforced
    origin: ConfigOrigin | None = None  # where the enforced content came from (set by the loop, which read it)
    # observe mode (ipmasq.observe.observer): why the node's rules do not enforce the policy, one line (None: they do)
    mismatch: str | None = None
    # observe mode: the config keys the observed writer ignores and what that does to traffic, one line (None: none);
    # a fact of the config and the writer, never a mismatch of the node's rules
    ignored: str | None = None
    # another program keeps rewriting our rules and this agent stopped repairing them (None: no such writer)
    foreign_writer: ForeignWriter | None = None
    foreign_rewrites: int = 0  # how often this pass found our verified rules rewritten by someone else


def count_objects(state: State) -> tuple[int, int]:
    """(rules, set elements) among a backend State's lines (see ipmasq.backends.base.State); an ownership marker's
    rule is a record, not a rule (nftables' marker is a set that holds none)."""
    rules = sum(1 for line in state.objects if line.startswith(("-A ", "rule ")) and not is_marker_rule(line))
    elements = sum(1 for line in state.objects if line.startswith("element "))
    return rules, elements
