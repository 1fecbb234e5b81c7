"""The nftables table for our policy: rendered as an `nft -f` script, parsed back from `nft -j list` JSON.

One table, ``inet ip-masq-agent``: an interval set per family holding the exact disjoint non-masquerade ranges the
Policy computes (so masqueradeCIDRs exceptions need no rules of their own), and one nat chain at postrouting that
returns for local destinations and for addresses in the sets, and masquerades the rest. A new connection costs one
set lookup whatever the number of CIDRs.

Rules are kept as text in the form `nft list` prints them (our canonical form, like iptables-save's for the
iptables backend); `rule_from_json` reads the kernel's JSON into that form and `rule_to_json` is its inverse for
the stateful fake. Only our own dialect is read: anything else becomes an "unrecognised" rule that never equals a
desired one, so the agent repairs it and `check` shows it.
"""

from __future__ import annotations

import itertools
import json
import re
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ipmasq.errors import IpmasqError
from ipmasq.options import PolicyOptions
from ipmasq.policy import Policy
from ipmasq.prefix import Family
from ipmasq.rules.iptables import MASQ_COMMENT, NON_MASQ_COMMENT

__all__ = [
    "CHAIN",
    "LOCAL_COMMENT",
    "SET_NAMES",
    "TABLE",
    "TABLE_FAMILY",
    "V6_UNMANAGED_COMMENT",
    "NftChain",
    "NftParseError",
    "NftSet",
    "NftTable",
    "ScriptCommand",
    "delete_script",
    "desired_table",
    "format_element",
    "format_elements",
    "list_json",
    "parse_address_element",
    "parse_list_json",
    "parse_script",
    "render_definition",
    "render_script",
    "replace_script",
    "rule_from_json",
    "rule_to_json",
]

TABLE_FAMILY = "inet"
TABLE = "ip-masq-agent"
CHAIN = "postrouting"
SRCNAT_PRIORITY = 100  # nft's "srcnat" keyword; the JSON listing prints the number
SET_NAMES = {Family.V4: "nomasq_v4", Family.V6: "nomasq_v6"}
SET_TYPES = {Family.V4: "ipv4_addr", Family.V6: "ipv6_addr"}
LOCAL_COMMENT = "ip-masq-agent: local destinations are not subject to MASQUERADE"
V6_UNMANAGED_COMMENT = "ip-masq-agent: IPv6 is not managed without --enable-ipv6"
PROTOCOLS_WITH_PORTS = "{ tcp, udp, sctp }"


class NftParseError(IpmasqError):
    """nft output or an nft script that is not what we expect."""


@dataclass(frozen=True, slots=True)
class NftSet:
    name: str
    type: str
    flags: tuple[str, ...]
    elements: tuple[tuple[int, int], ...]  # sorted, disjoint inclusive ranges of addresses as integers

    @property
    def family(self) -> Family:
        return Family.V6 if self.type == "ipv6_addr" else Family.V4


@dataclass(frozen=True, slots=True)
class NftChain:
    name: str
    type: str  # "" for a regular (non-base) chain
    hook: str
    priority: int
    policy: str
    rules: tuple[str, ...]  # canonical text, as `nft list` prints them (without handles)


@dataclass(frozen=True, slots=True)
class NftTable:
    """Our table, normalised: two tables are equal when the kernel would treat every packet the same way."""

    sets: tuple[NftSet, ...]  # sorted by name
    chains: tuple[NftChain, ...]  # sorted by name

    def set_named(self, name: str) -> NftSet | None:
        return next((s for s in self.sets if s.name == name), None)

    def chain_named(self, name: str) -> NftChain | None:
        return next((c for c in self.chains if c.name == name), None)

    def element_count(self) -> int:
        return sum(len(s.elements) for s in self.sets)


# --- desired state ----------------------------------------------------------------------------------------------


def _comment(text: str) -> str:
    return f' comment "{text}"'


def _masquerade_rules(options: PolicyOptions) -> list[str]:
    """MASQUERADE, or with --to-ports one rule per port range, each taking its share like the iptables backend's."""
    random_fully = " fully-random" if options.random_fully else ""
    rules = []
    ranges = options.to_ports
    for i, port_range in enumerate(ranges):
        remaining = len(ranges) - i
        # nft lists "numgen random mod N 0" without "==": keep the listed form so read-back compares equal
        pick = f"numgen random mod {remaining} 0 " if remaining > 1 else ""
        rules.append(f"meta l4proto {PROTOCOLS_WITH_PORTS} {pick}masquerade to :{port_range}{random_fully}"
                     + _comment(MASQ_COMMENT))
    rules.append(f"masquerade{random_fully}" + _comment(MASQ_COMMENT))
    return rules


def desired_table(policy: Policy) -> NftTable:
    """Our whole table for a policy (every family it manages)."""
    families = policy.families
    sets = tuple(
        NftSet(SET_NAMES[f], SET_TYPES[f], ("interval",), tuple(policy.non_masquerade_ranges(f))) for f in families
    )
    rules = ["fib daddr type local return" + _comment(LOCAL_COMMENT)]
    if Family.V6 not in families:
        # an inet chain sees IPv6 too; without --enable-ipv6 the reference writes no IPv6 rules, so pod IPs stay
        rules.append("meta nfproto ipv6 return" + _comment(V6_UNMANAGED_COMMENT))
    for family in families:
        protocol = "ip" if family is Family.V4 else "ip6"
        rules.append(f"{protocol} daddr @{SET_NAMES[family]} return" + _comment(NON_MASQ_COMMENT))
    rules.extend(_masquerade_rules(policy.options))
    chain = NftChain(CHAIN, "nat", "postrouting", SRCNAT_PRIORITY, "accept", tuple(rules))
    return NftTable(tuple(sorted(sets, key=lambda s: s.name)), (chain,))


# --- rendering ----------------------------------------------------------------------------------------------------


def _v4(n: int) -> str:
    return f"{n >> 24}.{(n >> 16) & 255}.{(n >> 8) & 255}.{n & 255}"


def _v6(n: int) -> str:
    return socket.inet_ntop(socket.AF_INET6, n.to_bytes(16, "big"))


def format_element(family: Family, first: int, last: int) -> str:
    """A range as nft writes it: an address, a CIDR when the range is exactly one prefix, else first-last."""
    fmt = _v4 if family is Family.V4 else _v6
    if first == last:
        return fmt(first)
    size = last - first + 1
    if size & (size - 1) == 0 and first & (size - 1) == 0:
        return f"{fmt(first)}/{family.bits - size.bit_length() + 1}"
    return f"{fmt(first)}-{fmt(last)}"


def format_elements(family: Family, elements: tuple[tuple[int, int], ...]) -> list[str]:
    """format_element over a whole set; IPv4 inlined, because a set may hold 100,000 ranges (agent --once)."""
    if family is Family.V6:
        return [format_element(family, a, b) for a, b in elements]
    ntoa = socket.inet_ntoa
    out: list[str] = []
    append = out.append
    for a, b in elements:
        first = ntoa(a.to_bytes(4, "big"))
        if a == b:
            append(first)
            continue
        size = b - a + 1
        if size & (size - 1) == 0 and a & (size - 1) == 0:
            append(f"{first}/{33 - size.bit_length()}")
        else:
            append(f"{first}-{ntoa(b.to_bytes(4, 'big'))}")
    return out


def _priority(chain: NftChain) -> str:
    return "srcnat" if chain.type == "nat" and chain.priority == SRCNAT_PRIORITY else str(chain.priority)


def render_definition(table: NftTable, *, formatted: Mapping[str, Sequence[str]] | None = None) -> str:
    """`table inet ip-masq-agent { ... }` for a normalised table; `formatted`: each set's elements as text, when
    the caller already has them (format_elements)."""
    out = [f"table {TABLE_FAMILY} {TABLE} {{"]
    for s in table.sets:
        out.append(f"\tset {s.name} {{")
        out.append(f"\t\ttype {s.type}")
        if s.flags:
            out.append(f"\t\tflags {', '.join(s.flags)}")
        if s.elements:  # "elements = { }" is a syntax error
            texts = formatted[s.name] if formatted is not None else format_elements(s.family, s.elements)
            out.append("\t\telements = { " + ",\n\t\t\t".join(texts) + " }")
        out.append("\t}")
    for c in table.chains:
        out.append(f"\tchain {c.name} {{")
        if c.type:
            out.append(f"\t\ttype {c.type} hook {c.hook} priority {_priority(c)}; policy {c.policy};")
        out.extend(f"\t\t{rule}" for rule in c.rules)
        out.append("\t}")
    out.append("}")
    return "\n".join(out) + "\n"


def render_script(policy: Policy) -> str:
    """One `nft -f -` transaction that replaces our table whatever state it is in (absent, drifted, current).

    Declaring the table first makes the delete valid when it does not exist yet; the kernel applies the three
    commands atomically, so no packet ever sees the table half-written or missing.
    """
    return replace_script(desired_table(policy))


def replace_script(table: NftTable, *, formatted: Mapping[str, Sequence[str]] | None = None) -> str:
    """render_script for an already built table (see render_definition for `formatted`)."""
    return delete_script() + render_definition(table, formatted=formatted)


def delete_script() -> str:
    """Remove our table if it exists, in one transaction (nft 1.0.6 has no `destroy`)."""
    return f"table {TABLE_FAMILY} {TABLE}\ndelete table {TABLE_FAMILY} {TABLE}\n"


# --- parsing `nft -j list table` ----------------------------------------------------------------------------------


def _address(text: str) -> tuple[Family, int]:
    try:
        return Family.V4, int.from_bytes(socket.inet_pton(socket.AF_INET, text), "big")
    except OSError:
        pass
    try:
        return Family.V6, int.from_bytes(socket.inet_pton(socket.AF_INET6, text), "big")
    except OSError:
        raise NftParseError(f"not an address in a set: {text!r}") from None


def parse_address_element(element: Any) -> tuple[int, int]:
    """One element of an interval set in nft's JSON: "a", {"prefix": ...}, {"range": [a, b]}, {"elem": ...}."""
    if isinstance(element, str):
        _, n = _address(element)
        return n, n
    if isinstance(element, dict):
        if "elem" in element:  # elements with a comment or timeout are wrapped
            return parse_address_element(element["elem"].get("val"))
        if "prefix" in element:
            family, network = _address(element["prefix"]["addr"])
            length = int(element["prefix"]["len"])
            return network, network | ((1 << (family.bits - length)) - 1)
        if "range" in element:
            a, b = element["range"]
            return _address(a)[1], _address(b)[1]
    raise NftParseError(f"not an address element: {json.dumps(element)}")


def _elements(raw: list[Any], family: Family) -> tuple[tuple[int, int], ...]:
    """A set's elements as sorted ranges; the common shapes inline, because a listing may hold 100,000 of them."""
    af = socket.AF_INET if family is Family.V4 else socket.AF_INET6
    bits = family.bits
    pton = socket.inet_pton
    from_bytes = int.from_bytes
    out: list[tuple[int, int]] = []
    append = out.append
    try:
        for e in raw:
            if type(e) is str:
                n = from_bytes(pton(af, e), "big")
                append((n, n))
                continue
            prefix = e.get("prefix") if type(e) is dict else None
            if prefix is not None:
                n = from_bytes(pton(af, prefix["addr"]), "big")
                append((n, n | ((1 << (bits - prefix["len"])) - 1)))
            else:
                append(parse_address_element(e))
    except (OSError, KeyError, TypeError):
        bad = json.dumps(raw[len(out)])
        raise NftParseError(f"a {family.name} set holds an element we cannot read: {bad}") from None
    if any(out[i][0] <= out[i - 1][1] for i in range(1, len(out))):
        out.sort()  # nft lists interval sets in order; sort only when it did not
    return tuple(out)


def parse_list_json(text: str, *, table: str = TABLE, family: str = TABLE_FAMILY,
                    table_listed: bool = True) -> NftTable | None:
    """Our table from `nft -j list table inet ip-masq-agent` (or a whole `list ruleset`); None when it is absent.

    `table_listed=False` reads listings that omit the table object (`nft -j list set ...`).
    """
    try:
        document = json.loads(text)
        items = document["nftables"]
    except (ValueError, KeyError, TypeError) as exc:
        raise NftParseError(f"nft -j output is not an nftables JSON listing: {exc}") from None
    found = not table_listed
    sets: list[NftSet] = []
    chains: dict[str, dict[str, Any]] = {}
    rules: dict[str, list[str]] = {}
    for item in items:
        kind, body = next(iter(item.items()))
        if kind == "metainfo" or body.get("family") != family:
            continue
        if kind == "table":
            found = found or body.get("name") == table
            continue
        if body.get("table") != table:
            continue
        if kind == "set":
            set_type = str(body.get("type"))
            elements = _elements(body.get("elem", []), Family.V6 if set_type == "ipv6_addr" else Family.V4)
            flags = body.get("flags", ())
            sets.append(NftSet(body["name"], set_type, tuple([flags] if isinstance(flags, str) else flags), elements))
        elif kind == "chain":
            chains[body["name"]] = body
            rules.setdefault(body["name"], [])
        elif kind == "rule":
            rules.setdefault(body["chain"], []).append(rule_from_json(body))
        else:
            # maps, flowtables, counters...: not ours; record them so the table never compares equal
            rules.setdefault(f"<{kind}>", []).append(json.dumps(body, sort_keys=True))
    if not found:
        return None
    parsed_chains = [
        NftChain(name, str(b.get("type", "")), str(b.get("hook", "")), int(b.get("prio", 0)), str(b.get("policy", "")),
                 tuple(rules.get(name, ())))
        for name, b in chains.items()
    ]
    parsed_chains += [NftChain(name, "", "", 0, "", tuple(r)) for name, r in rules.items() if name not in chains]
    return NftTable(tuple(sorted(sets, key=lambda s: s.name)), tuple(sorted(parsed_chains, key=lambda c: c.name)))


# --- rule text <-> JSON expressions ------------------------------------------------------------------------------


class _Unrecognised(Exception):
    pass


def _value(right: Any) -> str:
    if isinstance(right, dict) and "set" in right:
        return "{ " + ", ".join(_value(v) for v in right["set"]) + " }"
    if isinstance(right, str | int) and not isinstance(right, bool):
        return str(right)
    raise _Unrecognised


def _left(left: Any) -> str:
    if not isinstance(left, dict) or len(left) != 1:
        raise _Unrecognised
    kind, body = next(iter(left.items()))
    if kind == "fib":
        flags = body.get("flags", [])
        return f"fib {' . '.join([flags] if isinstance(flags, str) else flags)} {body['result']}"
    if kind == "payload" and "protocol" in body:
        return f"{body['protocol']} {body['field']}"
    if kind == "meta":
        return f"meta {body['key']}"
    if kind == "numgen":
        offset = f" offset {body['offset']}" if body.get("offset") else ""
        return f"numgen {body['mode']} mod {body['mod']}{offset}"
    raise _Unrecognised


def _statement(stmt: Any) -> str:
    kind, body = next(iter(stmt.items()))
    if kind == "match":
        op = body.get("op", "==")
        if op not in ("==", "!="):
            raise _Unrecognised
        return f"{_left(body['left'])} {'!= ' if op == '!=' else ''}{_value(body['right'])}"
    if kind in ("return", "accept", "drop") and body is None:
        return str(kind)
    if kind == "masquerade":
        if body is None:
            return "masquerade"
        text = "masquerade"
        port = body.get("port")
        if isinstance(port, dict) and "range" in port:
            text += f" to :{port['range'][0]}-{port['range'][1]}"
        elif isinstance(port, int):
            text += f" to :{port}"
        elif port is not None:
            raise _Unrecognised
        flags = body.get("flags", [])
        for flag in [flags] if isinstance(flags, str) else flags:
            text += f" {flag}"
        if set(body) - {"port", "flags"}:
            raise _Unrecognised
        return text
    raise _Unrecognised


def rule_from_json(rule: dict[str, Any]) -> str:
    """A rule object of `nft -j list` as the canonical text; an unknown shape as "unrecognised: <json>"."""
    try:
        text = " ".join(_statement(s) for s in rule.get("expr", ()))
    except (_Unrecognised, KeyError, TypeError, AttributeError, StopIteration):
        return "unrecognised: " + json.dumps(rule.get("expr"), sort_keys=True)
    if "comment" in rule:
        text += f' comment "{rule["comment"]}"'
    return text


_TOKEN = re.compile(r'"[^"]*"|\{[^}]*\}|\S+')


def _json_value(token: str) -> Any:
    if token.startswith("{"):
        return {"set": [_json_value(t.strip()) for t in token[1:-1].split(",") if t.strip()]}
    return int(token) if token.isdigit() else token


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
        elif t in ("ip", "ip6"):
            field, value = need(3)[1:]
            match_left = {"payload": {"protocol": t, "field": field}}
            i += 3
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
        elif t == "masquerade":
            i += 1
            body: dict[str, Any] = {}
            if i < len(tokens) and tokens[i] == "to":
                port = need(2)[1].lstrip(":")
                low, _, high = port.partition("-")
                body["port"] = {"range": [int(low), int(high)]} if high else int(low)
                i += 2
            masq_flags: list[str] = []
            while i < len(tokens) and tokens[i] in ("fully-random", "random", "persistent"):
                masq_flags.append(tokens[i])
                i += 1
            if masq_flags:
                body["flags"] = masq_flags[0] if len(masq_flags) == 1 else masq_flags
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



# --- the other direction, for the stateful fake: script text -> table -> `nft -j list` JSON ------------------------


@dataclass(frozen=True, slots=True)
class ScriptCommand:
    """One top-level command of an `nft -f` script in our dialect."""

    verb: str  # "add" (table NAME without a body), "delete", or "define" (table NAME { ... })
    family: str
    table: str
    definition: NftTable | None = None


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
    element_text: str | None = None
    for index, line in enumerate(body):
        if line.startswith("type "):
            set_type = line[5:].strip()
        elif line.startswith("flags "):
            flags = tuple(f.strip() for f in line[6:].split(","))
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
    return NftSet(name, set_type, flags, tuple(elements))


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
