"""What a change flips: the minimal CIDRs whose verdict differs between two policies, and probe destinations.

Pure: policies in, values out. The flipped address set comes from flips.flipped_ranges (exact, independent of
how either side spells its CIDRs); it is printed as the fewest CIDRs that cover it exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from ipmasq.flips import flipped_ranges
from ipmasq.policy import Policy, Reason, Verdict
from ipmasq.prefix import Family, Prefix, parse_address, parse_cidr

__all__ = ["Action", "DiffResult", "FlippedPrefix", "ProbeResult", "diff_policies", "parse_probe"]


class Action(Enum):
    MASQUERADE = "masquerade"  # the destination sees the node IP
    PRESERVE = "preserve"  # the destination sees the pod IP
    MIXED = "mixed"  # a probe CIDR whose addresses are treated both ways


@dataclass(frozen=True, slots=True)
class FlippedPrefix:
    prefix: Prefix
    before: Action
    after: Action


@dataclass(frozen=True, slots=True)
class ProbeResult:
    destination: str
    before: Action
    after: Action
    flips: bool
    decided_before: str  # which rule decided (for one address), for the text output
    decided_after: str


@dataclass(frozen=True, slots=True)
class DiffResult:
    flips: tuple[FlippedPrefix, ...]
    probes: tuple[ProbeResult, ...]

    @property
    def probe_flipped(self) -> bool:
        return any(p.flips for p in self.probes)


def parse_probe(text: str) -> Prefix:
    """A probe is an address (a /32 or /128) or a CIDR; ValueError when it is neither."""
    if "/" in text:
        return parse_cidr(text)
    family, address = parse_address(text)
    return Prefix(family, address, family.bits)


def diff_policies(before: Policy, after: Policy, probes: tuple[str, ...] = ()) -> DiffResult:
    flips: list[FlippedPrefix] = []
    by_family = {}
    for family in Family:
        ranges = flipped_ranges(before, after, family)
        by_family[family] = ranges
        for flip in ranges:
            was = Action.MASQUERADE if flip.masquerade_before else Action.PRESERVE
            now = Action.PRESERVE if flip.masquerade_before else Action.MASQUERADE
            flips.extend(FlippedPrefix(p, was, now) for p in flip.prefixes())
    results = []
    for text in probes:
        probe = parse_probe(text)
        flipped = [f for f in by_family[probe.family] if f.first <= probe.last and f.last >= probe.first]
        results.append(ProbeResult(
            destination=text if "/" not in text or probe.length < probe.family.bits else str(probe.network),
            before=_action(before, probe), after=_action(after, probe), flips=bool(flipped),
            decided_before=_decided(before.verdict_for(probe.family, probe.network)),
            decided_after=_decided(after.verdict_for(probe.family, probe.network)),
        ))
    return DiffResult(tuple(flips), tuple(results))


def _action(policy: Policy, probe: Prefix) -> Action:
    """Masquerade, preserve, or mixed across the probe's addresses."""
    if probe.family not in policy.families:
        return Action.PRESERVE  # no rules for the family: the pod address leaves unchanged
    preserved = 0
    for first, last in policy.non_masquerade_ranges(probe.family):
        if last < probe.first or first > probe.last:
            continue
        preserved += min(last, probe.last) - max(first, probe.first) + 1
    size = probe.last - probe.first + 1
    if preserved == 0:
        return Action.MASQUERADE
    return Action.PRESERVE if preserved == size else Action.MIXED


def _decided(verdict: Verdict) -> str:
    if verdict.entry is None:
        return "final MASQUERADE" if verdict.reason is Reason.CATCH_ALL else verdict.reason.value
    return f"{verdict.entry.prefix} ({verdict.reason.value}, {verdict.entry.where()})"
