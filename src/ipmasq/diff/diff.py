"""What a change flips: the minimal CIDRs whose verdict differs between two policies, and probe destinations.

Pure: policies in, values out. The flipped address set is the symmetric difference of the two policies' preserved
address sets (exact, independent of how either side spells its CIDRs); it is printed as the fewest CIDRs that
cover it exactly. Conntrack cleanup deletes the entries of the same flipped ranges.

With `rules` in either config, a packet's outcome depends on more than its destination: `diff_rule_policies`
reports the regions of destination x source x protocol x port x node whose outcome (masquerade to the node IP,
keep the pod IP, snat to an address) differs, with the rule that decided on each side (ipmasq.policy.packet_space).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from ipmasq.config.model import Rule
from ipmasq.policy.packet import Outcome, Packet
from ipmasq.policy.packet_space import (
    MAX_PORT,
    OTHER,
    Decision,
    NodeClass,
    cells,
    compare,
    list_decision,
    node_classes,
    paint,
    protocol_atoms,
)
from ipmasq.policy.policy import Policy
from ipmasq.policy.ranges import (
    Span,
    count_inside,
    inside_runs,
    subtract,
    symmetric_difference,
    to_prefixes,
    union,
    union_of_prefixes,
)
from ipmasq.prefix import Family, Prefix, parse_address, parse_cidr

__all__ = ["DiffResult", "Flip", "FlippedPrefix", "ProbedDestination", "Region", "RuleDiffResult",
           "diff_policies", "diff_rule_policies", "flipped_ranges", "has_rules", "parse_probe"]


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


_TO_PRESERVE = (Outcome.MASQUERADE, Outcome.PRESERVE)
_TO_MASQUERADE = (Outcome.PRESERVE, Outcome.MASQUERADE)


class FlippedPrefix(NamedTuple):
    """One CIDR of the flipped set (a NamedTuple: a diff of 100,000-CIDR configs makes this many of them)."""

    prefix: Prefix
    before: Outcome
    after: Outcome


@dataclass(frozen=True, slots=True)
class ProbedDestination:
    destination: str
    before: Outcome
    after: Outcome
    flips: bool
    decided_before: str  # which rule decided (for one address), for the text output
    decided_after: str


@dataclass(frozen=True, slots=True)
class DiffResult:
    flips: tuple[FlippedPrefix, ...]
    probes: tuple[ProbedDestination, ...]

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
        results.append(ProbedDestination(
            destination=text,
            before=_outcome(preserved[0, probe.family], probe), after=_outcome(preserved[1, probe.family], probe),
            flips=bool(flipped),
            decided_before=_decided(before, probe.family, probe.network),
            decided_after=_decided(after, probe.family, probe.network),
        ))
    return DiffResult(tuple(flips), tuple(results))


def _outcome(preserved: list[Span], probe: Prefix) -> Outcome:
    """Masquerade, preserve, or mixed across the probe's addresses."""
    covered = count_inside(preserved, probe.first, probe.last)
    if covered == 0:
        return Outcome.MASQUERADE
    return Outcome.PRESERVE if covered == probe.last - probe.first + 1 else Outcome.MIXED


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


# --- configs with rules: regions of the packet space ----------------------------------------------------------


def has_rules(policy: Policy) -> bool:
    """Whether the policy has rules for a family it manages (then a destination alone does not decide)."""
    return any(rule.family in policy.families for rule in policy.config.rules)


@dataclass(frozen=True, slots=True)
class Region:
    """Packets whose outcome differs: every destination x source x protocol x port x node of these (None: any)."""

    family: Family
    destinations: tuple[Span, ...]
    sources: tuple[Span, ...] | None
    protocols: tuple[str, ...] | None  # OTHER: any protocol none of `named_protocols`
    ports: tuple[Span, ...] | None  # destination ports (a protocol without ports: any)
    nodes: tuple[NodeClass, ...] | None
    before: Decision
    after: Decision
    named_protocols: tuple[str, ...] = ()

    def contains(self, packet: Packet, node: str) -> bool:
        """Whether a packet (every field known) sent from `node` is in the region."""
        def within(spans: tuple[Span, ...] | None, value: int | None) -> bool:
            return spans is None or (value is not None and any(a <= value <= b for a, b in spans))

        if packet.family is not self.family or not within(self.destinations, packet.destination):
            return False
        if not within(self.sources, packet.source_address) or not within(self.ports, packet.port):
            return False
        if self.protocols is not None:
            atom = packet.protocol if packet.protocol in self.named_protocols else OTHER
            if atom not in self.protocols:
                return False
        return self.nodes is None or any(c.holds(node) for c in self.nodes)

    def destination_prefixes(self) -> list[Prefix]:
        return [p for first, last in self.destinations for p in to_prefixes(self.family, first, last)]

    def protocols_shown(self) -> str | None:
        if self.protocols is None:
            return None
        named = [p for p in self.protocols if p != OTHER]
        if OTHER in self.protocols:
            others = ", ".join(p for p in self.named_protocols if p != OTHER and p not in named)
            named.append(f"any protocol but {others}")
        return " or ".join(named)

    def ports_shown(self) -> str | None:
        if self.ports is None:
            return None

        def listed(spans: list[Span]) -> str:
            return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)

        others = subtract([(0, MAX_PORT)], self.ports)
        return f"all but {listed(others)}" if len(others) < len(self.ports) else listed(list(self.ports))

    def sources_shown(self) -> str | None:
        if self.sources is None:
            return None

        def listed(spans: Sequence[Span]) -> list[str]:
            return [str(p) for a, b in spans for p in to_prefixes(self.family, a, b)]

        given, others = listed(self.sources), listed(subtract([(0, self.family.max_address)], self.sources))
        return "all but " + ", ".join(others) if len(others) < len(given) else ", ".join(given)

    def nodes_shown(self) -> str | None:
        return None if self.nodes is None else " or ".join(c.shown() for c in self.nodes)


@dataclass(frozen=True, slots=True)
class RuleDiffResult:
    regions: tuple[Region, ...]
    probes: tuple[ProbedDestination, ...]

    @property
    def probe_flipped(self) -> bool:
        return any(p.flips for p in self.probes)


def _rules_of(policy: Policy, family: Family) -> tuple[Rule, ...]:
    """The config's rules of a family the policy manages, on every node (node classes select them later)."""
    if family not in policy.families:
        return ()
    return tuple(r for r in policy.config.rules if r.family is family)


_Key = tuple[Decision, Decision]
_Pieces = dict[_Key, tuple[Span, ...]]


class _FamilyDiff:
    """The regions of one family, and what each side does to the probes' destinations."""

    def __init__(self, before: Policy, after: Policy, family: Family, node_names: Sequence[str], *,
                 shared: list[Span] | None) -> None:
        self.family = family
        self.sides = (_rules_of(before, family), _rules_of(after, family))
        self.preserved = (shared, shared) if shared is not None else \
            (before.preserved_ranges(family), after.preserved_ranges(family))
        every = self.sides[0] + self.sides[1]
        self.protocols = protocol_atoms(every)
        self.classes = node_classes([r.nodes for r in every if r.nodes], node_names)
        self.ruled = union_of_prefixes([p for r in every for p in r.destinations], family.bits)
        self._painted: dict[tuple[tuple[Rule, ...], ...], tuple[list[tuple[int, int, Decision]], ...]] = {}

    def painted(self, active: tuple[tuple[Rule, ...], ...]) -> tuple[list[tuple[int, int, Decision]], ...]:
        got = self._painted.get(active)
        if got is None:
            got = tuple(paint(rules, preserved, self.ruled, self.family.max_address)
                        for rules, preserved in zip(active, self.preserved, strict=True))
            self._painted[active] = got
        return got

    def regions(self) -> list[Region]:
        family = self.family
        out: list[Region] = []
        # outside every rule's destinations only the lists decide, for any source, protocol, port and node
        flips = [] if self.preserved[0] == self.preserved[1] else \
            symmetric_difference(self.preserved[0], self.preserved[1], family.max_address)
        for kept_before in (True, False):
            spans = subtract([(a, b) for a, b, in_before in flips if in_before is kept_before], self.ruled)
            if spans:
                out.append(Region(family, tuple(spans), None, None, None, None, list_decision(kept_before),
                                  list_decision(not kept_before)))
        # inside them, cell by cell: (class index, protocol, ports, sources) -> key -> destinations
        pieces: list[tuple[int, str, Span, Span, _Key, tuple[Span, ...]]] = []
        class_index = {c: i for i, c in enumerate(self.classes)}
        differences: dict[tuple[tuple[Rule, ...], ...], _Pieces] = {}
        for cell, active in cells(family, self.sides, self.classes, self.protocols):
            found = differences.get(active)
            if found is None:
                grouped: dict[_Key, list[Span]] = {}
                before, after = self.painted(active)
                for first, last, was, now in compare(before, after):
                    grouped.setdefault((was, now), []).append((first, last))
                found = {key: tuple(union(spans)) for key, spans in grouped.items()}
                differences[active] = found
            for key, destinations in found.items():
                pieces.append((class_index[cell.nodes], cell.protocol, cell.ports, cell.sources, key, destinations))
        out += self._merged(pieces)
        return out

    def _merged(self, pieces: list[tuple[int, str, Span, Span, _Key, tuple[Span, ...]]]) -> list[Region]:
        """Cells with the same outcome over the same destinations, joined along sources, ports, protocols, nodes."""
        by_sources: dict[tuple[int, str, Span, _Key, tuple[Span, ...]], list[Span]] = {}
        for node_class, protocol, port_span, source_span, key, destinations in pieces:
            by_sources.setdefault((node_class, protocol, port_span, key, destinations), []).append(source_span)
        by_ports: dict[tuple[int, str, _Key, tuple[Span, ...], tuple[Span, ...]], list[Span]] = {}
        for (node_class, protocol, port_span, key, destinations), source_spans in by_sources.items():
            by_ports.setdefault((node_class, protocol, key, destinations, tuple(union(source_spans))),
                                []).append(port_span)
        by_protocol: dict[tuple[int, _Key, tuple[Span, ...], tuple[Span, ...], tuple[Span, ...]], list[str]] = {}
        for (node_class, protocol, key, destinations, sources), port_spans in by_ports.items():
            by_protocol.setdefault((node_class, key, destinations, sources, tuple(union(port_spans))),
                                   []).append(protocol)
        by_nodes: dict[tuple[_Key, tuple[Span, ...], tuple[Span, ...], tuple[Span, ...], tuple[str, ...]],
                       list[int]] = {}
        for (node_class, key, destinations, sources, ports), protocol_names in by_protocol.items():
            by_nodes.setdefault((key, destinations, sources, ports, tuple(sorted(protocol_names))),
                                []).append(node_class)
        family = self.family
        everywhere = ((0, family.max_address),)
        out = []
        for ((was, now), destinations, sources, ports, protocols), classes in by_nodes.items():
            out.append(Region(
                family, destinations,
                None if sources == everywhere else sources,
                None if len(protocols) == len(self.protocols) else protocols,
                None if ports == ((0, MAX_PORT),) else ports,
                None if len(classes) == len(self.classes) and not self.classes[0].names
                else tuple(self.classes[i] for i in sorted(classes)),
                was, now, self.protocols))
        return out

    def outcomes_over(self, first: int, last: int) -> tuple[list[Decision], list[Decision]]:
        """Every outcome each side gives some packet to a destination in first..last, in first-seen order."""
        seen: tuple[dict[Decision, None], dict[Decision, None]] = ({}, {})
        outside = subtract([(first, last)], self.ruled)
        for side, preserved in enumerate(self.preserved):
            for a, b in outside:
                for _, _, inside in inside_runs(preserved, a, b):
                    seen[side].setdefault(list_decision(inside), None)
        if len(outside) != 1 or outside[0] != (first, last):
            for _, active in cells(self.family, self.sides, self.classes, self.protocols):
                for side, painting in enumerate(self.painted(active)):
                    for a, b, outcome in painting:
                        if a <= last and b >= first:
                            seen[side].setdefault(outcome, None)
        return list(seen[0]), list(seen[1])


def _probe_outcome(decisions: list[Decision]) -> Outcome:
    outcomes = {d.outcome for d in decisions}
    return outcomes.pop() if len(outcomes) == 1 else Outcome.MIXED


def _probe_decided(outcomes: list[Decision], policy: Policy, probe: Prefix) -> str:
    if all(o.rule is None for o in outcomes):
        return _decided(policy, probe.family, probe.network)
    deciders = list(dict.fromkeys("CIDR lists" if o.rule is None else f"rule {o.rule}" for o in outcomes))
    if len(deciders) == 1:
        (outcome,) = {o for o in outcomes if o.rule is not None}
        return outcome.decided()
    return "depends on the packet: " + " or ".join(deciders)


def diff_rule_policies(before: Policy, after: Policy, probes: tuple[str, ...] = (), node_names: Sequence[str] = (),
                       *, shared_lists: dict[Family, list[Span]] | None = None) -> RuleDiffResult:
    """Every packet whose outcome differs between the policies, as disjoint regions (exact: a packet is in a
    region iff its outcomes differ, with the region's before and after); node_names: evaluate on these nodes
    only (else per class of the rules' node globs). ValueError when the node globs make too many classes.
    shared_lists: the preserved ranges of each family when the caller knows both policies have them (only the
    rules differ), so that a caller diffing many rule changes computes them once."""
    by_family = {family: _FamilyDiff(before, after, family, node_names,
                                     shared=None if shared_lists is None else shared_lists[family])
                 for family in Family}
    regions = [region for family in Family for region in by_family[family].regions()]
    regions.sort(key=lambda r: (r.family, r.destinations[0][0], r.destinations))
    results = []
    for text in probes:
        probe = parse_probe(text)
        was, now = by_family[probe.family].outcomes_over(probe.first, probe.last)
        flipped = any(r.family is probe.family and any(a <= probe.last and b >= probe.first
                                                      for a, b in r.destinations) for r in regions)
        results.append(ProbedDestination(text, _probe_outcome(was), _probe_outcome(now), flipped,
                                   _probe_decided(was, before, probe), _probe_decided(now, after, probe)))
    return RuleDiffResult(tuple(regions), tuple(results))
