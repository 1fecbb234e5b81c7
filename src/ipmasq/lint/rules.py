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

from bisect import bisect_right
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
from ipmasq.policy.prefix import Family, Prefix, parse_address
from ipmasq.policy.ranges import Span, subtract, union_of_prefixes

__all__ = ["lint_rules"]

Add = Callable[[str, Severity, str, "int | None"], None]
Where = Callable[["int | None"], str]
_SpansOf = dict[int, tuple[Span, ...]]
_MAX_NAMED = 5  # covering rules named in one finding


def lint_rules(config: MasqConfig, policy: Policy, add: Add, where: Where, *, pod_ranges: Sequence[Prefix] = (),
               node_names: Sequence[str] = (), budget: WorkBudget | None = None) -> None:
    """Report each rule's findings through `add(id, severity, message, config line)`; `where(line)` names a line.
    With a budget, the rules it leaves unchecked for shadowing and effect are named in one rules-not-checked."""
    shared_lists = {family: policy.preserved_ranges(family) for family in Family}  # one rule removed: same lists
    pods = [(p, "--pod-range") for p in pod_ranges] + [(p, f"the sources of rule {r.name}")
                                                         for r in config.rules for p in r.sources]
    spans_of = {id(r): tuple((p.network, p.last) for p in r.destinations) for r in config.rules}
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
            _check_reach(index, rule, config, add, where, node_names, shared_lists, spans_of, budget)
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


def _check_reach(index: int, rule: Rule, config: MasqConfig, add: Add, where: Where, node_names: Sequence[str],
                 shared_lists: dict[Family, list[Span]], spans_of: _SpansOf, budget: WorkBudget | None) -> None:
    """Whether a packet reaches the rule (shadowed-rule), and whether it changes anything (rule-no-effect)."""
    earlier = [r for r in config.rules[:index] if r.family is rule.family]
    covering = _covering(rule, earlier, node_names, spans_of, budget)
    if covering is not None:
        named = ", ".join(f"{r.name} ({where(r.line)})" for r in covering[:_MAX_NAMED])
        more = f" and {len(covering) - _MAX_NAMED} more" if len(covering) > _MAX_NAMED else ""
        add("shadowed-rule", Severity.WARNING,
            f"rule {rule.name} is never reached: every packet it matches is matched first by {named}{more}",
            rule.line)
        return
    _check_effect(rule, [r for r in config.rules if r.family is rule.family], shared_lists[rule.family], add,
                  node_names, spans_of, budget)


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


def _covering(rule: Rule, earlier: list[Rule], node_names: Sequence[str], spans_of: _SpansOf,
              budget: WorkBudget | None) -> list[Rule] | None:
    """The earlier rules that together match every packet `rule` matches (on every node it exists on), or None
    when some packet reaches it (or it cannot be decided)."""
    family = rule.family
    destinations = union_of_prefixes(rule.destinations, family.bits)
    earlier = _meeting(earlier, destinations, spans_of, budget)  # only these can match a packet of the rule's
    if not earlier:
        return None
    classes = _classes([*earlier, rule], node_names)
    if classes is None:
        return None
    protocols = protocol_atoms([*earlier, rule])
    used: dict[str, Rule] = {}
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
                    for r in active:
                        if any(p.covers(q) or q.covers(p) for p in r.destinations for q in rule.destinations):
                            used.setdefault(r.name, r)
    if not reached_somewhere:
        return None  # on no given node: rule-nodes-match-none says so
    return [r for r in earlier if r.name in used]


def _meeting(rules: Sequence[Rule], spans: list[Span], spans_of: _SpansOf, budget: WorkBudget | None) -> list[Rule]:
    """The rules with a destination that meets `spans` (sorted, disjoint): the only ones that can decide a packet
    bound there, so the only ones a check of those destinations needs to walk. `spans_of`: id(rule) -> its
    destinations as spans, worked out once (Prefix.last is computed on every use)."""
    if budget is not None:
        budget.charge(len(rules))
    starts = [first for first, _ in spans]
    met = []
    for r in rules:
        for first, last in spans_of[id(r)]:
            i = bisect_right(starts, last) - 1
            if i >= 0 and spans[i][1] >= first:
                met.append(r)
                break
    return met



def _check_effect(rule: Rule, family_rules: Sequence[Rule], preserved: list[Span], add: Add,
                  node_names: Sequence[str], spans_of: _SpansOf, budget: WorkBudget | None) -> None:
    """A rule whose action is what the rules below it and the lists do anyway, for every packet it decides.

    Exact, and local: only the packets the rule matches can change when it goes, so the walk covers its own box
    (its node classes, protocol, ports and sources) and destinations, with the rules whose destinations meet its."""
    family = rule.family
    windows = union_of_prefixes(rule.destinations, family.bits)
    near = _meeting(family_rules, windows, spans_of, budget)
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
