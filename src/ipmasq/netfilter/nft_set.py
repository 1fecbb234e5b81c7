"""Reading one interval set from `nft -j list set FAMILY TABLE NAME`, without holding nft's JSON tree.

`parse_list_json` (ipmasq.netfilter.nft_json) builds the whole document first: for a set of 100,000 prefixes that is
two dicts and a string per element alive at once next to the policy, the agent's peak (docs/measurements.md). Here each
element becomes its (first, last) range as soon as the JSON decoder has built it (an object_hook), so only the
ranges stay alive. The set it returns is equal to the one parse_list_json(text, table_listed=False).set_named(name)
returns for the same listing (same ranges, same order, same type and flags), and what it refuses it refuses with
NftParseError.
"""

from __future__ import annotations

import json
from typing import Any

from ipmasq.errors import NftParseError, clip
from ipmasq.netfilter.nft import TABLE, TABLE_FAMILY, NftSet
from ipmasq.netfilter.nft_json import parse_address_element

__all__ = ["parse_set_json"]


class _Range(tuple[int, int]):
    """An element already read (a tuple subclass, so nothing in nft's JSON can be mistaken for one)."""

    __slots__ = ()


def _compact(obj: dict[str, Any]) -> Any:
    """object_hook: an element object ({"prefix": ...}, {"range": ...}, {"elem": ...}) becomes its range at once."""
    if len(obj) != 1:
        return obj
    key = next(iter(obj))
    if key == "prefix" and isinstance(obj[key], dict):
        return _Range(parse_address_element(obj))
    if key == "range" and isinstance(obj[key], list):
        return _Range(parse_address_element(obj))
    if key == "elem" and isinstance(obj[key], dict) and "val" in obj[key]:
        value = obj[key]["val"]
        return value if isinstance(value, _Range) else _Range(parse_address_element(obj))
    return obj


def parse_set_json(text: str, name: str, *, table: str = TABLE, family: str = TABLE_FAMILY) -> NftSet | None:
    """The set `name` of our table from a `nft -j list set` listing; None when the listing does not hold it."""
    try:
        document = json.loads(text, object_hook=_compact)
        items = document["nftables"]
    except NftParseError as exc:
        raise NftParseError(f"a set holds an element we cannot read: {exc}") from None
    except (ValueError, KeyError, TypeError, RecursionError) as exc:
        raise NftParseError(f"nft -j output is not an nftables JSON listing: {clip(str(exc))}") from None
    if not isinstance(items, list):
        raise NftParseError('"nftables" does not hold a list of objects')
    for item in items:
        if not isinstance(item, dict) or len(item) != 1 or not isinstance(next(iter(item.values())), dict):
            raise NftParseError(f"an object of the listing is not {{KIND: {{...}}}}: {clip(repr(item))}")
        kind, body = next(iter(item.items()))
        if kind != "set" or body.get("family") != family or body.get("table") != table or body.get("name") != name:
            continue
        return _set(body, name)
    return None


def _set(body: dict[str, Any], name: str) -> NftSet:
    raw = body.get("elem", [])
    if not isinstance(raw, list):
        raise NftParseError(f"set {name}: elements are not a list: {clip(repr(raw))}")
    ranges: list[tuple[int, int]] = []
    for element in raw:
        if isinstance(element, _Range):
            ranges.append((element[0], element[1]))
        else:  # a single address (a string), or a shape the hook left alone: read (or refused) as nft.py does
            try:
                ranges.append(parse_address_element(element))
            except (KeyError, TypeError, ValueError, AttributeError) as exc:
                raise NftParseError(f"set {name} holds an element we cannot read: {clip(repr(element))}") from exc
    if any(ranges[i][0] <= ranges[i - 1][1] for i in range(1, len(ranges))):
        ranges.sort()  # nft lists interval sets in order; sort only when it did not
    flags = body.get("flags", [])
    flags = [flags] if isinstance(flags, str) else flags
    if not isinstance(flags, list) or not all(isinstance(f, str) for f in flags):
        raise NftParseError(f"set flags are not a list of words: {clip(repr(flags))}")
    return NftSet(name, str(body.get("type")), tuple(flags), tuple(ranges))
