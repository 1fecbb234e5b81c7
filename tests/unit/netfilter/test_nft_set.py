"""The element-by-element reader of `nft -j list set` equals the whole-document parser, and refuses what it refuses."""

from __future__ import annotations

import json
from typing import Any

import pytest

from ipmasq.errors import NftParseError
from ipmasq.netfilter.nft_json import parse_list_json
from ipmasq.netfilter.nft_set import parse_set_json

META = {"metainfo": {"version": "1.0.6", "release_name": "Lester Gooch #5", "json_schema_version": 1}}


def listing(name: str, elements: list[Any], *, set_type: str = "ipv4_addr", flags: Any = "interval") -> str:
    body: dict[str, Any] = {"family": "inet", "name": name, "table": "ip-masq-agent", "type": set_type,
                            "handle": 2, "flags": flags}
    if elements:
        body["elem"] = elements
    return json.dumps({"nftables": [META, {"set": body}]})


CASES = {
    "prefixes": listing("nomasq_v4", [{"prefix": {"addr": "10.0.0.0", "len": 8}},
                                      {"prefix": {"addr": "172.16.0.0", "len": 12}}]),
    "single address and range": listing("nomasq_v4", ["10.0.0.1", {"range": ["10.0.0.5", "10.0.0.9"]},
                                                      {"prefix": {"addr": "192.168.0.0", "len": 16}}]),
    "wrapped element": listing("nomasq_v4", [{"elem": {"val": {"prefix": {"addr": "10.0.0.0", "len": 8}},
                                                       "comment": "x"}},
                                             {"elem": {"val": "10.1.0.1", "timeout": 5}}]),
    "out of order": listing("nomasq_v4", [{"prefix": {"addr": "192.168.0.0", "len": 16}}, "10.0.0.1"]),
    "ipv6": listing("nomasq_v6", [{"prefix": {"addr": "fd00::", "len": 8}}, "2001:db8::1"], set_type="ipv6_addr"),
    "empty": listing("nomasq_v4", []),
    "flags list": listing("nomasq_v4", ["10.0.0.1"], flags=["interval", "timeout"]),
    "100,000 prefixes": listing("nomasq_v4", [{"prefix": {"addr": f"{20 + (2 * i >> 16)}.{(2 * i >> 8) & 255}."
                                                          f"{2 * i & 255}.0", "len": 24}} for i in range(100_000)]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_equal_to_the_document_parser(case: str) -> None:
    text = CASES[case]
    name = "nomasq_v6" if case == "ipv6" else "nomasq_v4"
    table = parse_list_json(text, table_listed=False)
    assert table is not None
    assert parse_set_json(text, name) == table.set_named(name)


def test_another_set_or_table_is_not_ours() -> None:
    assert parse_set_json(CASES["prefixes"], "nomasq_v6") is None
    other = CASES["prefixes"].replace('"table": "ip-masq-agent"', '"table": "kube-proxy"')
    assert parse_set_json(other, "nomasq_v4") is None


@pytest.mark.parametrize("bad", [
    "", "not json", "[]", '{"nftables": 3}', '{"nftables": [1]}',
    listing("nomasq_v4", ["10.0.0.300"]),
    listing("nomasq_v4", [{"prefix": {"addr": "10.0.0.0", "len": 99}}]),
    listing("nomasq_v4", [{"prefix": {"addr": "10.0.0.0"}}]),
    listing("nomasq_v4", [{"range": ["10.0.0.1"]}]),
    listing("nomasq_v4", [{"what": 1}]),
    listing("nomasq_v4", [None]),
    listing("nomasq_v4", ["10.0.0.1"], flags=[1]),
])
def test_what_it_cannot_read_is_one_parse_error(bad: str) -> None:
    with pytest.raises(NftParseError):
        parse_set_json(bad, "nomasq_v4")
