"""`ipmasq check`'s text output: what it quotes of the node's rules reaches the terminal escaped."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ipmasq.cli import main
from ipmasq.netfilter.nft import render_script
from ipmasq.options import PolicyOptions
from ipmasq.testing.nft import FakeNft
from tests.configs import policy_of

# a rule comment (or a chain, a table) as a hostile writer of rules may name it: an OSC that retitles the window,
# BEL, an erase, a right-to-left override, NEL (U+0085), a newline forging a line, and CSI as one C1 byte
HOSTILE = "x\x1b]0;owned\x07\x1b[2J\u202egnp.exe\u0085next\nERROR forged: all good\u009b31m"
RAW = ("\x1b", "\x07", "\u202e", "\u0085", "\u009b")


def hostile_listing() -> str:
    """`nft -j list ruleset` on a node where the agent applied its table, beside a chain whose names and comment
    are hostile and which masquerades everything."""
    nft = FakeNft()
    assert nft(["nft", "-f", "-"], render_script(policy_of("", PolicyOptions()))).returncode == 0
    document: dict[str, Any] = json.loads(nft(["nft", "-j", "list", "ruleset"]).stdout)
    table, chain = "t" + HOSTILE, "post" + HOSTILE
    document["nftables"] += [
        {"table": {"family": "ip", "name": table, "handle": 3}},
        {"chain": {"family": "ip", "table": table, "name": chain, "handle": 1, "type": "nat", "hook": "postrouting",
                   "prio": 50, "policy": "accept"}},
        {"rule": {"family": "ip", "table": table, "chain": chain, "handle": 2, "comment": HOSTILE,
                  "expr": [{"masquerade": None}]}}]
    return json.dumps(document)


def assert_escaped(out: str) -> None:
    assert not any(char in out for char in RAW)
    assert "\\x1b]0;owned\\x07" in out and "\\u202e" in out and "\\x85" in out and "\\x9b" in out
    assert "\\nERROR forged" in out and not any(line.startswith("ERROR forged") for line in out.splitlines())


def test_check_escapes_what_it_quotes_of_the_rules(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dump = tmp_path / "ruleset.json"
    dump.write_text(hostile_listing())
    assert main(["check", "--from-dump", str(dump)]) == 1
    out = capsys.readouterr().out
    assert "foreign-masquerade" in out
    assert_escaped(out)
    assert main(["check", "--from-dump", str(dump), "-o", "json"]) == 1  # JSON escapes them its own way
    document = json.loads(capsys.readouterr().out)
    assert any(HOSTILE in finding["message"] for finding in document["findings"])


def test_an_error_quoting_a_dumps_chain_is_one_escaped_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dump = tmp_path / "nat.save"
    dump.write_text("*nat\n:POSTROUTING ACCEPT [0:0]\n-A EVIL\u202eNIAHC -j MASQUERADE\nCOMMIT\n")
    assert main(["check", "--from-dump", str(dump)]) == 3  # a dump that cannot be read: could not run
    captured = capsys.readouterr()
    assert not captured.out and captured.err.count("\n") == 1
    assert "EVIL\\u202eNIAHC" in captured.err and "\u202e" not in captured.err
