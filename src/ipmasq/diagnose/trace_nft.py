"""Walk one packet through the nftables nat postrouting hook, as `nft -j list ruleset` shows it; never guess.

The kernel runs every base chain of type nat at the postrouting hook (tables of family ip or ip6 for their family,
inet for both) in priority order; the first masquerade or snat decides, and a chain that ends without one (its
policy, `accept`, a `return` in the base chain) hands the packet to the next (ipmasq.diagnose.hooks, which also
says what chains of equal priority do). The tracer understands the matches an ip-masq-agent node's nat chains are
made of, kube-proxy's nftables mode included: `ip`/`ip6` `saddr`/`daddr` (addresses, prefixes, ranges, anonymous and
named sets), `meta l4proto`/`ip protocol`/`ip6 nexthdr`, `meta nfproto`, `tcp`/`udp`/`sctp`/`th` `dport`/`sport`
(ports, ranges, sets), `fib daddr type local`, `meta oifname`/`iifname`, `meta mark` and `meta mark & N`, `ct state`
and `ct status` (of a new connection: state new; status dnat as the packet description says, Packet.dnat),
concatenations of those fields against a set (kube-proxy's `ip saddr . ip daddr . meta l4proto . th dport
@hairpin-connections`), with `==`/`!=`; the statements counter and log; the verdicts return, accept, drop, jump
and goto; masquerade and snat (an address, a range, with or without ports); `meta mark set` to a value or to the
mark `|`, `^` or `&` a value. Anything else (an iptables-nft `xt` match, limit...), or a test on a field the packet
description leaves unknown, stops the walk with the reason, as the iptables tracer does.
"""

from __future__ import annotations

import json
from bisect import bisect_right
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

from ipmasq.diagnose.hooks import NatHook, walk_hooks
from ipmasq.diagnose.rule_match import PROTOCOL_NUMBERS, is_local
from ipmasq.diagnose.trace import RuleShape, Step, TraceResult
from ipmasq.diagnose.walk import MAX_STEPS, ChainWalk
from ipmasq.errors import NftParseError, NftTraceError, Undecidable, clip
from ipmasq.netfilter.iptables import RULE_COMMENT_PREFIX
from ipmasq.netfilter.nft_json import parse_address_element, rule_from_json
from ipmasq.policy.packet import Outcome, Packet
from ipmasq.policy.ranges import Span, union
from ipmasq.prefix import Family, format_address, parse_address, parse_cidr

__all__ = ["NftTracer", "chain_name"]

_PORT_PROTOCOLS = {"tcp": 6, "udp": 17, "sctp": 132, "udplite": 136, "dccp": 33}
_NAMES = {**PROTOCOL_NUMBERS, "dccp": 33, "gre": 47, "esp": 50, "ah": 51}
_FAMILIES = {"ip": (Family.V4,), "ip6": (Family.V6,), "inet": (Family.V4, Family.V6)}
_SKIPPED = frozenset({"counter", "log"})


@dataclass(frozen=True, slots=True)
class _Rule:
    text: str  # as `nft list` prints it, after "FAMILY TABLE CHAIN: "
    label: str  # "rule NAME" for a config rule of ours, else "FAMILY TABLE CHAIN handle N" (or ":POSITION")
    chain: str  # "FAMILY TABLE CHAIN"
    expr: tuple[Any, ...]


@dataclass(frozen=True, slots=True)
class _Base:
    priority: int
    order: int
    key: tuple[str, str, str]
    policy: str


def _chain_name(key: tuple[str, str, str]) -> str:
    return " ".join(key)


chain_name = _chain_name


class NftTracer:
    """A parsed `nft -j list ruleset`, ready to trace many packets."""

    def __init__(self, text: str) -> None:
        try:
            document = json.loads(text)
            items = document["nftables"]
            if not isinstance(items, list):
                raise TypeError("nftables is not a list")
        except (ValueError, KeyError, TypeError, RecursionError) as exc:
            raise NftTraceError(f"not an nft -j listing: {clip(str(exc))}") from None
        self.chains: dict[tuple[str, str, str], list[_Rule]] = {}
        self._sets: dict[tuple[str, str, str], dict[str, Any]] = {}
        self._maps: dict[tuple[str, str, str], dict[str, Any]] = {}
        self._set_cache: dict[tuple[tuple[str, str, str], Family | None], list[Span]] = {}
        bases: list[_Base] = []
        prerouting: list[_Base] = []
        nat_prerouting: list[_Base] = []
        for number, item in enumerate(items, start=1):
            try:
                kind, body = next(iter(item.items()))
                if kind in ("chain", "rule", "set", "map"):
                    family, table = str(body["family"]), str(body["table"])
                if kind == "chain":
                    key = (family, table, str(body["name"]))
                    self.chains.setdefault(key, [])
                    if body.get("type") == "nat" and body.get("hook") == "postrouting" and family in _FAMILIES:
                        priority = body.get("prio", 0)
                        bases.append(_Base(priority if isinstance(priority, int) else 0, number, key,
                                           str(body.get("policy", "accept"))))
                    elif body.get("type") == "filter" and body.get("hook") == "prerouting" and family in _FAMILIES:
                        priority = body.get("prio", 0)
                        prerouting.append(_Base(priority if isinstance(priority, int) else 0, number, key,
                                                str(body.get("policy", "accept"))))
                    elif body.get("type") == "nat" and body.get("hook") == "prerouting" and family in _FAMILIES:
                        priority = body.get("prio", 0)
                        nat_prerouting.append(_Base(priority if isinstance(priority, int) else 0, number, key,
                                                    str(body.get("policy", "accept"))))
                elif kind == "rule":
                    key = (family, table, str(body["chain"]))
                    rules = self.chains.setdefault(key, [])
                    rules.append(self._rule(body, key, len(rules) + 1))
                elif kind == "set":
                    self._sets[(family, table, str(body["name"]))] = body
                elif kind == "map":
                    self._maps[(family, table, str(body["name"]))] = body
            except (AttributeError, KeyError, TypeError, StopIteration) as exc:
                raise NftTraceError(f"object {number} of the nft listing has an unexpected shape "
                                    f"({type(exc).__name__}: {clip(str(exc))})") from None
        # equal priorities run newest hook first, which the listing does not show: walk_hooks walks them each alone
        self.bases = sorted(bases, key=lambda b: (b.priority, b.order))
        # the filter chains at prerouting, which mark packets before the routing decision (ipmasq.diagnose.mangle)
        self.prerouting = sorted(prerouting, key=lambda b: (b.priority, b.order))
        # the nat chains at prerouting, which a connection's first packet meets before the routing decision too:
        # a mark set there (AWS VPC CNI's CONNMARK, kube-proxy's masquerade mark) routes it
        self.nat_prerouting = sorted(nat_prerouting, key=lambda b: (b.priority, b.order))

    @staticmethod
    def _rule(body: dict[str, Any], key: tuple[str, str, str], position: int) -> _Rule:
        expr = body.get("expr", ())
        text = rule_from_json(body)
        comment = body.get("comment")
        if isinstance(comment, str) and comment.startswith(RULE_COMMENT_PREFIX):
            label = "rule " + comment[len(RULE_COMMENT_PREFIX):]
        elif isinstance(body.get("handle"), int):
            label = f"{_chain_name(key)} handle {body['handle']}"
        else:
            label = f"{_chain_name(key)}:{position}"
        return _Rule(text, label, _chain_name(key), tuple(expr) if isinstance(expr, list) else ())

    def base_chains(self, family: Family) -> list[_Base]:
        return [b for b in self.bases if family in _FAMILIES[b.key[0]]]

    def hooks(self, family: Family, *, beside: frozenset[tuple[str, str]] = frozenset()) -> list[NatHook]:
        """The nat postrouting base chains a packet of `family` meets, each walked on its own; `beside`: tables
        (family, name) left out because another reading walks them (iptables-nft's `ip nat`, read with
        iptables-save)."""
        return [NatHook(base.priority, _chain_name(base.key), partial(self._walk_base, base))
                for base in self.base_chains(family) if base.key[:2] not in beside]

    def trace(self, packet: Packet, *, record_steps: bool = True) -> TraceResult:
        return walk_hooks(self.hooks(packet.family), packet, record_steps=record_steps)

    def _walk_base(self, base: _Base, packet: Packet, record_steps: bool) -> TraceResult:
        """One base chain alone: PRESERVE when it hands the packet on (its end, accept, a return in it)."""
        steps: list[Step] = []
        entered = [_chain_name(base.key)]
        mark = packet.mark
        last_return: _Rule | None = None

        def result(outcome: Outcome, rule: _Rule | None, snat_to: str | None = None,
                   reason: str | None = None) -> TraceResult:
            return TraceResult(tuple(steps), outcome, None if rule is None else f"{rule.chain}: {rule.text}",
                               None if rule is None else rule.chain, snat_to=snat_to, mark=mark,
                               undecided_reason=reason, chains=tuple(entered),
                               named=None if rule is None else rule.label)

        walk = ChainWalk(self.chains, base.key)
        while True:
            rule = walk.next_rule()
            if rule is None:
                break  # the base chain's policy: accept hands the packet to the next base chain
            current = walk.current
            if walk.exhausted:
                return result(Outcome.UNDECIDED, None, reason=f"depth limit: more than {MAX_STEPS} rules "
                              "evaluated for one packet")
            try:
                verdict, mark = self._run(rule, packet, mark, current[:2])
            except Undecidable as exc:
                steps.append(Step(rule.chain, rule.text, False))
                return result(Outcome.UNDECIDED, rule, reason=str(exc))
            if record_steps:
                steps.append(Step(rule.chain, rule.text, verdict is not None))
            if verdict is None or verdict[0] == "continue":
                continue
            action, argument = verdict
            if action == "masquerade":
                return result(Outcome.MASQUERADE, rule)
            if action == "snat":
                return result(Outcome.SNAT, rule, snat_to=argument)
            if action == "drop":
                return result(Outcome.UNDECIDED, rule, reason="the packet is dropped (no connection at all)")
            if action == "return" and walk.can_return():
                walk.return_()
                last_return = rule
                continue
            if action in ("return", "accept"):
                last_return = rule
                break
            target = (current[0], current[1], argument or "")
            if target not in self.chains:
                return result(Outcome.UNDECIDED, rule, reason=f"{action} to a chain the listing lacks: "
                              f"{argument}")
            if len(walk.stack) > 64:
                return result(Outcome.UNDECIDED, rule, reason="jumps nested deeper than 64 chains (a loop?)")
            walk.enter(target, goto=action == "goto")
            entered.append(_chain_name(target))
        if base.policy == "drop":
            return result(Outcome.UNDECIDED, None, reason=f"chain {_chain_name(base.key)} has policy drop")
        return result(Outcome.PRESERVE, last_return)

    def _run(self, rule: _Rule, packet: Packet, mark: int,
             table: tuple[str, str]) -> tuple[tuple[str, str | None] | None, int]:
        """(None, mark) when a match fails; else the verdict ("continue" when the rule has none) and the mark."""
        undecidable: Undecidable | None = None
        for statement in rule.expr:
            if not isinstance(statement, dict) or len(statement) != 1:
                raise Undecidable(f"cannot read statement {clip(json.dumps(statement))}")
            kind, body = next(iter(statement.items()))
            if kind == "match":
                try:
                    if not self._match(body, packet, mark, table):
                        return None, mark
                except Undecidable as exc:
                    undecidable = undecidable or exc  # a later test that surely fails still decides
                continue
            if undecidable is not None:
                raise undecidable
            if kind in _SKIPPED:
                continue
            if kind in ("return", "accept", "drop"):
                return (kind, None), mark
            if kind in ("jump", "goto") and isinstance(body, dict):
                return (kind, str(body.get("target"))), mark
            if kind == "masquerade":
                return ("masquerade", None), mark
            if kind == "snat" and isinstance(body, dict):
                return ("snat", _snat_to(body.get("addr"), packet.family)), mark
            if kind == "mangle" and isinstance(body, dict) and body.get("key") == {"meta": {"key": "mark"}}:
                mark = _new_mark(body.get("value"), mark)
                continue
            raise Undecidable(f"statement {kind} is not understood by trace")
        if undecidable is not None:
            raise undecidable
        return ("continue", None), mark

    def match(self, body: Any, packet: Packet, mark: int, table: tuple[str, str]) -> bool:
        """One `match` statement of a rule of `table` against the packet with `mark` (Undecidable: it cannot be
        told); the mangle walk evaluates the matches of prerouting chains with it."""
        return self._match(body, packet, mark, table)

    def _match(self, body: Any, packet: Packet, mark: int, table: tuple[str, str]) -> bool:
        if not isinstance(body, dict):
            raise Undecidable(f"cannot read match {clip(json.dumps(body))}")
        op = body.get("op", "==")
        if op not in ("==", "!=", "in"):
            raise Undecidable(f"comparison {op} is not understood by trace")
        left, right = body.get("left"), body.get("right")
        if isinstance(left, dict) and "ct" in left:
            return _conntrack(left["ct"], right, op, packet)
        if isinstance(left, dict) and "concat" in left:
            hit = self._concat(left["concat"], right, packet, mark, table)
        else:
            hit = self._test(left, right, packet, mark, table)
        negated: bool = op == "!="
        return hit != negated

    def _test(self, left: Any, right: Any, packet: Packet, mark: int, table: tuple[str, str]) -> bool:
        field = _field(left)
        family = packet.family
        if field in ("ip saddr", "ip daddr", "ip6 saddr", "ip6 daddr"):
            if (field.startswith("ip6") and family is Family.V4) or (field.startswith("ip ") and family is Family.V6):
                return False  # the payload belongs to the other family: nft's implicit dependency fails
            spans = self._spans(right, "address", family, table)
            if field.endswith("daddr"):
                return _contains(spans, packet.destination)
            if not packet.source:
                raise Undecidable(f"the packet's source is unknown and this rule tests {field}")
            return _covers(spans, [(p.first, p.last) for p in packet.source], field)
        if field in ("meta l4proto", "ip protocol", "ip6 nexthdr"):
            spans = self._spans(right, "protocol", family, table)
            if packet.protocol is None:
                raise Undecidable(f"the rule tests {field} and the packet's protocol is not given (give --protocol)")
            return _contains(spans, _protocol_number(packet.protocol))
        if field == "meta nfproto":
            wanted = right if isinstance(right, str) else None
            if wanted not in ("ipv4", "ipv6"):
                raise Undecidable(f"meta nfproto {clip(json.dumps(right))} is not understood by trace")
            return (wanted == "ipv4") == (family is Family.V4)
        if field.endswith((" dport", " sport")):
            protocol = field.split(" ")[0]
            if protocol != "th":  # tcp dport: nft adds the dependency on the protocol
                if packet.protocol is None:
                    raise Undecidable(f"the rule tests {field} and the packet's protocol is not given "
                                      "(give --protocol)")
                if _protocol_number(packet.protocol) != _PORT_PROTOCOLS[protocol]:
                    return False
            elif packet.protocol is None or _protocol_number(packet.protocol) not in _PORT_PROTOCOLS.values():
                raise Undecidable(f"the rule tests {field} and the packet's protocol is not one with ports "
                                  "(give --protocol tcp, udp or sctp)")
            spans = self._spans(right, "port", family, table)
            if field.endswith("dport"):
                if packet.port is None:
                    raise Undecidable(f"the rule tests {field} and the packet's port is not given (give --port)")
                return _contains(spans, packet.port)
            if packet.source_port is None:
                raise Undecidable(f"the rule tests {field} and the packet's source port is not given "
                                  "(give --source-port)")
            return _contains(spans, packet.source_port)
        if field == "fib daddr type":
            types = right.get("set") if isinstance(right, dict) else [right]
            if not isinstance(types, list) or not all(isinstance(t, str) for t in types):
                raise Undecidable(f"fib daddr type {clip(json.dumps(right))} is not understood by trace")
            if set(types) - {"local", "unicast"}:
                raise Undecidable(f"fib daddr type {', '.join(types)}: only local is understood by trace")
            local = is_local(packet, packet.destination)
            return ("local" in types and local) or ("unicast" in types and not local)
        if field in ("meta oifname", "meta iifname"):
            name = packet.out_interface if field == "meta oifname" else packet.in_interface
            flag = "--out-interface" if field == "meta oifname" else "--in-interface"
            if name is None:
                raise Undecidable(f"the rule tests {field} and the packet's interface is unknown (give {flag})")
            names = right.get("set") if isinstance(right, dict) else [right]
            if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
                raise Undecidable(f"{field} {clip(json.dumps(right))} is not understood by trace")
            return any(name.startswith(n[:-1]) if n.endswith("*") else name == n for n in names)
        if field == "meta mark":
            return _contains(self._spans(right, "number", family, table), mark)
        if field.startswith("meta mark & "):
            return _contains(self._spans(right, "number", family, table), mark & int(field.rsplit(" ", 1)[1]))
        raise Undecidable(f"match on {field} is not understood by trace")

    def map_verdict(self, key: Any, data: Any, packet: Packet, mark: int, table: tuple[str, str]) -> Any:
        """A `vmap` statement (`ip daddr . meta l4proto . th dport vmap @firewall-ips`, kube-proxy's): the verdict
        of the map element the packet's key matches, None when none does (the rule goes on); Undecidable when
        the key or an element cannot be read."""
        if isinstance(data, str) and data.startswith("@"):
            elements = self._named_elements("map", data, table)
        elif isinstance(data, dict) and isinstance(data.get("set"), list):
            elements = data["set"]
        else:
            raise Undecidable(f"vmap {clip(json.dumps(data))} is not understood by trace")
        if not elements:
            return None  # an empty map (kube-proxy's, with no such Service): no verdict
        fields = key.get("concat") if isinstance(key, dict) and "concat" in key else [key]
        if not isinstance(fields, list):
            raise Undecidable(f"cannot read the vmap's key {clip(json.dumps(key))}")
        # a field the packet leaves unknown (no --port) decides nothing while another field of every element
        # surely misses (a destination no Service has): only an element whose known fields all match needs it
        values: list[tuple[str, int | None] | Undecidable] = []
        for f in fields:
            try:
                values.append(_concat_value(_field(f), packet, mark))
            except Undecidable as exc:
                values.append(exc)
        if any(not isinstance(v, Undecidable) and v[1] is None for v in values):
            return None  # a field of the other family: nft's implicit dependency fails
        for element in elements:
            if not isinstance(element, list) or len(element) != 2:
                raise Undecidable(f"cannot read map element {clip(json.dumps(element))} of {data}")
            element_key, verdict = element
            if isinstance(element_key, dict) and isinstance(element_key.get("elem"), dict):
                element_key = element_key["elem"].get("val")
            parts = element_key.get("concat") if isinstance(element_key, dict) and "concat" in element_key \
                else [element_key]
            if not isinstance(parts, list) or len(parts) != len(values):
                raise Undecidable(f"cannot read map element {clip(json.dumps(element))} of {data}")
            unknown: Undecidable | None = None
            for part, known in zip(parts, values, strict=True):
                if isinstance(known, Undecidable):
                    unknown = unknown or known
                elif known[1] is not None and not _contains(union(list(_element(part, known[0], packet.family))),
                                                            known[1]):
                    break
            else:
                if unknown is not None:
                    raise unknown
                return verdict
        return None

    def _concat(self, fields: Any, right: Any, packet: Packet, mark: int, table: tuple[str, str]) -> bool:
        """`ip saddr . ip daddr . meta l4proto . th dport @set` (kube-proxy's hairpin connections): the packet's
        values, one per field, against every element of the set."""
        if not isinstance(fields, list) or not fields:
            raise Undecidable(f"cannot read concatenation {clip(json.dumps(fields))}")
        values = [_concat_value(_field(f), packet, mark) for f in fields]
        if any(value is None for value in values):
            return False  # a field of the other family: nft's implicit dependency fails
        if isinstance(right, str) and right.startswith("@"):
            elements = self._named_elements("set", right, table)
        elif isinstance(right, dict) and isinstance(right.get("set"), list):
            elements = right["set"]
        else:
            raise Undecidable(f"cannot read the concatenation's set {clip(json.dumps(right))}")
        for element in elements:
            if isinstance(element, dict) and isinstance(element.get("elem"), dict):
                element = element["elem"].get("val")
            parts = element.get("concat") if isinstance(element, dict) else None
            if not isinstance(parts, list) or len(parts) != len(values):
                raise Undecidable(f"cannot read element {clip(json.dumps(element))} of {clip(json.dumps(right))}")
            if all(_contains(union(list(_element(part, kind, packet.family))), value)
                   for part, (kind, value) in zip(parts, values, strict=True) if value is not None):
                return True
        return False

    def _named_elements(self, kind: str, ref: str, table: tuple[str, str]) -> list[Any]:
        """The elements of the set or map `ref` (`@name`) of `table` in the listing; Undecidable when it is not
        there or holds no list."""
        body = (self._maps if kind == "map" else self._sets).get((table[0], table[1], ref[1:]))
        if body is None:
            raise Undecidable(f"{kind} {ref} is not in the listing")
        elements = body.get("elem", [])
        if not isinstance(elements, list):
            raise Undecidable(f"{kind} {ref} holds no list of elements")
        return elements

    def _spans(self, right: Any, kind: str, family: Family, table: tuple[str, str]) -> list[Span]:
        if isinstance(right, str) and right.startswith("@"):
            key = (table[0], table[1], right[1:])
            cache_key = (key, family if kind == "address" else None)
            if cache_key not in self._set_cache:
                elements = self._named_elements("set", right, table)
                self._set_cache[cache_key] = union([s for e in elements for s in _element(e, kind, family)])
            return self._set_cache[cache_key]
        if isinstance(right, dict) and "set" in right and isinstance(right["set"], list):
            return union([s for e in right["set"] for s in _element(e, kind, family)])
        return union(list(_element(right, kind, family)))

    def shapes(self, family: Family, *, beside: frozenset[tuple[str, str]] = frozenset()) -> Iterator[RuleShape]:
        """What each reachable rule tests, for check's classes of packets (RuleShape); `beside` as for hooks."""
        seen: set[tuple[str, str, str]] = set()
        todo = [b.key for b in self.base_chains(family) if b.key[:2] not in beside]
        while todo:
            key = todo.pop()
            if key in seen:
                continue
            seen.add(key)
            for rule in self.chains.get(key, []):
                yield self._shape(rule, family, key[:2])
                for statement in rule.expr:
                    if isinstance(statement, dict):
                        for kind in ("jump", "goto"):
                            target = statement.get(kind)
                            if isinstance(target, dict):
                                todo.append((key[0], key[1], str(target.get("target"))))

    def _shape(self, rule: _Rule, family: Family, table: tuple[str, str]) -> RuleShape:
        destinations: list[Span] | None = None
        negated = False
        sources: list[Span] = []
        protocols: set[int] = set()
        ports: list[Span] = []
        rich = False
        for statement in rule.expr:
            body = statement.get("match") if isinstance(statement, dict) else None
            if not isinstance(body, dict):
                continue
            try:
                field = _field(body.get("left"))
                if field in ("ip daddr", "ip6 daddr"):
                    spans = self._spans(body.get("right"), "address", family, table)
                    if destinations is None:
                        destinations, negated = spans, body.get("op") == "!="
                    else:
                        destinations = destinations + spans  # boundaries only: both tests' edges count
                elif field in ("ip saddr", "ip6 saddr"):
                    rich = True
                    sources += self._spans(body.get("right"), "address", family, table)
                elif field in ("meta l4proto", "ip protocol", "ip6 nexthdr"):
                    rich = True
                    protocols.update(n for a, b in self._spans(body.get("right"), "protocol", family, table)
                                     for n in range(a, min(b, 255) + 1))
                elif field.endswith((" dport", " sport")):
                    rich = True
                    protocol = field.split(" ")[0]
                    protocols.update(_PORT_PROTOCOLS.values() if protocol == "th" else {_PORT_PROTOCOLS[protocol]})
                    if field.endswith("dport"):
                        ports += self._spans(body.get("right"), "port", family, table)
            except Undecidable:
                continue  # the walk reports it
        return RuleShape(destinations, negated, rich, sources, protocols, ports)


def _field(left: Any) -> str:
    if isinstance(left, dict) and len(left) == 1:
        kind, body = next(iter(left.items()))
        if kind == "payload" and isinstance(body, dict) and "protocol" in body:
            field = f"{body['protocol']} {body.get('field')}"
            if body["protocol"] in ("ip", "ip6", "th", *_PORT_PROTOCOLS):
                return field
        elif kind == "meta" and isinstance(body, dict):
            return f"meta {body.get('key')}"
        elif kind == "fib" and isinstance(body, dict) and body.get("result") == "type" and \
                body.get("flags") in (["daddr"], "daddr"):
            return "fib daddr type"
        elif kind == "&" and isinstance(body, list) and len(body) == 2 and body[0] == {"meta": {"key": "mark"}} \
                and isinstance(body[1], int):
            return f"meta mark & {body[1]}"
    raise Undecidable(f"match on {clip(json.dumps(left))} is not understood by trace")


# What conntrack holds for a new connection's first packet at postrouting. Its state is new; of its status bits,
# dnat is what the packet description says (Packet.dnat), the others are not set yet (snat is being decided, no
# reply was seen, the entry is confirmed only after postrouting); expected (a helper's related connection) is unknown.
_NEW_CONNECTION = {
    "state": {"new": True, "established": False, "related": False, "invalid": False, "untracked": False},
    "status": {"snat": False, "seen-reply": False, "assured": False, "confirmed": False, "dying": False},
}


def _conntrack(left: Any, right: Any, op: str, packet: Packet) -> bool:
    """`ct state new`, `ct status dnat` (flags, as nft -j writes them: a name or a list of names, op `in`)."""
    key = left.get("key") if isinstance(left, dict) and set(left) == {"key"} else None
    names = right if isinstance(right, list) else [right]
    if key not in _NEW_CONNECTION or not all(isinstance(n, str) for n in names) or op == "==":
        raise Undecidable(f"match on ct {clip(json.dumps(left))} {op} {clip(json.dumps(right))} is not understood "
                          "by trace")
    known = _NEW_CONNECTION[key]
    hit = False
    for name in names:
        if key == "status" and name == "dnat":
            hit = hit or packet.dnat
        elif name in known:
            hit = hit or known[name]
        else:
            raise Undecidable(f"ct {key} {name} is not known for a new connection")
    return hit != (op == "!=")


def _concat_value(field: str, packet: Packet, mark: int) -> tuple[str, int | None]:
    """A field of a concatenation as (kind, the packet's value); value None: a field of the other family."""
    if field in ("ip saddr", "ip daddr", "ip6 saddr", "ip6 daddr"):
        if (field.startswith("ip6") and packet.family is Family.V4) or \
                (field.startswith("ip ") and packet.family is Family.V6):
            return "address", None
        if field.endswith("daddr"):
            return "address", packet.destination
        if packet.source_address is None:
            raise Undecidable(f"the rule tests {field} in a concatenation and the packet's source is not one "
                              "address (give --source)")
        return "address", packet.source_address
    if field in ("meta l4proto", "ip protocol", "ip6 nexthdr"):
        if packet.protocol is None:
            raise Undecidable(f"the rule tests {field} and the packet's protocol is not given (give --protocol)")
        return "protocol", _protocol_number(packet.protocol)
    if field.endswith((" dport", " sport")):  # th, tcp, udp...: _field names no other protocol
        protocol = field.split(" ")[0]
        number = None if packet.protocol is None else _protocol_number(packet.protocol)
        if number is None or number not in _PORT_PROTOCOLS.values() or \
                (protocol != "th" and number != _PORT_PROTOCOLS[protocol]):
            raise Undecidable(f"the rule tests {field} and the packet's protocol is not one with ports "
                              "(give --protocol tcp, udp or sctp)")
        port = packet.port if field.endswith("dport") else packet.source_port
        if port is None:
            flag = "--port" if field.endswith("dport") else "--source-port"
            raise Undecidable(f"the rule tests {field} and the packet's port is not given (give {flag})")
        return "port", port
    if field == "meta mark":
        return "number", mark
    raise Undecidable(f"{field} in a concatenation is not understood by trace")


def _new_mark(value: Any, mark: int) -> int:
    """`meta mark set 0x10`, or set from the mark itself: `meta mark | 0x4000`, `^`, `&` (kube-proxy's)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value & 0xFFFFFFFF
    if isinstance(value, dict) and len(value) == 1:
        op, operands = next(iter(value.items()))
        if op in ("|", "^", "&") and isinstance(operands, list) and len(operands) == 2 \
                and operands[0] == {"meta": {"key": "mark"}} and isinstance(operands[1], int):
            number = operands[1]
            changed = mark | number if op == "|" else mark ^ number if op == "^" else mark & number
            return changed & 0xFFFFFFFF
    raise Undecidable(f"meta mark set {clip(json.dumps(value))} is not understood by trace")


def _protocol_number(name: str) -> int:
    return _NAMES.get(name, int(name) if name.isdigit() else -1)


def _element(element: Any, kind: str, family: Family) -> Iterator[Span]:
    """One value, prefix, range or set element as inclusive spans; Undecidable on anything else."""
    if isinstance(element, dict) and "elem" in element and isinstance(element["elem"], dict):
        element = element["elem"].get("val")
    try:
        if kind == "address":
            if isinstance(element, str):
                element_family, _ = parse_address(element.split("/")[0])
                if element_family is not family:
                    return
                if "/" in element:
                    prefix = parse_cidr(element)
                    yield prefix.first, prefix.last
                    return
            yield parse_address_element(element)
            return
        if isinstance(element, dict) and "range" in element and len(element["range"]) == 2:
            low, high = (_number(v, kind) for v in element["range"])
            yield low, high
            return
        value = _number(element, kind)
        yield value, value
    except (NftParseError, ValueError, KeyError, TypeError) as exc:
        raise Undecidable(f"cannot read {kind} {clip(json.dumps(element))} ({clip(str(exc))})") from None


def _number(value: Any, kind: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and kind == "protocol" and value in _NAMES:
        return _NAMES[value]
    if isinstance(value, str) and value.isdigit():
        return int(value)
    raise Undecidable(f"cannot read {kind} {clip(json.dumps(value))}")


def _contains(spans: list[Span], value: int) -> bool:
    i = bisect_right(spans, (value, 1 << 130)) - 1
    return i >= 0 and spans[i][1] >= value


def _covers(spans: list[Span], sources: list[Span], field: str) -> bool:
    """True: every source inside; False: none overlaps; else the source range straddles the test."""
    inside = overlapping = 0
    for first, last in sources:
        i = bisect_right(spans, (first, 1 << 130)) - 1
        if i >= 0 and spans[i][1] >= last:
            inside += 1
            continue
        j = bisect_right(spans, (last, 1 << 130)) - 1
        if j >= 0 and spans[j][1] >= first:
            overlapping += 1
    if inside == len(sources):
        return True
    if inside == 0 and overlapping == 0:
        return False
    raise Undecidable(f"{field} covers only part of the source range")


def _snat_to(addr: Any, family: Family) -> str:
    if isinstance(addr, str):
        return addr
    if isinstance(addr, dict) and "range" in addr and len(addr["range"]) == 2:
        return f"{addr['range'][0]}-{addr['range'][1]}"
    if isinstance(addr, dict) and "prefix" in addr:
        first, last = parse_address_element(addr)
        return f"{format_address(family, first)}-{format_address(family, last)}"
    raise Undecidable(f"snat to {clip(json.dumps(addr))} is not understood by trace")
