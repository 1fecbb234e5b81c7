"""The shipped admission policy on a real API server: an agent's token, bound to its pod as the kubelet's is, writes
its own node's status object and Events about its own Node, and is refused (403, with the policy's message) for any
other node's, a forged object, another holder in the Lease or a Lease held for ever; the agents keep working.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

import pytest

from ipmasq.errors import Forbidden
from ipmasq.kube import paths
from ipmasq.kube.client import KubeClient
from ipmasq.kube.kubeconfig import load
from ipmasq.lab.kubernetes import agent
from ipmasq.lab.kubernetes.cluster import Cluster
from ipmasq.lab.scenarios import KEEP_10_8, REFERENCE_OPTIONS
from tests.kernel.lab.kubernetes.conftest import module_cluster, wait_until

pytestmark = pytest.mark.kubernetes

LEASE = "/apis/coordination.k8s.io/v1/namespaces/kube-system/leases/ip-masq-agent"


@pytest.fixture(scope="module")
def lab() -> Iterator[Cluster]:
    with module_cluster() as cluster:
        agent.apply_config(cluster, KEEP_10_8)
        agent.deploy_agent(cluster)
        for node in cluster.nodes:
            agent.wait_synced(cluster, node, KEEP_10_8, REFERENCE_OPTIONS)
        yield cluster



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


def _node_event(node: str, name: str) -> dict[str, object]:
    return {"apiVersion": "v1", "kind": "Event", "metadata": {"name": name, "namespace": "default"},
            "involvedObject": {"apiVersion": "v1", "kind": "Node", "name": node, "uid": node},
            "type": "Normal", "reason": "PolicyProbe", "message": "written by the admission policy's lab test",
            "source": {"component": "ipmasq-agent", "host": node}, "reportingComponent": "ipmasq-agent",
            "reportingInstance": node, "count": 1}


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
    _refused(lambda: client.create("/api/v1/namespaces/default/events", _node_event(other, f"{other}.forged")),
             f"ip-masq-agent on node {mine} may write Events only about its own Node or a ConfigMap")
    _refused(lambda: client.patch(LEASE, {"spec": {"holderIdentity": other}}),
             f"ip-masq-agent on node {mine} may hold the Lease only for itself")
    _refused(lambda: client.patch(LEASE, {"spec": {"holderIdentity": mine, "leaseDurationSeconds": 2147483647}}),
             "ip-masq-agent may hold the Lease for at most 120 seconds")
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
    finally:
        agent.apply_config(lab, KEEP_10_8)
