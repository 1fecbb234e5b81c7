"""The agent's /settings and `ipmasq check` run beside it (kubectl exec into the agent's pod): with no --config and no
policy flag, check compares with what the running agent enforces, not with the built-in defaults."""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from ipmasq.agent.health import EndpointServer, respond
from ipmasq.agent.metrics import AgentVitals
from ipmasq.commands.common import adopt_agent_settings, agent_settings
from ipmasq.commands.policy_source import load_policy
from ipmasq.errors import UsageError
from ipmasq.options import DEFAULT_CHAIN


def _agent_args(**given: object) -> argparse.Namespace:
    values: dict[str, object] = {"config": None, "masq_chain": DEFAULT_CHAIN, "nomasq_all_reserved_ranges": False,
                                 "enable_ipv6": None, "random_fully": True, "to_ports": "", "node_name": None,
                                 "agent": "auto"}
    values.update(given)
    return argparse.Namespace(**values)


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """A real status server on loopback, as a GKE-flagged agent with a mounted config serves it."""
    config = tmp_path / "ip-masq-agent"
    config.write_text("nonMasqueradeCIDRs:\n  - 10.0.0.0/8\n")
    status = AgentVitals(version="test", backend="iptables (nft)")
    status.settings = agent_settings(_agent_args(masq_chain="IP-MASQ", nomasq_all_reserved_ranges=True,
                                                 node_name="gke-prod-egress-pool-7f3k"), str(config))
    status.settings["backend"] = "iptables (nft)"
    server = EndpointServer(status, "127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{server.port}", config
    finally:
        server.stop()


def test_settings_are_one_line_of_json() -> None:
    status = AgentVitals(version="test", backend="nftables")
    status.settings = {"config": "/etc/config/ip-masq-agent", "masq_chain": "IP-MASQ"}
    answer = respond(status, "/settings")
    assert answer.status == 200 and answer.body.count(b"\n") == 1
    assert json.loads(answer.body) == status.settings


def test_check_without_flags_takes_the_running_agents_settings(agent: tuple[str, Path],
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    address, config = agent
    args = _agent_args(agent=address)
    settings = adopt_agent_settings(args, "check")
    assert settings is not None and settings["backend"] == "iptables (nft)"
    assert args.config == str(config) and args.masq_chain == "IP-MASQ" and args.nomasq_all_reserved_ranges
    assert args.node_name == "gke-prod-egress-pool-7f3k"
    said = capsys.readouterr().err
    assert f"--config={config}" in said and "--masq-chain=IP-MASQ" in said and address in said
    policy = load_policy(args, "check")
    assert policy.options.masq_chain == "IP-MASQ" and [str(e.prefix) for e in policy.config.non_masquerade] \
        == ["10.0.0.0/8"]


def test_a_missing_mounted_config_is_the_defaults_as_the_agent_reads_it(agent: tuple[str, Path]) -> None:
    address, config = agent
    config.unlink()  # optional ConfigMap not there: the agent enforces the defaults
    args = _agent_args(agent=address)
    assert adopt_agent_settings(args, "check") is not None
    assert load_policy(args, "check").options.masq_chain == "IP-MASQ"


@pytest.mark.parametrize("given", [{"config": "x.yaml"}, {"masq_chain": "IP-MASQ"},
                                   {"nomasq_all_reserved_ranges": True}, {"agent": "none"}])
def test_a_flag_on_the_command_line_wins_over_the_agent(agent: tuple[str, Path], given: dict[str, object]) -> None:
    address, _config = agent
    args = _agent_args(**{"agent": address, **given})
    if given.get("agent") == "none":
        args.agent = "none"
    assert adopt_agent_settings(args, "check") is None


def test_no_agent_answering(unused_tcp_port: int) -> None:
    args = _agent_args(agent=f"127.0.0.1:{unused_tcp_port}")
    with pytest.raises(UsageError, match="no agent settings there"):
        adopt_agent_settings(args, "check")
    assert args.config is None  # nothing taken


def test_auto_without_an_agent_keeps_the_defaults(monkeypatch: pytest.MonkeyPatch, unused_tcp_port: int) -> None:
    monkeypatch.setattr("ipmasq.agent.health_probe.DEFAULT_METRICS_ADDRESS", f"127.0.0.1:{unused_tcp_port}")
    args = _agent_args()
    assert adopt_agent_settings(args, "check") is None and args.config is None


@pytest.fixture
def unused_tcp_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
