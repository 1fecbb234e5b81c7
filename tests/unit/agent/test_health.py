"""The agent's listeners: the loopback status port answers every endpoint; the scrape listener
(--prometheus-address) answers /metrics and nothing else."""

from __future__ import annotations

import logging

import pytest
from prometheus_client.parser import text_string_to_metric_families

from ipmasq.agent.health import EndpointServer, query, respond, respond_metrics_only
from ipmasq.agent.metrics import AgentVitals
from ipmasq.errors import IpmasqError
from tests.unit.agent.test_responder import exchange


@pytest.mark.parametrize("path", ["/healthz", "/readyz", "/settings", "/", "/metricsx", "/metrics/"])
def test_the_scrape_listener_answers_nothing_but_metrics(path: str) -> None:
    status = AgentVitals(version="test", backend="iptables")
    status.settings = {"config": "/etc/config/ip-masq-agent", "node": "secret-node"}
    answer = respond_metrics_only(status, path)
    assert answer.status == 404 and b"secret-node" not in answer.body
    assert respond(status, path).status != 200 or path in ("/healthz", "/readyz", "/settings")


def test_the_scrape_listener_serves_the_same_metrics_over_http() -> None:
    status = AgentVitals(version="test", backend="nftables")
    server = EndpointServer(status, "127.0.0.1:0", metrics_only=True, flag="--prometheus-address")
    server.start()
    try:
        address = f"127.0.0.1:{server.port}"
        assert not query(address, "/healthz").ok and not query(address, "/settings").ok
        answer = exchange(server.port, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 OK")
        names = {family.name for family in text_string_to_metric_families(body.decode())}
        assert {"ipmasq_build_info", "ipmasq_ready", "ipmasq_syncs"} <= names
    finally:
        server.stop()


def test_an_address_in_use_names_the_flag(caplog: pytest.LogCaptureFixture) -> None:
    first = EndpointServer(AgentVitals(version="t", backend="b"), "127.0.0.1:0")
    first.start()
    try:
        second = EndpointServer(AgentVitals(version="t", backend="b"), f"127.0.0.1:{first.port}", metrics_only=True,
                              flag="--prometheus-address")
        with pytest.raises(IpmasqError, match=r"--prometheus-address"):
            second.start()
        second.stop()
        third = EndpointServer(AgentVitals(version="t", backend="b"), f"127.0.0.1:{first.port}", metrics_only=True,
                             flag="--prometheus-address")
        with caplog.at_level(logging.WARNING):
            third.start(wait_if_in_use=True, log=logging.getLogger("test"))
        assert "--prometheus-address" in caplog.text and not third.serving
        third.stop()
    finally:
        first.stop()


def test_per_rule_series_are_on_the_node_address_only_when_opted_in_and_always_on_loopback() -> None:
    """The rule names (`rule="to-the-payroll-db"`) and their traffic: the config's to tell, not the pod network's."""
    from ipmasq.agent.reconcile import Reconciler
    from ipmasq.backends.iptables import IptablesBackend, Variant
    from ipmasq.options import PolicyOptions
    from ipmasq.testing import FakeIptables
    from tests.configs import agent_config

    status = AgentVitals(version="test", backend="iptables")
    rec = Reconciler(IptablesBackend(FakeIptables(), chain="IP-MASQ-AGENT", variant=Variant.NFT), PolicyOptions(),
                     log=logging.getLogger("test.health"), fingerprint=lambda: "unchanged")
    rec.take_config(agent_config("nonMasqueradeCIDRs: [10.0.0.0/8]\nrules:\n  - name: to-the-payroll-db\n"
                             "    destinations: [172.30.0.0/16]\n    action: preserve\n"))
    status.reconciled(rec.reconcile(), 0.001)

    def served(server: EndpointServer) -> str:
        server.start()
        try:
            answer = exchange(server.port, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        finally:
            server.stop()
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 OK")
        return body.decode()

    scrape = served(EndpointServer(status, "127.0.0.1:0", metrics_only=True, flag="--prometheus-address"))
    assert "to-the-payroll-db" not in scrape and "ipmasq_rule_" not in scrape and "ipmasq_ready" in scrape
    opted_in = served(EndpointServer(status, "127.0.0.1:0", metrics_only=True, flag="--prometheus-address",
                                   rule_series=True))
    loopback = served(EndpointServer(status, "127.0.0.1:0"))
    for text in (opted_in, loopback):
        assert 'ipmasq_rule_packets_total{family="ipv4",rule="to-the-payroll-db"}' in text
