"""The Lease's holder writes the fleet's verdict on the ConfigMap: one Event per reason, patched as nodes report."""

from __future__ import annotations

import logging
import threading
from dataclasses import replace

from ipmasq.agent.apiconfig import ApiContent
from ipmasq.agent.origin import ConfigOrigin
from ipmasq.agent.summary import SETTLE_SECONDS, SummaryWriter
from ipmasq.config.source import ConfigInput
from ipmasq.errors import ApiUnreachable, TooManyRequests
from ipmasq.kube import paths
from ipmasq.kube.agentstatus import NodeStatus
from ipmasq.kube.configmaps import ConfigMapState
from ipmasq.kube.events import EventRecorder
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
    events = EventRecorder(client, component="ip-masq-agent", host=node)
    summary = SummaryWriter(client, elector, events, log=logging.getLogger("test"), stop=threading.Event(),
                            clock=clock)
    origin = ConfigOrigin("api", digest=NEW, configmaps=(("ip-masq-agent", "7"),), exists=True)
    summary.content_changed(ApiContent(ConfigInput((("configmap/ip-masq-agent[config]", b"bad"),)), origin,
                                       (configmap,)))
    return summary


def node_status(name: str, status: NodeStatus = BASE) -> dict[str, object]:
    """A node's status object as its agent writes it: named after the node and owned by it."""
    return {"metadata": {"name": name, "ownerReferences": [{"apiVersion": "v1", "kind": "Node", "name": name,
                                                             "uid": f"uid-{name}"}]}, **status.as_json()}


def summaries(client: FakeKubeClient) -> list[dict[str, object]]:
    return [obj for path, obj in client.objects.items() if path.startswith(EVENTS)]


def test_one_holder_writes_one_warning_for_a_thousand_rejections_and_patches_it_as_nodes_report() -> None:
    client, clock = FakeKubeClient(), Clock()
    for i in range(1000):
        client.put(paths.statuses(f"node-{i:04d}"),
                   node_status(f"node-{i:04d}", BASE if i < 600 else replace(BASE, rejected_digest=None)))
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
    lists = [path for verb, path in client.calls if verb == "GET" and path == paths.statuses()]
    assert len(lists) == 2  # in pages of 500
    for i in range(600, 1000):  # the others report
        client.patch(paths.statuses(f"node-{i:04d}"), {"rejectedDigest": NEW})
    clock.now += SETTLE_SECONDS * 2
    holder.step()
    (event,) = summaries(client)  # the same Event, its message patched
    assert str(event["message"]).startswith(f"rejected on 1,000 of 1,000 nodes: {LINE}. They keep")
    client.calls.clear()
    for _ in range(100):  # every node reported: no more tallies for this content
        clock.now += 1.0
        holder.step()
    assert not any(path == paths.statuses() for _verb, path in client.calls)


def test_a_new_holder_patches_the_same_event_not_another_one() -> None:
    client, clock = FakeKubeClient(), Clock()
    for i in range(3):
        client.put(paths.statuses(f"node-{i}"), node_status(f"node-{i}"))
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


def test_objects_for_nodes_that_do_not_exist_are_not_counted_and_the_count_is_published_for_the_spread() -> None:
    """Five thousand objects no Node owns (anyone with the agents' rights could write them) change nothing."""
    client, clock = FakeKubeClient(), Clock()
    for i in range(2):
        client.put(paths.statuses(f"node-{i}"), node_status(f"node-{i}"))
    for i in range(5000):
        client.put(paths.statuses(f"phantom-{i}"), {"metadata": {"name": f"phantom-{i}"}, **BASE.as_json()})
    client.put(paths.statuses("claims-node-0"), node_status("node-0") | {"metadata": {
        "name": "claims-node-0", "ownerReferences": [{"kind": "Node", "name": "node-0", "uid": "uid-node-0"}]}})
    holder = writer(client, clock, "node-0")
    clock.now = 10.0
    holder.step()
    clock.now += SETTLE_SECONDS
    holder.step()
    (event,) = summaries(client)
    assert str(event["message"]).startswith(f"rejected on 2 of 2 nodes: {LINE}")
    assert holder.fleet.nodes is None and holder.elector.publish is None  # one count is not a settled one
    clock.now += 2 * SETTLE_SECONDS
    holder.step()  # tallied again although nothing is pending: the same count twice is the fleet's size
    assert holder.fleet.nodes == 2 and holder.elector.publish == 2
    holder.step()  # a new size is said on the Lease at once, where every candidate reads it
    lease = client.objects["/apis/coordination.k8s.io/v1/namespaces/kube-system/leases/ip-masq-agent"]
    assert lease["metadata"]["annotations"] == {"ipmasq.dev/nodes": "2"}


def test_a_fleet_still_starting_is_not_published_until_two_tallies_agree() -> None:
    """Status objects appear over minutes while a fleet starts: a count of those written so far is not its size."""
    client, clock = FakeKubeClient(), Clock()
    holder = writer(client, clock, "node-0")
    clock.now = 10.0
    holder.step()
    for count in (3, 40, 200):  # more nodes wrote their status before each tally
        for i in range(count):
            client.put(paths.statuses(f"node-{i}"), node_status(f"node-{i}"))
        clock.now += 60.0
        holder.step()
        assert holder.last is not None and holder.last.nodes == count
        assert holder.fleet.nodes is None and holder.elector.publish is None
    clock.now += 60.0
    holder.step()
    assert holder.fleet.nodes == 200 and holder.elector.publish == 200
    clock.now += 60.0
    holder.step()
    assert holder._next_tally is None  # nothing pending, the count settled: done until the next content


def test_a_tally_refused_is_not_asked_again_before_the_retry_after_nor_at_once_after_no_answer() -> None:
    client, clock = FakeKubeClient(), Clock()
    client.put(paths.statuses("node-0"), node_status("node-0"))
    holder = writer(client, clock, "node-0")
    clock.now = 10.0
    holder.step()
    assert holder.elector.leading
    clock.now += SETTLE_SECONDS
    client.refuse(paths.statuses(), TooManyRequests(429, "shed", retry_after=7.0),
                  ApiUnreachable("GET: no answer in time"))
    holder.attempt()  # refused: asked again after the Retry-After (with up to a quarter more), not at once
    assert holder._next_tally is not None and holder._next_tally >= clock.now + 7.0
    clock.now = holder._next_tally
    holder.attempt()  # no answer: the backoff's wait
    assert holder._next_tally is not None and holder._next_tally > clock.now
    clock.now = holder._next_tally
    holder.attempt()
    assert holder.last is not None and holder.last.nodes == 1


def test_observed_nodes_whose_rules_do_not_enforce_the_content_are_one_warning() -> None:
    client, clock = FakeKubeClient(), Clock()
    observed = replace(BASE, config_digest=NEW, ready=True, last_rejection=None, rejected_digest=None,
                       mode="observe", writer="gke", chain="IP-MASQ",
                       mismatch="IP-MASQ: config-not-applied: \x1b[2Konly the MASQUERADE rule")
    client.put(paths.statuses("node-0"), node_status("node-0", observed))
    client.put(paths.statuses("node-1"), node_status("node-1", replace(observed, mismatch=None)))
    holder = writer(client, clock, "node-0")
    clock.now = 10.0
    holder.step()
    clock.now += SETTLE_SECONDS
    holder.step()
    by_reason = {str(e["reason"]): str(e["message"]) for e in summaries(client)}
    assert by_reason["ConfigNotEnforced"].startswith(
        "not enforced on 1 of 2 nodes (observed: the rules of gke in IP-MASQ): IP-MASQ: config-not-applied: "
        "\\x1b[2Konly the MASQUERADE rule (1 enforce it)")
    assert by_reason["ConfigApplied"].startswith("enforced on 1 of 2 nodes")
