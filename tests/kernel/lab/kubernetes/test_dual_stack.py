"""The dual-stack cluster: every pod has an IPv4 and an IPv6 address, kubelet, the API server and kube-proxy speak
both families, and the agent enforces both from one ConfigMap (`enableIPv6: true`): for one pod, the IPv4 and IPv6
sources real peers saw are what the config says (masqueraded to the node's address of that family, or kept), what
explain's model predicts and what `kubectl ipmasq trace NODE DEST --source POD` predicts from the node's own routes
and rules (no address given: it reads them in the agent pod).
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Iterator
from typing import Any

import pytest

from ipmasq.lab.kubernetes import agent
from ipmasq.lab.kubernetes.cluster import Cluster
from ipmasq.lab.kubernetes.layout import FAST_SYNC_FREQUENCY, LAB_NAMESPACE, PROBE_DAEMONSET, NodeSpec
from ipmasq.lab.kubernetes.scenarios import BACKENDS, probe_client
from ipmasq.lab.scenarios import REFERENCE_OPTIONS, Phase, Vantage, outcome
from ipmasq.lab.topology import ADDR, OPEN_PORT, Probe
from tests.kernel.lab.kubernetes.conftest import module_cluster, run_ipmasq, wait_until

pytestmark = pytest.mark.kubernetes

# one ConfigMap for both families: the VPC's private space keeps pod addresses, everything else is masqueraded
DUAL_STACK_CONFIG = "enableIPv6: true\nnonMasqueradeCIDRs:\n  - 10.0.0.0/8\n  - fd00::/8\n"
KEPT_V4, MASQUERADED_V4 = Probe(ADDR.vpc_vm, OPEN_PORT), Probe(ADDR.aws_db, OPEN_PORT)
KEPT_V6, MASQUERADED_V6 = Probe(ADDR.vpc_vm6, OPEN_PORT), Probe(ADDR.outside6, OPEN_PORT)
PROBES = (KEPT_V4, MASQUERADED_V4, KEPT_V6, MASQUERADED_V6)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with module_cluster() as lab:
        yield lab


def _family(address: str) -> int:
    return ipaddress.ip_address(address).version


def test_every_node_and_pod_has_both_families_and_kube_proxy_programs_both(cluster: Cluster) -> None:
    pod_ips = cluster.probe_pod_ips()
    for node in cluster.nodes:
        shown = cluster.kubectl_json("get", "node", node.name)
        internal = [a["address"] for a in shown["status"]["addresses"] if a["type"] == "InternalIP"]
        assert internal == [node.address, node.address6], shown["status"]["addresses"]
        assert shown["spec"]["podCIDRs"] == [node.pod_cidr, node.pod_cidr6]
        v4, v6 = pod_ips[node.name]
        assert ipaddress.ip_address(v4) in ipaddress.ip_network(node.pod_cidr)
        assert ipaddress.ip_address(v6) in ipaddress.ip_network(node.pod_cidr6)
    # a Service asking for both families gets a ClusterIP of each, and each node's kube-proxy (iptables mode on one,
    # nftables on the other) writes the IPv6 one into its IPv6 rules
    cluster.kubectl("apply", "-f", "-", stdin=json.dumps({
        "apiVersion": "v1", "kind": "Service", "metadata": {"name": "dual", "namespace": LAB_NAMESPACE},
        "spec": {"ipFamilyPolicy": "RequireDualStack", "selector": {"app": PROBE_DAEMONSET},
                 "ports": [{"port": OPEN_PORT, "protocol": "TCP"}]}}))
    try:
        cluster_ips = cluster.kubectl_json("get", "service", "dual", "-n", LAB_NAMESPACE)["spec"]["clusterIPs"]
        assert [_family(ip) for ip in cluster_ips] == [4, 6], cluster_ips
        for node in cluster.nodes:
            listing = ["ip6tables-save", "-t", "nat"] if node.proxy_mode == "iptables" else \
                ["nft", "list", "table", "ip6", "kube-proxy"]
            namespace = cluster.namespace(node)
            wait_until(lambda ns=namespace, argv=listing: cluster_ips[1] in ns.run(argv, check=False).stdout, 30,
                       f"{node.name}: kube-proxy ({node.proxy_mode}) programs the Service's IPv6 ClusterIP")
    finally:
        cluster.kubectl("delete", "service", "dual", "-n", LAB_NAMESPACE, "--ignore-not-found")


def _trace(cluster: Cluster, node: NodeSpec, pod_ip: str, probe: Probe) -> dict[str, Any]:
    """`kubectl ipmasq trace NODE DEST --source POD --protocol tcp --port P -o json`, the one command from a
    workstation: in the node's agent pod it reads the node's rules, routes, addresses and nat rules itself."""
    result = run_ipmasq(cluster, "kubectl", "ipmasq", "trace", node.name, probe.destination, "--source", pod_ip,
                        "--protocol", "tcp", "--port", str(probe.port), "-o", "json")
    assert result.returncode == 0, (result.stdout, result.stderr)
    report: dict[str, Any] = json.loads(result.stdout)
    return report


def _kernel_route_device(cluster: Cluster, node: NodeSpec, destination: str) -> str:
    """The device the node's kernel routes `destination` by (`ip route get`: the lab's nodes hold no ip rules of
    their own, so a pod's forwarded packet takes the same route)."""
    shown = cluster.namespace(node).run(["ip", "-o", "route", "get", destination]).stdout.split()
    return shown[shown.index("dev") + 1]


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_configmap_decides_both_families_for_one_pod(cluster: Cluster, backend: str) -> None:
    cluster.restart_kubelets(FAST_SYNC_FREQUENCY)  # the ConfigMap reaches the agents within seconds
    agent.apply_config(cluster, DUAL_STACK_CONFIG)
    agent.deploy_agent(cluster, backend=backend)
    phase = Phase("dual-stack", DUAL_STACK_CONFIG, REFERENCE_OPTIONS, PROBES)
    try:
        for node in cluster.nodes:
            agent.wait_synced(cluster, node, DUAL_STACK_CONFIG, REFERENCE_OPTIONS, backend=backend)
        pods, pod_ips = cluster.probe_pods(), cluster.probe_pod_ips()
        assert cluster.world is not None
        for node in cluster.nodes:
            pod = pods[node.name][0]
            v4, v6 = pod_ips[node.name]
            results = cluster.world.probe(list(PROBES), client=probe_client(cluster, pod),
                                          nodes=[cluster.namespace(node)])
            seen = {r.probe: r.seen_source for r in results}
            # what the config says: 10/8 and fd00::/8 keep the pod's address, the rest leaves with the node's
            assert seen == {KEPT_V4: v4, MASQUERADED_V4: node.address, KEPT_V6: v6, MASQUERADED_V6: node.address6}, \
                (node.name, backend, seen)
            assert all(r.connected for r in results), results
            # explain's model, each family from the pod's and the node's address of that family
            for result in results:
                vantage = Vantage(pod_ip=v4 if _family(result.probe.destination) == 4 else v6,
                                  node_ip=node.address if _family(result.probe.destination) == 4 else node.address6,
                                  node_name=node.name)
                predicted = outcome(phase, result, vantage)
                assert predicted.ok, predicted
                # trace on the node, from the node's own routes and rules: the source this peer saw, and the
                # node's interface of that family (the lab's nodes have one uplink) carried it
                traced = _trace(cluster, node, vantage.pod_ip, result.probe)
                assert (traced["source_seen"], traced["source_seen_reason"]) == (result.seen_source, None), \
                    (node.name, backend, result, traced)
                assert traced["egress_interface"] == _kernel_route_device(cluster, node, result.probe.destination), \
                    (node.name, traced)
    finally:
        agent.remove_agent(cluster)
        for node in cluster.nodes:
            agent.uninstall(cluster, node, REFERENCE_OPTIONS.masq_chain)
        agent.apply_config(cluster, None)
