"""Address-range arithmetic: the one place where sets of addresses are merged, subtracted, compared and cut.

A set of addresses is a list of inclusive integer ranges ``(first, last)``, sorted, disjoint and non-adjacent
(a "normal" list). Policies, diffs, conntrack cleanup, check and lint all speak this form, so an answer never
depends on how a config happens to spell its CIDRs. Pure and fast: 100,000-CIDR configs go through here.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from ipmasq.prefix import Family, Prefix

__all__ = [
    "FirstMatchTable",
    "Span",
    "append_span",
    "count_inside",
    "cut_points",
    "first_match_table",
    "inside_runs",
    "label_runs",
    "subtract",
    "symmetric_difference",
    "to_prefixes",
    "union",
    "union_of_prefixes",
]

Span = tuple[int, int]  # first, last (inclusive)


def union(spans: Iterable[Span]) -> list[Span]:
    """Any ranges (overlapping, adjacent, unsorted) as a normal list."""
    merged: list[Span] = []
    for first, last in sorted(spans):
        if merged and first <= merged[-1][1] + 1:
            if last > merged[-1][1]:
                merged[-1] = (merged[-1][0], last)
        else:
            merged.append((first, last))
    return merged


def union_of_prefixes(prefixes: Iterable[Prefix], bits: int) -> list[Span]:
    """`union` of CIDRs of one family; one int per prefix (network, then the length in its low byte) sorts
    several times faster than tuples, which matters for the agent's 100,000-CIDR path."""
    keys = [(p.network << 8) | p.length for p in prefixes]
    keys.sort()
    merged: list[Span] = []
    end = -2
    for key in keys:
        first = key >> 8
        last = first | ((1 << (bits - (key & 255))) - 1)
        if first <= end + 1:
            if last > end:
                merged[-1] = (merged[-1][0], last)
                end = last
        else:
            merged.append((first, last))
            end = last
    return merged


def append_span(spans: list[Span], first: int, last: int) -> None:
    """Add first..last to a normal list built in address order, merging it with the last range when adjacent."""
    if spans and spans[-1][1] + 1 == first:
        spans[-1] = (spans[-1][0], last)
    else:
        spans.append((first, last))


def subtract(a: Iterable[Span], b: Iterable[Span]) -> list[Span]:
    """The addresses of normal list `a` that are not in normal list `b`."""
    holes = list(b)
    out: list[Span] = []
    j = 0
    for first, last in a:
        start = first
        while j < len(holes) and holes[j][1] < start:
            j += 1
        k = j
        while k < len(holes) and holes[k][0] <= last and start <= last:
            if holes[k][0] > start:
                out.append((start, holes[k][0] - 1))
            start = max(start, holes[k][1] + 1)
            k += 1
        if start <= last:
            out.append((start, last))
    return out


def _edges(spans: list[Span]) -> list[int]:
    """A normal list as the strictly increasing points where membership toggles."""
    edges: list[int] = []
    for first, last in spans:
        edges.append(first)
        edges.append(last + 1)
    return edges


def symmetric_difference(a: list[Span], b: list[Span], top: int) -> list[tuple[int, int, bool]]:
    """The addresses (up to `top`) in exactly one of two normal lists, as maximal ranges in address order, each
    with True when it is in `a` (and not `b`).

    One merge of the two toggle lists (both already sorted): linear, no dict or sort, since 100,000-CIDR configs
    give 200,000 points per side.
    """
    ea, eb = _edges(a), _edges(b)
    na, nb = len(ea), len(eb)
    out: list[tuple[int, int, bool]] = []
    i = j = 0
    in_a = in_b = False
    open_at = -1  # start of the range being built, -1 when none
    open_in_a = False
    while i < na or j < nb:
        if j >= nb or (i < na and ea[i] < eb[j]):
            point = ea[i]
            i += 1
            in_a = not in_a
        elif i >= na or eb[j] < ea[i]:
            point = eb[j]
            j += 1
            in_b = not in_b
        else:  # both toggle here
            point = ea[i]
            i += 1
            j += 1
            in_a = not in_a
            in_b = not in_b
        if open_at >= 0:
            out.append((open_at, point - 1, open_in_a))
            open_at = -1
        if in_a != in_b and point <= top:
            open_at = point
            open_in_a = in_a
    return out


def count_inside(spans: list[Span], first: int, last: int) -> int:
    """How many addresses of first..last lie in the normal list `spans`."""
    covered = 0
    for lo, hi in spans[max(0, bisect_right(spans, (first, -1)) - 1):]:
        if lo > last:
            break
        if hi >= first:
            covered += min(hi, last) - max(lo, first) + 1
    return covered


def cut_points(first: int, last: int, edges: Iterable[int]) -> list[int]:
    """first..last cut at `edges` (points where something changes): the starts of the pieces, first included."""
    ordered = sorted(set(edges))
    return [first, *ordered[bisect_right(ordered, first):bisect_left(ordered, last + 1)]]


def to_prefixes(family: Family, first: int, last: int) -> list[Prefix]:
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


@dataclass(frozen=True, slots=True)
class FirstMatchTable:
    """Disjoint intervals: starts[i] .. starts[i+1]-1 is decided by the rule with index labels[i] (-1: none)."""

    starts: list[int]
    labels: list[int]

    def label_at(self, address: int) -> int:
        """The index of the first rule whose prefix holds `address`, -1 when none does: O(log n)."""
        return self.labels[bisect_right(self.starts, address) - 1]


def first_match_table(prefixes: Sequence[Prefix], top: int) -> FirstMatchTable:
    """For rules each testing one prefix, in order: which rule a first-match walk stops at, for every address.

    One sweep over the nested prefixes: CIDRs either nest or are disjoint, so the prefixes containing a point
    form a stack, and each point is labelled by the lowest rule index on it. The kernel's first-match walk over
    a chain, and the policy's verdict, in O(log n) per address instead of O(n).
    """
    starts = [0]
    labels = [-1]

    def emit(position: int, label: int) -> None:
        if starts[-1] == position:
            labels[-1] = label
            if len(labels) > 1 and labels[-2] == label:
                starts.pop()
                labels.pop()
        elif labels[-1] != label:
            starts.append(position)
            labels.append(label)

    order = sorted(range(len(prefixes)), key=lambda i: (prefixes[i].network, prefixes[i].length))
    stack: list[tuple[int, int]] = []  # (last address, first rule index containing this level)
    for index in order:
        prefix = prefixes[index]
        while stack and stack[-1][0] < prefix.network:
            last, _ = stack.pop()
            emit(last + 1, stack[-1][1] if stack else -1)
        best = index if not stack else min(index, stack[-1][1])
        stack.append((prefix.last, best))
        emit(prefix.network, best)
    while stack:
        last, _ = stack.pop()
        if last < top:
            emit(last + 1, stack[-1][1] if stack else -1)
    return FirstMatchTable(starts, labels)


def label_runs(table: FirstMatchTable, first: int, last: int) -> Iterator[tuple[int, int, int]]:
    """first..last cut where the table's label changes: (start, end, label) in address order."""
    starts, labels = table.starts, table.labels
    index = bisect_right(starts, first) - 1
    start = first
    while start <= last:
        end = starts[index + 1] - 1 if index + 1 < len(starts) else last
        end = min(end, last)
        yield start, end, labels[index]
        start = end + 1
        index += 1


def inside_runs(spans: list[Span], first: int, last: int) -> Iterator[tuple[int, int, bool]]:
    """first..last cut where membership in the normal list `spans` changes: (start, end, inside)."""
    index = bisect_right(spans, (first, 1 << 130)) - 1  # the last span starting at or before `first`
    start = first
    if index < 0:
        index = 0
    while start <= last:
        while index < len(spans) and spans[index][1] < start:
            index += 1
        if index == len(spans) or spans[index][0] > last:
            yield start, last, False
            return
        span_first, span_last = spans[index]
        if span_first > start:
            yield start, span_first - 1, False
            start = span_first
        end = min(span_last, last)
        yield start, end, True
        start = end + 1
