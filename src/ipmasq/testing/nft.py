"""A stateful fake `nft` for fast tests, in the spirit of knftables' Fake: it parses the scripts it is given
(our dialect only, refusing anything else as nft would refuse a syntax error), keeps the tables, and answers the
listings the backend reads with the JSON the real nft prints (the kernel tests prove the two identical).

Supported: `nft -f -` (atomic: a failing script changes nothing; `delete set` of a set that is not there fails it, as
the kernel does, which is what makes ipmasq's removal conditional on its ownership marker), `nft -j [-t] list ruleset
[FAMILY]`, `nft -j list table|set ...`, `nft -j list chains`, and the drift an operator might cause: `nft delete
table|set`, `nft flush chain|set`, `nft add rule`.
"""

from __future__ import annotations

import itertools
import json
import re
import socket
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from ipmasq.backends.base import Result
from ipmasq.errors import NftParseError
from ipmasq.netfilter.nft import SRCNAT_PRIORITY, TABLE, TABLE_FAMILY, NftChain, NftSet, NftTable, format_element
from ipmasq.prefix import Family
from ipmasq.testing.runner import FakeRunner

__all__ = ["FakeNft", "ScriptCommand", "list_json", "parse_script", "rule_to_json"]

_ABSENT = "Error: No such file or directory"
_META = {"metainfo": {"version": "1.0.6", "release_name": "fake", "json_schema_version": 1}}


def _rename(objects: list[dict[str, Any]], family: str, name: str) -> list[dict[str, Any]]:
    """list_json speaks of our table; re-label its objects for any other table the fake holds."""
    out = []
    for o in objects:
        kind, body = next(iter(o.items()))
        body = dict(body, family=family)
        body["name" if kind == "table" else "table"] = name
        out.append({kind: body})
    return out


class FakeNft(FakeRunner):
    """A Runner (`fake(argv, stdin) -> Result`) for argv[0] == "nft"; `tables` is the kernel's state."""

    def __init__(self) -> None:
        super().__init__()
        self.tables: dict[tuple[str, str], NftTable] = {}
        self.transactions = 0  # successful `nft -f` writes: an idle agent must not add any
        self.counts: dict[str, tuple[int, int]] = {}  # (packets, bytes) by rule comment: simulated traffic
        self.listings: list[list[str]] = []  # the argv of every `nft -j` listing, to count reads

    def count(self, comment: str, packets: int, octets: int) -> None:
        """Simulate traffic through the rules with this comment (their counter statements show it when listed)."""
        before = self.counts.get(comment, (0, 0))
        self.counts[comment] = (before[0] + packets, before[1] + octets)

    def __call__(self, argv: Sequence[str], stdin: str | None = None) -> Result:
        args = list(argv[1:])
        try:
            if args == ["-f", "-"]:
                return self._transaction(stdin or "")
            if args[:1] == ["-j"]:
                return self._list(args[1:])
            return self._command(args)
        except NftParseError as exc:
            return Result(1, "", f"Error: {exc}\n")

    def _transaction(self, script: str) -> Result:
        tables = dict(self.tables)
        for command in parse_script(script):
            key = (command.family, command.table)
            if command.verb == "add":
                tables.setdefault(key, NftTable((), ()))
            elif command.verb == "delete set":
                table = tables.get(key)
                if table is None or table.set_named(command.name) is None:
                    return Result(1, "", f"{_ABSENT}\ndelete set {command.family} {command.table} {command.name}\n")
                tables[key] = replace(table, sets=tuple(x for x in table.sets if x.name != command.name))
            elif command.verb == "delete":
                if key not in tables:
                    return Result(1, "", f"{_ABSENT}\ndelete table {command.family} {command.table}\n")
                del tables[key]
            elif command.definition is not None:
                current = tables.get(key, NftTable((), ()))
                names = {s.name for s in current.sets} | {c.name for c in current.chains}
                new = command.definition
                clash = names & ({s.name for s in new.sets} | {c.name for c in new.chains})
                if clash:
                    # the fake only ever defines into an empty table, as our scripts do after `delete table`
                    return Result(1, "", f"Error: fake nft: {sorted(clash)} already exist\n")
                tables[key] = NftTable(tuple(sorted(current.sets + command.definition.sets, key=lambda s: s.name)),
                                       tuple(sorted(current.chains + command.definition.chains, key=lambda c: c.name)))
        self.tables = tables
        self.transactions += 1
        self.generation += 1
        return Result(0)

    def _objects(self, key: tuple[str, str], *, terse: bool) -> list[dict[str, Any]]:
        objects = _rename(list_json(self.tables[key], terse=terse), *key)
        for item in objects:
            rule = item.get("rule")
            if rule is not None and rule.get("comment") in self.counts:
                packets, octets = self.counts[rule["comment"]]
                for stmt in rule["expr"]:
                    if "counter" in stmt:
                        stmt["counter"] = {"packets": packets, "bytes": octets}
        return objects

    def _list(self, args: list[str]) -> Result:
        self.listings.append(["nft", "-j", *args])
        terse = args[:1] == ["-t"]
        args = args[1:] if terse else args
        objects: list[dict[str, Any]] = []
        if args[:2] == ["list", "ruleset"]:
            for key in sorted(self.tables):
                if len(args) < 3 or key[0] == args[2]:
                    objects += self._objects(key, terse=terse)
        elif args[:2] == ["list", "chains"]:
            for key in sorted(self.tables):
                objects += [o for o in self._objects(key, terse=True) if "chain" in o]
        elif args[:2] == ["list", "table"] and len(args) == 4:
            key = (args[2], args[3])
            if key not in self.tables:
                return Result(1, "", f"{_ABSENT}\n")
            objects = self._objects(key, terse=terse)
        elif args[:2] == ["list", "set"] and len(args) == 5:
            key = (args[2], args[3])
            if key not in self.tables or self.tables[key].set_named(args[4]) is None:
                return Result(1, "", f"{_ABSENT}\n")
            objects = [o for o in self._objects(key, terse=terse) if o.get("set", {}).get("name") == args[4]]
        else:
            return Result(1, "", f"Error: fake nft: unsupported listing {args}\n")
        return Result(0, json.dumps({"nftables": [_META, *objects]}))

    def _command(self, args: list[str]) -> Result:
        if len(args) < 3:
            return Result(1, "", f"Error: fake nft: unsupported command {args}\n")
        verb, kind, key = args[0], args[1], (args[2], args[3] if len(args) > 3 else "")
        table = self.tables.get(key)
        if table is None:
            return Result(1, "", f"{_ABSENT}\n")
        if (verb, kind) == ("delete", "table"):
            del self.tables[key]
        elif (verb, kind) == ("delete", "set") and len(args) == 5:
            if table.set_named(args[4]) is None:
                return Result(1, "", f"{_ABSENT}\n")
            self.tables[key] = replace(table, sets=tuple(x for x in table.sets if x.name != args[4]))
        elif (verb, kind) == ("flush", "chain") and len(args) == 5:
            chain = table.chain_named(args[4])
            if chain is None:
                return Result(1, "", f"{_ABSENT}\n")
            self._put(key, table, chain=replace(chain, rules=()))
        elif (verb, kind) == ("flush", "set") and len(args) == 5:
            s = table.set_named(args[4])
            if s is None:
                return Result(1, "", f"{_ABSENT}\n")
            self.tables[key] = replace(table, sets=tuple(replace(x, elements=()) if x is s else x for x in table.sets))
        elif (verb, kind) == ("add", "rule") and len(args) >= 6:
            chain = table.chain_named(args[4])
            if chain is None:
                return Result(1, "", f"{_ABSENT}\n")
            rule = " ".join(args[5:])
            rule_to_json(rule)  # our dialect only
            self._put(key, table, chain=replace(chain, rules=(*chain.rules, rule)))
        else:
            return Result(1, "", f"Error: fake nft: unsupported command {args}\n")
        self.generation += 1
        return Result(0)

    def _put(self, key: tuple[str, str], table: NftTable, *, chain: NftChain) -> None:
        self.tables[key] = replace(table, chains=tuple(chain if c.name == chain.name else c for c in table.chains))


# --- our nft dialect the other way round: script text -> table -> `nft -j list` JSON, as the kernel answers ------


_TOKEN = re.compile(r'"[^"]*"|\{[^}]*\}|\S+')


def _json_value(token: str) -> Any:
    if token.startswith("{"):
        return {"set": [_json_value(t.strip()) for t in token[1:-1].split(",") if t.strip()]}
    if "/" in token:  # an address prefix, as nft lists one
        address, _, length = token.partition("/")
        return {"prefix": {"addr": address, "len": int(length)}}
    first, dash, last = token.partition("-")
    if dash and ((first.isdigit() and last.isdigit()) or "." in first or ":" in first):
        return {"range": [_json_value(first), _json_value(last)]}  # ports or addresses, not a name (ipv6-icmp)
    return int(token) if token.isdigit() else token


def _nat_flags(tokens: list[str], i: int, into: dict[str, Any]) -> int:
    """Read the NAT flags at tokens[i:] into `into["flags"]` as nft -j lists them (one as a string, several as a
    list); the index after them."""
    flags: list[str] = []
    while i < len(tokens) and tokens[i] in ("fully-random", "random", "persistent"):
        flags.append(tokens[i])
        i += 1
    if flags:
        into["flags"] = flags[0] if len(flags) == 1 else flags
    return i


def rule_to_json(text: str) -> dict[str, Any]:
    """Canonical rule text (our dialect only) as the kernel lists it in JSON: {"expr": [...], "comment"?: ...}.

    The inverse of rule_from_json; the fake nft uses it, and the kernel tests prove it equals the real listing.
    """
    tokens = _TOKEN.findall(text)
    expr: list[dict[str, Any]] = []
    out: dict[str, Any] = {}
    i = 0

    def need(n: int) -> list[str]:
        if i + n > len(tokens):
            raise NftParseError(f"rule ends early: {text!r}")
        return tokens[i : i + n]

    while i < len(tokens):
        t = tokens[i]
        if t == "fib":
            flags, result, value = need(4)[1:]
            match_left: dict[str, Any] = {"fib": {"result": result, "flags": flags.split(".")}}
            i += 4
        elif t in ("ip", "ip6", "tcp", "udp", "sctp"):  # ip daddr, tcp dport, ...
            field, value = need(3)[1:]
            match_left = {"payload": {"protocol": t, "field": field}}
            i += 3
        elif t == "snat":
            family, to, address = need(4)[1:]
            if to != "to" or family not in ("ip", "ip6"):
                raise NftParseError(f"unsupported snat in {text!r}")
            i += 4
            snat: dict[str, Any] = {"family": family, "addr": address}
            i = _nat_flags(tokens, i, snat)
            expr.append({"snat": snat})
            continue
        elif t == "meta":
            key, value = need(3)[1:]
            match_left = {"meta": {"key": key}}
            i += 3
        elif t == "numgen":
            mode, mod_kw, mod, value = need(5)[1:]
            if mod_kw != "mod":
                raise NftParseError(f"unsupported numgen in {text!r}")
            match_left = {"numgen": {"mode": mode, "mod": int(mod), "offset": 0}}
            i += 5
        elif t in ("return", "accept", "drop"):
            expr.append({t: None})
            i += 1
            continue
        elif t in ("jump", "goto"):
            expr.append({t: {"target": need(2)[1]}})
            i += 2
            continue
        elif t == "counter":  # a new counter: traffic is simulated by FakeNft.count
            expr.append({"counter": {"packets": 0, "bytes": 0}})
            i += 1
            continue
        elif t == "masquerade":
            i += 1
            body: dict[str, Any] = {}
            if i < len(tokens) and tokens[i] == "to":
                port = need(2)[1].lstrip(":")
                low, _, high = port.partition("-")
                body["port"] = {"range": [int(low), int(high)]} if high else int(low)
                i += 2
            i = _nat_flags(tokens, i, body)
            expr.append({"masquerade": body or None})
            continue
        elif t == "comment":
            out["comment"] = need(2)[1].strip('"')
            i += 2
            continue
        else:
            raise NftParseError(f"not our nft dialect: {t!r} in {text!r}")
        if value == "!=":
            raise NftParseError(f"negated matches are not our dialect: {text!r}")
        expr.append({"match": {"op": "==", "left": match_left, "right": _json_value(value)}})
    out["expr"] = expr
    return out


@dataclass(frozen=True, slots=True)
class ScriptCommand:
    """One top-level command of an `nft -f` script in our dialect."""

    verb: str  # "add" (table NAME without a body), "delete", "delete set", or "define" (table NAME { ... })
    family: str
    table: str
    definition: NftTable | None = None
    name: str = ""  # the set of "delete set"


def _parse_element(family: Family, text: str) -> tuple[int, int]:
    af = socket.AF_INET if family is Family.V4 else socket.AF_INET6
    try:
        if "/" in text:
            address, _, length = text.partition("/")
            n = int.from_bytes(socket.inet_pton(af, address), "big")
            last = n | ((1 << (family.bits - int(length))) - 1)
            if n & ((1 << (family.bits - int(length))) - 1):
                raise NftParseError(f"element {text} is not a network address")
            return n, last
        first, dash, last_text = text.partition("-")
        a = int.from_bytes(socket.inet_pton(af, first), "big")
        b = int.from_bytes(socket.inet_pton(af, last_text), "big") if dash else a
    except (OSError, ValueError):
        raise NftParseError(f"not a {family.name} element: {text!r}") from None
    if b < a:
        raise NftParseError(f"range {text} ends before it starts")
    return a, b


_CHAIN_HEADER = re.compile(r"type (\w+) hook (\w+) priority ([\w-]+); policy (\w+);\Z")


def parse_script(text: str) -> list[ScriptCommand]:
    """Our own dialect of `nft -f` script (what render_script writes); anything else raises NftParseError."""
    commands: list[ScriptCommand] = []
    lines = [line.strip() for line in text.splitlines()]
    lines = [line for line in lines if line and not line.startswith("#")]
    i = 0

    def fail(message: str) -> NftParseError:
        return NftParseError(f"line {i + 1}: {message}: {lines[i] if i < len(lines) else '<end>'!r}")

    while i < len(lines):
        words = lines[i].split()
        if words[:1] == ["delete"] and len(words) == 4 and words[1] == "table":
            commands.append(ScriptCommand("delete", words[2], words[3]))
            i += 1
        elif words[:2] == ["delete", "set"] and len(words) == 5:
            commands.append(ScriptCommand("delete set", words[2], words[3], name=words[4]))
            i += 1
        elif words[:1] == ["table"] and len(words) == 3:
            commands.append(ScriptCommand("add", words[1], words[2]))
            i += 1
        elif words[:1] == ["table"] and len(words) == 4 and words[3] == "{":
            family, name = words[1], words[2]
            i += 1
            sets: list[NftSet] = []
            chains: list[NftChain] = []
            while i < len(lines) and lines[i] != "}":
                header = lines[i].split()
                if len(header) != 3 or header[0] not in ("set", "chain") or header[2] != "{":
                    raise fail("expected a set or a chain")
                kind, object_name = header[0], header[1]
                i += 1
                body: list[str] = []
                while i < len(lines) and lines[i] != "}":
                    body.append(lines[i])
                    i += 1
                if i >= len(lines):
                    raise fail(f"{kind} {object_name} is not closed")
                i += 1
                if kind == "set":
                    sets.append(_parse_set_body(object_name, body))
                else:
                    chains.append(_parse_chain_body(object_name, body))
            if i >= len(lines):
                raise fail(f"table {name} is not closed")
            i += 1
            definition = NftTable(tuple(sorted(sets, key=lambda s: s.name)),
                                  tuple(sorted(chains, key=lambda c: c.name)))
            commands.append(ScriptCommand("define", family, name, definition))
        else:
            raise fail("not our nft dialect")
    return commands


def _parse_set_body(name: str, body: list[str]) -> NftSet:
    set_type = ""
    flags: tuple[str, ...] = ()
    comment = ""
    element_text: str | None = None
    for index, line in enumerate(body):
        if line.startswith("type "):
            set_type = line[5:].strip()
        elif line.startswith("flags "):
            flags = tuple(f.strip() for f in line[6:].split(","))
        elif line.startswith('comment "') and line.endswith('"') and '"' not in line[9:-1]:
            comment = line[9:-1]
        elif line.startswith("elements = {"):
            element_text = " ".join(body[index:])
            break
        else:
            raise NftParseError(f"set {name}: not our dialect: {line!r}")
    if set_type not in ("ipv4_addr", "ipv6_addr"):
        raise NftParseError(f"set {name}: type {set_type!r} is not an address type")
    family = Family.V6 if set_type == "ipv6_addr" else Family.V4
    elements: list[tuple[int, int]] = []
    if element_text is not None:
        inner = element_text[len("elements = {") :].strip()
        if not inner.endswith("}"):
            raise NftParseError(f"set {name}: elements are not closed")
        elements = sorted(_parse_element(family, t.strip()) for t in inner[:-1].split(",") if t.strip())
        for (_, last), (first, _) in itertools.pairwise(elements):
            if first <= last:
                # the kernel refuses overlaps in an interval set without auto-merge
                raise NftParseError(f"set {name}: conflicting intervals specified")
        if "interval" not in flags and any(a != b for a, b in elements):
            raise NftParseError(f"set {name}: ranges need flags interval")
    return NftSet(name, set_type, flags, tuple(elements), comment)


def _parse_chain_body(name: str, body: list[str]) -> NftChain:
    chain_type = hook = policy = ""
    priority = 0
    rules = body
    if body and body[0].startswith("type "):
        m = _CHAIN_HEADER.match(body[0])
        if m is None:
            raise NftParseError(f"chain {name}: cannot read {body[0]!r}")
        chain_type, hook, priority_text, policy = m.groups()
        priority = SRCNAT_PRIORITY if priority_text == "srcnat" else int(priority_text)
        rules = body[1:]
    for rule in rules:
        rule_to_json(rule)  # refuses what is not our dialect
    return NftChain(name, chain_type, hook, priority, policy, tuple(rules))


def _element_json(family: Family, first: int, last: int) -> Any:
    text = format_element(family, first, last)
    if "/" in text:
        address, _, length = text.partition("/")
        return {"prefix": {"addr": address, "len": int(length)}}
    if "-" in text:
        a, _, b = text.partition("-")
        return {"range": [a, b]}
    return text


def list_json(table: NftTable, *, terse: bool = False) -> list[dict[str, Any]]:
    """The objects `nft -j list table inet ip-masq-agent` prints for a table (handles omitted)."""
    out: list[dict[str, Any]] = [{"table": {"family": TABLE_FAMILY, "name": TABLE}}]
    for s in table.sets:
        body: dict[str, Any] = {"family": TABLE_FAMILY, "name": s.name, "table": TABLE, "type": s.type}
        if s.flags:
            body["flags"] = list(s.flags)
        if s.comment:  # listed even by a terse listing
            body["comment"] = s.comment
        if s.elements and not terse:
            body["elem"] = [_element_json(s.family, a, b) for a, b in s.elements]
        out.append({"set": body})
    for c in table.chains:
        chain: dict[str, Any] = {"family": TABLE_FAMILY, "table": TABLE, "name": c.name}
        if c.type:
            chain.update(type=c.type, hook=c.hook, prio=c.priority, policy=c.policy)
        out.append({"chain": chain})
    for c in table.chains:
        for rule in c.rules:
            out.append({"rule": {"family": TABLE_FAMILY, "table": TABLE, "chain": c.name, **rule_to_json(rule)}})
    return out
