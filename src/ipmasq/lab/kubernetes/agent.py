"""The agent on the lab's cluster, installed and configured as users do it: `kubectl apply -k` of the shipped
manifests (only the image's tag changed, by an overlay the lab writes), the ConfigMap with `kubectl apply`.

The lab reads each node's kernel from outside (the backends' own readers, run in the node's network namespace) to
know when the agent has enforced a config; it never waits by sleeping.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import yaml

from ipmasq.backends.base import Backend
from ipmasq.backends.iptables import IptablesBackend, Variant
from ipmasq.backends.nftables import NftablesBackend
from ipmasq.errors import ClusterError
from ipmasq.lab.kubernetes.cluster import Cluster
from ipmasq.lab.kubernetes.layout import NodeSpec
from ipmasq.lab.netns import NamespaceRunner
from ipmasq.lab.scenarios import GKE_FLAGS, NO_RULES, policy_for
from ipmasq.options import PolicyOptions
from ipmasq.policy.policy import Policy
from ipmasq.prefix import Family

__all__ = [
    "AGENT_LABEL", "CONFIGMAP", "OBSERVER", "SHIPPED_BACKEND", "agent_pods", "apply_config", "deploy_agent",
    "deploy_observe_overlay", "deploy_observer",
    "image_name", "kernel", "lab_overlay", "node_options", "overlay_for", "remove_agent", "uninstall",
    "wait_agents_ready", "wait_synced", "wait_volume",
]

AGENT_LABEL = "k8s-app=ip-masq-agent"
OBSERVER = "ipmasq-observer"  # the observe overlays' DaemonSet, and its pods' k8s-app label
SHIPPED_BACKEND = "iptables"  # what deploy/ passes (--backend=iptables); the lab runs nftables through an overlay
CONFIGMAP = "ip-masq-agent"
OVERLAYS = {(): "deploy", GKE_FLAGS: "deploy/overlays/gke"}


def overlay_for(flags: tuple[str, ...]) -> str:
    """The shipped kustomization that runs the agent with these flags."""
    try:
        return OVERLAYS[flags]
    except KeyError:
        raise ClusterError(f"no shipped manifest runs the agent with {' '.join(flags)}") from None


def lab_overlay(cluster: Cluster, shipped: str, image: str, backend: str = SHIPPED_BACKEND) -> Path:
    """A kustomization on top of the shipped one that changes only the image and, for another backend than the
    shipped one, the agent's --backend flag (the shipped files stay as they are)."""
    repository, tag = image.rsplit(":", 1)
    directory = cluster.state / "deploy" / str(shipped).strip("/").replace("/", "-") / backend / tag
    directory.mkdir(parents=True, exist_ok=True)
    kustomization: dict[str, Any] = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        # kustomize takes a base by a relative path only
        "resources": [os.path.relpath((cluster.source / shipped).resolve(), directory.resolve())],
        # the shipped image's name (whatever registry and digest it names): kustomize replaces it by name
        "images": [{"name": image_name(str(_shipped_container(cluster, shipped)["image"])), "newName": repository,
                    "newTag": tag}],
    }
    if backend != SHIPPED_BACKEND:
        args = list(_shipped_container(cluster, shipped)["args"])
        (index,) = [i for i, arg in enumerate(args) if arg == f"--backend={SHIPPED_BACKEND}"]
        kustomization["patches"] = [{
            "target": {"group": "apps", "version": "v1", "kind": "DaemonSet", "name": "ip-masq-agent"},
            "patch": json.dumps([{"op": "replace", "path": f"/spec/template/spec/containers/0/args/{index}",
                                  "value": f"--backend={backend}"}])}]
    (directory / "kustomization.yaml").write_text(json.dumps(kustomization, indent=2) + "\n")
    return directory


def _shipped_container(cluster: Cluster, shipped: str) -> dict[str, Any]:
    """The agent's (or the webhook's) container as a shipped kustomization renders it (`shipped` relative to the
    checkout, or a directory anywhere: an earlier release's manifests)."""
    built = cluster.kubectl("kustomize", str(cluster.source / shipped)).stdout
    (workload,) = [d for d in yaml.safe_load_all(built) if d and d.get("kind") in ("DaemonSet", "Deployment")]
    container: dict[str, Any] = workload["spec"]["template"]["spec"]["containers"][0]
    return container


def image_name(reference: str) -> str:
    """An image reference without its digest and tag: ghcr.io/o/ipmasq:0.2.0@sha256:... -> ghcr.io/o/ipmasq (a
    registry's port is not a tag)."""
    name = reference.split("@", 1)[0]
    head, _, last = name.rpartition("/")
    return f"{head}/{last.split(':', 1)[0]}" if head else last.split(":", 1)[0]


def deploy_agent(cluster: Cluster, shipped: str = "deploy", *, image: str | None = None, wait: bool = True,
                 backend: str = SHIPPED_BACKEND) -> None:
    """`kubectl apply -k` of a shipped kustomization (deploy/ or an overlay), the lab's image in it, the agent on
    `backend`."""
    cluster.apply_shipped(lab_overlay(cluster, shipped, image or cluster.artifacts.image, backend))
    if wait:
        wait_agents_ready(cluster)


def deploy_observer(cluster: Cluster, writer: str, flags: tuple[str, ...], *, image: str | None = None,
                    wait: bool = True) -> None:
    """The shipped DaemonSet with the agent in observe mode (`--observe=WRITER` and the writer's policy flags),
    through a lab overlay of deploy/ that adds them to the container's arguments, as the shipped observe overlays
    do (its name, label, rights, probes and listeners stay the shipped ones, so the lab's helpers find it)."""
    directory = lab_overlay(cluster, "deploy", image or cluster.artifacts.image)
    kustomization = json.loads((directory / "kustomization.yaml").read_text())
    args = "/spec/template/spec/containers/0/args"
    kustomization["patches"] = [{
        "target": {"group": "apps", "version": "v1", "kind": "DaemonSet", "name": "ip-masq-agent"},
        "patch": json.dumps([{"op": "test", "path": f"{args}/0", "value": "agent"},
                             {"op": "add", "path": f"{args}/1", "value": f"--observe={writer}"},
                             *({"op": "add", "path": f"{args}/-", "value": flag} for flag in flags)])}]
    observe = directory.parent / f"observe-{writer}"
    observe.mkdir(exist_ok=True)
    kustomization["resources"] = [os.path.relpath((cluster.source / "deploy").resolve(), observe.resolve())]
    (observe / "kustomization.yaml").write_text(json.dumps(kustomization, indent=2) + "\n")
    cluster.apply_shipped(observe)
    if wait:
        wait_agents_ready(cluster)


def deploy_observe_overlay(cluster: Cluster, shipped: str, *, image: str | None = None, wait: bool = True) -> None:
    """`kubectl apply -k` of a shipped observe overlay (deploy/overlays/observe/eks, ...) as it is, the lab's image
    in it: its DaemonSet, service account and rights are the ones users install (ipmasq-observer)."""
    cluster.apply_shipped(lab_overlay(cluster, shipped, image or cluster.artifacts.image))
    if wait:
        wait_agents_ready(cluster, daemonset=OBSERVER)


def wait_agents_ready(cluster: Cluster, timeout: float = 120.0, *, daemonset: str = "ip-masq-agent") -> None:
    result = cluster.kubectl("rollout", "status", f"daemonset/{daemonset}", "-n", "kube-system",
                             f"--timeout={timeout:.0f}s", check=False, timeout=timeout + 10)
    if result.returncode != 0:
        pods = cluster.kubectl("get", "pods", "-n", "kube-system", "-l", f"k8s-app={daemonset}", "-o", "wide",
                               check=False)
        raise ClusterError(f"the agent's DaemonSet did not roll out: {result.stderr.strip()[-300:]} "
                           f"{pods.stdout.strip()}")


def remove_agent(cluster: Cluster, *, daemonset: str = "ip-masq-agent") -> None:
    """Delete the DaemonSet and wait until its pods are gone (each agent exits on SIGTERM, leaving its rules)."""
    cluster.kubectl("delete", "daemonset", daemonset, "-n", "kube-system", "--ignore-not-found",
                    "--cascade=foreground", "--wait", "--timeout=90s", timeout=120)
    deadline = time.monotonic() + 90
    while agent_pods(cluster, label=f"k8s-app={daemonset}"):
        if time.monotonic() > deadline:
            raise ClusterError("the agent's pods are still there 90 s after the DaemonSet was deleted")
        time.sleep(0.5)


def agent_pods(cluster: Cluster, *, label: str = AGENT_LABEL) -> dict[str, Any]:
    """node name -> the agent's pod there (as the API shows it)."""
    pods = cluster.kubectl_json("get", "pods", "-n", "kube-system", "-l", label)
    return {p["spec"]["nodeName"]: p for p in pods["items"]}


def apply_config(cluster: Cluster, text: str | None) -> None:
    """`kubectl apply` of the ip-masq-agent ConfigMap with this config (None: the ConfigMap deleted)."""
    if text is None:
        cluster.kubectl("delete", "configmap", CONFIGMAP, "-n", "kube-system", "--ignore-not-found")
        return
    cluster.kubectl("apply", "-f", "-", stdin=json.dumps({
        "apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": CONFIGMAP, "namespace": "kube-system"},
        "data": {"config": text}}))


def node_options(options: PolicyOptions, node: NodeSpec) -> PolicyOptions:
    """The agent's options on a node: its name comes from the downward API (NODE_NAME)."""
    return replace(options, node_name=node.name)


def kernel(cluster: Cluster, node: NodeSpec, options: PolicyOptions, backend: str = SHIPPED_BACKEND,
           families: tuple[Family, ...] | None = None) -> Backend:
    """The node's nat rules as the agent's own backend reads them (iptables: Debian's, the nft variant); `families`:
    the ones to read (default: those the options enable, whatever a config says)."""
    runner = NamespaceRunner(cluster.namespace(node))
    if backend == "nftables":
        return NftablesBackend(runner)
    return IptablesBackend(runner, chain=options.masq_chain, variant=Variant.NFT,
                           families=families or policy_for(NO_RULES, options).families)


def wait_synced(cluster: Cluster, node: NodeSpec, config: str | None, options: PolicyOptions, *,
                timeout: float = 60.0, backend: str = SHIPPED_BACKEND) -> float:
    """Wait until the node's kernel holds what the agent should write for this config; returns the seconds."""
    policy: Policy = policy_for(config, node_options(options, node))
    kernel_rules = kernel(cluster, node, options, backend, policy.families)  # a config's enableIPv6 counts
    started = time.monotonic()
    while True:
        if all(kernel_rules.read(f) == kernel_rules.desired(policy, f) for f in policy.families):
            return time.monotonic() - started
        if time.monotonic() - started > timeout:
            pod = _pod_name(cluster, node)
            logs = cluster.kubectl("logs", "-n", "kube-system", pod, "--tail=4", check=False).stdout.strip()
            raise ClusterError(f"{node.name}: the kernel did not reach the config within {timeout:.0f} s "
                               f"(kubectl logs -n kube-system {pod}: ...{' | '.join(logs.splitlines())})")
        time.sleep(0.1)


def wait_volume(cluster: Cluster, node: NodeSpec, config: str | None, *, timeout: float = 180.0) -> float:
    """Wait until kubelet's ConfigMap volume in the node's agent pod holds this config (the file the agent would read
    without the API); returns the seconds. Read in the node's mount namespace, where kubelet mounted it."""
    pod = agent_pods(cluster)[node.name]
    path = (cluster.state / "nodes" / node.name / "kubelet" / "pods" / pod["metadata"]["uid"] / "volumes"
            / "kubernetes.io~configmap" / "config" / CONFIGMAP)
    want = (config or "").encode()
    started = time.monotonic()
    while True:
        shown = subprocess.run(cluster.in_node(node, ["cat", str(path)]), capture_output=True)
        if (shown.stdout if shown.returncode == 0 else b"") == want:
            return time.monotonic() - started
        if time.monotonic() - started > timeout:
            raise ClusterError(f"{node.name}: kubelet's volume did not show the config within {timeout:.0f} s")
        time.sleep(0.2)


def _pod_name(cluster: Cluster, node: NodeSpec) -> str:
    pod = agent_pods(cluster).get(node.name)
    return str(pod["metadata"]["name"]) if pod else "(no agent pod on the node)"


def uninstall(cluster: Cluster, node: NodeSpec, chain: str) -> None:
    """What `ipmasq uninstall` does on the node: our chain and jump gone (run from outside, in its namespace)."""
    result = cluster.namespace(node).run([sys.executable, "-m", "ipmasq", "uninstall", f"--masq-chain={chain}"],
                                         check=False)
    if result.returncode != 0:
        raise ClusterError(f"{node.name}: ipmasq uninstall: {result.stderr.strip()}")


def run_in_pod(cluster: Cluster, namespace: str, pod: str, argv: list[str], *,
               timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    """`kubectl exec` into a pod (the way a user on a workstation runs a command on a node)."""
    return cluster.kubectl("exec", "-n", namespace, pod, "--", *argv, check=False, timeout=timeout)
