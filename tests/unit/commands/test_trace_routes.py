"""`ipmasq trace --routes`: the whole path offline from a node's dumps, its JSON fields and text, and a hostile
routing dump ending in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ipmasq.cli import main
from tests.unit.diagnose.test_path import LINKS, ROUTES, RULES, SAVE


@pytest.fixture
def dumps(tmp_path: Path) -> tuple[str, str]:
    routes = tmp_path / "routing.json"
    routes.write_text("\n".join(json.dumps(a) for a in (RULES, [], ROUTES, LINKS)))  # no IPv6 rules: an empty array
    save = tmp_path / "node.save"
    save.write_text(SAVE)
    return str(routes), str(save)


def _trace(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict[str, object], str]:
    code = main(["trace", *argv, "-o", "json"])
    captured = capsys.readouterr()
    return code, json.loads(captured.out) if captured.out else {}, captured.err


def test_the_path_in_json(dumps: tuple[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    routes, save = dumps
    code, document, err = _trace(capsys, "198.51.100.10", "--source", "10.44.0.5", "--protocol", "tcp", "--port",
                                 "5432", "--routes", routes, "--dump", save)
    assert code == 0 and not err
    assert document["source_seen"] == "192.168.20.2" and document["source_seen_reason"] is None
    assert document["outcome"] == "masqueraded" and document["egress_interface"] == "eth1"
    assert document["ingress_interface"] == "cni0" and document["routing_mark"] == 0x80
    assert document["route"] == {"type": "unicast", "rule": "32764: from all fwmark 0x80/0x80 lookup 200",
                                 "table": "200", "route": "default via 192.168.20.1 dev eth1 table 200 src "
                                 "192.168.20.99", "nexthop": "192.168.20.1"}
    assert document["masquerade_address"] == "192.168.20.2" and document["delivered"] is True
    stages = [step["stage"] for step in document["path"]]  # type: ignore[attr-defined]
    assert stages[:2] == ["in-interface", "mangle"] and stages[-1] == "masquerade"


def test_the_path_in_text(dumps: tuple[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    routes, save = dumps
    assert main(["trace", "172.30.1.10", "--source", "10.44.0.5", "--protocol", "tcp", "--port", "80",
                 "--routes", routes, "--dump", save]) == 0
    out = capsys.readouterr().out
    assert out.startswith("path:\n")
    assert "32765: from 10.44.0.0/14 to 172.30.0.0/16 lookup 100: matched" in out
    assert "the destination sees 192.168.20.2 by eth1" in out


def test_a_dropped_packet_and_an_undecided_one_exit_1_with_the_reason(dumps: tuple[str, str],
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    routes, save = dumps
    code, document, _ = _trace(capsys, "203.0.113.9", "--source", "10.44.0.5", "--protocol", "udp", "--routes",
                               routes, "--dump", save)
    assert code == 1 and document["source_seen"] is None and document["delivered"] is False
    assert "blackhole" in str(document["source_seen_reason"]) and document["cannot_decide"]
    code, document, _ = _trace(capsys, "198.51.100.10", "--source", "10.44.0.5", "--routes", routes, "--dump", save)
    assert code == 1 and "--protocol" in str(document["source_seen_reason"])  # mangle tests -p tcp


def test_without_routes_trace_walks_as_it_always_has(dumps: tuple[str, str],
                                                     capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    nat_only = tmp_path / "nat.save"
    nat_only.write_text(SAVE.split("*nat\n", 1)[1].join(["*nat\n", ""]))
    code, document, _ = _trace(capsys, "198.51.100.10", "--source", "10.44.0.5", "--dump", str(nat_only))
    assert code == 0 and document["source_seen"] is None and "path" not in document
    assert "--local-address" in str(document["source_seen_reason"])


@pytest.mark.parametrize(("content", "said"), [
    (b"[{\"priority\": 1}]", "no action"),
    (b"\x00" * 100, "control character"),
    (b"{\"nftables\": []}", "a JSON dict"),
])
def test_a_hostile_routing_dump_is_one_line(dumps: tuple[str, str], capsys: pytest.CaptureFixture[str],
                                            tmp_path: Path, content: bytes, said: str) -> None:
    _, save = dumps
    bad = tmp_path / "bad.json"
    bad.write_bytes(content)
    code = main(["trace", "198.51.100.10", "--source", "10.44.0.5", "--routes", str(bad), "--dump", save])
    err = capsys.readouterr().err
    assert code == 3 and said in err and err.count("\n") == 1 and str(bad) in err


def test_a_100_mb_routing_dump_is_refused_unread(dumps: tuple[str, str], capsys: pytest.CaptureFixture[str],
                                                 tmp_path: Path) -> None:
    _, save = dumps
    huge = tmp_path / "huge.json"
    with huge.open("wb") as f:
        f.truncate(100 << 20)  # sparse: 100 MB that cost no disk
    code = main(["trace", "198.51.100.10", "--source", "10.44.0.5", "--routes", str(huge), "--dump", save])
    err = capsys.readouterr().err
    assert code == 3 and "too large" in err and err.count("\n") == 1


def test_a_node_whose_nat_is_all_nftables_is_traced_from_its_iptables_save_and_listing(
        dumps: tuple[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # the documented capture (iptables-save > node.save; nft -j list ruleset > ruleset.json) on a node whose nat
    # rules are nftables': its iptables-save holds the mangle table alone, and that mark still routes the packet
    routes, _ = dumps
    mangle_only = tmp_path / "mangle.save"
    mangle_only.write_text(SAVE.split("*nat")[0])
    listing = tmp_path / "ruleset.json"
    listing.write_text(json.dumps({"nftables": [
        {"table": {"family": "ip", "name": "masq", "handle": 1}},
        {"chain": {"family": "ip", "table": "masq", "name": "post", "handle": 1, "type": "nat", "hook": "postrouting",
                   "prio": 100, "policy": "accept"}},
        {"rule": {"family": "ip", "table": "masq", "chain": "post", "handle": 2, "expr": [{"masquerade": None}]}}]}))
    code, document, err = _trace(capsys, "198.51.100.10", "--source", "10.44.0.5", "--protocol", "tcp", "--port",
                                 "5432", "--routes", routes, "--dump", str(mangle_only), "--dump", str(listing))
    assert code == 0 and not err
    assert (document["routing_mark"], document["egress_interface"], document["source_seen"]) == (
        0x80, "eth1", "192.168.20.2")
    # alone, a dump without a nat table is still not something trace walks
    assert main(["trace", "198.51.100.10", "--source", "10.44.0.5", "--dump", str(mangle_only)]) == 3
    assert "no *nat table" in capsys.readouterr().err
