"""Which destinations change verdict between two policies: the core of `diff` and of conntrack cleanup.

Computed on the exact non-masquerade address sets, so the answer is minimal and independent of how either
config happens to spell its CIDRs.
"""

from __future__ import annotations

from dataclasses import dataclass

from ipmasq.policy import Policy
from ipmasq.prefix import Family, Prefix

__all__ = ["Flip", "flipped_ranges", "flips_between", "preserved_ranges", "range_to_prefixes"]


@dataclass(frozen=True, slots=True)
class Flip:
    """Addresses first..last (inclusive) whose pod traffic was masqueraded before and not after, or the reverse."""

    family: Family
    first: int
    last: int
    masquerade_before: bool

    @property
    def masquerade_after(self) -> bool:
        return not self.masquerade_before

    def prefixes(self) -> list[Prefix]:
        return range_to_prefixes(self.family, self.first, self.last)


def preserved_ranges(policy: Policy, family: Family) -> list[tuple[int, int]]:
    """The addresses whose pod traffic keeps the pod IP: sorted, disjoint, non-adjacent inclusive ranges."""
    if family not in policy.families:
        return [(0, family.max_address)]  # no rules for this family: every pod address leaves unchanged
    entries = policy.rule_entries(family)
    if any(e.masquerade for e in entries):
        return policy.non_masquerade_ranges(family)
    # Without exceptions every rule but the catch-all is a RETURN, so the preserved set is the plain union of
    # the prefixes: a sort and a merge, several times faster than the policy's first-match sweep.
    bits = family.bits
    hosts = [(1 << (bits - length)) - 1 for length in range(bits + 1)]
    spans = sorted([(e.prefix.network, e.prefix.network | hosts[e.prefix.length]) for e in entries])
    ranges: list[tuple[int, int]] = []
    for first, last in spans:
        if ranges and first <= ranges[-1][1] + 1:
            if last > ranges[-1][1]:
                ranges[-1] = (ranges[-1][0], last)
        else:
            ranges.append((first, last))
    return ranges


def _edges(ranges: list[tuple[int, int]]) -> list[int]:
    """Sorted, disjoint, non-adjacent ranges as the strictly increasing points where membership toggles."""
    edges: list[int] = []
    for first, last in ranges:
        edges.append(first)
        edges.append(last + 1)
    return edges


def flipped_ranges(before: Policy, after: Policy, family: Family) -> list[Flip]:
    """The symmetric difference of the two preserved sets, as maximal ranges in address order.

    One merge of the two toggle lists (both already sorted): linear, no dict or sort, since 100,000-CIDR
    configs give 200,000 points per side.
    """
    return flips_between(preserved_ranges(before, family), preserved_ranges(after, family), family)


def flips_between(before: list[tuple[int, int]], after: list[tuple[int, int]], family: Family) -> list[Flip]:
    """flipped_ranges over two preserved sets already computed (diff also answers probes from them)."""
    a = _edges(before)
    b = _edges(after)
    na, nb = len(a), len(b)
    top = family.max_address
    flips: list[Flip] = []
    i = j = 0
    in_a = in_b = False
    open_at = -1  # start of the flip being built, -1 when none
    masquerade_before = False
    while i < na or j < nb:
        if j >= nb or (i < na and a[i] < b[j]):
            point = a[i]
            i += 1
            in_a = not in_a
        elif i >= na or b[j] < a[i]:
            point = b[j]
            j += 1
            in_b = not in_b
        else:  # both toggle here
            point = a[i]
            i += 1
            j += 1
            in_a = not in_a
            in_b = not in_b
        if open_at >= 0:
            flips.append(Flip(family, open_at, point - 1, masquerade_before))
            open_at = -1
        if in_a != in_b and point <= top:
            open_at = point
            masquerade_before = in_b  # preserved only after: it was masqueraded before
    return flips


def range_to_prefixes(family: Family, first: int, last: int) -> list[Prefix]:
    """The fewest CIDRs that exactly cover first..last."""
    out = []
    bits = family.bits
    while first <= last:
        # the largest block aligned at `first` (its lowest set bit) that does not run past `last`
        size = first & -first if first else 1 << bits
        fits = 1 << ((last - first + 1).bit_length() - 1)
        if fits < size:
            size = fits
        out.append(Prefix(family, first, bits + 1 - size.bit_length()))
        first += size
    return out
