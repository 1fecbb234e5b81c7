"""The Lease's holder writes the fleet's verdict on the ConfigMap: one Event per reason, patched as nodes report."""

from __future__ import annotations

import logging
import threading
from dataclasses import replace

import yaml

from ipmasq.agent.api.config import ApiContent
from ipmasq.agent.api.summary import SETTLE_SECONDS, SummaryWriter
from ipmasq.agent.origin import ConfigOrigin
from ipmasq.config.source import ConfigInput
from ipmasq.errors import ApiUnreachable, TooManyRequests
from ipmasq.fleet.nodetrust import POLICY
from ipmasq.kube import paths
from ipmasq.kube.agentstatus import NodeStatus
from ipmasq.kube.configmaps import ConfigMapState
from ipmasq.kube.events import EventRecorder
from ipmasq.kube.lease import LeaseElector
from ipmasq.testing.kube import FakeKubeClient
from tests.conftest import ROOT

NEW = "n" * 64
LINE = "configmap/ip-masq-agent[config]:3: nonMasqueradeCIDRs[0]: invalid CIDR '10.0.0.0/33'"
EVENTS = "/api/v1/namespaces/kube-system/events"
BASE = NodeStatus(node="", pod=None, version="0.1.0", backend="iptables-nft", ready=False, reason="not ready",
                  policy_hash="a" * 64, config_digest="o" * 64, config_source="api", configmaps=(),
                  last_rejection=LINE, last_rejection_time=None, drift_repairs=0, foreign_masquerade_rules=0,
                  updated="", rejected_digest=NEW)


def trusted(client: FakeKubeClient) -> FakeKubeClient:
    """The shipped node-trust policy and its binding installed: the statuses can be believed."""
    for doc in yaml.safe_load_all((ROOT / "deploy" / "base" / "admission-policy.yaml").read_text()):
        kind = doc["kind"]
        client.put(paths.admission_policies(POLICY) if kind == "ValidatingAdmissionPolicy"
                   else paths.admission_policy_bindings(POLICY), doc)
    return client


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
    client, clock = trusted(FakeKubeClient()), Clock()
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


def test_a_new_holder_writes_an_event_of_its_own_and_patches_it() -> None:
    """The node-trust policy lets no node patch another's Event: a new holder says the tally in its own."""
    client, clock = trusted(FakeKubeClient()), Clock()
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
    assert len(summaries(client)) == 2
    (event,) = [e for e in summaries(client) if e["reportingInstance"] == "node-1"]
    assert str(event["message"]).startswith(f"rejected on 3 of 3 nodes: {LINE}")
    client.patch(paths.statuses("node-2"), {"rejectedDigest": None, "configDigest": NEW, "ready": True})
    clock.now += SETTLE_SECONDS * 2
    second.step()
    (event,) = [e for e in summaries(client) if e["reportingInstance"] == "node-1" and e["reason"] == "ConfigRejected"]
    assert str(event["message"]).startswith(f"rejected on 2 of 3 nodes: {LINE}")  # its own, patched


def test_objects_for_nodes_that_do_not_exist_are_not_counted_and_the_count_is_published_for_the_spread() -> None:
    """Five thousand objects no Node owns (anyone with the agents' rights could write them) change nothing."""
    client, clock = trusted(FakeKubeClient()), Clock()
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
    client, clock = trusted(FakeKubeClient()), Clock()
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
    client, clock = trusted(FakeKubeClient()), Clock()
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
    client, clock = trusted(FakeKubeClient()), Clock()
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


class Facts:
    """What the summary tells the agent's metrics."""

    def __init__(self) -> None:
        self.trust: list[bool | None] = []
        self.lost_early = 0

    def node_trust(self, verified: bool | None) -> None:
        self.trust.append(verified)

    def lease_lost_early(self) -> None:
        self.lost_early += 1


def test_without_the_node_trust_policy_every_summary_says_its_counts_are_unverified_until_it_is_installed() -> None:
    client, clock, facts = FakeKubeClient(), Clock(), Facts()
    for i in range(2):
        client.put(paths.statuses(f"node-{i}"), node_status(f"node-{i}", replace(
            BASE, config_digest=NEW, ready=True, last_rejection=None, rejected_digest=None)))
    holder = writer(client, clock, "node-0")
    holder.facts = facts
    clock.now = 10.0
    holder.step()
    clock.now += SETTLE_SECONDS
    holder.step()
    (event,) = summaries(client)
    assert event["message"] == ("enforced on 2 of 2 nodes (unverified: the admission policy ip-masq-agent-own-node "
                                "is not installed: any agent's token can write any node's status (kubectl apply -k "
                                "deploy/ installs it)): policy aaaaaaaaaaaa")
    assert facts.trust == [False]
    trusted(client)  # installed: at the holder's next renewal it looks again, and tallies the content again
    clock.now += 40.0
    holder.step()
    holder.step()
    (event,) = summaries(client)  # its own Event, patched
    assert event["message"] == "enforced on 2 of 2 nodes: policy aaaaaaaaaaaa" and facts.trust == [False, True]


def test_a_lease_taken_before_it_could_expire_is_said_once_and_the_new_holder_tallies() -> None:
    client, clock, facts = trusted(FakeKubeClient()), Clock(), Facts()
    client.put(paths.statuses("node-0"), node_status("node-0"))
    holder = writer(client, clock, "node-0")
    holder.facts = facts
    clock.now = 10.0
    holder.step()
    assert holder.elector.leading
    # a node that does not wait: it writes itself as the holder at once (the policy cannot refuse it: no clock)
    client.patch(paths.leases("kube-system", "ip-masq-agent"), {"spec": {"holderIdentity": "node-9"}})
    clock.now += 40.0
    holder.step()
    assert not holder.elector.leading and facts.lost_early == 1 and facts.trust == [True, None]
    (said,) = [e for e in client.objects.values() if e.get("reason") == "SummaryLeaseLostEarly"]
    assert said["involvedObject"]["kind"] == "Node" and said["involvedObject"]["name"] == "node-0"
    assert str(said["message"]).startswith("Lease kube-system/ip-masq-agent taken from this agent by node-9 40 s "
                                           "after it renewed it, before it could expire (120 s)")
    for _ in range(5):  # said once: asking again as a candidate says nothing more
        clock.now += 200.0
        holder._next_lease = clock.now
        holder.step()
    assert facts.lost_early == 1


def test_a_lease_taken_after_the_holder_could_not_renew_it_is_no_warning() -> None:
    client, clock, facts = trusted(FakeKubeClient()), Clock(), Facts()
    holder = writer(client, clock, "node-0")
    holder.facts = facts
    clock.now = 10.0
    holder.step()
    # the holder cannot renew for longer than the duration (partitioned); another takes over, as it may
    client.patch(paths.leases("kube-system", "ip-masq-agent"), {"spec": {"holderIdentity": "node-1"}})
    clock.now += 130.0
    holder._next_lease = clock.now
    holder.step()
    assert not holder.elector.leading and facts.lost_early == 0
    assert not [e for e in client.objects.values() if e.get("reason") == "SummaryLeaseLostEarly"]
