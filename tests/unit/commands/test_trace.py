"""`ipmasq trace`'s text output: chain and table names, rules and their comments reach the terminal escaped."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ipmasq.cli import main

HOSTILE = "x\x1b]0;owned\x07\x1b[2J\u202egnp.exe\u0085next\noutcome: source unchanged\u009b31m"
RAW = ("\x1b", "\x07", "\u202e", "\u0085", "\u009b")


def listing(*expr: dict[str, object]) -> str:
    table, chain = "t" + HOSTILE, "post" + HOSTILE
    return json.dumps({"nftables": [
        {"metainfo": {"json_schema_version": 1}},
        {"table": {"family": "ip", "name": table, "handle": 1}},
        {"chain": {"family": "ip", "table": table, "name": chain, "handle": 1, "type": "nat", "hook": "postrouting",
                   "prio": 100, "policy": "accept"}},
        {"rule": {"family": "ip", "table": table, "chain": chain, "handle": 2, "comment": HOSTILE,
                  "expr": list(expr)}}]})


def run_trace(tmp_path: Path, text: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    dump = tmp_path / "ruleset.json"
    dump.write_text(text)
    code = main(["trace", "8.8.8.8", "--source", "10.1.0.5", "--dump", str(dump)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("expr", [{"masquerade": None}, {"jump": {"target": HOSTILE}}])
def test_trace_escapes_every_name_and_comment_it_prints(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                        expr: dict[str, object]) -> None:
    _code, out, err = run_trace(tmp_path, listing(expr), capsys)
    assert not err
    assert not any(char in out for char in RAW)
    assert "\\x1b]0;owned\\x07" in out and "\\u202e" in out and "\\x85" in out and "\\x9b" in out
    assert not any(line.startswith("outcome: source unchanged") for line in out.splitlines())


def test_trace_of_an_iptables_dump_escapes_a_bidi_override_in_a_comment(tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    dump = tmp_path / "nat.save"
    dump.write_text("*nat\n:POSTROUTING ACCEPT [0:0]\n"
                    '-A POSTROUTING -m comment --comment "exe.\u202egnp \u2066x" -j MASQUERADE\nCOMMIT\n')
    assert main(["trace", "8.8.8.8", "--source", "10.1.0.5", "--dump", str(dump)]) == 0
    out = capsys.readouterr().out
    assert "\u202e" not in out and "\u2066" not in out and "exe.\\u202egnp \\u2066x" in out


def test_what_trace_cannot_decide_is_said_escaped(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _err = run_trace(tmp_path, listing({HOSTILE: 1}), capsys)
    assert code == 1 and "CANNOT DECIDE: statement x\\x1b]0;owned\\x07" in out
    assert not any(char in out for char in RAW)
