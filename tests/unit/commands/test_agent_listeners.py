"""`ipmasq agent`'s two listeners: the status port is required (the probes need it); the scrape listener
(--prometheus-address) that cannot bind is logged and the agent runs on without it."""

from __future__ import annotations

import logging

import pytest

from ipmasq.agent.metrics import AgentStatus
from ipmasq.commands.agent import _serve_status
from ipmasq.errors import IpmasqError, UsageError

NOT_HERE = "192.0.2.1:9848"  # TEST-NET-1: never an address of this machine


def test_a_scrape_address_that_cannot_be_bound_is_logged_and_skipped(caplog: pytest.LogCaptureFixture) -> None:
    log = logging.getLogger("test-agent")
    with caplog.at_level(logging.ERROR):
        server = _serve_status(AgentStatus(version="t", backend="b"), NOT_HERE, log, metrics_only=True,
                               flag="--prometheus-address")
    assert server is None
    assert f"cannot listen on {NOT_HERE} (--prometheus-address)" in caplog.text
    assert "not serving /metrics for Prometheus" in caplog.text


def test_the_status_address_that_cannot_be_bound_stops_the_agent() -> None:
    with pytest.raises(IpmasqError, match=r"--metrics-address"):
        _serve_status(AgentStatus(version="t", backend="b"), NOT_HERE, logging.getLogger("test-agent"))


def test_a_malformed_scrape_address_is_a_usage_error() -> None:
    with pytest.raises(UsageError):
        _serve_status(AgentStatus(version="t", backend="b"), "no-port", logging.getLogger("test-agent"),
                      metrics_only=True, flag="--prometheus-address")


def test_the_scrape_listener_serves_on_the_address_given() -> None:
    server = _serve_status(AgentStatus(version="t", backend="b"), "127.0.0.1:0", logging.getLogger("test-agent"),
                           metrics_only=True, flag="--prometheus-address")
    assert server is not None and server.serving and server.what == "/metrics"
    server.stop()
