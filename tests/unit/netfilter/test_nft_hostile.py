"""`nft -j` listings that are not what nft prints (hand-edited dumps, truncated files, other tools' JSON): each ends
in NftParseError with one short line, never another exception; the fuzzing covers shapes nobody listed."""

from __future__ import annotations

import contextlib
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ipmasq.cli import main
from ipmasq.errors import NftParseError
from ipmasq.netfilter.nft_json import parse_list_json

TABLE = {"table": {"family": "inet", "name": "ip-masq-agent"}}


def listing(*objects: Any) -> str:
    return json.dumps({"nftables": [TABLE, *objects]})


HOSTILE = [
    "null", '"text"', "[]", '{"nftables": null}', '{"nftables": "x"}', '{"nftables": [null]}', '{"nftables": [5]}',
    '{"nftables": [{"set": null}]}', '{"nftables": [{}]}', '{"nftables": [{"a": {}, "b": {}}]}',
    listing({"chain": {"family": "inet", "table": "ip-masq-agent"}}),  # no name
    listing({"chain": {"family": "inet", "table": "ip-masq-agent", "name": "postrouting", "prio": None}}),
    listing({"chain": {"family": "inet", "table": "ip-masq-agent", "name": "postrouting", "prio": "x"}}),
    listing({"chain": {"family": "inet", "table": "ip-masq-agent", "name": 7}}),
    listing({"rule": {"family": "inet", "table": "ip-masq-agent"}}),  # no chain
    listing({"set": {"family": "inet", "table": "ip-masq-agent", "name": "nomasq_v4", "type": "ipv4_addr",
                     "elem": [None]}}),
    listing({"set": {"family": "inet", "table": "ip-masq-agent", "name": "nomasq_v4", "type": "ipv4_addr",
                     "elem": None}}),
    listing({"set": {"family": "inet", "table": "ip-masq-agent", "name": "nomasq_v4", "type": "ipv4_addr",
                     "elem": [{"prefix": {"addr": "10.0.0.0", "len": -1000000000}}]}}),
    listing({"set": {"family": "inet", "table": "ip-masq-agent", "name": "nomasq_v4", "type": "ipv4_addr",
                     "elem": [{"prefix": {"addr": 5, "len": 8}}]}}),
    listing({"set": {"family": "inet", "table": "ip-masq-agent", "name": "nomasq_v4", "type": "ipv4_addr",
                     "elem": [{"range": ["10.0.0.1"]}]}}),
    listing({"set": {"family": "inet", "table": "ip-masq-agent", "name": "nomasq_v4", "type": "ipv4_addr",
                     "flags": [None]}}),
    '{"nftables": ' + "[" * 100_000 + "]" * 100_000 + "}",
]


@pytest.mark.parametrize("text", HOSTILE)
def test_hostile_listing_is_one_parse_error(text: str) -> None:
    with pytest.raises(NftParseError) as info:
        parse_list_json(text)
    assert "\n" not in str(info.value) and len(str(info.value)) < 400


def test_a_huge_value_is_not_echoed_whole() -> None:
    huge = "x" * 10_000_000
    with pytest.raises(NftParseError) as info:
        parse_list_json(listing({"set": {"family": "inet", "table": "ip-masq-agent", "name": "nomasq_v4",
                                          "type": "ipv4_addr", "elem": [huge]}}))
    assert len(str(info.value)) < 400


def test_check_reports_a_malformed_dump_in_one_line(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    dump = tmp_path / "ruleset.json"
    dump.write_text(HOSTILE[11])
    assert main(["check", "--from-dump", str(dump)]) == 3  # could not read it
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("ipmasq check: ") and str(dump) in err


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.sampled_from(
        ["nftables", "table", "set", "chain", "rule", "family", "name", "table", "type", "elem", "flags", "prio",
         "prefix", "addr", "len", "range", "expr", "chain", "hook", "policy"]), inner, max_size=5),
    max_leaves=30,
)


@settings(max_examples=300, deadline=None)
@given(st.lists(json_values, max_size=5))
def test_random_listings_parse_or_raise_our_error(objects: list[Any]) -> None:
    text = json.dumps({"nftables": [TABLE, *objects]})
    with contextlib.suppress(NftParseError):
        parse_list_json(text)
