"""The config's rules of one family indexed by destination: a packet is tested only against the rules whose
destinations hold its destination address, in rule order, so the first match costs a bisect and a few rule tests
instead of a walk over every rule.

The address space is cut into elementary intervals at every rule destination's boundaries. CIDRs either nest or
are disjoint, so the destinations holding an interval form a chain (at most 33 for IPv4, 129 for IPv6), and each
interval keeps that chain as a tuple of groups: one group per distinct destination prefix, the sorted positions of
the rules that list it, shared by every interval the prefix covers. Memory is then the rules' destinations plus one
short chain per interval, whatever the overlap (10,000 rules all to 0.0.0.0/0 hold one group of 10,000, not one per
interval). A chain whose groups hold few rules in all is merged into one sorted group, the common case's single
in-order scan.

The first match over several groups scans each in order, stopping at the best position found so far: every rule
before the first match is still tested, in whichever group it is, so the answer (and the rules it depends on when
the packet's source, protocol or port is not known) is exactly the walk's.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from typing import NamedTuple

from ipmasq.config.model import Rule

__all__ = ["MERGE_LIMIT", "RuleIndex", "RuleMatch"]

# a chain whose groups hold at most this many rules in all is merged into one group: one in-order scan, and the
# memory this costs per interval stays bounded by the limit
MERGE_LIMIT = 32

_SOURCE, _PROTOCOL, _PORT = 1, 2, 4
# the unknown fields' bit mask -> their names in PACKET_FIELDS order (source, protocol, port)
_FIELDS_OF_MASK = tuple(tuple(name for bit, name in ((_SOURCE, "source"), (_PROTOCOL, "protocol"), (_PORT, "port"))
                              if mask & bit) for mask in range(8))


class RuleMatch(NamedTuple):
    """The first rule that matches a packet (None: none does) and the earlier rules that match or not depending on
    fields not given (in rule order), with those fields in PACKET_FIELDS order."""

    rule: Rule | None
    conditional: tuple[Rule, ...] = ()
    depends_on: tuple[str, ...] = ()


NO_MATCH = RuleMatch(None)
# the groups of rule positions whose destinations hold an interval: each group sorted, together each position once
Chain = tuple[tuple[int, ...], ...]


class _Test(NamedTuple):
    """What a rule tests besides the destination, as plain values: the scan reads them without method calls."""

    sources: tuple[tuple[int, int], ...]  # inclusive (first, last) address spans; empty: any source
    protocol: str | None
    ports: tuple[tuple[int, int], ...]


class RuleIndex:
    """The rules of one family on one node (already selected by their nodes globs), in order, by destination."""

    __slots__ = ("_chains", "_starts", "_tests", "rules")

    def __init__(self, rules: Sequence[Rule], merge_limit: int = MERGE_LIMIT) -> None:
        self.rules = tuple(rules)
        self._tests = tuple(_Test(tuple((p.network, p.last) for p in rule.sources), rule.protocol, rule.ports)
                            for rule in self.rules)
        top = self.rules[0].family.max_address if self.rules else 0
        self._starts, self._chains = _intervals(self.rules, top, merge_limit)

    @property
    def intervals(self) -> int:
        return len(self._starts)

    @property
    def interval_starts(self) -> Sequence[int]:
        """The first address of each elementary interval, ascending (the first is 0)."""
        return tuple(self._starts)

    def candidates(self, address: int) -> Chain:
        """The groups of rule positions whose destinations hold `address`: each group sorted, no position twice."""
        return self._chains[bisect_right(self._starts, address) - 1]

    def first_match(self, address: int, source: int | None = None, protocol: str | None = None,
                    port: int | None = None) -> RuleMatch:
        """The walk's first match for a packet to `address`; None fields: not known (see RuleMatch)."""
        chain = self._chains[bisect_right(self._starts, address) - 1]
        if not chain:
            return NO_MATCH
        tests = self._tests
        best = len(tests)
        pending: list[tuple[int, int]] = []  # (position, unknown fields' mask) of the rules that may match
        for group in chain:
            for position in group:
                if position >= best:
                    break
                sources, rule_protocol, ports = tests[position]
                unknown = 0
                if sources:
                    if source is None:
                        unknown = _SOURCE
                    else:
                        for first, last in sources:
                            if first <= source <= last:
                                break
                        else:
                            continue
                if rule_protocol is not None:
                    if protocol is None:
                        unknown |= _PROTOCOL
                    elif protocol != rule_protocol:
                        continue
                if ports:
                    if port is None:
                        unknown |= _PORT
                    else:
                        for low, high in ports:
                            if low <= port <= high:
                                break
                        else:
                            continue
                if unknown:
                    pending.append((position, unknown))
                    continue
                best = position
                break
        rules = self.rules
        decided = rules[best] if best < len(rules) else None
        if not pending:
            return NO_MATCH if decided is None else RuleMatch(decided)
        if len(chain) > 1:
            # several groups: their pending rules interleave, and some may come after the match a later group found
            pending = sorted(p for p in pending if p[0] < best)
        mask = 0
        for _, unknown in pending:
            mask |= unknown
        return RuleMatch(decided, tuple(rules[position] for position, _ in pending), _FIELDS_OF_MASK[mask])


def _widest_first(span: tuple[int, int]) -> tuple[int, int]:
    """By first address, the wider of two with the same first address ahead: a parent precedes its children."""
    return span[0], -span[1]


def _intervals(rules: tuple[Rule, ...], top: int, merge_limit: int) -> tuple[list[int], list[Chain]]:
    """Interval starts (the first is 0; none past `top`, the family's last address) and each interval's chain of
    groups, widest destination first."""
    positions: dict[tuple[int, int], list[int]] = {}  # (first, last) of a destination -> positions of its rules
    for position, rule in enumerate(rules):
        if len(rule.destinations) == 1:  # most rules
            p = rule.destinations[0]
            positions.setdefault((p.network, p.last), []).append(position)
            continue
        # a rule's destinations that another of its destinations covers add nothing: dropped, so that a rule is in
        # at most one group of any chain (its remaining destinations are disjoint)
        widest_last = -1
        for first, last in sorted(((p.network, p.last) for p in rule.destinations), key=_widest_first):
            if first <= widest_last:
                continue
            widest_last = last
            positions.setdefault((first, last), []).append(position)
    spans = sorted(positions, key=_widest_first)
    groups = [tuple(positions[span]) for span in spans]
    starts: list[int] = [0]
    chains: list[Chain] = [()]
    merged: dict[tuple[int, ...], Chain] = {(): ()}  # chain (span numbers) -> its groups
    stack: list[int] = []  # span numbers of the destinations holding the current point, widest first

    def chain_of(key: tuple[int, ...]) -> Chain:
        found = merged.get(key)
        if found is None:
            members = [groups[k] for k in key]
            if len(members) > 1 and sum(map(len, members)) <= merge_limit:
                found = (tuple(sorted(position for group in members for position in group)),)
            else:
                found = tuple(members)
            merged[key] = found
        return found

    def emit(at: int) -> None:
        """From `at` on, the destinations on the stack hold the addresses."""
        if at > top:  # after a destination that ends at the family's last address
            return
        chain = chain_of(tuple(stack))
        if starts[-1] == at:
            chains[-1] = chain
            if len(chains) > 1 and chains[-2] is chain:
                starts.pop()
                chains.pop()
        elif chains[-1] is not chain:
            starts.append(at)
            chains.append(chain)

    for number, (first, _) in enumerate(spans):
        while stack and spans[stack[-1]][1] < first:  # the destinations that end before this one starts
            emit(spans[stack.pop()][1] + 1)
        stack.append(number)
        emit(first)
    while stack:
        emit(spans[stack.pop()][1] + 1)
    return starts, chains
