"""The shipped admission policy on a real API server: an agent's token, bound to its pod as the kubelet's is, writes
its own node's status object and Events about its own Node, and is refused (403, with the policy's message) for any
other node's, a forged object, another holder in the Lease or a Lease held for ever; it cannot rewrite another
node's Event or the kubelet's, change what its own Events are about, or write large Events; it cannot release
another's hold on the Lease or drop its duration, and a holder whose Lease was taken early says so; without the
policy `ipmasq status` says its rows are unverified; the agents keep working.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from ipmasq.errors import Forbidden, NotFound
from ipmasq.kube import paths
from ipmasq.kube.client import KubeClient
from ipmasq.kube.kubeconfig import load
from ipmasq.lab.kubernetes import agent
from ipmasq.lab.kubernetes.cluster import Cluster
from ipmasq.lab.scenarios import KEEP_10_8, REFERENCE_OPTIONS
from tests.kernel.lab.kubernetes.conftest import module_cluster, progress, run_ipmasq, wait_until

pytestmark = pytest.mark.kubernetes

LEASE = "/apis/coordination.k8s.io/v1/namespaces/kube-system/leases/ip-masq-agent"
POLICY_FILE = "deploy/base/admission-policy.yaml"
METRICS = ("import urllib.request; "
           "print(urllib.request.urlopen('http://127.0.0.1:9847/metrics', timeout=5).read().decode())")


@pytest.fixture(scope="module")
def lab() -> Iterator[Cluster]:
    with module_cluster() as cluster:
        agent.apply_config(cluster, KEEP_10_8)
        agent.deploy_agent(cluster)
        admin = KubeClient(load(str(cluster.kubeconfig)))
        for node in cluster.nodes:
            agent.wait_synced(cluster, node, KEEP_10_8, REFERENCE_OPTIONS)
            # its status object too: the agent writes it from a thread of its own, after its rules
            wait_until(lambda name=node.name: _exists(admin, paths.statuses(name)), 60, f"{node.name}'s status object")
        yield cluster


def _exists(client: KubeClient, path: str) -> bool:
    try:
        client.get(path)
    except NotFound:
        return False
    return True



def _as_agent(lab: Cluster, node: str | None) -> KubeClient:
    """A client with the agents' service account token: bound to the agent's pod on `node` (as the kubelet binds the
    token it mounts: the API server adds the node's name), or bound to nothing (None)."""
    argv = ["create", "token", "ip-masq-agent", "-n", "kube-system", "--duration", "10m"]
    if node is not None:
        pod = agent.agent_pods(lab)[node]["metadata"]
        argv += ["--bound-object-kind", "Pod", "--bound-object-name", pod["name"], "--bound-object-uid", pod["uid"]]
    token = lab.kubectl(*argv).stdout.strip()
    admin = load(str(lab.kubeconfig))
    return KubeClient(dataclasses.replace(admin, token=token, token_file=None, exec_plugin=None,
                                          client_cert_file=None, client_key_file=None, client_cert_data=None,
                                          client_key_data=None))


def _refused(call: Callable[[], object], message: str) -> None:
    with pytest.raises(Forbidden) as raised:
        call()
    assert raised.value.status == 403 and message in raised.value.server_message, raised.value.server_message
    assert "ip-masq-agent-own-node" in raised.value.server_message  # the policy said it, not RBAC


def _node_event(node: str, name: str, writer: str | None = None) -> dict[str, Any]:
    """An Event about Node `node` as the agent on `writer` (default: that node) writes it (ipmasq.kube.events)."""
    writer = writer or node
    return {"apiVersion": "v1", "kind": "Event", "metadata": {"name": name, "namespace": "default"},
            "involvedObject": {"apiVersion": "v1", "kind": "Node", "name": node, "uid": node},
            "type": "Normal", "reason": "PolicyProbe", "message": "written by the admission policy's lab test",
            "source": {"component": "ip-masq-agent", "host": writer}, "reportingComponent": "ip-masq-agent",
            "reportingInstance": writer, "count": 1}


def _admin(lab: Cluster) -> KubeClient:
    return KubeClient(load(str(lab.kubeconfig)))


def _heard(what: str, call: Callable[[], object]) -> str:
    """The API server's answer to one request, for the report: "200", or "403: <the policy's message>"."""
    try:
        call()
    except Forbidden as exc:
        answer = f"{exc.status}: {exc.server_message}"
    else:
        answer = "200"
    progress(f"node trust: {what} -> {answer}")
    return answer


def test_an_agents_token_writes_for_its_own_node_only(lab: Cluster) -> None:
    mine, other = (node.name for node in lab.nodes[:2])
    client = _as_agent(lab, mine)
    own = KubeClient(load(str(lab.kubeconfig))).get(paths.statuses(mine))  # read as admin: the agents may not get
    # its own node's status object and an Event about its own Node: admitted
    client.patch(paths.statuses(mine), {"nodeName": mine})
    created = client.create("/api/v1/namespaces/default/events", _node_event(mine, f"{mine}.policy-probe"))
    assert created["involvedObject"]["name"] == mine
    # another node's: refused by the policy, with its message
    speak_for = f"ip-masq-agent on node {mine} may write only the IPMasqAgentStatus of its own node"
    _refused(lambda: client.patch(paths.statuses(other), {"ready": True, "reason": "forged"}), speak_for)
    forged = {**own, "metadata": {"name": "zzz-forged"}, "nodeName": other}
    _refused(lambda: client.create(paths.statuses(), forged), speak_for)
    _refused(lambda: client.create("/api/v1/namespaces/default/events",
                                   _node_event(other, f"{other}.forged", writer=mine)),
             f"ip-masq-agent on node {mine} may write Events only about its own Node or a ConfigMap")
    _refused(lambda: client.create("/api/v1/namespaces/default/events", _node_event(other, f"{other}.forged-as")),
             f"ip-masq-agent on node {mine} writes Events only as itself")
    _refused(lambda: client.patch(LEASE, {"spec": {"holderIdentity": other}}),
             f"ip-masq-agent on node {mine} may hold the Lease only for itself")
    _refused(lambda: client.patch(LEASE, {"spec": {"holderIdentity": mine, "leaseDurationSeconds": 2147483647}}),
             "ip-masq-agent may hold the Lease for 1 to 120 seconds")
    assert lab.kubectl("get", "ipmasq", "zzz-forged", check=False).returncode != 0
    # a token of the agents' account bound to no pod says no node: it writes nothing
    _refused(lambda: _as_agent(lab, None).patch(paths.statuses(mine), {"nodeName": mine}),
             "authentication.kubernetes.io/node-name")


def test_the_agents_keep_writing_their_status_events_and_the_lease(lab: Cluster) -> None:
    admin = KubeClient(load(str(lab.kubeconfig)))
    names = {node.name for node in lab.nodes}

    def every_status_ready() -> bool:
        items = admin.get(paths.statuses())["items"]
        return {item["metadata"]["name"] for item in items if item.get("ready") is True} >= names

    wait_until(every_status_ready, 60, "every node's agent wrote its status through the policy")

    def held() -> bool:
        holder = (admin.get(LEASE).get("spec") or {}).get("holderIdentity")
        return holder in names

    wait_until(held, 60, "an agent holds the Lease")
    # a config the agents refuse: each writes a ConfigRejected Event about its own Node (admitted by the policy)
    agent.apply_config(lab, "nonMasqueradeCIDRs:\n  - 10.0.0.0/33\n")
    try:
        def rejected_everywhere() -> bool:
            events = admin.get("/api/v1/namespaces/default/events")["items"]
            return {e["involvedObject"]["name"] for e in events if e.get("reason") == "ConfigRejected"} >= names

        wait_until(rejected_everywhere, 60, "every node's ConfigRejected Event about itself")

        def summarized() -> bool:  # the holder's summary on the ConfigMap, written and patched as itself
            return any(e.get("reason") == "ConfigRejected" and e["involvedObject"]["kind"] == "ConfigMap"
                       and str(e.get("message", "")).startswith(f"rejected on {len(names)} of {len(names)} nodes")
                       and e.get("reportingInstance") in names
                       for e in admin.get("/api/v1/namespaces/kube-system/events")["items"])

        wait_until(summarized, 90, "the Lease's holder's summary of the rejection on the ConfigMap")
    finally:
        agent.apply_config(lab, KEEP_10_8)


INTO_SUMMARY = {"involvedObject": {"apiVersion": "v1", "kind": "ConfigMap", "name": "ip-masq-agent",
                                   "namespace": "kube-system"},
                "type": "Normal", "reason": "ConfigApplied", "message": "all good"}


def test_no_token_rewrites_another_nodes_or_the_kubelets_events_or_writes_large_ones(lab: Cluster) -> None:
    """The attacks: a merge patch turning another node's Event, and the kubelet's Event about a Pod in kube-system,
    into an Event about the ConfigMap saying "all good"; an Event of 1 MiB; 200 KB Events in a row."""
    mine, other = (node.name for node in lab.nodes[:2])
    client, theirs, admin = _as_agent(lab, mine), _as_agent(lab, other), _admin(lab)
    default, system = "/api/v1/namespaces/default/events", "/api/v1/namespaces/kube-system/events"
    summary = {**INTO_SUMMARY, "reportingComponent": "ip-masq-agent", "reportingInstance": mine,
               "source": {"component": "ip-masq-agent", "host": mine}}
    # the API server itself keeps an Event in its involvedObject's namespace (a Node's: default), 422 otherwise: so
    # a Node's Event is turned into one about a ConfigMap of default, the kubelet's into one about kube-system's
    in_default = {**summary, "involvedObject": {**summary["involvedObject"], "namespace": "default"}}
    theirs.create(default, _node_event(other, f"{other}.probe-theirs"))  # another node's agent's own Event
    only_its_own = f"ip-masq-agent on node {mine} writes Events only as itself"
    for patch in (in_default, {"message": "all good"}):
        _heard("merge-patch of another node's Event", lambda patch=patch: client.patch(
            paths.events("default", f"{other}.probe-theirs"), patch))
        _refused(lambda patch=patch: client.patch(paths.events("default", f"{other}.probe-theirs"), patch),
                 only_its_own)
    # the kubelet's own Events about the pods it runs (the agent's pod on this node), in kube-system
    kubelets = [e for e in admin.get(system)["items"]
                if (e.get("source") or {}).get("component") == "kubelet"
                or e.get("reportingComponent") == "kubelet"]
    assert kubelets, "the kubelet wrote no Event in kube-system"
    kubelet = kubelets[0]
    where = paths.events("kube-system", kubelet["metadata"]["name"])
    _heard(f"merge-patch of the kubelet's Event about {kubelet['involvedObject']['kind']} "
           f"{kubelet['involvedObject']['name']} into a summary", lambda: client.patch(where, summary))
    _refused(lambda: client.patch(where, summary), only_its_own)
    _refused(lambda: client.patch(where, {"message": "all good"}), only_its_own)
    assert admin.get(where)["message"] == kubelet["message"]
    # its own Event: counted and re-said as the writer does, never turned into another's
    own = paths.events("default", f"{mine}.probe-own")
    client.create(default, _node_event(mine, f"{mine}.probe-own"))
    client.patch(own, {"count": 2, "lastTimestamp": "2026-11-26T18:05:00Z"})
    client.patch(own, {"message": "said again"})
    _heard("UPDATE changing an own Event's involvedObject", lambda: client.patch(own, in_default))
    _refused(lambda: client.patch(own, in_default), "never what they are about")
    # small: a 1 MiB message, annotations, and 200 KB Events one after another are refused before etcd
    small = "ip-masq-agent writes Events of at most 1024 characters of message"
    _heard("an Event with a 1 MiB message", lambda: client.create(default, {
        **_node_event(mine, f"{mine}.probe-huge"), "message": "x" * 2**20}))
    _refused(lambda: client.create(default, {**_node_event(mine, f"{mine}.probe-huge"), "message": "x" * 2**20}),
             small)
    for i in range(5):
        _refused(lambda i=i: client.create(default, {**_node_event(mine, f"{mine}.probe-flood-{i}"),
                                                     "message": "y" * 200_000}), small)
    _refused(lambda: client.patch(own, {"metadata": {"annotations": {"junk": "z" * 200_000}}}), small)
    stored = [e["metadata"]["name"] for e in admin.get(default)["items"]
              if e["metadata"]["name"].startswith(f"{mine}.probe-") and len(json.dumps(e)) > 4096]
    assert stored == []


def _metric(lab: Cluster, node: str, name: str) -> float | None:
    """One sample of the node's agent, read on its loopback status port inside the node's namespace."""
    text = lab.namespace(lab.node(node)).run([sys.executable, "-c", METRICS], check=False).stdout
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return None


def _holder(admin: KubeClient) -> str | None:
    holder = (admin.get(LEASE).get("spec") or {}).get("holderIdentity")
    return holder if isinstance(holder, str) and holder else None


def test_without_the_policy_status_says_its_rows_are_unverified_and_the_agents_stay_ready(lab: Cluster) -> None:
    admin = _admin(lab)
    names = [node.name for node in lab.nodes]
    wait_until(lambda: run_ipmasq(lab, "ipmasq", "status").returncode == 0, 90, "ipmasq status: every node current")
    wait_until(lambda: _holder(admin) in names, 150, "an agent holds the Lease")
    holder = _holder(admin)
    assert holder is not None
    wait_until(lambda: _metric(lab, holder, "ipmasq_node_trust_verified") == 1, 60, "the holder: policy in force")
    lab.kubectl("delete", "validatingadmissionpolicybinding", "ip-masq-agent-own-node")
    try:
        # what the policy kept out: one node's token writes another node's status
        mine, other = (n for n in names if n != holder) if len(names) > 2 else (names[0], names[1])
        before = admin.get(paths.statuses(other))
        client = _as_agent(lab, mine)

        def forged() -> bool:  # the binding's removal reaches the API server's policy cache within seconds
            try:
                client.patch(paths.statuses(other), {"reason": before.get("reason")})
            except Forbidden:
                return False
            return True

        wait_until(forged, 30, "another node's status written without the policy")
        why = ("the admission policy ip-masq-agent-own-node has no binding ip-masq-agent-own-node, so it is not "
               "enforced: any agent's token can write any node's status")
        result = run_ipmasq(lab, "ipmasq", "status")
        progress(f"node trust: ipmasq status without the binding -> exit {result.returncode}, last line: "
                 f"{result.stdout.splitlines()[-1]}")
        assert result.returncode == 1, result.stdout
        assert result.stdout.splitlines()[-1] == (f"{len(names)} of {len(names)} nodes enforce the current config, "
                                                  f"UNVERIFIED: {why} (kubectl apply -k deploy/ installs it)")
        rows = [line for line in result.stdout.splitlines() if line.split()[:1] and line.split()[0] in names]
        assert len(rows) == len(names) and all("yes (unverified)" in row for row in rows), result.stdout
        document = json.loads(run_ipmasq(lab, "ipmasq", "status", "-o", "json").stdout)
        assert document["node_trust"]["verified"] is False and document["all_current"] is True
        assert {row["verified"] for row in document["nodes"]} == {False}
        # the holder: its metric at its next renewal, and its summary on the ConfigMap says so
        wait_until(lambda: _metric(lab, holder, "ipmasq_node_trust_verified") == 0, 90, "the holder: unverified")

        def summary_unverified() -> bool:
            return any(e["involvedObject"]["kind"] == "ConfigMap" and e.get("reportingInstance") == holder
                       and f"(unverified: {why}" in str(e.get("message", ""))
                       for e in admin.get("/api/v1/namespaces/kube-system/events")["items"])

        wait_until(summary_unverified, 90, "the summary Event: unverified")
        assert all(p["status"].get("conditions") for p in agent.agent_pods(lab).values())
        assert run_ipmasq(lab, "kubectl", "wait", "--for=condition=Ready", "pods", "-n", "kube-system", "-l",
                          agent.AGENT_LABEL, "--timeout=1s").returncode == 0  # readiness is not the policy's
    finally:
        lab.kubectl("apply", "-f", str(lab.source / POLICY_FILE))
    wait_until(lambda: run_ipmasq(lab, "ipmasq", "status").returncode == 0, 60, "ipmasq status: verified again")
    wait_until(lambda: _metric(lab, holder, "ipmasq_node_trust_verified") == 1, 90, "the holder: policy in force")


def test_the_lease_cannot_be_released_for_another_or_kept_without_a_duration_and_taken_early_is_said(
        lab: Cluster) -> None:
    admin = _admin(lab)
    names = [node.name for node in lab.nodes]
    wait_until(lambda: _holder(admin) in names, 150, "an agent holds the Lease")
    holder = _holder(admin)
    assert holder is not None
    taker = next(n for n in names if n != holder)
    as_holder, as_taker = _as_agent(lab, holder), _as_agent(lab, taker)
    _heard("another node's hold released", lambda: as_taker.patch(LEASE, {"spec": {"holderIdentity": None}}))
    _refused(lambda: as_taker.patch(LEASE, {"spec": {"holderIdentity": None}}),
             f"ip-masq-agent on node {taker} may hold the Lease only for itself, and release only its own hold")
    _heard("the holder drops the duration", lambda: as_holder.patch(LEASE, {"spec": {"leaseDurationSeconds": None}}))
    _refused(lambda: as_holder.patch(LEASE, {"spec": {"leaseDurationSeconds": None}}),
             "ip-masq-agent may hold the Lease for 1 to 120 seconds, and says how long")
    _refused(lambda: as_holder.patch(LEASE, {"metadata": {"annotations": {"junk": "x" * 100_000}}}),
             "no annotation but ipmasq.dev/nodes")
    assert _metric(lab, holder, "ipmasq_summary_lease_lost_early_total") == 0
    # taken before it expired: the API server cannot refuse it (no clock); the displaced holder says so once
    now = admin.get(LEASE)["spec"].get("renewTime")
    answer = _heard("the Lease taken from a live holder",
                    lambda: as_taker.patch(LEASE, {"spec": {"holderIdentity": taker, "leaseDurationSeconds": 120,
                                                            "acquireTime": now, "renewTime": now}}))
    assert answer == "200"

    def said() -> bool:
        return any(e.get("reason") == "SummaryLeaseLostEarly" and e["involvedObject"]["name"] == holder
                   and e.get("reportingInstance") == holder
                   for e in admin.get("/api/v1/namespaces/default/events")["items"])

    wait_until(said, 90, "the displaced holder's Warning Event on its Node")
    assert _metric(lab, holder, "ipmasq_summary_lease_lost_early_total") == 1
    # the token's holder never renews: after the duration an agent holds it again, and the summary goes on
    wait_until(lambda: _holder(admin) in names, 300, "an agent holds the Lease again")
