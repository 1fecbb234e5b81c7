"""The agent's API features wired as `ipmasq agent` (and the fleet bench) start them, over the fake API seam."""

from __future__ import annotations

import logging
import threading

import pytest

from ipmasq.agent.api import summary
from ipmasq.agent.api.wiring import start_api
from ipmasq.testing.kube import FakeKubeClient
from tests.eventually import eventually

LEASE = "/apis/coordination.k8s.io/v1/namespaces/kube-system/leases/ip-masq-agent"


def test_following_reporting_and_standing_for_the_summary_lease(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(summary, "FIRST_TRY_SECONDS", 0.01)
    client = FakeKubeClient()
    client.put("/api/v1/namespaces/kube-system/configmaps/ip-masq-agent",
               {"metadata": {"name": "ip-masq-agent"}, "data": {"config": "nonMasqueradeCIDRs: [10.0.0.0/8]\n"}})
    client.put(LEASE, {"metadata": {"name": "ip-masq-agent"}, "spec": {}})
    stop, pokes = threading.Event(), []
    api_config, reporter = start_api(client, "node-a", pod="ip-masq-agent-x", namespace="kube-system",
                                     names=["ip-masq-agent"], key="config", summary_lease="ip-masq-agent",
                                     log=logging.getLogger("test"), poke=lambda: pokes.append(1), stop=stop)
    try:
        eventually(lambda: api_config.digest() is not None
                   and client.objects[LEASE]["spec"].get("holderIdentity") == "node-a",
                   lambda: f"the ConfigMap followed and the summary Lease held; calls: {client.calls}")
        assert pokes and reporter.narrator.status.node == "node-a"
    finally:
        stop.set()
        client.watch_events.put(None)
