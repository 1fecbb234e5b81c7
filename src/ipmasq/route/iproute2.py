"""A node's routing from iproute2's JSON: `ip -j rule` (each family), `ip -j route show table all`, `ip -j addr`.

A routing dump is those commands' outputs one after the other, as this one line writes it on a node:

    { ip -j -4 rule; ip -j -6 rule; ip -j route show table all; ip -j addr; } > routing.json

Each output is one JSON array; an array is told by what its objects hold (a rule its priority, a route its dst, a
link its ifname). `ip rule` prints no family, so the first rules array is IPv4's and the second IPv6's, unless a
rule's addresses say otherwise. Input is hostile: whatever the bytes, the answer is a Routing or one RouteDumpError
line (the size is bounded by whoever read the bytes; nesting, types and values are checked here).
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Iterable
from dataclasses import replace
from typing import Any

from ipmasq.config.source import paused_gc
from ipmasq.errors import RouteDumpError, clip
from ipmasq.prefix import Family, Prefix, format_address, parse_address
from ipmasq.route.facts import SCOPES, Address, IpRule, Link, NextHop, Route, Routing, table_name

__all__ = ["PROTOCOLS", "parse_addresses", "parse_routes", "parse_routing", "parse_rules"]

PROTOCOLS = {"tcp": 6, "udp": 17, "icmp": 1, "sctp": 132, "ipv6-icmp": 58, "icmpv6": 58, "udplite": 136,
             "dccp": 33, "gre": 47, "esp": 50, "ah": 51}

# what a rule's JSON may hold that the lookup reads; "src"/"srclen"/"dst"/"dstlen" and the action words aside
_RULE_KNOWN = frozenset({
    "priority", "src", "srclen", "dst", "dstlen", "not", "table", "goto", "unresolved", "action", "nop",
    "fwmark", "fwmask", "iif", "iif_detached", "oif", "oif_detached", "ipproto", "sport", "sport_start",
    "sport_end", "dport", "dport_start", "dport_end", "uid_start", "uid_end", "tos", "dsfield",
    "suppress_prefixlen", "suppress_ifgroup", "l3mdev", "protocol", "flags"})
_RULE_ACTIONS = frozenset({"blackhole", "unreachable", "prohibit", "nop"})
_ROUTE_KNOWN = frozenset({
    "type", "dst", "gateway", "via", "dev", "table", "protocol", "scope", "prefsrc", "metric", "flags",
    "nexthops", "pref", "expires", "cache", "mtu", "advmss", "rtt", "rttvar", "hoplimit", "initcwnd",
    "initrwnd", "quickack", "congctl", "features", "metrics", "nhid", "tos", "from", "src", "weight",
    "fastopen_no_cookie", "error", "users", "age", "ttl-propagate"})
_ROUTE_KINDS = frozenset({"unicast", "local", "broadcast", "anycast", "multicast", "blackhole", "unreachable",
                          "prohibit", "throw", "nat"})
_ROUTE_HARMLESS = frozenset({"protocol", "pref", "expires", "cache", "mtu", "advmss", "rtt", "rttvar",
                             "hoplimit", "initcwnd", "initrwnd", "quickack", "congctl", "features", "metrics",
                             "fastopen_no_cookie", "error", "users", "age", "ttl-propagate", "nhid"})
_ADDRESS_FLAGS = ("secondary", "temporary", "tentative", "deprecated", "optimistic", "dadfailed", "nodad",
                  "home", "noprefixroute", "mngtmpaddr", "stable-privacy", "autojoin")


def parse_routing(text: str, shown: str) -> Routing:
    """A routing dump (see the module docstring) as a Routing; RouteDumpError naming `shown` otherwise."""
    # 100,000 routes become values and no cycle: the collector's passes over the growing heap would cost as much
    # as the parse itself (docs/measurements.md)
    with paused_gc():
        return _parse_routing(text, shown)


def _parse_routing(text: str, shown: str) -> Routing:
    arrays = _arrays(text, shown)
    rules: list[IpRule] = []
    routes: list[Route] = []
    links: list[Link] = []
    read: set[str] = set()
    rule_arrays = 0
    for number, array in enumerate(arrays, start=1):
        kind = _kind(array, number, shown)
        try:
            if kind == "rules":
                family = _rules_family(array, Family.V4 if rule_arrays == 0 else Family.V6)
                rule_arrays += 1
                rules += parse_rules(array, family, shown)
                read.add("rules")
            elif kind == "routes":
                routes += parse_routes(array, shown)
                read.add("routes")
            elif kind == "links":
                links += parse_addresses(array, shown)
                read.add("links")
        except (TypeError, ValueError, KeyError, AttributeError) as exc:
            # a shape no iproute2 prints that the checks above did not name: still one line
            raise RouteDumpError(f"{shown}: array {number} has an unexpected shape ({type(exc).__name__}: "
                                 f"{clip(str(exc))})") from None
    return Routing(tuple(rules), tuple(routes), tuple(links), frozenset(read))


def _arrays(text: str, shown: str) -> list[list[Any]]:
    decoder = json.JSONDecoder()
    arrays: list[list[Any]] = []
    at = 0
    end = len(text)
    while True:
        while at < end and text[at] in " \t\r\n":
            at += 1
        if at >= end:
            break
        try:
            value, at = decoder.raw_decode(text, at)
        except ValueError as exc:
            raise RouteDumpError(f"{shown}: not iproute2's JSON ({clip(str(exc))})") from None
        except RecursionError:
            raise RouteDumpError(f"{shown}: JSON nested too deep: not iproute2's output") from None
        if not isinstance(value, list):
            raise RouteDumpError(f"{shown}: a JSON {type(value).__name__} where iproute2 prints an array (expected "
                                 "the output of ip -j rule, ip -j route show table all, ip -j addr)")
        arrays.append(value)
    if not arrays:
        raise RouteDumpError(f"{shown}: empty: expected the output of ip -j rule, ip -j route show table all and "
                             "ip -j addr")
    return arrays


def _kind(array: list[Any], number: int, shown: str) -> str:
    """Which command printed the array (an empty array: none to tell, nothing to read)."""
    if not array:
        return "empty"
    first = array[0]
    if isinstance(first, dict):
        if "ifname" in first:
            return "links"
        if "priority" in first:  # a route's priority is printed as "metric": only rules have one
            return "rules"
        if "dst" in first:
            return "routes"
    raise RouteDumpError(f"{shown}: array {number} is none of ip -j rule, ip -j route, ip -j addr "
                         f"(its first element: {clip(json.dumps(first))})")


def _rules_family(array: list[Any], default: Family) -> Family:
    """The family the rules' addresses name; `default` when they name none (every rule `from all`)."""
    for item in array:
        if isinstance(item, dict):
            for key in ("src", "dst"):
                value = item.get(key)
                if isinstance(value, str) and value != "all":
                    return Family.V6 if ":" in value else Family.V4
    return default


def _bad(shown: str, what: str, item: Any) -> RouteDumpError:
    return RouteDumpError(f"{shown}: {what}: {clip(json.dumps(item))}")


def _int(value: Any, shown: str, what: str, item: Any, *, low: int = 0, high: int = 0xFFFFFFFF) -> int:
    if isinstance(value, bool):
        raise _bad(shown, f"{what} is not a number", item)
    if isinstance(value, str):
        try:
            value = int(value, 0)
        except ValueError:
            raise _bad(shown, f"{what} is not a number", item) from None
    if not isinstance(value, int) or not low <= value <= high:
        raise _bad(shown, f"{what} is out of range", item)
    return value


def _str(value: Any, shown: str, what: str, item: Any) -> str:
    if not isinstance(value, str) or len(value) > 256:
        raise _bad(shown, f"{what} is not a name", item)
    return value


def _table(value: Any, shown: str, item: Any) -> str:
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    return _str(value, shown, "table", item)


def _address(value: Any, family: Family | None, shown: str, what: str, item: Any) -> tuple[Family, int]:
    if not isinstance(value, str) or len(value) > 64:
        raise _bad(shown, f"{what} is not an address", item)
    try:
        found, number = _exact_address(value)
    except ValueError:
        raise _bad(shown, f"{what} is not an address", item) from None
    if family is not None and found is not family:
        raise _bad(shown, f"{what} is not an IPv{family.value} address", item)
    return found, number


def _exact_address(text: str) -> tuple[Family, int]:
    """An address as iproute2 prints it (an IPv4-mapped IPv6 address stays IPv6: a route's family is its own)."""
    if ":" in text:
        return Family.V6, int(ipaddress.IPv6Address(text))
    return parse_address(text)


def _prefix(address: Any, length: Any, family: Family, shown: str, what: str, item: Any) -> Prefix:
    _, number = _address(address, family, shown, what, item)
    bits = _int(length, shown, f"{what}'s length", item, high=family.bits)
    mask = ((1 << bits) - 1) << (family.bits - bits)
    return Prefix(family, number & mask, bits)


def _range(item: dict[str, Any], name: str, shown: str) -> tuple[int, int] | None:
    if name in item:
        port = _int(item[name], shown, name, item, high=65535)
        return port, port
    if f"{name}_start" in item:
        return (_int(item[f"{name}_start"], shown, name, item, high=65535),
                _int(item.get(f"{name}_end", item[f"{name}_start"]), shown, name, item, high=65535))
    return None


def parse_rules(array: Iterable[Any], family: Family, shown: str) -> list[IpRule]:
    """`ip -j -4 rule` or `ip -j -6 rule` as IpRules of `family`."""
    out = []
    for item in array:
        if not isinstance(item, dict) or "priority" not in item:
            raise _bad(shown, "not a rule of ip -j rule", item)
        priority = _int(item["priority"], shown, "priority", item)
        source = destination = None
        if isinstance(item.get("src"), str) and item["src"] != "all":
            source = _prefix(item["src"], item.get("srclen", family.bits), family, shown, "src", item)
        if "dst" in item and item["dst"] != "all":
            destination = _prefix(item["dst"], item.get("dstlen", family.bits), family, shown, "dst", item)
        action, table, goto = "lookup", None, None
        if "goto" in item:
            action, goto = "goto", _int(item["goto"], shown, "goto", item)
        elif "table" in item:
            table = table_name(_table(item["table"], shown, item))
        elif "nop" in item:
            action = "nop"
        elif isinstance(item.get("action"), str) and item["action"] in _RULE_ACTIONS:
            action = item["action"]
        else:
            raise _bad(shown, "a rule with no action (lookup, goto, nop, blackhole, unreachable, prohibit)", item)
        fwmark = None
        fwmask = 0xFFFFFFFF
        if "fwmark" in item:
            fwmark = _int(item["fwmark"], shown, "fwmark", item)
            fwmask = _int(item.get("fwmask", 0xFFFFFFFF), shown, "fwmask", item)
        ipproto = None
        if "ipproto" in item:
            value = item["ipproto"]
            if isinstance(value, str) and value in PROTOCOLS:
                ipproto = PROTOCOLS[value]
            else:
                text = value[len("ipproto-"):] if isinstance(value, str) and value.startswith("ipproto-") else value
                ipproto = _int(text, shown, "ipproto", item, high=255)
        uid = None
        if "uid_start" in item:
            uid = (_int(item["uid_start"], shown, "uid", item), _int(item.get("uid_end"), shown, "uid", item))
        tos = item.get("tos", item.get("dsfield"))
        unknown = tuple(sorted(k for k in item if k not in _RULE_KNOWN))
        rule = IpRule(
            family, priority, action, table, goto, "not" in item, source, destination, fwmark, fwmask,
            None if "iif" not in item else _str(item["iif"], shown, "iif", item), "iif_detached" in item,
            None if "oif" not in item else _str(item["oif"], shown, "oif", item), "oif_detached" in item,
            ipproto, _range(item, "sport", shown), _range(item, "dport", shown), uid,
            None if tos is None else _int(tos, shown, "tos", item, high=255),
            None if "suppress_prefixlen" not in item else _int(item["suppress_prefixlen"], shown,
                                                               "suppress_prefixlen", item, high=128),
            None if "suppress_ifgroup" not in item else str(item["suppress_ifgroup"]),
            "l3mdev" in item, unknown)
        out.append(_with_rule_text(rule))
    return out


def _with_rule_text(rule: IpRule) -> IpRule:
    parts = [f"{rule.priority}:"]
    if rule.invert:
        parts.append("not")
    parts.append(f"from {'all' if rule.source is None else _shown(rule.source)}")
    if rule.destination is not None:
        parts.append(f"to {_shown(rule.destination)}")
    if rule.tos is not None:
        parts.append(f"tos {rule.tos:#x}")
    if rule.fwmark is not None:
        parts.append(f"fwmark {rule.fwmark:#x}" + ("" if rule.fwmask == 0xFFFFFFFF else f"/{rule.fwmask:#x}"))
    if rule.iif is not None:
        parts.append(f"iif {rule.iif}" + (" [detached]" if rule.iif_detached else ""))
    if rule.oif is not None:
        parts.append(f"oif {rule.oif}" + (" [detached]" if rule.oif_detached else ""))
    if rule.l3mdev:
        parts.append("lookup [l3mdev-table]")
    if rule.uid_range is not None:
        parts.append(f"uidrange {rule.uid_range[0]}-{rule.uid_range[1]}")
    if rule.ipproto is not None:
        names = {v: k for k, v in PROTOCOLS.items() if k not in ("icmpv6",)}
        parts.append(f"ipproto {names.get(rule.ipproto, rule.ipproto)}")
    for name, ports in (("sport", rule.sport), ("dport", rule.dport)):
        if ports is not None:
            parts.append(f"{name} {ports[0]}" + ("" if ports[0] == ports[1] else f"-{ports[1]}"))
    if rule.action == "lookup" and not rule.l3mdev:
        parts.append(f"lookup {rule.table}")
    elif rule.action == "goto":
        parts.append(f"goto {rule.goto}")
    elif rule.action != "lookup":
        parts.append(rule.action)
    if rule.suppress_prefixlength is not None:
        parts.append(f"suppress_prefixlength {rule.suppress_prefixlength}")
    if rule.suppress_ifgroup is not None:
        parts.append(f"suppress_ifgroup {rule.suppress_ifgroup}")
    return replace(rule, text=" ".join(parts))


def _shown(prefix: Prefix) -> str:
    return format_address(prefix.family, prefix.network) if prefix.length == prefix.family.bits else str(prefix)


_NO_FLAGS: frozenset[str] = frozenset()


def _nexthop(item: dict[str, Any], family: Family, shown: str) -> NextHop:
    gateway = None
    gateway_family = None
    if "gateway" in item:
        gateway_family, gateway = _address(item["gateway"], None, shown, "gateway", item)
    elif isinstance(item.get("via"), dict):
        gateway_family, gateway = _address(item["via"].get("host"), None, shown, "via", item)
    flags = item.get("flags")
    if flags:
        if not isinstance(flags, list):
            raise _bad(shown, "flags is not a list", item)
        flag_set = frozenset(str(f) for f in flags if isinstance(f, str))
    else:
        flag_set = _NO_FLAGS  # the common case, shared
    weight = 1 if "weight" not in item else _int(item["weight"], shown, "weight", item, low=1, high=256)
    return NextHop(gateway, None if "dev" not in item else _str(item["dev"], shown, "dev", item), weight, flag_set,
                   None if gateway_family is family else gateway_family)


def parse_routes(array: Iterable[Any], shown: str) -> list[Route]:
    """`ip -j route show table all` (both families, every table) as Routes."""
    out = []
    for item in array:
        if not isinstance(item, dict) or "dst" not in item:
            raise _bad(shown, "not a route of ip -j route", item)
        kind = item.get("type", "unicast")
        if not isinstance(kind, str) or kind not in _ROUTE_KINDS:
            raise _bad(shown, "a route of an unknown type", item)
        dst = _str(item["dst"], shown, "dst", item)
        if dst == "default":
            family = _route_family(item)
            destination = Prefix(family, 0, 0)
        else:
            address, _, length = dst.partition("/")
            family = _address(address, None, shown, "dst", item)[0]
            destination = _prefix(address, length or family.bits, family, shown, "dst", item)
        nexthops: tuple[NextHop, ...]
        if "nexthops" in item:
            hops = item["nexthops"]
            if not isinstance(hops, list) or not hops or not all(isinstance(h, dict) for h in hops):
                raise _bad(shown, "nexthops is not a list of next hops", item)
            nexthops = tuple(_nexthop(h, family, shown) for h in hops)
        elif "gateway" in item or "dev" in item or "via" in item:
            nexthops = (_nexthop(item, family, shown),)
        else:
            nexthops = ()
        scope = item.get("scope", "global")
        scope_number = SCOPES.get(scope) if isinstance(scope, str) else None
        if scope_number is None:
            scope_number = _int(scope, shown, "scope", item, high=255)
        source_prefix = None
        from_text = item.get("src") if family is Family.V6 else None
        if isinstance(from_text, str):
            address, _, length = from_text.partition("/")
            source_prefix = _prefix(address, length or 128, Family.V6, shown, "from", item)
        unknown = tuple(sorted(k for k in item if k not in _ROUTE_KNOWN)) if len(item) > 6 else \
            tuple(k for k in item if k not in _ROUTE_KNOWN)
        table = table_name(_table(item.get("table", "main"), shown, item))
        out.append(Route(
            family, table, destination, kind, _int(item.get("metric", 0), shown, "metric", item),
            scope_number, nexthops,
            None if "prefsrc" not in item else _address(item["prefsrc"], family, shown, "prefsrc", item)[1],
            None if "tos" not in item else _int(item["tos"], shown, "tos", item, high=255),
            source_prefix, unknown, _route_text(item, kind, table)))
    return out


def _route_family(item: dict[str, Any]) -> Family:
    """A default route's family, from its gateway or preferred source; an IPv6 route says `pref` (its router
    preference) where an IPv4 one never does."""
    for key in ("gateway", "prefsrc"):
        value = item.get(key)
        if isinstance(value, str):
            return Family.V6 if ":" in value else Family.V4
    hops = item.get("nexthops")
    if isinstance(hops, list) and hops and isinstance(hops[0], dict) and isinstance(hops[0].get("gateway"), str):
        return Family.V6 if ":" in hops[0]["gateway"] else Family.V4
    return Family.V6 if "pref" in item else Family.V4


def _hop_text(item: dict[str, Any]) -> str:
    """A next hop as `ip route` prints it, from the JSON's own strings (formatting 100,000 addresses anew costs
    more than reading them)."""
    parts = []
    if isinstance(item.get("gateway"), str):
        parts.append(f"via {item['gateway']}")
    elif isinstance(item.get("via"), dict):
        parts.append(f"via {item['via'].get('host')}")
    if isinstance(item.get("dev"), str):
        parts.append(f"dev {item['dev']}")
    return " ".join(parts)


def _route_text(item: dict[str, Any], kind: str, table: str) -> str:
    parts = [] if kind == "unicast" else [kind]
    parts.append(str(item["dst"]))
    if isinstance(item.get("src"), str):
        parts.append(f"from {item['src']}")
    hops = item.get("nexthops")
    if not isinstance(hops, list):
        parts.append(_hop_text(item))
    if table != "main":
        parts.append(f"table {table}")
    for key, word in (("protocol", "proto"), ("scope", "scope"), ("prefsrc", "src"), ("metric", "metric")):
        if key in item:
            parts.append(f"{word} {item[key]}")
    if isinstance(hops, list):
        parts += [f"nexthop {_hop_text(h)} weight {h.get('weight', 1)}" for h in hops if isinstance(h, dict)]
    return " ".join(p for p in parts if p)


def parse_addresses(array: Iterable[Any], shown: str) -> list[Link]:
    """`ip -j addr` as Links, their addresses in the kernel's order."""
    out = []
    for item in array:
        if not isinstance(item, dict) or "ifname" not in item:
            raise _bad(shown, "not a link of ip -j addr", item)
        infos = item.get("addr_info", [])
        if not isinstance(infos, list):
            raise _bad(shown, "addr_info is not a list", item)
        addresses = []
        for info in infos:
            if not isinstance(info, dict):
                raise _bad(shown, "an address of addr_info is not an object", info)
            kind = info.get("family")
            if kind not in ("inet", "inet6") or "local" not in info:
                continue  # an address of another family (mpls, ...) or a placeholder iproute2 prints
            family = Family.V4 if kind == "inet" else Family.V6
            _, local = _address(info["local"], family, shown, "local", info)
            peer = None
            if "address" in info and info["address"] != info["local"]:
                _, peer = _address(info["address"], family, shown, "address", info)
            scope = info.get("scope", "global")
            scope_number = SCOPES.get(scope) if isinstance(scope, str) else None
            if scope_number is None:
                scope_number = _int(scope, shown, "scope", info, high=255)
            flags = frozenset(f for f in _ADDRESS_FLAGS if info.get(f) is True or (f in info and info[f] is None))
            addresses.append(Address(family, local, _int(info.get("prefixlen", family.bits), shown, "prefixlen",
                                                         info, high=family.bits), scope_number, flags, peer))
        flags = item.get("flags", [])
        index = _int(item.get("ifindex", 0), shown, "ifindex", item)
        out.append(Link(index, _str(item["ifname"], shown, "ifname", item),
                        isinstance(flags, list) and "UP" in flags, tuple(addresses),
                        None if not isinstance(item.get("master"), str) else item["master"],
                        str(item.get("group", "default"))))
    return out
