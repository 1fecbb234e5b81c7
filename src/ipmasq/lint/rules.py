"""Findings about the config's `rules` that the agent accepts: rules no packet reaches, rules that change nothing,
node globs that match no node, snat addresses that cannot work.

Exact over destinations, sources, protocols and ports (ipmasq.policy.packet_space). Node names cannot be listed: a rule
is reached on a node class (the rules' node globs it matches and does not match) unless the earlier rules on that
class cover it; a class no real node can be in makes a rule look reachable, never shadowed (a finding is never
wrong, one may be missed). With --node-name the given nodes are the fleet.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from fnmatch import fnmatchcase

from ipmasq.config.model import MasqConfig, Rule, RuleAction
from ipmasq.diff.diff import diff_rule_policies
from ipmasq.findings import Severity
from ipmasq.policy.packet_space import MAX_PORT, OTHER, Cell, NodeClass, cells, node_classes, protocol_atoms
from ipmasq.policy.policy import Policy
from ipmasq.policy.prefix import Family, Prefix, parse_address
from ipmasq.policy.ranges import Span, subtract, union_of_prefixes

__all__ = ["lint_rules"]

Add = Callable[[str, Severity, str, "int | None"], None]
Where = Callable[["int | None"], str]
_MAX_NAMED = 5  # covering rules named in one finding


def lint_rules(config: MasqConfig, policy: Policy, add: Add, where: Where, *, pod_ranges: Sequence[Prefix] = (),
               node_names: Sequence[str] = ()) -> None:
    """Report each rule's findings through `add(id, severity, message, config line)`; `where(line)` names a line."""
    shared_lists = {family: policy.preserved_ranges(family) for family in Family}  # one rule removed: same lists
    for index, rule in enumerate(config.rules):
        if rule.family not in policy.families:
            continue
        _check_snat(rule, config, add, pod_ranges)
        if node_names and rule.nodes and not any(fnmatchcase(n, g) for n in node_names for g in rule.nodes):
            add("rule-nodes-match-none", Severity.WARNING,
                f"rule {rule.name}: its nodes {', '.join(rule.nodes)} match none of the given nodes "
                f"({', '.join(node_names)}), so it is written on none of them", rule.line)
            continue  # on none of the nodes: neither shadowed nor without effect there
        earlier = [r for r in config.rules[:index] if r.family is rule.family]
        covering = _covering(rule, earlier, node_names)
        if covering is not None:
            named = ", ".join(f"{r.name} ({where(r.line)})" for r in covering[:_MAX_NAMED])
            more = f" and {len(covering) - _MAX_NAMED} more" if len(covering) > _MAX_NAMED else ""
            add("shadowed-rule", Severity.WARNING,
                f"rule {rule.name} is never reached: every packet it matches is matched first by {named}{more}",
                rule.line)
            continue
        _check_effect(rule, config, policy, add, node_names, shared_lists)


def _check_snat(rule: Rule, config: MasqConfig, add: Add, pod_ranges: Sequence[Prefix]) -> None:
    if rule.action is not RuleAction.SNAT or rule.snat_to is None:
        return
    family, address = parse_address(rule.snat_to)
    pods = [(p, "--pod-range") for p in pod_ranges] + [(p, f"the sources of rule {r.name}")
                                                         for r in config.rules for p in r.sources]
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


def _covering(rule: Rule, earlier: list[Rule], node_names: Sequence[str]) -> list[Rule] | None:
    """The earlier rules that together match every packet `rule` matches (on every node it exists on), or None
    when some packet reaches it (or it cannot be decided)."""
    if not earlier:
        return None
    classes = _classes([*earlier, rule], node_names)
    if classes is None:
        return None
    family = rule.family
    destinations = union_of_prefixes(rule.destinations, family.bits)
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
                for _, (active,) in cells(family, [earlier], classes, protocols, within=box):
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


def _check_effect(rule: Rule, config: MasqConfig, policy: Policy, add: Add, node_names: Sequence[str],
                  shared_lists: dict[Family, list[Span]]) -> None:
    """A rule whose action is what the rules below it and the lists do anyway, for every packet it decides."""
    without = dataclasses.replace(config, rules=tuple(r for r in config.rules if r is not rule))
    try:
        result = diff_rule_policies(policy, Policy(without, policy.options), node_names=node_names,
                                    shared_lists=shared_lists)
    except ValueError:
        return
    if result.regions:
        return
    family = "IPv4" if rule.family is Family.V4 else "IPv6"
    add("rule-no-effect", Severity.INFO,
        f"rule {rule.name} changes nothing: for every {family} packet it decides, the rules below it and the CIDR "
        f"lists give the same outcome ({rule.action.value})", rule.line)
