"""Findings about the config's `rules` that the agent accepts: rules no packet reaches, rules that change nothing,
node globs that match no node, snat addresses that cannot work.

Exact over destinations, sources, protocols and ports (ipmasq.policy.packet_space). Node names cannot be listed: a rule
is reached on a node class (the rules' node globs it matches and does not match) unless the earlier rules on that
class cover it; a class no real node can be in makes a rule look reachable, never shadowed (a finding is never
wrong, one may be missed). With --node-name the given nodes are the fleet.

Exact means work that grows faster than the rules (a rule is compared with the rules before it and after it): a
caller that must answer in time passes a WorkBudget, and when it is spent the rules left are named in one finding,
rules-not-checked, instead of being reported as fine.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Callable, Sequence
from fnmatch import fnmatchcase

from ipmasq.config.model import MasqConfig, Rule, RuleAction
from ipmasq.errors import WorkBudgetExhausted
from ipmasq.findings import Severity
from ipmasq.policy.budget import WorkBudget
from ipmasq.policy.packet_space import (
    MAX_PORT,
    OTHER,
    Cell,
    NodeClass,
    cells,
    compare,
    node_classes,
    paint,
    protocol_atoms,
)
from ipmasq.policy.policy import Policy
from ipmasq.policy.ranges import Span, subtract, union_of_prefixes
from ipmasq.prefix import Family, Prefix, parse_address

__all__ = ["lint_rules"]

Add = Callable[[str, Severity, str, "int | None"], None]
Where = Callable[["int | None"], str]
_MAX_NAMED = 5  # covering rules named in one finding


def lint_rules(config: MasqConfig, policy: Policy, add: Add, where: Where, *, pod_ranges: Sequence[Prefix] = (),
               node_names: Sequence[str] = (), budget: WorkBudget | None = None) -> None:
    """Report each rule's findings through `add(id, severity, message, config line)`; `where(line)` names a line.
    With a budget, the rules it leaves unchecked for shadowing and effect are named in one rules-not-checked."""
    shared_lists = {family: policy.preserved_ranges(family) for family in Family}  # one rule removed: same lists
    pods = [(p, "--pod-range") for p in pod_ranges] + [(p, f"the sources of rule {r.name}")
                                                         for r in config.rules for p in r.sources]
    destinations = _Destinations(config.rules)
    # past the budget's rule count nothing is walked: the rules are only named
    too_many = budget is not None and budget.max_rules is not None and len(config.rules) > budget.max_rules
    unchecked: list[Rule] = []
    for index, rule in enumerate(config.rules):
        if rule.family not in policy.families:
            continue
        _check_snat(rule, add, pods)
        if node_names and rule.nodes and not any(fnmatchcase(n, g) for n in node_names for g in rule.nodes):
            add("rule-nodes-match-none", Severity.WARNING,
                f"rule {rule.name}: its nodes {', '.join(rule.nodes)} match none of the given nodes "
                f"({', '.join(node_names)}), so it is written on none of them", rule.line)
            continue  # on none of the nodes: neither shadowed nor without effect there
        if unchecked or too_many:
            unchecked.append(rule)
            continue
        try:
            _check_reach(index, rule, add, where, node_names, shared_lists, destinations, budget)
        except WorkBudgetExhausted:
            unchecked.append(rule)
    if unchecked and budget is not None:  # only a budget leaves rules unchecked
        _not_checked(unchecked, len(config.rules), add, where, budget)


def _not_checked(rules: Sequence[Rule], total: int, add: Add, where: Where, budget: WorkBudget) -> None:
    first, last = rules[0], rules[-1]
    shown = f"rule {first.name} ({where(first.line)})" if len(rules) == 1 else \
        f"rules {first.name} ({where(first.line)}) to {last.name} ({where(last.line)}), {len(rules):,} in all,"
    if budget.max_rules is not None and total > budget.max_rules:
        why = f"this check takes on at most {budget.max_rules:,} rules, and the config has {total:,}"
    else:
        why = f"the check's work budget ({budget.limit:,} steps) was spent on the rules above them"
    add("rules-not-checked", Severity.WARNING,
        f"{shown} not checked for being shadowed or changing nothing: {why}", first.line)


def _check_reach(index: int, rule: Rule, add: Add, where: Where, node_names: Sequence[str],
                 shared_lists: dict[Family, list[Span]], destinations: _Destinations,
                 budget: WorkBudget | None) -> None:
    """Whether a packet reaches the rule (shadowed-rule), and whether it changes anything (rule-no-effect)."""
    windows = union_of_prefixes(rule.destinations, rule.family.bits)
    # only the rules whose destinations meet the rule's can match (or decide) a packet of its
    earlier = destinations.meeting(rule.family, windows, budget, below=index)
    covering = _covering(rule, earlier, windows, node_names, budget)
    if covering is not None:
        named = ", ".join(f"{r.name} ({where(r.line)})" for r in covering[:_MAX_NAMED])
        more = f" and {len(covering) - _MAX_NAMED} more" if len(covering) > _MAX_NAMED else ""
        add("shadowed-rule", Severity.WARNING,
            f"rule {rule.name} is never reached: every packet it matches is matched first by {named}{more}",
            rule.line)
        return
    near = destinations.meeting(rule.family, windows, budget)
    _check_effect(rule, near, windows, shared_lists[rule.family], add, node_names, budget)


def _check_snat(rule: Rule, add: Add, pods: list[tuple[Prefix, str]]) -> None:
    """`pods`: the pod ranges and every rule's sources, each with what to call it."""
    if rule.action is not RuleAction.SNAT or rule.snat_to is None:
        return
    family, address = parse_address(rule.snat_to)
    inside = next(((p, what) for p, what in pods if p.family is family and p.contains(address)), None)
    if inside is not None:
        add("snat-to-pod-address", Severity.ERROR,
            f"rule {rule.name}: snatTo {rule.snat_to} is a pod address (inside {inside[0]}, {inside[1]}): the "
            "destination sees a pod IP and its replies go to that pod, not back through this node", rule.line)
        return
    own = next((p for p in rule.destinations if p.contains(address)), None)
    if own is not None:
        add("snat-to-destination", Severity.WARNING,
            f"rule {rule.name}: snatTo {rule.snat_to} is inside its own destinations ({own}): the destination "
            "sees a source from its own range, and its replies stay in that network instead of reaching this node",
            rule.line)


def _classes(rules: Sequence[Rule], node_names: Sequence[str]) -> list[NodeClass] | None:
    try:
        return node_classes([r.nodes for r in rules if r.nodes], node_names)
    except ValueError:
        return None  # too many node-glob sets to decide: say nothing rather than guess


def _covering(rule: Rule, earlier: list[Rule], destinations: list[Span], node_names: Sequence[str],
              budget: WorkBudget | None) -> list[Rule] | None:
    """The earlier rules (those meeting its `destinations`) that together match every packet `rule` matches (on
    every node it exists on), or None when some packet reaches it (or it cannot be decided)."""
    family = rule.family
    if not earlier:
        return None
    classes = _classes([*earlier, rule], node_names)
    if classes is None:
        return None
    protocols = protocol_atoms([*earlier, rule])
    seen: set[int] = set()  # ids of the earlier rules active in some cell
    reached_somewhere = False
    for node_class in classes:
        if not node_class.selects(rule):
            continue
        reached_somewhere = True
        for ports in rule.ports or ((0, MAX_PORT),):
            for sources in [(p.network, p.last) for p in rule.sources] or [(0, family.max_address)]:
                box = Cell(node_class, rule.protocol or OTHER, ports, sources)
                for _, (active,) in cells(family, [earlier], classes, protocols, within=box, budget=budget):
                    left = subtract(destinations,
                                    union_of_prefixes([p for r in active for p in r.destinations], family.bits))
                    if left:
                        return None
                    seen.update(map(id, active))
    if not reached_somewhere:
        return None  # on no given node: rule-nodes-match-none says so
    # named: the rules active somewhere whose destinations nest with the rule's (tested once each, not per cell)
    return [r for r in earlier if id(r) in seen
            and any(p.covers(q) or q.covers(p) for p in r.destinations for q in rule.destinations)]


class _Destinations:
    """Which rules have a destination meeting some addresses, without a pass over every rule (that pass, once per
    rule, made the checks quadratic): a prefix meets a span iff it holds the span's first address (one lookup for
    each prefix length in use) or starts inside it (a bisection of the prefixes by their start)."""

    def __init__(self, rules: Sequence[Rule]) -> None:
        self.rules = rules
        self.holding: dict[tuple[Family, int, int], list[int]] = {}  # (family, length, network) -> positions
        self.lengths: dict[Family, list[int]] = {family: [] for family in Family}
        by_start: dict[Family, list[tuple[int, int]]] = {family: [] for family in Family}
        for position, rule in enumerate(rules):
            for p in rule.destinations:
                self.holding.setdefault((p.family, p.length, p.network), []).append(position)
                by_start[p.family].append((p.network, position))
        for family, length in {(family, length) for family, length, _ in self.holding}:
            self.lengths[family].append(length)
        self.starts = {family: [start for start, _ in sorted(pairs)] for family, pairs in by_start.items()}
        self.positions = {family: [position for _, position in sorted(pairs)] for family, pairs in by_start.items()}

    def meeting(self, family: Family, spans: list[Span], budget: WorkBudget | None, *,
                below: int | None = None) -> list[Rule]:
        """The rules (of the config's first `below`, in its order) with a destination meeting `spans`."""
        found: set[int] = set()
        lengths, starts, positions = self.lengths[family], self.starts[family], self.positions[family]
        for first, last in spans:
            for length in lengths:
                host_bits = family.bits - length
                found.update(self.holding.get((family, length, first >> host_bits << host_bits), ()))
            found.update(positions[bisect_left(starts, first):bisect_right(starts, last)])
        if budget is not None:
            budget.charge(len(spans) * (1 + len(lengths)) + len(found))
        end = len(self.rules) if below is None else below
        return [self.rules[i] for i in sorted(found) if i < end]


def _check_effect(rule: Rule, near: list[Rule], windows: list[Span], preserved: list[Span], add: Add,
                  node_names: Sequence[str], budget: WorkBudget | None) -> None:
    """A rule whose action is what the rules below it and the lists do anyway, for every packet it decides.

    Exact, and local: only the packets the rule matches can change when it goes, so the walk covers its own box
    (its node classes, protocol, ports and sources) and destinations (`windows`), with the rules whose destinations
    meet them (`near`, the rule among them)."""
    family = rule.family
    without = [r for r in near if r is not rule]
    classes = _classes(near, node_names)
    if classes is None:
        return
    protocols = protocol_atoms(near)
    top = family.max_address
    for node_class in classes:
        if not node_class.selects(rule):
            continue
        for ports in rule.ports or ((0, MAX_PORT),):
            for sources in [(p.network, p.last) for p in rule.sources] or [(0, family.max_address)]:
                box = Cell(node_class, rule.protocol or OTHER, ports, sources)
                for _, (with_it, without_it) in cells(family, [near, without], classes, protocols, within=box,
                                                      budget=budget):
                    before = paint(with_it, preserved, windows, top, budget)
                    after = paint(without_it, preserved, windows, top, budget)
                    if next(compare(before, after), None) is not None:
                        return
    family_name = "IPv4" if family is Family.V4 else "IPv6"
    add("rule-no-effect", Severity.INFO,
        f"rule {rule.name} changes nothing: for every {family_name} packet it decides, the rules below it and the "
        f"CIDR lists give the same outcome ({rule.action.value})", rule.line)
