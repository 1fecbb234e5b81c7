"""The namespace lab's scenarios on the real cluster: the same phases, the same predictions (explain's model), with
the agent as a DaemonSet and the probes sent from a real pod on each node.

How a phase's world is made here:
    config            `kubectl apply` of the ConfigMap (None: deleted); kubelet's volume brings it to the agents
    agent running     the shipped DaemonSet (deploy/, or deploy/overlays/gke for GKE's flags) applied
    agent stopped     the DaemonSet deleted: every agent exits on SIGTERM and leaves its rules
    agent uninstalled the DaemonSet deleted and `ipmasq uninstall` run on each node
    node recreated    the node's netfilter flushed (its kube-proxy restarted to write its own rules again) and its
                      agent's pod deleted: the DaemonSet starts a new one on a node with no rules
    hand-written rule the operator's iptables command, run on the node
    node name         the phase probes from the pod on the node of that name; otherwise from every node
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable

from ipmasq.errors import IpmasqError
from ipmasq.lab.kubernetes import agent
from ipmasq.lab.kubernetes.cluster import Cluster
from ipmasq.lab.kubernetes.layout import FAST_SYNC_FREQUENCY, LAB_NAMESPACE, NodeSpec
from ipmasq.lab.run import ScenarioResult
from ipmasq.lab.scenarios import Phase, PhaseResult, Scenario, Vantage, outcome
from ipmasq.lab.topology import ProbeClient

__all__ = ["BACKENDS", "probe_client", "run_scenario", "scenario_backend"]

BACKENDS = ("iptables", "nftables")


def scenario_backend(index: int) -> str:
    """The agent's backend for the scenario at this place in a run: they alternate, so a run of every scenario has
    the agent on both backends, each beside kube-proxy in iptables mode on one node and nftables mode on the other."""
    return BACKENDS[index % len(BACKENDS)]


def probe_client(cluster: Cluster, pod: str) -> ProbeClient:
    """The probe client run in a real pod (`kubectl exec`), where Lab.probe starts its probes."""
    def run(argv: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
        return agent.run_in_pod(cluster, LAB_NAMESPACE, pod, ["python", *argv], timeout=timeout)
    return run


def _phase_nodes(cluster: Cluster, phase: Phase) -> list[NodeSpec]:
    if phase.options.node_name is not None:
        return [cluster.node(phase.options.node_name)]
    return list(cluster.nodes)


def recreate_node(cluster: Cluster, node: NodeSpec, *, agent_running: bool) -> None:
    """The node as a new one comes up: no netfilter rules but those its own daemons write, a new agent."""
    ns = cluster.namespace(node)
    ns.run(["nft", "flush", "ruleset"])
    ns.run(["conntrack", "-F"], check=False)
    cluster.restart_kube_proxy(node)
    if agent_running:
        pod = agent.agent_pods(cluster).get(node.name)
        if pod is not None:
            cluster.kubectl("delete", "pod", "-n", "kube-system", str(pod["metadata"]["name"]),
                            "--wait=true", timeout=90)
        agent.wait_agents_ready(cluster)


def run_scenario(cluster: Cluster, scenario: Scenario, *, progress: Callable[[str], None] = lambda _l: None,
                 backend: str = agent.SHIPPED_BACKEND) -> ScenarioResult:
    """The scenario's phases with the agent on `backend` (the DaemonSet as shipped, or through the lab's overlay)."""
    result = ScenarioResult(scenario.name, scenario.summary)
    cluster.restart_kubelets(FAST_SYNC_FREQUENCY)  # config changes reach the nodes within seconds, not a minute
    assert cluster.world is not None
    world = cluster.world
    shipped = agent.overlay_for(scenario.flags)
    chain = scenario.phases[0].options.masq_chain
    running = False
    try:
        for phase in scenario.phases:
            progress(f"{scenario.name}: {phase.name}")
            nodes = _phase_nodes(cluster, phase)
            if phase.agent == "running":
                agent.apply_config(cluster, phase.config)
                if phase.recreate_node:
                    for node in nodes:
                        recreate_node(cluster, node, agent_running=running)
                if not running:
                    agent.deploy_agent(cluster, shipped, backend=backend)
                    running = True
                for node in nodes:
                    agent.wait_synced(cluster, node, phase.config, phase.options, backend=backend)
            else:
                agent.remove_agent(cluster)
                running = False
                for node in nodes:
                    if phase.agent == "uninstalled":
                        agent.uninstall(cluster, node, chain)
                    else:  # SIGTERM left the rules
                        agent.wait_synced(cluster, node, phase.config, phase.options, timeout=0, backend=backend)
            for rule in phase.hand_written:
                for node in nodes:
                    cluster.namespace(node).run(rule.command)
            if world.cloud_nat_mode is not phase.cloud_nat:
                world.set_cloud_nat(phase.cloud_nat)
            pods = cluster.probe_pods()
            outcomes = []
            for node in nodes:
                pod, pod_ip = pods[node.name]
                seen = world.probe(list(phase.probes), client=probe_client(cluster, pod),
                                   nodes=[cluster.namespace(node)])
                vantage = Vantage(pod_ip=pod_ip, node_ip=node.address, node_name=node.name)
                outcomes += [outcome(phase, r, vantage) for r in seen]
            result.phases.append(PhaseResult(phase.name, outcomes))
    except IpmasqError as exc:
        result.error = str(exc)
    finally:
        try:
            agent.remove_agent(cluster)
            for node in cluster.nodes:
                agent.uninstall(cluster, node, chain)
                for phase in scenario.phases:
                    for rule in phase.hand_written:  # an operator's rule is no agent's to uninstall
                        delete = ["-D" if word == "-I" else word for word in rule.command]
                        cluster.namespace(node).run(delete, check=False)
        except IpmasqError as exc:
            result.error = result.error or f"cleaning up after the scenario: {exc}"
    return result
