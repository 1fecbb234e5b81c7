"""The Lease's holder writes the fleet's verdict on the ConfigMap: one Event per reason, patched as nodes report."""

from __future__ import annotations

import logging
import threading
from dataclasses import replace

from ipmasq.agent.summary import SETTLE_SECONDS, SummaryWriter
from ipmasq.kube.agentstatus import NodeStatus, status_path
from ipmasq.kube.configmaps import ConfigMapState
from ipmasq.kube.lease import LeaseElector
from ipmasq.testing.kube import FakeKubeClient

NEW = "n" * 64
LINE = "configmap/ip-masq-agent[config]:3: nonMasqueradeCIDRs[0]: invalid CIDR '10.0.0.0/33'"
EVENTS = "/api/v1/namespaces/kube-system/events"
BASE = NodeStatus(node="", pod=None, version="0.1.0", backend="iptables-nft", ready=False, reason="not ready",
                  policy_hash="a" * 64, config_digest="o" * 64, config_source="api", configmaps=(),
                  last_rejection=LINE, last_rejection_time=None, drift_repairs=0, foreign_masquerade_rules=0,
                  updated="", rejected_digest=NEW)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def writer(client: FakeKubeClient, clock: Clock, node: str) -> SummaryWriter:
    configmap = ConfigMapState("kube-system", "ip-masq-agent", True, b"bad", uid="cm-uid", resource_version="7")
    elector = LeaseElector(client, "kube-system", "ip-masq-agent", node, duration=120, clock=clock)
    return SummaryWriter(client, elector, lambda: {"ip-masq-agent": configmap}, lambda: NEW, component="ip-masq-agent",
                         host=node, log=logging.getLogger("test"), stop=threading.Event(), clock=clock)


def summaries(client: FakeKubeClient) -> list[dict[str, object]]:
    return [obj for path, obj in client.objects.items() if path.startswith(EVENTS)]


def test_one_holder_writes_one_warning_for_a_thousand_rejections_and_patches_it_as_nodes_report() -> None:
    client, clock = FakeKubeClient(), Clock()
    for i in range(1000):
        client.put(status_path(f"node-{i:04d}"), BASE.as_json() if i < 600 else replace(BASE, rejected_digest=None)
                   .as_json())
    holder, other = writer(client, clock, "node-0000"), writer(client, clock, "node-0001")
    clock.now = 10.0
    holder.step()
    other.step()
    assert holder.elector.leading and not other.elector.leading
    clock.now += SETTLE_SECONDS
    holder.step()
    other.step()
    (event,) = summaries(client)
    assert event["reason"] == "ConfigRejected" and event["involvedObject"] == {
        "kind": "ConfigMap", "apiVersion": "v1", "namespace": "kube-system", "name": "ip-masq-agent", "uid": "cm-uid"}
    assert str(event["message"]).startswith(f"rejected on 600 of 1,000 nodes: {LINE} (400 not reported yet)")
    lists = [path for verb, path in client.calls if verb == "GET" and path == status_path()]
    assert len(lists) == 2  # in pages of 500
    for i in range(600, 1000):  # the others report
        client.patch(status_path(f"node-{i:04d}"), {"rejectedDigest": NEW})
    clock.now += SETTLE_SECONDS * 2
    holder.step()
    (event,) = summaries(client)  # the same Event, its message patched
    assert str(event["message"]).startswith(f"rejected on 1,000 of 1,000 nodes: {LINE}. They keep")
    client.calls.clear()
    for _ in range(100):  # every node reported: no more tallies for this content
        clock.now += 1.0
        holder.step()
    assert not any(path == status_path() for _verb, path in client.calls)


def test_a_new_holder_patches_the_same_event_not_another_one() -> None:
    client, clock = FakeKubeClient(), Clock()
    for i in range(3):
        client.put(status_path(f"node-{i}"), BASE.as_json())
    first = writer(client, clock, "node-0")
    clock.now = 10.0
    first.step()
    clock.now += SETTLE_SECONDS
    first.step()
    assert len(summaries(client)) == 1
    # the holder is gone; after the lease's duration another one takes over and tallies again
    second = writer(client, clock, "node-1")
    clock.now += 5.0
    second.step()
    assert not second.elector.leading
    clock.now += 200.0
    second._next_lease = clock.now
    second.step()
    assert second.elector.leading
    clock.now += SETTLE_SECONDS
    second.step()
    (event,) = summaries(client)
    assert str(event["message"]).startswith(f"rejected on 3 of 3 nodes: {LINE}")
