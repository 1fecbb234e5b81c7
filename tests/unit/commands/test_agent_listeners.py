"""`ipmasq agent`'s two listeners: the status port is required (the probes need it); the scrape listener
(--prometheus-address) that cannot bind is logged and the agent runs on without it."""

from __future__ import annotations

import argparse
import logging
import socket

import pytest

from ipmasq.agent.metrics import AgentVitals
from ipmasq.commands.agent import _serve_endpoints, _serve_status
from ipmasq.errors import IpmasqError, UsageError

NOT_HERE = "192.0.2.1:9848"  # TEST-NET-1: never an address of this machine


def test_a_scrape_address_that_cannot_be_bound_is_logged_and_skipped(caplog: pytest.LogCaptureFixture) -> None:
    log = logging.getLogger("test-agent")
    with caplog.at_level(logging.ERROR):
        server = _serve_status(AgentVitals(version="t", backend="b"), NOT_HERE, log, metrics_only=True,
                               flag="--prometheus-address")
    assert server is None
    assert f"cannot listen on {NOT_HERE} (--prometheus-address)" in caplog.text
    assert "not serving /metrics for Prometheus" in caplog.text


def test_the_status_address_that_cannot_be_bound_stops_the_agent() -> None:
    with pytest.raises(IpmasqError, match=r"--metrics-address"):
        _serve_status(AgentVitals(version="t", backend="b"), NOT_HERE, logging.getLogger("test-agent"))


def test_a_malformed_scrape_address_is_a_usage_error() -> None:
    with pytest.raises(UsageError):
        _serve_status(AgentVitals(version="t", backend="b"), "no-port", logging.getLogger("test-agent"),
                      metrics_only=True, flag="--prometheus-address")


def test_the_scrape_listener_serves_on_the_address_given() -> None:
    server = _serve_status(AgentVitals(version="t", backend="b"), "127.0.0.1:0", logging.getLogger("test-agent"),
                           metrics_only=True, flag="--prometheus-address")
    assert server is not None and server.serving and server.what == "/metrics"
    server.stop()


def _args(**given: str) -> argparse.Namespace:
    return argparse.Namespace(**{"metrics_address": "", "prometheus_address": "", "prometheus_rule_metrics": False,
                                 **given})


def test_both_listeners_serve_in_either_mode_from_one_place() -> None:
    """Enforcing and observing agents start their endpoints through one helper: the status port and the scrape port."""
    listeners = _serve_endpoints(AgentVitals(version="t", backend="b"),
                                 _args(metrics_address="127.0.0.1:0", prometheus_address="127.0.0.1:0"),
                                 logging.getLogger("test-agent"))
    try:
        assert [server.what for server in listeners] == ["/metrics, /healthz and /readyz", "/metrics"]
        assert all(server.serving for server in listeners)
    finally:
        for server in listeners:
            server.stop()


def test_a_malformed_scrape_address_stops_the_status_listener_already_started() -> None:
    with socket.socket() as probe:  # a port free now
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(UsageError):
        _serve_endpoints(AgentVitals(version="t", backend="b"),
                         _args(metrics_address=f"127.0.0.1:{port}", prometheus_address="no-port"),
                         logging.getLogger("test-agent"))
    with socket.socket() as client, pytest.raises(ConnectionRefusedError):  # the status port was closed again
        client.connect(("127.0.0.1", port))
