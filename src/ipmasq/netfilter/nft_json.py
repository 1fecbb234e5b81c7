"""Reading nftables' JSON back: `parse_list_json` turns `nft -j list` into the NftTable of ipmasq.netfilter.nft,
`rule_from_json` a rule's JSON expressions into the text form `nft list` prints (our canonical form), and
`rule_counter` a config rule's packet and byte counts. Only our own dialect is read: anything else becomes an
"unrecognised" rule that never equals a desired one, so the agent repairs it and `check` shows it; input that is not
a listing at all is one NftParseError line."""

from __future__ import annotations

import json
import socket
from typing import Any

from ipmasq.errors import NftParseError, clip
from ipmasq.netfilter.iptables import RULE_COMMENT_PREFIX
from ipmasq.netfilter.nft import TABLE, TABLE_FAMILY, NftChain, NftSet, NftTable
from ipmasq.prefix import Family

__all__ = ["NFT_NAME_MAXLEN", "parse_address_element", "parse_list_json", "rule_counter", "rule_from_json"]


# --- parsing `nft -j list table` ----------------------------------------------------------------------------------


def _address(text: str) -> tuple[Family, int]:
    try:
        return Family.V4, int.from_bytes(socket.inet_pton(socket.AF_INET, text), "big")
    except OSError:
        pass
    try:
        return Family.V6, int.from_bytes(socket.inet_pton(socket.AF_INET6, text), "big")
    except OSError:
        raise NftParseError(f"not an address in a set: {clip(repr(text))}") from None


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
            length = element["prefix"]["len"]
            if type(length) is not int or not 0 <= length <= family.bits:
                raise NftParseError(f"prefix length {_shown(length)} is not one of {family.name}")
            return network, network | ((1 << (family.bits - length)) - 1)
        if "range" in element:
            a, b = element["range"]
            return _address(a)[1], _address(b)[1]
    raise NftParseError(f"not an address element: {_shown(element)}")


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
                length = prefix["len"]
                if type(length) is not int or not 0 <= length <= bits:  # a huge shift would eat memory
                    raise ValueError(length)
                append((n, n | ((1 << (bits - length)) - 1)))
            else:
                append(parse_address_element(e))
    except (OSError, KeyError, TypeError, ValueError, AttributeError, IndexError, RecursionError, NftParseError):
        bad = _shown(raw[len(out)] if isinstance(raw, list) and len(out) < len(raw) else raw)
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
    except (ValueError, KeyError, TypeError, RecursionError) as exc:
        raise NftParseError(f"nft -j output is not an nftables JSON listing: {clip(str(exc))}") from None
    if not isinstance(items, list):
        raise NftParseError(f'"nftables" holds {_shown(items)}, not a list of objects')
    try:
        return _table_from_items(items, table=table, family=family, table_listed=table_listed)
    except (KeyError, TypeError, ValueError, AttributeError, StopIteration) as exc:
        raise NftParseError(f"nft -j output has an object of an unexpected shape ({type(exc).__name__}: "
                            f"{clip(str(exc))})") from None


def _table_from_items(items: list[Any], *, table: str, family: str, table_listed: bool) -> NftTable | None:
    """The listing's objects that belong to our table; any malformed object raises (KeyError, TypeError, ...)."""
    found = not table_listed
    sets: list[NftSet] = []
    chains: dict[str, dict[str, Any]] = {}
    rules: dict[str, list[str]] = {}
    counters: list[tuple[str, int, int]] = []
    for number, item in enumerate(items, start=1):
        if not isinstance(item, dict) or len(item) != 1 or not isinstance(next(iter(item.values())), dict):
            raise NftParseError(f"object {number} of the listing is not {{KIND: {{...}}}}: "
                                f"{_shown(item)}")
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
            flags = body.get("flags", [])
            flags = [flags] if isinstance(flags, str) else flags
            if not isinstance(flags, list) or not all(isinstance(f, str) for f in flags):
                raise NftParseError(f"set flags are not a list of words: {_shown(flags)}")
            comment = body.get("comment", "")
            if not isinstance(comment, str):
                raise NftParseError(f"a set's comment is not text: {_shown(comment)}")
            sets.append(NftSet(_name(body, "name"), set_type, tuple(flags), elements, comment))
        elif kind == "chain":
            chains[_name(body, "name")] = body
            rules.setdefault(body["name"], [])
        elif kind == "rule":
            rules.setdefault(_name(body, "chain"), []).append(rule_from_json(body))
            counted = rule_counter(body)
            if counted is not None:
                counters.append(counted)
        else:
            # maps, flowtables, counters...: not ours; record them so the table never compares equal
            rules.setdefault(f"<{kind}>", []).append(json.dumps(body, sort_keys=True))
    if not found:
        return None
    parsed_chains = [
        NftChain(name, str(b.get("type", "")), str(b.get("hook", "")), _priority_of(b), str(b.get("policy", "")),
                 tuple(rules.get(name, ())))
        for name, b in chains.items()
    ]
    parsed_chains += [NftChain(name, "", "", 0, "", tuple(r)) for name, r in rules.items() if name not in chains]
    return NftTable(tuple(sorted(sets, key=lambda s: s.name)), tuple(sorted(parsed_chains, key=lambda c: c.name)),
                    tuple(counters))


def _shown(value: Any) -> str:
    """A JSON value for an error line: cut short, and never an error of its own (deep nesting)."""
    try:
        return clip(json.dumps(value))
    except (ValueError, TypeError, RecursionError):
        return "(a value too deeply nested to show)"


NFT_NAME_MAXLEN = 256  # the kernel's NFT_NAME_MAXLEN, its NUL included: nft never lists a longer name


def _name(body: dict[str, Any], key: str) -> str:
    value = body.get(key)
    if not isinstance(value, str):
        raise NftParseError(f"an object without a {key} string: {_shown(body)}")
    if len(value) >= NFT_NAME_MAXLEN:
        raise NftParseError(f"a {key} of {len(value):,} characters (nft allows {NFT_NAME_MAXLEN - 1}): "
                            f"{clip(json.dumps(value[:200]))}")
    return value


def _priority_of(chain: dict[str, Any]) -> int:
    value = chain.get("prio", 0)
    if type(value) is not int:
        raise NftParseError(f"chain {_shown(chain.get('name'))} has priority {_shown(value)}, not a number")
    return value


# --- rule text <-> JSON expressions ------------------------------------------------------------------------------


class _Unrecognised(Exception):  # control flow inside this module (not in errors.py): never leaves rule_from_json
    """A JSON expression with no text form here: rule_from_json shows the rule as "unrecognised: <json>"."""


def _value(right: Any) -> str:
    if isinstance(right, dict) and "set" in right:
        return "{ " + ", ".join(_value(v) for v in right["set"]) + " }"
    if isinstance(right, dict) and set(right) == {"prefix"}:  # an address prefix (config rules)
        prefix = right["prefix"]
        return f"{_value(prefix['addr'])}/{_value(prefix['len'])}"
    if isinstance(right, dict) and set(right) == {"range"} and len(right["range"]) == 2:  # addresses or ports
        return f"{_value(right['range'][0])}-{_value(right['range'][1])}"
    if isinstance(right, str | int) and not isinstance(right, bool):
        return str(right)
    if isinstance(right, list) and right and all(isinstance(v, str) for v in right):  # flags: ct state a,b
        return ",".join(right)
    if isinstance(right, dict) and set(right) == {"concat"}:
        return " . ".join(_value(v) for v in right["concat"])
    raise _Unrecognised


_BINARY = ("&", "|", "^")


def _is_mark(expression: Any) -> bool:
    """`meta mark`, or an expression of it (`meta mark & 0x4000`): nft prints its numbers as 0x%08x."""
    if expression == {"meta": {"key": "mark"}}:
        return True
    if not isinstance(expression, dict) or len(expression) != 1:
        return False
    op, operands = next(iter(expression.items()))
    return op in _BINARY and isinstance(operands, list) and len(operands) == 2 and _is_mark(operands[0])


def _mark_value(value: Any) -> str:
    if type(value) is int:
        return f"0x{value:08x}"
    return _value(value)


def _left(left: Any) -> str:
    if not isinstance(left, dict) or len(left) != 1:
        raise _Unrecognised
    kind, body = next(iter(left.items()))
    if kind in _BINARY and isinstance(body, list) and len(body) == 2:
        operand = _mark_value(body[1]) if _is_mark(body[0]) else _value(body[1])
        return f"{_left(body[0])} {kind} {operand}"
    if kind == "concat" and isinstance(body, list):
        return " . ".join(_left(part) for part in body)
    if kind == "ct" and isinstance(body, dict) and set(body) == {"key"}:
        return f"ct {body['key']}"
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
        if op not in ("==", "!=", "in"):  # in: flags (ct status dnat), printed without an operator
            raise _Unrecognised
        right = _mark_value(body["right"]) if _is_mark(body["left"]) else _value(body["right"])
        return f"{_left(body['left'])} {'!= ' if op == '!=' else ''}{right}"
    if kind == "mangle" and isinstance(body, dict) and set(body) == {"key", "value"}:
        value = body["value"]
        return f"{_left(body['key'])} set {_left(value) if isinstance(value, dict) else _mark_value(value)}" \
            if _is_mark(body["key"]) else f"{_left(body['key'])} set {_value(value)}"
    if kind in ("return", "accept", "drop") and body is None:
        return str(kind)
    if kind in ("jump", "goto") and isinstance(body, dict) and set(body) == {"target"}:
        return f"{kind} {body['target']}"
    if kind == "counter" and isinstance(body, dict) and set(body) <= {"packets", "bytes"}:
        return "counter"  # the values are traffic, not the rule: read by rule_counter
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
    if kind == "snat" and isinstance(body, dict) and set(body) <= {"family", "addr", "flags"}:
        text = f"snat {body['family']} to {_value(body['addr'])}"
        flags = body.get("flags", [])
        for flag in [flags] if isinstance(flags, str) else flags:
            text += f" {flag}"
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


def rule_counter(rule: dict[str, Any]) -> tuple[str, int, int] | None:
    """(config rule name, packets, bytes) of a listed rule of a config rule (its comment names it) that holds a
    counter statement; None for any other rule. Values that are not counts are refused, not guessed."""
    comment = rule.get("comment")
    if not isinstance(comment, str) or not comment.startswith(RULE_COMMENT_PREFIX):
        return None
    for stmt in rule.get("expr", ()):
        body = stmt.get("counter") if isinstance(stmt, dict) else None
        if isinstance(body, dict):
            packets, octets = body.get("packets", 0), body.get("bytes", 0)
            if type(packets) is not int or type(octets) is not int or packets < 0 or octets < 0:
                raise NftParseError(f"a counter that is not two counts: {_shown(body)}")
            return comment[len(RULE_COMMENT_PREFIX):], packets, octets
    return None
