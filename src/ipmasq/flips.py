"""Which destinations change verdict between two policies: the core of `diff` and of conntrack cleanup.

Computed on the exact non-masquerade address sets, so the answer is minimal and independent of how either
config happens to spell its CIDRs.
"""

from __future__ import annotations

from dataclasses import dataclass

from ipmasq.policy import Policy
from ipmasq.prefix import Family, Prefix

__all__ = ["Flip", "flipped_ranges", "range_to_prefixes"]


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


def _preserved(policy: Policy, family: Family) -> list[tuple[int, int]]:
    if family not in policy.families:
        return [(0, family.max_address)]  # no rules for this family: every pod address leaves unchanged
    return policy.non_masquerade_ranges(family)


def flipped_ranges(before: Policy, after: Policy, family: Family) -> list[Flip]:
    """The symmetric difference of the two preserved sets, as maximal ranges in address order."""
    toggles: dict[int, int] = {}
    for bit, ranges in ((1, _preserved(before, family)), (2, _preserved(after, family))):
        for first, last in ranges:
            toggles[first] = toggles.get(first, 0) ^ bit
            toggles[last + 1] = toggles.get(last + 1, 0) ^ bit
    flips: list[Flip] = []
    state = 0
    points = sorted(toggles)
    for i, point in enumerate(points):
        state ^= toggles[point]
        if point > family.max_address:
            break
        if state in (1, 2):
            end = points[i + 1] - 1 if i + 1 < len(points) else family.max_address
            masquerade_before = state == 2  # preserved only after: it was masqueraded before
            if flips and flips[-1].last + 1 == point and flips[-1].masquerade_before == masquerade_before:
                flips[-1] = Flip(family, flips[-1].first, end, masquerade_before)
            else:
                flips.append(Flip(family, point, end, masquerade_before))
    return flips


def range_to_prefixes(family: Family, first: int, last: int) -> list[Prefix]:
    """The fewest CIDRs that exactly cover first..last."""
    out = []
    bits = family.bits
    while first <= last:
        # largest block aligned at `first` that does not run past `last`
        size_bits = (first & -first).bit_length() - 1 if first else bits
        while size_bits > 0 and first + (1 << size_bits) - 1 > last:
            size_bits -= 1
        out.append(Prefix(family, first, bits - size_bits))
        first += 1 << size_bits
    return out
