"""What a change flips: the minimal CIDRs whose verdict differs between two policies, and probe destinations.

Pure: policies in, values out. The flipped address set is the symmetric difference of the two policies' preserved
address sets (exact, independent of how either side spells its CIDRs); it is printed as the fewest CIDRs that
cover it exactly. Conntrack cleanup deletes the entries of the same flipped ranges.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import NamedTuple

from ipmasq.policy import Policy
from ipmasq.prefix import Family, Prefix, parse_address, parse_cidr
from ipmasq.ranges import Span, count_inside, symmetric_difference, to_prefixes

__all__ = ["DiffResult", "Flip", "FlippedPrefix", "ProbeResult", "Treatment", "diff_policies", "flipped_ranges",
           "parse_probe"]


@dataclass(frozen=True, slots=True)
class Flip:
    """Addresses first..last (inclusive) whose pod traffic was masqueraded before and not after, or the reverse."""

    family: Family
    first: int
    last: int
    masquerade_before: bool

    def prefixes(self) -> list[Prefix]:
        return to_prefixes(self.family, self.first, self.last)


def _flips(before: list[Span], after: list[Span], family: Family) -> list[Flip]:
    # in `after` only: preserved after, so masqueraded before
    return [Flip(family, first, last, not in_before)
            for first, last, in_before in symmetric_difference(before, after, family.max_address)]


def flipped_ranges(before: Policy, after: Policy, family: Family) -> list[Flip]:
    """The destinations of `family` whose verdict differs between the policies, as maximal ranges in address
    order; a family one policy does not manage counts as "never masqueraded" there."""
    return _flips(before.preserved_ranges(family), after.preserved_ranges(family), family)


class Treatment(Enum):
    MASQUERADE = "masquerade"  # the destination sees the node IP
    PRESERVE = "preserve"  # the destination sees the pod IP
    MIXED = "mixed"  # a probe CIDR whose addresses are treated both ways


_TO_PRESERVE = (Treatment.MASQUERADE, Treatment.PRESERVE)
_TO_MASQUERADE = (Treatment.PRESERVE, Treatment.MASQUERADE)


class FlippedPrefix(NamedTuple):
    """One CIDR of the flipped set (a NamedTuple: a diff of 100,000-CIDR configs makes this many of them)."""

    prefix: Prefix
    before: Treatment
    after: Treatment


@dataclass(frozen=True, slots=True)
class ProbeResult:
    destination: str
    before: Treatment
    after: Treatment
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
    preserved: dict[tuple[int, Family], list[Span]] = {}
    by_family = {}
    for family in Family:
        preserved[0, family] = before.preserved_ranges(family)
        preserved[1, family] = after.preserved_ranges(family)
        ranges = _flips(preserved[0, family], preserved[1, family], family)
        by_family[family] = ranges
        for flip in ranges:
            was, now = _TO_PRESERVE if flip.masquerade_before else _TO_MASQUERADE
            flips += [FlippedPrefix(p, was, now) for p in flip.prefixes()]
    results = []
    for text in probes:
        probe = parse_probe(text)
        flipped = [f for f in by_family[probe.family] if f.first <= probe.last and f.last >= probe.first]
        results.append(ProbeResult(
            destination=text,
            before=_treatment(preserved[0, probe.family], probe), after=_treatment(preserved[1, probe.family], probe),
            flips=bool(flipped),
            decided_before=_decided(before, probe.family, probe.network),
            decided_after=_decided(after, probe.family, probe.network),
        ))
    return DiffResult(tuple(flips), tuple(results))


def _treatment(preserved: list[Span], probe: Prefix) -> Treatment:
    """Masquerade, preserve, or mixed across the probe's addresses."""
    covered = count_inside(preserved, probe.first, probe.last)
    if covered == 0:
        return Treatment.MASQUERADE
    return Treatment.PRESERVE if covered == probe.last - probe.first + 1 else Treatment.MIXED


def _decided(policy: Policy, family: Family, address: int) -> str:
    """Which rule decides `address`, for the text output."""
    if family not in policy.families:
        return "no IPv6 rules without --enable-ipv6"
    entries = policy.rule_entries(family)
    if any(e.masquerade for e in entries):
        verdict = policy.verdict_for(family, address)
        entry, reason = verdict.entry, verdict.reason.value
    else:
        # without exceptions the kernel's first match is the first entry holding the address; a scan spares the
        # policy's interval table, which costs more than the whole diff for 100,000-entry configs
        entry = next((e for e in entries if e.prefix.network <= address <= e.prefix.last), None)
        reason = "catch-all" if entry is None else entry.origin.value
    if entry is None:
        return "final MASQUERADE"
    return f"{entry.prefix} ({reason}, {entry.where()})"
