"""`ipmasq explain --routes`: the config decides whether a destination is masqueraded, the node's routes to which
address (the kernel's choice on the interface the route leaves by, never the route's src)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ipmasq.cli import main
from tests.unit.diagnose.test_path import LINKS, ROUTES, RULES


@pytest.fixture
def routes(tmp_path: Path) -> str:
    path = tmp_path / "routing.json"
    path.write_text("\n".join(json.dumps(a) for a in (RULES, [], ROUTES, LINKS)))
    return str(path)


@pytest.fixture
def config(tmp_path: Path) -> str:
    path = tmp_path / "ip-masq-agent.yaml"
    path.write_text("nonMasqueradeCIDRs: [10.0.0.0/8]\n")
    return str(path)


def test_the_masquerade_address_follows_the_route(routes: str, config: str,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["explain", "198.51.100.10", "172.30.1.10", "10.20.0.5", "--source", "10.44.0.5",
                 "--routes", routes, "--config", config, "-o", "json"]) == 0
    results = {r["destination"]: r for r in json.loads(capsys.readouterr().out)["results"]}
    assert results["198.51.100.10"]["source_seen"] == "192.168.10.2"
    assert results["198.51.100.10"]["egress_interface"] == "eth0"
    # table 100 for the VPC: eth1's primary address
    assert results["172.30.1.10"]["source_seen"] == "192.168.20.2"
    assert "table 100" in results["172.30.1.10"]["route"]
    assert results["10.20.0.5"]["source_seen"] == "10.44.0.5" and "egress_interface" not in results["10.20.0.5"]


def test_text_names_the_interface_and_routes_need_a_source(routes: str, config: str,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["explain", "172.30.1.10", "--source", "10.44.0.5", "--routes", routes, "--config", config]) == 0
    out = capsys.readouterr().out
    assert "the destination sees 192.168.20.2 (leaving by eth1, table 100:" in out
    assert main(["explain", "172.30.1.10", "--routes", routes]) == 2
    assert "--routes needs --source" in capsys.readouterr().err
