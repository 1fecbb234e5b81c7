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
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import lru_cache, partial
from typing import NamedTuple, Protocol

from ipmasq.diagnose.walk import MAX_STEPS, ChainWalk
from ipmasq.errors import PrefixError, RuleParseError, Undecidable
from ipmasq.netfilter.iptables import RULE_COMMENT_PREFIX, Condition, IptablesRule, Match, NatTable, parse_rule
from ipmasq.policy.packet import Outcome, Packet
from ipmasq.policy.prefix import Family, Prefix, parse_address, parse_cidr
from ipmasq.policy.ranges import FirstMatchTable, first_match_table

__all__ = [
    "PORT_MATCHES",
    "PROTOCOL_NUMBERS",
    "RuleShape",
    "Step",
    "TraceResult",
    "Tracer",
    "all_hold",
    "apply_mark",
    "condition_holds",
    "is_local",
    "match_holds",
    "port_test_ranges",
    "tests_ports",
    "trace",
]

BUILTIN_CHAINS = frozenset({"PREROUTING", "INPUT", "OUTPUT", "POSTROUTING", "FORWARD"})
_SIMPLE_TARGETS = frozenset({"RETURN", "ACCEPT", "MASQUERADE", "SNAT"})
PROTOCOL_NUMBERS = {"tcp": 6, "udp": 17, "icmp": 1, "sctp": 132, "icmpv6": 58, "ipv6-icmp": 58, "udplite": 136}
_LOOPBACK = {Family.V4: parse_cidr("127.0.0.0/8"), Family.V6: parse_cidr("::1/128")}
_NON_DECIDING_TARGETS = frozenset({"LOG", "NFLOG", "MARK"})
_CONFIG_RULE_COMMENT = re.compile("--comment " + re.escape(f'"{RULE_COMMENT_PREFIX}') + r'((?:[^"\\]|\\.)*)"')
PORT_MATCHES = frozenset({"tcp", "udp", "sctp", "udplite", "dccp"})
_PORT_OPTIONS = {"--dport": "dport", "--destination-port": "dport", "--sport": "sport", "--source-port": "sport"}
_MULTIPORT_OPTIONS = {"--dports": "dport", "--destination-ports": "dport", "--sports": "sport",
                      "--source-ports": "sport", "--ports": "either"}


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
                matched = _matches(rule, packet, mark)
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
                        mark = _apply_mark(rule, mark)
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
    destination = None if condition is None else _cidr(condition.value)
    destinations = None if destination is None or destination.family is not family else [
        (destination.first, destination.last)]
    source = rule.condition("-s")
    source_prefix = None if source is None else _cidr(source.value)
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


@lru_cache(maxsize=4096)  # check traces the same few foreign rules once per destination interval
def _cidr(text: str) -> Prefix | None:
    try:
        return parse_cidr(text)
    except PrefixError:
        return None


def _prefix(text: str, family: Family) -> Prefix:
    prefix = _cidr(text)
    if prefix is None:
        raise Undecidable(f"cannot read address {text!r}")
    if prefix.family is not family:
        raise Undecidable(f"{text} is not an IPv{family.value} prefix")
    return prefix


def _source_in(packet: Packet, prefix: Prefix) -> bool:
    if not packet.source:
        raise Undecidable(f"the packet's source is unknown and this rule tests -s {prefix}")
    inside = [prefix.covers(s) for s in packet.source]
    if all(inside):
        return True
    if not any(prefix.covers(s) or s.covers(prefix) for s in packet.source):
        return False
    raise Undecidable(f"-s {prefix} covers only part of the source range {', '.join(map(str, packet.source))}")


def _interface_is(name: str | None, pattern: str, option: str) -> bool:
    if name is None:
        flag = "--out-interface" if option == "-o" else "--in-interface"
        raise Undecidable(f"the rule tests {option} {pattern} and the packet's interface is unknown (give {flag})")
    return name.startswith(pattern[:-1]) if pattern.endswith("+") else name == pattern


def _protocol_is(protocol: str | None, value: str) -> bool:
    value = value.lower()
    if value in ("all", "0"):
        return True
    wanted = PROTOCOL_NUMBERS.get(value, int(value) if value.isdigit() else None)
    if wanted is None:
        raise Undecidable(f"protocol {value!r} is not known")
    if protocol is None:
        raise Undecidable(f"the rule tests -p {value} and the packet's protocol is not given (give --protocol)")
    return PROTOCOL_NUMBERS.get(protocol, int(protocol) if protocol.isdigit() else -1) == wanted


def _condition(c: Condition, packet: Packet) -> bool:
    if c.option == "-d":
        hit = _prefix(c.value, packet.family).contains(packet.destination)
    elif c.option == "-s":
        hit = _source_in(packet, _prefix(c.value, packet.family))
    elif c.option in ("-o", "-i"):
        hit = _interface_is(packet.out_interface if c.option == "-o" else packet.in_interface, c.value, c.option)
    elif c.option == "-p":
        hit = _protocol_is(packet.protocol, c.value)
    else:
        raise Undecidable(f"condition {c.option} is not understood by trace")
    return hit != c.negated


def _matches(rule: IptablesRule, packet: Packet, mark: int) -> bool:
    """All tests of the rule (all_hold)."""
    tests: list[Callable[[], bool]] = [partial(_condition, c, packet) for c in rule.conditions]
    tests += [partial(_match, m, packet, mark) for m in rule.matches]
    return all_hold(tests)


def all_hold(tests: Iterable[Callable[[], bool]]) -> bool:
    """Whether every test holds; a test that surely fails decides even when another one cannot be evaluated (its
    Undecidable is raised only when no test fails)."""
    undecidable: Undecidable | None = None
    for test in tests:
        try:
            hit = test()
        except Undecidable as exc:
            undecidable = undecidable or exc
            continue
        if not hit:
            return False
    if undecidable is not None:
        raise undecidable
    return True


def _negatable(args: tuple[str, ...], what: str) -> list[tuple[str, str, bool]]:
    """A match's options as (option, value, negated), e.g. ("--dst-type", "LOCAL", True)."""
    out = []
    i = 0
    while i < len(args):
        negated = args[i] == "!"
        at = i + 1 if negated else i
        if at + 1 >= len(args) or not args[at].startswith("--"):
            raise Undecidable(f"cannot read -m {what} {' '.join(args)}")
        out.append((args[at], args[at + 1], negated))
        i = at + 2
    return out


def _match(match: Match, packet: Packet, mark: int) -> bool:
    if match.name == "comment":
        return True
    if match.name == "addrtype":
        for option, value, negated in _negatable(match.args, "addrtype"):
            if option not in ("--dst-type", "--src-type") or value != "LOCAL":
                raise Undecidable(f"-m addrtype {option} {value}: only --dst-type/--src-type LOCAL is understood")
            if option == "--dst-type":
                local = is_local(packet, packet.destination)
            else:
                if not packet.source:
                    raise Undecidable("the packet's source is unknown and this rule tests --src-type LOCAL")
                local = all(s.length == packet.family.bits and is_local(packet, s.network) for s in packet.source)
            if local == negated:
                return False
        return True
    if match.name == "mark":
        for option, value, negated in _negatable(match.args, "mark"):
            if option != "--mark":
                raise Undecidable(f"-m mark {option} is not understood")
            wanted, mask = _value_mask(value, default_mask=0xFFFFFFFF)
            if ((mark & mask) == wanted) == negated:
                return False
        return True
    if match.name in PORT_MATCHES:
        for option, value, negated in _negatable(match.args, match.name):
            which = _PORT_OPTIONS.get(option)
            if which is None:
                raise Undecidable(f"-m {match.name} {option} is not understood by trace")
            if _port_in(packet, which, _port_ranges(value, option)) == negated:
                return False
        return True
    if match.name == "multiport":
        for option, value, negated in _negatable(match.args, "multiport"):
            which = _MULTIPORT_OPTIONS.get(option)
            if which is None:
                raise Undecidable(f"-m multiport {option} is not understood by trace")
            ranges = [r for item in value.split(",") for r in _port_ranges(item, option)]
            if _port_in(packet, which, ranges) == negated:
                return False
        return True
    raise Undecidable(f"-m {match.name} is not understood by trace")


def tests_ports(rule: IptablesRule) -> bool:
    """The rule has a port match (check splits the traffic its destinations get by port)."""
    return any(m.name in PORT_MATCHES or m.name == "multiport" for m in rule.matches)


def port_test_ranges(rule: IptablesRule) -> list[tuple[int, int]]:
    """The destination port ranges the rule's port matches test (what check splits ports at); unreadable ones are
    left out here, the walk reports them."""
    out = []
    for match in rule.matches:
        options = _PORT_OPTIONS if match.name in PORT_MATCHES else _MULTIPORT_OPTIONS if match.name == "multiport" \
            else None
        if options is None:
            continue
        try:
            for option, value, _ in _negatable(match.args, match.name):
                if options.get(option) in ("dport", "either"):
                    out += [r for item in value.split(",") for r in _port_ranges(item, option)]
        except Undecidable:
            continue
    return out


def _port_ranges(text: str, option: str) -> list[tuple[int, int]]:
    """`80`, `8000:8080`, `:1024` or `1024:` as an inclusive range (iptables' forms for a port or a range)."""
    low, colon, high = text.partition(":")
    try:
        first = int(low) if low else 0
        last = (int(high) if high else 65535) if colon else first
    except ValueError:
        raise Undecidable(f"cannot read port {text!r} of {option}") from None
    if not 0 <= first <= 65535 or not 0 <= last <= 65535:
        raise Undecidable(f"port {text!r} of {option} is out of range")
    return [(min(first, last), max(first, last))]  # iptables swaps an inverted range


def _port_in(packet: Packet, which: str, ranges: list[tuple[int, int]]) -> bool:
    shown = ",".join(str(a) if a == b else f"{a}:{b}" for a, b in ranges)
    ports = []
    if which in ("dport", "either"):
        if packet.port is None:
            raise Undecidable(f"the rule tests destination port {shown} and the packet's port is not given "
                               "(give --port)")
        ports.append(packet.port)
    if which in ("sport", "either"):
        if packet.source_port is None:
            raise Undecidable(f"the rule tests source port {shown} and the packet's source port is not given "
                               "(give --source-port)")
        ports.append(packet.source_port)
    return any(low <= port <= high for port in ports for low, high in ranges)


def is_local(packet: Packet, address: int) -> bool:
    # the node's own addresses (--local-address) and loopback are what routing types LOCAL
    return address in packet.local_addresses or _LOOPBACK[packet.family].contains(address)


def _value_mask(text: str, *, default_mask: int) -> tuple[int, int]:
    value, _, mask = text.partition("/")
    try:
        return int(value, 0), (int(mask, 0) if mask else default_mask)
    except ValueError:
        raise Undecidable(f"cannot read mark {text!r}") from None


def _apply_mark(rule: IptablesRule, mark: int) -> int:
    args = rule.target_args
    if len(args) != 2:
        raise Undecidable(f"cannot read MARK {' '.join(args)}")
    option, value = args
    if option == "--set-xmark":
        v, m = _value_mask(value, default_mask=0xFFFFFFFF)
        return (mark & ~m & 0xFFFFFFFF) ^ v
    if option == "--set-mark":
        v, m = _value_mask(value, default_mask=0xFFFFFFFF)
        return (mark & ~m & 0xFFFFFFFF) | v
    number, _ = _value_mask(value, default_mask=0)
    if option == "--or-mark":
        return mark | number
    if option == "--and-mark":
        return mark & number
    if option == "--xor-mark":
        return mark ^ number
    raise Undecidable(f"MARK {option} is not understood")


# the mangle walk (ipmasq.diagnose.mangle) tests a rule's conditions and matches with the nat walk's own tests
condition_holds = _condition
match_holds = _match
apply_mark = _apply_mark
