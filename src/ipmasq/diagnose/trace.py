"""Walk one packet through a nat table's POSTROUTING, rule by rule, as the kernel would; never guess.

The tracer understands exactly the matches and targets an ip-masq-agent node's POSTROUTING is made of (ours,
kubenet's, kube-proxy's, operators' hand-written rules): `-s`/`-d`/`-i`/`-o`/`-p` (each possibly negated),
`-m comment`, `-m addrtype --dst-type/--src-type LOCAL`, `-m mark`, the port matches (`-m tcp`/`-m udp`/`-m sctp`
`--dport`/`--sport`, `-m multiport --dports/--sports/--ports`, single ports and `a:b` ranges, negated or not) and
the targets RETURN, ACCEPT, MASQUERADE, SNAT (an address or an address range, with or without ports), MARK, LOG
and jumps/gotos to user chains. A rule using anything else, or a condition on something the packet description
leaves unknown (its out interface, its exact source, its protocol or port), stops the walk with
`Outcome.UNDECIDED` and the reason naming the missing field: a wrong answer here would send an operator the wrong
way.

Only a connection's first packet traverses the nat table; what it decides is kept in the conntrack entry, so
the trace is the fate of a new connection.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from ipmasq.diagnose.rule_match import (
    PROTOCOL_NUMBERS,
    apply_mark,
    cidr_or_none,
    port_test_ranges,
    rule_holds,
    tests_ports,
)
from ipmasq.diagnose.walk import MAX_STEPS, ChainWalk
from ipmasq.errors import PrefixError, RuleParseError, Undecidable
from ipmasq.netfilter.iptables import RULE_COMMENT_PREFIX, IptablesRule, NatTable, parse_rule
from ipmasq.policy.packet import Outcome, Packet
from ipmasq.policy.ranges import FirstMatchTable, first_match_table
from ipmasq.prefix import Family, Prefix, parse_address, parse_cidr

__all__ = ["BUILTIN_CHAINS", "RuleShape", "Step", "TraceResult", "Tracer", "trace"]

BUILTIN_CHAINS = frozenset({"PREROUTING", "INPUT", "OUTPUT", "POSTROUTING", "FORWARD"})
_SIMPLE_TARGETS = frozenset({"RETURN", "ACCEPT", "MASQUERADE", "SNAT"})
_NON_DECIDING_TARGETS = frozenset({"LOG", "NFLOG", "MARK"})
_CONFIG_RULE_COMMENT = re.compile("--comment " + re.escape(f'"{RULE_COMMENT_PREFIX}') + r'((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True, slots=True)
class Step:
    chain: str
    rule: str
    matched: bool


@dataclass(frozen=True, slots=True)
class TraceResult:
    steps: tuple[Step, ...]
    outcome: Outcome
    # the rule whose target decided; for a source left unchanged by the chain policy, the last RETURN taken
    # before it (None when no rule matched at all)
    decided_by: str | None
    decided_in: str | None  # the chain holding that rule
    snat_to: str | None = None
    mark: int = 0
    undecided_reason: str | None = None
    chains: tuple[str, ...] = ()  # the chains the packet entered, in order, the first one included
    # the deciding rule's 1-based position in its chain (as `iptables -t nat -L CHAIN --line-numbers` numbers it)
    decided_position: int | None = None
    named: str | None = None  # a name the tracer gave the deciding rule itself (nftables: its handle)
    # what else a person should know about this walk (chains of the same priority that would NAT it the same way)
    notes: tuple[str, ...] = ()

    @property
    def decided_label(self) -> str | None:
        """The deciding rule as a person names it: "rule NAME" for a config rule of ours (its comment), else
        CHAIN:N (nftables: FAMILY TABLE CHAIN handle N). Computed on demand: check traces thousands of packets
        and names only the rules that get one wrong."""
        if self.named is not None or self.decided_by is None:
            return self.named
        found = _CONFIG_RULE_COMMENT.search(self.decided_by)
        if found is not None:
            return "rule " + found.group(1)
        return f"{self.decided_in}:{self.decided_position}"

    def source_seen(self, packet: Packet, *, masquerade_address: str | None) -> str | None:
        """The source the destination sees; None when not determined (undecided, or the masquerade address unknown)."""
        if self.outcome is Outcome.PRESERVE:
            return packet.exact_source
        if self.outcome is Outcome.MASQUERADE:
            return masquerade_address
        if self.outcome is Outcome.SNAT:
            return self.snat_to  # an address range ("A-B") when the SNAT rule spreads over several
        return None


class RuleShape(NamedTuple):
    """What one rule tests, for check's classes of packets that every rule treats alike (both tracers give them)."""

    destinations: list[tuple[int, int]] | None  # the spans its destination test names; None: no destination test
    negated_destination: bool
    rich: bool  # it tests the source, the protocol or a port
    sources: list[tuple[int, int]]
    protocols: set[int]
    ports: list[tuple[int, int]]  # destination port ranges


@dataclass(frozen=True, slots=True)
class _Bad:
    """A rule that does not parse: reaching it stops the trace."""

    text: str
    chain: str
    error: str


class _ResultFactory(Protocol):
    """Tracer.trace's inner `result`: builds the TraceResult from the walk so far."""

    def __call__(self, outcome: Outcome, rule: IptablesRule | None, **extra: str | None) -> TraceResult: ...


class Tracer:
    """A parsed nat table, ready to trace many packets (check traces one per address interval)."""

    def __init__(self, table: NatTable) -> None:
        self.policies = dict(table.chains)
        self.chains: dict[str, list[IptablesRule | _Bad]] = {name: [] for name in table.chains}
        for text in table.rules:
            try:
                rule: IptablesRule | _Bad = parse_rule(text, already_canonical=True)
            except RuleParseError as exc:
                rule = _Bad(text, text.split(" ", 2)[1], str(exc))
            self.chains.setdefault(rule.chain, []).append(rule)
        self._loops = _chains_in_loops(self.chains)
        self._positions = {id(rule): i for rules in self.chains.values() for i, rule in enumerate(rules, start=1)}
        self._compiled: dict[tuple[str, Family], FirstMatchTable | None] = {}

    def trace(self, packet: Packet, *, chain: str = "POSTROUTING", record_steps: bool = True) -> TraceResult:
        """The packet's walk; without `record_steps` (check traces thousands of packets) the steps are not kept,
        and chains that test only destinations are not walked rule by rule but looked up (O(log n))."""
        steps: list[Step] = []
        entered = [chain]
        mark = packet.mark
        walk: ChainWalk[str, IptablesRule | _Bad] = ChainWalk(self.chains, chain, ends=BUILTIN_CHAINS)
        # the last RETURN taken: when the packet then falls off POSTROUTING, that RETURN is what decided
        last_return: IptablesRule | None = None

        def result(outcome: Outcome, rule: IptablesRule | None, **extra: str | None) -> TraceResult:
            return TraceResult(tuple(steps), outcome, None if rule is None else rule.text,
                               None if rule is None else rule.chain, mark=mark,
                               snat_to=extra.get("snat_to"), undecided_reason=extra.get("reason"),
                               chains=tuple(entered),
                               decided_position=None if rule is None else self._positions[id(rule)])

        if chain not in self.chains:
            return result(Outcome.UNDECIDED, None, reason=f"the dump has no {chain} chain in its nat table")
        if chain in self._loops:
            return result(Outcome.UNDECIDED, None, reason=self._loop_reason(chain))
        while True:
            if walk.index == 0 and not record_steps:
                table = self._compiled_chain(walk.current, packet.family)
                if table is not None:
                    label = table.label_at(packet.destination)
                    # straight to the first rule that matches
                    walk.index = len(self.chains.get(walk.current, [])) if label < 0 else label
            rule = walk.next_rule()
            if rule is None:
                return self._policy(result, walk.current, last_return)
            current = walk.current
            if walk.exhausted:
                return result(Outcome.UNDECIDED, None, reason=f"depth limit: more than {MAX_STEPS} rules evaluated "
                              "for one packet (chains jumping to the same chains over and over)")
            if isinstance(rule, _Bad):
                steps.append(Step(current, rule.text, False))
                return result(Outcome.UNDECIDED, None, reason=f"cannot read rule: {rule.error}")
            try:
                matched = rule_holds(rule, packet, mark)
            except Undecidable as exc:
                steps.append(Step(current, rule.text, False))
                return result(Outcome.UNDECIDED, rule, reason=str(exc))
            if record_steps:
                steps.append(Step(current, rule.text, matched))
            if not matched or rule.target is None:
                continue
            target = rule.target
            if target == "RETURN":
                if not walk.can_return():
                    return self._policy(result, current, rule)
                walk.return_()
                last_return = rule
            elif target == "ACCEPT":
                return result(Outcome.PRESERVE, rule)
            elif target == "MASQUERADE":
                return result(Outcome.MASQUERADE, rule)
            elif target == "SNAT":
                to = rule.target_option("--to-source")
                if to is None:
                    return result(Outcome.UNDECIDED, rule, reason="SNAT without --to-source")
                try:
                    address = _snat_address(to, packet.family)
                except Undecidable as exc:
                    return result(Outcome.UNDECIDED, rule, reason=str(exc))
                return result(Outcome.SNAT, rule, snat_to=address)
            elif target in _NON_DECIDING_TARGETS:
                if target == "MARK":
                    try:
                        mark = apply_mark(rule, mark)
                    except Undecidable as exc:
                        return result(Outcome.UNDECIDED, rule, reason=str(exc))
            elif target in self.chains and target not in BUILTIN_CHAINS:
                if target in self._loops:
                    return result(Outcome.UNDECIDED, rule, reason=self._loop_reason(target))
                walk.enter(target, goto=rule.goto)
                entered.append(target)
            else:
                return result(Outcome.UNDECIDED, rule, reason=f"target {target} is not understood by trace "
                              "(only RETURN, ACCEPT, MASQUERADE, SNAT, MARK, LOG and chains of this table)")

    def _loop_reason(self, chain: str) -> str:
        return (f"loop: chain {chain} loops back into itself ({' -> '.join(self._loops[chain])}); the kernel "
                "refuses such a table, so this dump was not read from a running node")

    def _compiled_chain(self, chain: str, family: Family) -> FirstMatchTable | None:
        """A chain whose rules test only destinations (and carry comments), each ending in a target that decides
        or returns, as a first-match table; None for any other chain (walked rule by rule)."""
        key = (chain, family)
        if key not in self._compiled:
            self._compiled[key] = _compile(self.chains.get(chain, []), family)
        return self._compiled[key]

    def _policy(self, result: _ResultFactory, chain: str, returned_by: IptablesRule | None) -> TraceResult:
        """The end of a built-in chain (or a RETURN in one): its policy decides; `returned_by` is that RETURN."""
        policy = self.policies.get(chain, "ACCEPT")
        if policy in ("ACCEPT", "-"):
            return result(Outcome.PRESERVE, returned_by)
        return result(Outcome.UNDECIDED, returned_by, reason=f"chain {chain} has policy {policy}")

    def reachable(self, chain: str = "POSTROUTING") -> list[str]:
        """The chains a packet entering `chain` can visit, `chain` first."""
        seen = [chain]
        for name in seen:
            for rule in self.chains.get(name, []):
                if isinstance(rule, IptablesRule) and rule.target in self.chains and rule.target not in seen:
                    seen.append(rule.target)
        return seen

    def rules_of(self, chain: str) -> list[IptablesRule]:
        return [r for r in self.chains.get(chain, []) if isinstance(r, IptablesRule)]

    def shapes(self, family: Family) -> Iterator[RuleShape]:
        """What each rule a POSTROUTING packet can meet tests, for check's classes of packets."""
        for name in self.reachable():
            for rule in self.rules_of(name):
                yield _shape(rule, family)


def _shape(rule: IptablesRule, family: Family) -> RuleShape:
    conditions = rule.conditions
    if len(conditions) == 1 and conditions[0].option == "-d" and all(m.name == "comment" for m in rule.matches):
        # a destination and a comment: the bulk of a large chain (our RETURNs), without the general walk below
        try:
            only = parse_cidr(conditions[0].value)
        except PrefixError:
            return RuleShape(None, False, False, [], set(), [])
        return RuleShape([(only.first, only.last)] if only.family is family else None, conditions[0].negated, False,
                         [], set(), [])
    condition = rule.condition("-d")
    destination = None if condition is None else cidr_or_none(condition.value)
    destinations = None if destination is None or destination.family is not family else [
        (destination.first, destination.last)]
    source = rule.condition("-s")
    source_prefix = None if source is None else cidr_or_none(source.value)
    sources = [] if source_prefix is None or source_prefix.family is not family else [
        (source_prefix.first, source_prefix.last)]
    protocols: set[int] = set()
    protocol = rule.condition("-p")
    if protocol is not None:
        value = protocol.value.lower()
        number = PROTOCOL_NUMBERS.get(value, int(value) if value.isdigit() else None)
        if number is not None and number != 0:
            protocols.add(number)
    ports = port_test_ranges(rule)
    rich = source is not None or bool(protocols) or tests_ports(rule)
    return RuleShape(destinations, condition is not None and condition.negated, rich, sources, protocols, ports)


def trace(table: NatTable, packet: Packet, *, chain: str = "POSTROUTING") -> TraceResult:
    return Tracer(table).trace(packet, chain=chain)


def _compile(rules: list[IptablesRule | _Bad], family: Family) -> FirstMatchTable | None:
    everything = Prefix(family, 0, 0)
    prefixes = []
    for rule in rules:
        if not isinstance(rule, IptablesRule) or rule.target not in _SIMPLE_TARGETS or rule.goto:
            return None
        if any(m.name != "comment" for m in rule.matches) or len(rule.conditions) > 1:
            return None
        if not rule.conditions:
            prefixes.append(everything)
            continue
        condition = rule.conditions[0]
        if condition.option != "-d" or condition.negated:
            return None
        try:
            prefix = parse_cidr(condition.value)
        except PrefixError:
            return None
        if prefix.family is not family:
            return None  # the walk says why it cannot decide
        prefixes.append(prefix)
    return first_match_table(prefixes, family.max_address) if len(prefixes) > 8 else None


def _chains_in_loops(chains: dict[str, list[IptablesRule | _Bad]]) -> dict[str, tuple[str, ...]]:
    """Every chain that can reach itself through jumps and gotos, with one such cycle (for the message).

    Iterative (a dump may chain thousands of user chains): Tarjan's strongly connected components.
    """
    graph = {name: sorted({r.target for r in rules if isinstance(r, IptablesRule) and r.target in chains
                           and r.target not in BUILTIN_CHAINS}) for name, rules in chains.items()}
    index_of: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    loops: dict[str, tuple[str, ...]] = {}
    counter = 0
    for root in graph:
        if root in index_of:
            continue
        work = [(root, 0)]
        while work:
            node, child = work.pop()
            if child == 0:
                index_of[node] = low[node] = counter
                counter += 1
                stack.append(node)
                on_stack.add(node)
            targets = graph[node]
            if child < len(targets):
                work.append((node, child + 1))
                target = targets[child]
                if target not in index_of:
                    work.append((target, 0))
                elif target in on_stack:
                    low[node] = min(low[node], index_of[target])
                continue
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index_of[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1 or node in graph[node]:
                    members = set(component)
                    for member in component:
                        loops[member] = _cycle_from(member, graph, members)
    return loops


def _cycle_from(start: str, graph: dict[str, list[str]], members: set[str]) -> tuple[str, ...]:
    """One path start -> ... -> start inside a strongly connected component (breadth-first, shortest)."""
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for target in graph[node]:
                if target not in members:
                    continue
                if target == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return (start, *reversed(path[:-1]), start) if len(path) > 1 else (start, start)
                if target not in previous:
                    previous[target] = node
                    following.append(target)
        frontier = following
    return (start, start)


def _snat_address(to: str, family: Family) -> str:
    """The address part of --to-source ADDR[-ADDR][:PORT[-PORT]] ("A" or "A-B"); IPv6 addresses come bracketed
    when a port follows ([A]-[B]:P)."""
    if family is Family.V4:
        address = to.split(":", 1)[0]
    else:
        address = to[:to.rindex("]:") + 1] if "]:" in to else to
        address = address.replace("[", "").replace("]", "")
    parts = address.split("-")
    if len(parts) > 2:
        raise Undecidable(f"cannot read SNAT --to-source {to!r}")
    for part in parts:
        try:
            part_family, _ = parse_address(part)
        except ValueError:
            raise Undecidable(f"cannot read SNAT --to-source {to!r}") from None
        if part_family is not family:
            raise Undecidable(f"SNAT --to-source {to} is not an IPv{family.value} address")
    return address if len(parts) == 1 or parts[0] != parts[1] else parts[0]
