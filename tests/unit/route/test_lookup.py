"""The routing decision: each rule action, selector and route type as the kernel treats them, and the indexed
lookup against a brute-force reference over random tables and rules."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ipmasq.prefix import Family, Prefix, parse_address, parse_cidr
from ipmasq.route.facts import IpRule, NextHop, Route, Routing
from ipmasq.route.lookup import Fib, Flow, RouteDecision

V4 = Family.V4


def _a(text: str) -> int:
    return parse_address(text)[1]


def _route(dst: str, table: str = "main", *, kind: str = "unicast", dev: str = "eth0", via: str | None = None,
           metric: int = 0, dead: bool = False) -> Route:
    prefix = parse_cidr(dst)
    hop = NextHop(None if via is None else _a(via), dev, flags=frozenset({"dead"}) if dead else frozenset())
    return Route(prefix.family, table, prefix, kind, metric, 0, (hop,) if kind == "unicast" else (),
                 text=f"{kind} {dst} table {table} dev {dev} metric {metric}")


def _rule(priority: int, table: str | None = "main", **fields: object) -> IpRule:
    return IpRule(V4, priority, table=table, text=f"{priority}: {table} {fields}", **fields)  # type: ignore[arg-type]


DEFAULT_RULES = (_rule(0, "local"), _rule(32766, "main"), _rule(32767, "default"))


def _lookup(rules: tuple[IpRule, ...], routes: tuple[Route, ...], destination: str, source: str = "10.44.0.5",
            **flow: object) -> RouteDecision:
    return Fib(Routing(rules, routes)).lookup(Flow(V4, _a(destination), _a(source), **flow))  # type: ignore[arg-type]


MEASURED_RULES = (*DEFAULT_RULES,
                  _rule(32764, "200", fwmark=0x80, fwmask=0x80),
                  _rule(32765, "100", source=parse_cidr("10.44.0.0/14"), destination=parse_cidr("172.30.0.0/16")))
MEASURED_ROUTES = (_route("0.0.0.0/0", via="192.168.10.1", dev="eth0"),
                   _route("192.168.10.0/24", dev="eth0"), _route("192.168.20.0/24", dev="eth1"),
                   _route("172.30.0.0/16", "100", via="192.168.20.1", dev="eth1"),
                   _route("0.0.0.0/0", "200", via="192.168.20.1", dev="eth1"),
                   _route("192.168.10.2/32", "local", kind="local"))


@pytest.mark.parametrize(("destination", "mark", "table", "device"), [
    ("198.51.100.10", 0, "main", "eth0"),
    ("198.51.100.10", 0x80, "200", "eth1"),
    ("198.51.100.10", 0x81, "200", "eth1"),  # fwmark/mask: only bit 0x80 is tested
    ("172.30.1.10", 0, "100", "eth1"),
    ("192.168.10.7", 0x80, "200", "eth1"),  # 32764 comes before main's connected route
])
def test_the_measured_node(destination: str, mark: int, table: str, device: str) -> None:
    decision = _lookup(MEASURED_RULES, MEASURED_ROUTES, destination, iif="veth1", mark=mark)
    assert decision.kind == "unicast" and decision.route is not None
    assert decision.route.table == table and decision.nexthops[0].device == device
    assert decision.steps[-1].what == "table" and decision.steps[-1].result == "chosen (unicast)"


def test_the_source_selector_decides() -> None:
    assert _lookup(MEASURED_RULES, MEASURED_ROUTES, "172.30.1.10", source="10.99.0.5").route.table == "main"  # type: ignore[union-attr]


def test_local_table_first() -> None:
    decision = _lookup(MEASURED_RULES, MEASURED_ROUTES, "192.168.10.2", mark=0x80)
    assert decision.kind == "local" and not decision.forwarded


def test_goto_skips_the_rules_between() -> None:
    rules = (*MEASURED_RULES, _rule(60, None, action="goto", goto=32766))
    decision = _lookup(rules, MEASURED_ROUTES, "172.30.1.10", mark=0x80)
    assert decision.route is not None and decision.route.table == "main"
    assert any("goto 32766" in s.result for s in decision.steps)


def test_a_goto_to_no_rule_is_skipped() -> None:
    rules = (*MEASURED_RULES, _rule(60, None, action="goto", goto=100_000))
    assert _lookup(rules, MEASURED_ROUTES, "172.30.1.10").route.table == "100"  # type: ignore[union-attr]


def test_suppress_prefixlength_zero_refuses_only_the_default_route() -> None:
    # wg-quick's pattern: `lookup main suppress_prefixlength 0` ahead of the tunnel's table
    rules = (_rule(0, "local"), _rule(10, "main", suppress_prefixlength=0), _rule(20, "200"), _rule(32766, "main"))
    assert _lookup(rules, MEASURED_ROUTES, "198.51.100.10").route.table == "200"  # type: ignore[union-attr]
    assert _lookup(rules, MEASURED_ROUTES, "192.168.20.7").route.table == "main"  # type: ignore[union-attr]


def test_suppress_prefixlength_never_refuses_an_error_route() -> None:
    """The kernel suppresses only a lookup that succeeded: a table's prohibit, blackhole or unreachable default
    ends the lookup even under `suppress_prefixlength 24` (found against `ip route get`)."""
    rules = (_rule(0, "local"), _rule(30, "102", suppress_prefixlength=24), _rule(32766, "main"))
    for kind in ("prohibit", "blackhole", "unreachable"):
        routes = (*MEASURED_ROUTES, _route("0.0.0.0/0", "102", kind=kind, metric=5))
        decision = _lookup(rules, routes, "100.64.1.129")
        assert decision.kind == kind and decision.route is not None and decision.route.table == "102", decision
    # a unicast route of the same length is still refused, and so the main table decides
    routes = (*MEASURED_ROUTES, _route("0.0.0.0/0", "102", via="192.168.20.1", dev="eth1"))
    assert _lookup(rules, routes, "100.64.1.129").route.table == "main"  # type: ignore[union-attr]


def test_throw_and_no_route_go_on_errors_end() -> None:
    routes = (*MEASURED_ROUTES, _route("172.30.5.0/24", "100", kind="throw"),
              _route("172.30.6.0/24", "100", kind="unreachable"), _route("172.30.7.0/24", "100", kind="blackhole"),
              _route("172.30.8.0/24", "100", kind="prohibit"))
    assert _lookup(MEASURED_RULES, routes, "172.30.5.1").route.table == "main"  # type: ignore[union-attr]
    for destination, kind in (("172.30.6.1", "unreachable"), ("172.30.7.1", "blackhole"),
                              ("172.30.8.1", "prohibit")):
        decision = _lookup(MEASURED_RULES, routes, destination)
        assert decision.kind == kind and not decision.forwarded
    empty = _lookup(DEFAULT_RULES, (), "198.51.100.10")
    assert empty.kind == "no-route" and empty.described == "no route (network unreachable)"


def test_rule_actions_and_selectors() -> None:
    base = (*DEFAULT_RULES,)
    routes = MEASURED_ROUTES
    assert _lookup((*base, _rule(5, None, action="blackhole")), routes, "198.51.100.10").kind == "blackhole"
    assert _lookup((*base, _rule(5, None, action="prohibit", iif="gone", iif_detached=True)), routes,
                   "198.51.100.10", iif="veth1").kind == "unicast"  # a detached iif matches nothing
    assert _lookup((*base, _rule(5, None, action="prohibit", iif="gone", iif_detached=True, invert=True)), routes,
                   "198.51.100.10", iif="veth1").kind == "prohibit"  # ... so its `not` matches everything
    assert _lookup((*base, _rule(5, None, action="prohibit", oif="eth0")), routes, "198.51.100.10").kind == "unicast"
    assert _lookup((*base, _rule(5, None, action="prohibit", uid_range=(0, 0))), routes,
                   "198.51.100.10").kind == "prohibit"  # a forwarded packet has uid 0
    assert _lookup((*base, _rule(5, None, action="prohibit", uid_range=(1000, 2000))), routes,
                   "198.51.100.10").kind == "unicast"
    assert _lookup((*base, _rule(5, None, action="nop"), _rule(6, None, action="unreachable")), routes,
                   "198.51.100.10").kind == "unreachable"


def test_what_is_not_given_is_said_not_guessed() -> None:
    cases = [(_rule(5, "200", ipproto=6), {}, "--protocol"),
             (_rule(5, "200", ipproto=6, dport=(5432, 5432)), {"protocol": 6}, "--port"),
             (_rule(5, "200", iif="veth1"), {}, "--in-interface"),
             (_rule(5, "200", l3mdev=True), {}, "VRF"),
             (_rule(5, "200", unknown=("flowlabel",)), {}, "flowlabel")]
    for rule, flow, said in cases:
        decision = _lookup((*DEFAULT_RULES, rule), MEASURED_ROUTES, "198.51.100.10", **flow)
        assert decision.kind == "undecided" and said in (decision.undecided or ""), (rule, decision)
    # a selector that surely fails decides even when the packet leaves another field unknown
    assert _lookup((*DEFAULT_RULES, _rule(5, "200", ipproto=6, dport=(5432, 5432))), MEASURED_ROUTES,
                   "198.51.100.10", protocol=17).route.table == "main"  # type: ignore[union-attr]
    assert _lookup((*DEFAULT_RULES, _rule(5, "200", ipproto=6, dport=(5432, 5432))), MEASURED_ROUTES,
                   "198.51.100.10", protocol=6, dport=5432).route.table == "200"  # type: ignore[union-attr]


def test_dead_next_hops_fall_back_to_a_shorter_prefix_and_metric_orders() -> None:
    routes = (_route("0.0.0.0/0", dev="eth0"), _route("172.30.0.0/16", dev="eth1", dead=True),
              _route("172.31.0.0/16", dev="eth1", metric=10), _route("172.31.0.0/16", dev="eth2", metric=5))
    assert _lookup(DEFAULT_RULES, routes, "172.30.1.1").nexthops[0].device == "eth0"
    assert _lookup(DEFAULT_RULES, routes, "172.31.1.1").nexthops[0].device == "eth2"


def test_without_rules_read_the_kernels_defaults_apply() -> None:
    fib = Fib(Routing((), MEASURED_ROUTES, (), frozenset({"routes"})))
    assert fib.lookup(Flow(V4, _a("198.51.100.10"), _a("10.44.0.5"))).route.table == "main"  # type: ignore[union-attr]


# ---- the indexed lookup against a brute-force reference ----

def _reference(rules: tuple[IpRule, ...], routes: tuple[Route, ...], flow: Flow) -> tuple[str, Route | None]:
    ordered = sorted(rules, key=lambda r: r.priority)
    i = 0
    while i < len(ordered):
        rule = ordered[i]
        i += 1
        hit = (rule.fwmark is None or not (rule.fwmark ^ flow.mark) & rule.fwmask) and \
            (rule.source is None or rule.source.contains(flow.source)) and \
            (rule.destination is None or rule.destination.contains(flow.destination))
        if hit == rule.invert:
            continue
        if rule.action == "goto":
            nxt = [j for j in range(i, len(ordered)) if ordered[j].priority == rule.goto]
            if nxt:
                i = nxt[0]
            continue
        if rule.action in ("blackhole", "unreachable", "prohibit"):
            return rule.action, None
        candidates = [r for r in routes if r.table == rule.table and r.destination.contains(flow.destination)
                      and not (r.kind == "unicast" and all("dead" in h.flags for h in r.nexthops))]
        if not candidates:
            continue
        best = max(c.destination.length for c in candidates)
        route = min((c for c in candidates if c.destination.length == best), key=lambda c: c.metric)
        if route.kind == "throw":
            continue
        if rule.suppress_prefixlength is not None and route.destination.length <= rule.suppress_prefixlength \
                and route.kind not in ("blackhole", "unreachable", "prohibit"):
            continue
        return route.kind, route
    return "no-route", None


_prefixes = st.builds(lambda n, length: Prefix(V4, n >> (32 - length) << (32 - length) if length else 0, length),
                      st.integers(0, 0xFFFFFFFF), st.sampled_from([0, 1, 8, 16, 24, 30, 32]))
_routes = st.lists(st.builds(
    lambda p, table, kind, metric, dead: Route(V4, table, p, kind, metric, 0,
                                               (NextHop(None, "eth0", flags=frozenset({"dead"}) if dead else
                                                        frozenset()),) if kind == "unicast" else ()),
    _prefixes, st.sampled_from(["main", "100", "200"]),
    st.sampled_from(["unicast", "unicast", "unicast", "throw", "blackhole", "local"]), st.integers(0, 3),
    st.booleans()), max_size=25)
_rules = st.lists(st.builds(
    lambda priority, table, action, source, destination, fwmark, invert, suppress, goto: IpRule(
        V4, priority, action, table if action == "lookup" else None, goto if action == "goto" else None, invert,
        source, destination, fwmark, 0xF0 if fwmark is not None else 0xFFFFFFFF,
        suppress_prefixlength=suppress),
    st.integers(1, 50), st.sampled_from(["main", "100", "200"]),
    st.sampled_from(["lookup", "lookup", "lookup", "goto", "blackhole", "nop"]), st.none() | _prefixes,
    st.none() | _prefixes, st.none() | st.sampled_from([0x10, 0x80]), st.booleans(),
    st.none() | st.sampled_from([0, 8, 24]), st.integers(1, 60)), max_size=8)


@settings(max_examples=400, deadline=None)
@given(_rules, _routes, st.integers(0, 0xFFFFFFFF), st.integers(0, 0xFFFFFFFF), st.sampled_from([0, 0x10, 0x80]))
def test_the_lookup_equals_the_reference(rules: list[IpRule], routes: list[Route], destination: int, source: int,
                                         mark: int) -> None:
    all_rules = (*rules, _rule(32766, "main"))
    decision = Fib(Routing(all_rules, tuple(routes))).lookup(Flow(V4, destination, source, "veth1", mark))
    kind, route = _reference(all_rules, tuple(routes), Flow(V4, destination, source, "veth1", mark))
    assert decision.kind == kind
    if route is not None:
        assert decision.route is not None
        assert (decision.route.destination, decision.route.metric, decision.route.table) == \
            (route.destination, route.metric, route.table)
