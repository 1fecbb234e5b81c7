"""The routing decision for a forwarded packet, as the kernel makes it (fib_rules_lookup, fib_table_lookup,
fib6_table_lookup), every rule and table it met kept as a step.

Rules in priority order (equal priorities in the order given, as the kernel keeps them): a rule matches when all
its selectors do (from, to, fwmark/mask, iif, oif, ipproto, sport, dport, uidrange, tos), `not` inverting the
whole; its action then decides: `lookup` a table (a route found there ends the lookup unless the rule's
suppress_prefixlength or suppress_ifgroup refuses it, which they never do to a blackhole, unreachable or prohibit
route; no route, or a `throw` route, goes on to the next rule),
`goto` the first rule of a priority, `nop` nothing, `blackhole`/`unreachable`/`prohibit` end it. In a table the
longest prefix wins; among routes to one prefix the lowest metric whose next hops are not all dead; a prefix
whose routes are all dead falls back to a shorter one. A multipath route is "one of" its next hops: the kernel's
hash of the flow picks one, which this model does not compute.

The packet is a pod's, forwarded by the node: it arrived on a device (`iif`), it was bound to no out device (an
`oif` rule never matches it) and it has no socket, so the kernel looks it up with uid 0. A selector on something
the Flow leaves unknown (None) makes the lookup undecided, naming the field to give.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ipmasq.config.source import paused_gc
from ipmasq.prefix import Family
from ipmasq.route.facts import IpRule, NextHop, Route, Routing

__all__ = ["MAX_RULE_STEPS", "Fib", "Flow", "RouteDecision", "RouteStep"]

# Rules one lookup may evaluate: a goto only jumps forward (the kernel refuses one to an earlier priority), so a
# lookup ends after at most every rule once; the bound says so for a hostile dump as well.
MAX_RULE_STEPS = 100_000
_ERRORS = {"blackhole": "blackhole", "unreachable": "unreachable", "prohibit": "prohibit"}
# a route of these types ends the lookup at the node (delivered to it, or not forwarded as a unicast)
_LOCAL_KINDS = frozenset({"local", "broadcast", "anycast", "multicast"})


@dataclass(frozen=True, slots=True)
class Flow:
    """What the lookup keys on (the kernel's flowi): a forwarded packet's addresses, the device it came in by, its
    mark after mangle and nat PREROUTING, its protocol and ports. None: not known (a rule testing it cannot be
    decided)."""

    family: Family
    destination: int
    source: int
    iif: str | None = None
    mark: int = 0
    protocol: int | None = None
    sport: int | None = None
    dport: int | None = None
    tos: int | None = None


@dataclass(frozen=True, slots=True)
class RouteStep:
    """One rule or table the lookup met: `what` is "rule" or "table", `text` the rule or route as iproute2
    prints it (a table's name when it held no route), `result` what it did."""

    what: str
    text: str
    result: str


@dataclass(frozen=True, slots=True)
class RouteDecision:
    """The lookup's answer. `kind`: the route's type (unicast, local, broadcast, anycast, multicast, blackhole,
    unreachable, prohibit, nat), a rule's action (blackhole, unreachable, prohibit), "no-route" (every rule
    passed: the kernel answers network unreachable), or "undecided" (`undecided` says why and what to give).
    `rule` and `route` are what decided; `steps` everything met on the way."""

    family: Family
    kind: str
    rule: IpRule | None = None
    route: Route | None = None
    steps: tuple[RouteStep, ...] = ()
    undecided: str | None = None

    @property
    def forwarded(self) -> bool:
        """The packet leaves the node by this route (a unicast route)."""
        return self.kind == "unicast"

    @property
    def nexthops(self) -> tuple[NextHop, ...]:
        """Where it leaves (more than one: multipath, one of them); only the hops that are not dead."""
        if self.route is None:
            return ()
        alive = tuple(h for h in self.route.nexthops if "dead" not in h.flags)
        return alive or self.route.nexthops

    @property
    def described(self) -> str:
        """The decision in one phrase: "table 100: 172.30.0.0/16 via 192.168.20.1 dev eth1"."""
        if self.kind == "undecided":
            return f"undecided: {self.undecided}"
        if self.route is not None:
            return f"table {self.route.table}: {self.route.text}"
        if self.rule is not None:
            return f"rule {self.rule.text}"
        return "no route (network unreachable)"


class _Table:
    """One table's routes by prefix length and network, each prefix's routes in the order the kernel tries
    them; built once per Fib (linear), each lookup then probes at most one dict per prefix length."""

    def __init__(self, family: Family, routes: Iterable[Route]) -> None:
        by_length: dict[int, dict[int, list[Route]]] = defaultdict(lambda: defaultdict(list))
        for route in routes:
            by_length[route.destination.length][route.destination.network].append(route)
        self.family = family
        self.by_length = {length: dict(nets) for length, nets in by_length.items()}
        self.lengths = sorted(self.by_length, reverse=True)


class Fib:
    """A Routing ready for lookups: its rules sorted by priority, its routes grouped by table, each table indexed
    the first time a lookup reaches it (a question visits a few tables of a node's hundreds). Build it once per
    node read and ask it as often as needed."""

    def __init__(self, routing: Routing) -> None:
        self.routing = routing
        self.rules: dict[Family, list[IpRule]] = {
            family: sorted((r for r in routing.rules if r.family is family), key=lambda r: r.priority)
            for family in Family}
        grouped: dict[tuple[Family, str], list[Route]] = defaultdict(list)
        for route in routing.routes:
            grouped[(route.family, route.table)].append(route)
        self._grouped = dict(grouped)
        self._tables: dict[tuple[Family, str], _Table] = {}
        self._groups = {link.name: link.group for link in routing.links}

    def table(self, family: Family, name: str) -> _Table | None:
        """The table's index (built now when no lookup reached it before); None: the node has no such table."""
        key = (family, name)
        table = self._tables.get(key)
        if table is None:
            routes = self._grouped.get(key)
            if routes is None:
                return None
            with paused_gc():  # an index entry per route and no cycle (as ipmasq.route.iproute2 reads them)
                table = self._tables[key] = _Table(family, routes)
        return table

    def lookup(self, flow: Flow) -> RouteDecision:
        steps: list[RouteStep] = []
        rules = self.rules[flow.family]
        if not rules:
            if "rules" in self.routing.read:
                return RouteDecision(flow.family, "no-route", steps=(), undecided=None)
            # no rules read: the kernel's defaults (local, main, default)
            rules = [IpRule(flow.family, 0, table="local", text="0: from all lookup local"),
                     IpRule(flow.family, 32766, table="main", text="32766: from all lookup main"),
                     IpRule(flow.family, 32767, table="default", text="32767: from all lookup default")]
        index = 0
        evaluated = 0
        while index < len(rules):
            rule = rules[index]
            index += 1
            evaluated += 1
            if evaluated > MAX_RULE_STEPS:
                return self._undecided(flow, steps, f"more than {MAX_RULE_STEPS} rules evaluated for one lookup")
            matched = _rule_matches(rule, flow)
            if isinstance(matched, str):
                steps.append(RouteStep("rule", rule.text, "cannot decide"))
                return self._undecided(flow, steps, f"rule {rule.text}: {matched}", rule)
            if not matched:
                steps.append(RouteStep("rule", rule.text, "no match"))
                continue
            if rule.unknown:
                steps.append(RouteStep("rule", rule.text, "cannot decide"))
                return self._undecided(flow, steps, f"rule {rule.text} has fields this model does not know: "
                                       f"{', '.join(rule.unknown)}", rule)
            if rule.action == "goto":
                target = next((i for i, r in enumerate(rules) if r.priority >= (rule.goto or 0)
                               and i >= index), None)
                exact = target is not None and rules[target].priority == rule.goto
                if not exact:
                    # the kernel keeps an unresolved goto and skips it (it matches nothing until its target exists)
                    steps.append(RouteStep("rule", rule.text, f"goto {rule.goto}: no rule of that priority, "
                                                               "skipped"))
                    continue
                steps.append(RouteStep("rule", rule.text, f"matched: goto {rule.goto}"))
                assert target is not None
                index = target
                continue
            if rule.action == "nop":
                steps.append(RouteStep("rule", rule.text, "matched: nop, next rule"))
                continue
            if rule.action in _ERRORS:
                steps.append(RouteStep("rule", rule.text, f"matched: {rule.action}"))
                return RouteDecision(flow.family, rule.action, rule, None, tuple(steps))
            if rule.l3mdev:
                steps.append(RouteStep("rule", rule.text, "cannot decide"))
                return self._undecided(flow, steps, "an l3mdev (VRF) rule: which VRF the packet's devices belong "
                                       "to is not modelled", rule)
            found = self._table_lookup(flow, rule.table or "main")
            if isinstance(found, str):
                steps.append(RouteStep("rule", rule.text, "matched"))
                steps.append(RouteStep("table", f"table {rule.table}", "cannot decide"))
                return self._undecided(flow, steps, found, rule)
            if found is None:
                steps.append(RouteStep("rule", rule.text, f"matched: table {rule.table} has no route, next rule"))
                continue
            if found.kind == "throw":
                steps.append(RouteStep("rule", rule.text, "matched"))
                steps.append(RouteStep("table", found.text, "throw: next rule"))
                continue
            # the kernel asks suppress_* only of a lookup that succeeded (fib_rules_lookup: err == 0): a blackhole,
            # unreachable or prohibit route is the table's answer whatever its prefix length
            suppressed = None if found.kind in _ERRORS else self._suppressed(rule, found)
            if suppressed is not None:
                steps.append(RouteStep("rule", rule.text, "matched"))
                steps.append(RouteStep("table", found.text, f"suppressed ({suppressed}): next rule"))
                continue
            steps.append(RouteStep("rule", rule.text, "matched"))
            steps.append(RouteStep("table", found.text, f"chosen ({found.kind})"))
            if found.unknown:
                return self._undecided(flow, steps, f"route {found.text} has fields this model does not know: "
                                       f"{', '.join(found.unknown)}", rule, found)
            kind = found.kind
            return RouteDecision(flow.family, kind, rule, found, tuple(steps))
        return RouteDecision(flow.family, "no-route", None, None, tuple(steps))

    def _undecided(self, flow: Flow, steps: list[RouteStep], why: str, rule: IpRule | None = None,
                   route: Route | None = None) -> RouteDecision:
        return RouteDecision(flow.family, "undecided", rule, route, tuple(steps), why)

    def _suppressed(self, rule: IpRule, route: Route) -> str | None:
        if rule.suppress_prefixlength is not None and route.destination.length <= rule.suppress_prefixlength:
            return f"prefix /{route.destination.length} <= suppress_prefixlength {rule.suppress_prefixlength}"
        if rule.suppress_ifgroup is not None and route.nexthops:
            device = route.nexthops[0].device
            if device is not None and self._groups.get(device) == rule.suppress_ifgroup:
                return f"device {device} is in group {rule.suppress_ifgroup}"
        return None

    def _table_lookup(self, flow: Flow, name: str) -> Route | str | None:
        """The route a table gives (a throw route included: the caller goes on); None: none; text: undecided."""
        table = self.table(flow.family, name)
        if table is None:
            return None
        bits = flow.family.bits
        for length in table.lengths:
            network = flow.destination >> (bits - length) << (bits - length) if length else 0
            candidates = table.by_length[length].get(network)
            if not candidates:
                continue
            chosen = _choose(candidates, flow)
            if chosen is not None:
                return chosen
        return None


def _choose(candidates: Sequence[Route], flow: Flow) -> Route | str | None:
    """Among the routes to one prefix, the one the kernel takes; None when every one is dead (the kernel then
    tries a shorter prefix)."""
    # tos-specific routes first (the kernel sorts them ahead), an IPv6 route's longest `from` next, then metric
    ordered = sorted(candidates, key=lambda r: (0 if r.tos else 1,
                                               -(r.source_prefix.length if r.source_prefix else -1), r.metric))
    for route in ordered:
        if route.tos:
            if flow.tos is None:
                return (f"route {route.text} is for TOS {route.tos:#x} and the packet's TOS is not known "
                        "(TOS routes are not modelled)")
            if route.tos != flow.tos:
                continue
        if route.source_prefix is not None and not route.source_prefix.contains(flow.source):
            continue
        if route.kind == "unicast" and route.nexthops and all("dead" in h.flags for h in route.nexthops):
            continue
        return route
    return None


def _rule_matches(rule: IpRule, flow: Flow) -> bool | str:
    """Whether the rule's selectors match (before `not`); text: why it cannot be decided."""
    matched = _selectors(rule, flow)
    if isinstance(matched, str):
        return matched
    return matched != rule.invert


def _selectors(rule: IpRule, flow: Flow) -> bool | str:
    if rule.iif is not None:
        if rule.iif_detached:
            return False
        if flow.iif is None:
            return "it tests iif and the packet's in-interface is not known (give --in-interface)"
        if rule.iif != flow.iif:
            return False
    if rule.oif is not None:
        return False  # a forwarded packet is looked up with no out device (flowi_oif 0)
    if rule.fwmark is not None and (rule.fwmark ^ flow.mark) & rule.fwmask:
        return False
    if rule.uid_range is not None and not rule.uid_range[0] <= 0 <= rule.uid_range[1]:
        return False  # no socket: uid 0
    if rule.source is not None and not rule.source.contains(flow.source):
        return False
    if rule.destination is not None and not rule.destination.contains(flow.destination):
        return False
    if rule.tos is not None and rule.tos != 0:
        if flow.tos is None:
            return "it tests tos and the packet's TOS is not known"
        if rule.tos != flow.tos:
            return False
    if rule.ipproto is not None:
        if flow.protocol is None:
            return "it tests ipproto and the packet's protocol is not given (give --protocol)"
        if rule.ipproto != flow.protocol:
            return False
    for ports, value, flag in ((rule.sport, flow.sport, "--source-port"), (rule.dport, flow.dport, "--port")):
        if ports is None:
            continue
        if flow.protocol is not None and flow.protocol not in (6, 17, 132, 33, 136):
            return False  # a protocol without ports never matches a port range
        if value is None:
            return f"it tests a port and the packet's port is not given (give --protocol and {flag})"
        if not ports[0] <= value <= ports[1]:
            return False
    return True
