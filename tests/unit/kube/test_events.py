"""Events aggregated as Kubernetes aggregates them: one object per occurrence and node, repeats counted."""

from __future__ import annotations

from ipmasq.errors import ApiUnreachable
from ipmasq.kube.events import REPEAT_WRITE_SECONDS, EventRecorder, ObjectRef, Occurrence
from ipmasq.testing.kube import FakeKubeClient

CONFIGMAP = ObjectRef(kind="ConfigMap", name="ip-masq-agent", namespace="kube-system", uid="u1")
NODE = ObjectRef(kind="Node", name="node-a", uid="node-a")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_an_occurrence_is_one_event_described_where_kubectl_describe_matches_it() -> None:
    client, clock = FakeKubeClient(), Clock()
    recorder = EventRecorder(client, component="ip-masq-agent", host="node-a", clock=clock)
    rejected = Occurrence(CONFIGMAP, "Warning", "ConfigRejected", "node node-a rejected the config: x:3: bad")
    recorder.record(rejected)
    (path, event), = client.objects.items()
    assert path.startswith("/api/v1/namespaces/kube-system/events/ip-masq-agent.")
    assert event["involvedObject"] == {"kind": "ConfigMap", "name": "ip-masq-agent", "namespace": "kube-system",
                                       "uid": "u1", "apiVersion": "v1"}
    assert (event["type"], event["reason"], event["count"]) == ("Warning", "ConfigRejected", 1)
    assert event["source"] == {"component": "ip-masq-agent", "host": "node-a"}
    # node events go to default, as the kubelet writes them
    recorder.record(Occurrence(NODE, "Warning", "DriftRepaired", "rewritten"))
    assert any(p.startswith("/api/v1/namespaces/default/events/node-a.") for p in client.objects)


def test_repeats_are_a_count_written_at_most_once_per_interval() -> None:
    client, clock = FakeKubeClient(), Clock()
    recorder = EventRecorder(client, component="ip-masq-agent", host="node-a", clock=clock)
    drift = Occurrence(NODE, "Warning", "DriftRepaired", "rewritten")
    for _ in range(50):  # a resync loop repairing every few seconds
        recorder.record(drift)
        clock.now += 1
    writes = [c for c in client.calls if c[0] in ("POST", "PATCH")]
    assert writes[0][0] == "POST" and len(writes) == 1
    clock.now += REPEAT_WRITE_SECONDS
    recorder.flush()
    (event,) = client.objects.values()
    assert event["count"] == 50


def test_five_hundred_nodes_rejecting_one_edit_are_five_hundred_events_and_a_resync_adds_none() -> None:
    client, clock = FakeKubeClient(), Clock()
    recorders = [EventRecorder(client, component="ip-masq-agent", host=f"node-{i}", clock=clock) for i in range(500)]
    rejected = Occurrence(CONFIGMAP, "Warning", "ConfigRejected", "rejected the config: x:3: bad")
    for recorder in recorders:
        recorder.record(rejected)
    assert len(client.objects) == 500
    before = len(client.calls)
    for recorder in recorders:  # the same verdict again at the next resync: counted, not written
        recorder.record(rejected)
    assert len(client.calls) == before


def test_an_event_left_by_a_restarted_agent_is_found_by_its_name() -> None:
    client, clock = FakeKubeClient(), Clock()
    occurrence = Occurrence(NODE, "Normal", "WaitingForNodeLock", "waiting")
    EventRecorder(client, component="ip-masq-agent", host="node-a", clock=clock).record(occurrence)
    EventRecorder(client, component="ip-masq-agent", host="node-a", clock=clock).record(occurrence)
    assert len(client.objects) == 1
    assert [verb for verb, _ in client.calls] == ["POST", "POST", "PATCH"]


def test_a_failed_write_raises_so_the_reporter_can_retry_it() -> None:
    client, clock = FakeKubeClient(), Clock()
    recorder = EventRecorder(client, component="ip-masq-agent", host="node-a", clock=clock)
    client.refuse("/api/v1/namespaces/default/events", ApiUnreachable("connection refused"))
    occurrence = Occurrence(NODE, "Warning", "DriftRepaired", "rewritten")
    try:
        recorder.record(occurrence)
        raise AssertionError("expected ApiUnreachable")
    except ApiUnreachable:
        pass
    recorder.record(occurrence)
    assert len(client.objects) == 1
