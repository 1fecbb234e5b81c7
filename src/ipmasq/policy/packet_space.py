"""Exact arithmetic over the packets a config's `rules` look at: destination x source x protocol x port x node.

A rule matches a box of that space (its destinations, sources, protocol, ports and node globs; an absent field is
the whole axis). A packet's outcome is the first matching rule's action, else what the CIDR lists say for its
destination. The space is cut into cells where no rule edge falls inside: a node class (which rule node-glob sets
a node matches), a protocol (one a rule names, or OTHER: any protocol no rule names), a port range and a source
range, each uniform for every rule. Within a cell a rule matches a set of destinations, so the outcome over
destinations is painted exactly from the rules' prefixes and the lists' preserved ranges. Cells share the same
active rules often; their painting is computed once per set of active rules.

Node names cannot be enumerated: a node class says which of the rules' node-glob sets a node matches and which it
does not. A class no real name can be in (a node matching `a-1*` always matches `a-*`) holds no packet; it may be
reported, never wrongly. With node names given (--node-name), a class is the set of given names that match alike.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from fnmatch import fnmatchcase
from typing import NamedTuple

from ipmasq.config.model import Rule, RuleAction
from ipmasq.policy.budget import WorkBudget
from ipmasq.policy.packet import Outcome
from ipmasq.policy.ranges import Span, cut_points, first_match_table, inside_runs, label_runs
from ipmasq.prefix import Family

__all__ = [
    "MAX_NODE_GLOB_SETS",
    "MAX_PORT",
    "OTHER",
    "PORT_PROTOCOLS",
    "Cell",
    "Decision",
    "NodeClass",
    "cells",
    "compare",
    "list_decision",
    "node_classes",
    "paint",
    "protocol_atoms",
    "rule_decision",
]

PORT_PROTOCOLS = ("tcp", "udp", "sctp")
OTHER = "other"  # the protocol atom for every protocol no rule names
MAX_PORT = 65535
# 2**n node classes for n distinct `nodes` sets: past this, name the nodes (--node-name) instead
MAX_NODE_GLOB_SETS = 10


class Decision(NamedTuple):
    """What a packet's destination sees, and what decided it (rule None: no rule matched, the CIDR lists did)."""

    outcome: Outcome  # MASQUERADE, PRESERVE or SNAT
    snat_to: str | None = None
    rule: str | None = None
    where: str | None = None

    def effect(self) -> tuple[Outcome, str | None]:
        """What the destination sees, without who decided it: two decisions with one effect are no change."""
        return self.outcome, self.snat_to

    def sees(self) -> str:
        if self.outcome is Outcome.SNAT:
            return f"snat to {self.snat_to}"
        return "masquerade to node IP" if self.outcome is Outcome.MASQUERADE else "preserve pod IP"

    def decided(self) -> str:
        return "no rule matches: CIDR lists" if self.rule is None else f"rule {self.rule}, {self.where}"


LIST_MASQUERADE = Decision(Outcome.MASQUERADE)
LIST_PRESERVE = Decision(Outcome.PRESERVE)


def list_decision(preserved: bool) -> Decision:
    return LIST_PRESERVE if preserved else LIST_MASQUERADE


def rule_decision(rule: Rule) -> Decision:
    return Decision(Outcome(rule.action.value), rule.snat_to if rule.action is RuleAction.SNAT else None, rule.name,
                    rule.where())


class NodeClass(NamedTuple):
    """Nodes that match every glob set of `matching` and none of `not_matching` (a set matches a node when any
    of its globs does); with `names`, exactly those given node names."""

    matching: tuple[tuple[str, ...], ...]
    not_matching: tuple[tuple[str, ...], ...]
    names: tuple[str, ...] = ()

    def selects(self, rule: Rule) -> bool:
        """Whether the rule exists on this class's nodes."""
        return not rule.nodes or rule.nodes in self.matching

    def holds(self, node: str) -> bool:
        if self.names:
            return node in self.names
        return all(any(fnmatchcase(node, g) for g in globs) for globs in self.matching) and \
            not any(any(fnmatchcase(node, g) for g in globs) for globs in self.not_matching)

    def shown(self) -> str:
        if self.names:
            return "node " + ", ".join(self.names) if len(self.names) == 1 else "nodes " + ", ".join(self.names)
        parts = []
        if self.matching:
            parts.append("matching " + " and ".join("|".join(g) for g in self.matching))
        if self.not_matching:
            parts.append("not matching " + " nor ".join("|".join(g) for g in self.not_matching))
        return "nodes " + ", ".join(parts) if parts else "all nodes"


def node_classes(glob_sets: Sequence[tuple[str, ...]], names: Sequence[str] = ()) -> list[NodeClass]:
    """The node classes the rules' `nodes` sets cut the fleet into (ValueError when there are too many to list:
    name the nodes); with `names`, the given nodes grouped by which sets they match."""
    ordered = sorted(set(glob_sets))
    if names:
        groups: dict[tuple[bool, ...], list[str]] = {}
        for name in dict.fromkeys(names):
            vector = tuple(any(fnmatchcase(name, g) for g in globs) for globs in ordered)
            groups.setdefault(vector, []).append(name)
        return [NodeClass(tuple(g for g, m in zip(ordered, vector, strict=True) if m),
                          tuple(g for g, m in zip(ordered, vector, strict=True) if not m), tuple(group))
                for vector, group in groups.items()]
    if len(ordered) > MAX_NODE_GLOB_SETS:
        raise ValueError(f"the rules have {len(ordered)} different nodes lists ({2 ** len(ordered)} node "
                         f"combinations, more than {2 ** MAX_NODE_GLOB_SETS}): name the nodes with --node-name")
    out = []
    for mask in range(1 << len(ordered)):
        out.append(NodeClass(tuple(g for i, g in enumerate(ordered) if mask >> i & 1),
                             tuple(g for i, g in enumerate(ordered) if not mask >> i & 1)))
    return out


def protocol_atoms(rules: Sequence[Rule]) -> tuple[str, ...]:
    """The protocols the rules name, then OTHER."""
    return (*sorted({r.protocol for r in rules if r.protocol is not None}), OTHER)


class Cell(NamedTuple):
    """A piece of the packet space (all destinations) where every rule either matches all of it or none of it,
    destinations aside."""

    nodes: NodeClass
    protocol: str
    ports: Span
    sources: Span


def _port_matches(rule: Rule, port: int) -> bool:
    return not rule.ports or any(low <= port <= high for low, high in rule.ports)


def _source_matches(rule: Rule, source: int) -> bool:
    return not rule.sources or any(p.network <= source <= p.last for p in rule.sources)


def cells(family: Family, sides: Sequence[Sequence[Rule]], classes: Sequence[NodeClass], protocols: Sequence[str],
          *, within: Cell | None = None, budget: WorkBudget | None = None,
          ) -> Iterator[tuple[Cell, tuple[tuple[Rule, ...], ...]]]:
    """Every cell, with each side's rules (in order) that match the cell's packets (destinations aside).

    `within` (a cell-shaped box: one node class, a protocol, a port range, a source range) restricts the walk to
    it; OTHER as its protocol there means every protocol atom. `budget` is charged a step per rule tested in each
    cell (the walk's work).
    """
    for node_class in classes if within is None else (within.nodes,):
        by_class = [[r for r in rules if node_class.selects(r)] for rules in sides]
        for protocol in protocols if within is None or within.protocol == OTHER else (within.protocol,):
            by_protocol = [[r for r in rules if r.protocol is None or r.protocol == protocol] for rules in by_class]
            port_low, port_high = (0, MAX_PORT) if within is None else within.ports
            if protocol in PORT_PROTOCOLS:
                edges = [e for rules in by_protocol for r in rules for low, high in r.ports for e in (low, high + 1)]
                port_starts = cut_points(port_low, port_high, edges)
            else:
                port_starts = [port_low]
            for i, port_first in enumerate(port_starts):
                port_last = port_starts[i + 1] - 1 if i + 1 < len(port_starts) else port_high
                by_port = [[r for r in rules if _port_matches(r, port_first)] for rules in by_protocol]
                source_low, source_high = (0, family.max_address) if within is None else within.sources
                edges = [e for rules in by_port for r in rules for p in r.sources for e in (p.network, p.last + 1)]
                source_starts = cut_points(source_low, source_high, edges)
                for j, source_first in enumerate(source_starts):
                    if budget is not None:
                        budget.charge(1 + sum(map(len, by_port)))
                    source_last = source_starts[j + 1] - 1 if j + 1 < len(source_starts) else source_high
                    active = tuple(tuple(r for r in rules if _source_matches(r, source_first)) for rules in by_port)
                    yield Cell(node_class, protocol, (port_first, port_last), (source_first, source_last)), active


def paint(rules: Sequence[Rule], preserved: list[Span], windows: list[Span],
          top: int, budget: WorkBudget | None = None) -> list[tuple[int, int, Decision]]:
    """The outcome of every destination in `windows` (a normal list) for packets the rules match by every field
    but the destination: the first rule holding it, else the lists (preserved or masqueraded). `budget` is charged
    a step per prefix and window."""
    prefixes = [p for r in rules for p in r.destinations]
    if budget is not None:
        budget.charge(1 + len(prefixes) + len(windows))
    owners = [i for i, r in enumerate(rules) for _ in r.destinations]  # increasing: a lower prefix index wins
    outcomes = [rule_decision(r) for r in rules]
    table = first_match_table(prefixes, top)
    out: list[tuple[int, int, Decision]] = []
    for first, last in windows:
        for start, end, label in label_runs(table, first, last):
            if label >= 0:
                out.append((start, end, outcomes[owners[label]]))
            else:
                out += [(s, e, list_decision(inside)) for s, e, inside in inside_runs(preserved, start, end)]
    return out


def compare(before: list[tuple[int, int, Decision]],
            after: list[tuple[int, int, Decision]]) -> Iterator[tuple[int, int, Decision, Decision]]:
    """The pieces where two paintings of the same destinations differ in effect, in address order."""
    i = j = 0
    while i < len(before) and j < len(after):
        b_first, b_last, b_outcome = before[i]
        a_first, a_last, a_outcome = after[j]
        start = max(b_first, a_first)
        end = min(b_last, a_last)
        if start <= end and b_outcome.effect() != a_outcome.effect():
            yield start, end, b_outcome, a_outcome
        if b_last <= a_last:
            i += 1
        if a_last <= b_last:
            j += 1
