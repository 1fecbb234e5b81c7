"""What a change flips: the minimal CIDRs whose verdict differs between two policies, and probe destinations.

Pure: policies in, values out. The flipped address set comes from flips.flipped_ranges (exact, independent of
how either side spells its CIDRs); it is printed as the fewest CIDRs that cover it exactly.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass
from enum import Enum
from typing import NamedTuple

from ipmasq.flips import flips_between, preserved_ranges, range_to_prefixes
from ipmasq.policy import Policy
from ipmasq.prefix import Family, Prefix, parse_address, parse_cidr

__all__ = ["Action", "DiffResult", "FlippedPrefix", "ProbeResult", "diff_policies", "parse_probe"]


class Action(Enum):
    MASQUERADE = "masquerade"  # the destination sees the node IP
    PRESERVE = "preserve"  # the destination sees the pod IP
    MIXED = "mixed"  # a probe CIDR whose addresses are treated both ways


class FlippedPrefix(NamedTuple):
    """One CIDR of the flipped set (a NamedTuple: a diff of 100,000-CIDR configs makes this many of them)."""

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
    preserved: dict[tuple[int, Family], list[tuple[int, int]]] = {}
    by_family = {}
    for family in Family:
        preserved[0, family] = preserved_ranges(before, family)
        preserved[1, family] = preserved_ranges(after, family)
        ranges = flips_between(preserved[0, family], preserved[1, family], family)
        by_family[family] = ranges
        to_preserve, to_masquerade = (Action.MASQUERADE, Action.PRESERVE), (Action.PRESERVE, Action.MASQUERADE)
        for flip in ranges:
            was, now = to_preserve if flip.masquerade_before else to_masquerade
            flips += [FlippedPrefix(p, was, now) for p in range_to_prefixes(family, flip.first, flip.last)]
    results = []
    for text in probes:
        probe = parse_probe(text)
        flipped = [f for f in by_family[probe.family] if f.first <= probe.last and f.last >= probe.first]
        results.append(ProbeResult(
            destination=text,
            before=_action(preserved[0, probe.family], probe), after=_action(preserved[1, probe.family], probe),
            flips=bool(flipped),
            decided_before=_decided(before, probe.family, probe.network),
            decided_after=_decided(after, probe.family, probe.network),
        ))
    return DiffResult(tuple(flips), tuple(results))


def _action(preserved: list[tuple[int, int]], probe: Prefix) -> Action:
    """Masquerade, preserve, or mixed across the probe's addresses."""
    covered = 0
    for first, last in preserved[max(0, bisect_right(preserved, (probe.first, -1)) - 1):]:
        if first > probe.last:
            break
        if last >= probe.first:
            covered += min(last, probe.last) - max(first, probe.first) + 1
    if covered == 0:
        return Action.MASQUERADE
    return Action.PRESERVE if covered == probe.last - probe.first + 1 else Action.MIXED


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
