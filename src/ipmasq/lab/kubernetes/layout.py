"""The lab cluster's layout: its instance (a second lab beside the first), addresses, Service ranges, API port,
names, kubelet's sync beats, the Pod Security labels, the nodes (NodeSpec, NODES) and the state directory."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ipmasq.errors import ClusterError
from ipmasq.lab.topology import ADDR

__all__ = [
    "API_PORT", "CONTROL_PLANE", "CONTROL_PLANE6", "FAST_SYNC_FREQUENCY", "INSTANCE", "KUBELET_KERNEL_SETTINGS",
    "KUBELET_SYNC_FREQUENCY", "KUBERNETES_SERVICE", "LAB_NAMESPACE", "NETNS_PREFIX", "NODES", "POD_SECURITY_DEFAULT",
    "PRIVILEGED_NAMESPACE_LABELS", "PROBE_DAEMONSET", "SERVICE_CIDR", "SERVICE_CIDR6", "NodeSpec", "state_dir",
]


def _instance() -> str:
    """IPMASQ_LAB_INSTANCE: one digit naming a second (third ...) lab on the machine, beside the default one (""):
    its own namespaces, cgroup tree, state directory and API port, so two clusters run side by side (the test suite
    runs two). Everything else, the cache included, is shared."""
    instance = os.environ.get("IPMASQ_LAB_INSTANCE", "")
    if instance not in ("", *"123456789"):
        raise ClusterError(f"IPMASQ_LAB_INSTANCE must be one digit 1-9 (or empty): {instance[:20]!r}")
    return instance


INSTANCE = _instance()
API_PORT = 16443 + 10 * int(INSTANCE or 0)  # on the machine's loopback: kubectl's way in
CONTROL_PLANE = "10.142.0.2"
SERVICE_CIDR = "10.96.0.0/16"
SERVICE_CIDR6 = "fd00:96::/112"
CONTROL_PLANE6 = "fd00:142::2"
KUBERNETES_SERVICE = "10.96.0.1"
# not the namespace lab's prefix: its stale-namespace sweep must not take a kept cluster
NETNS_PREFIX = f"kl{INSTANCE}"
LAB_NAMESPACE = "ipmasq-lab"  # the long-running probe pods
PROBE_DAEMONSET = "ipmasq-probe"
# kubelet's pod sync period: its ConfigMap volumes are refreshed on that beat. The cluster comes up with kubelet's
# default (1m), as users run it; the scenarios change configs often and switch to FAST_SYNC_FREQUENCY.
KUBELET_SYNC_FREQUENCY = "1m"
FAST_SYNC_FREQUENCY = "2s"
# what kubelet sets unless told otherwise (pkg/kubelet/cm: setupKernelTunables): shown to it, never written
KUBELET_KERNEL_SETTINGS = {"vm/overcommit_memory": "1", "kernel/panic": "10", "kernel/panic_on_oops": "1"}
# Pod Security: what the API server enforces, audits and warns about where a namespace says nothing (a cluster
# hardened as the Pod Security Standards advise), and the labels kube-system needs for the agent's DaemonSet
# (hostNetwork, NET_ADMIN: only `privileged` admits them). The README tells users to set exactly these.
POD_SECURITY_DEFAULT = "baseline"
PRIVILEGED_NAMESPACE_LABELS = {f"pod-security.kubernetes.io/{mode}": "privileged"
                               for mode in ("enforce", "warn", "audit")}


@dataclass(frozen=True)
class NodeSpec:
    name: str
    pool: str
    role: str  # the network namespace's role (kl-ROLE)
    address: str
    pod_cidr: str
    address6: str
    pod_cidr6: str
    extra_addresses: tuple[str, ...] = ()
    proxy_mode: str = "iptables"  # kube-proxy's mode on the node: iptables or nftables

    @property
    def pod_gateway(self) -> str:
        return self.pod_cidr.rsplit(".", 1)[0] + ".1"

    @property
    def pod_gateway6(self) -> str:
        return self.pod_cidr6.split("/", 1)[0] + "1"  # fd00:44:0:14:: -> fd00:44:0:14::1


NODES = (
    # the egress pool's node also holds the spare address the partner's firewall admits
    NodeSpec("gke-prod-egress-pool-7f3k", "egress-pool", "node1", ADDR.node, "10.44.14.0/24", "fd00:142::203",
             "fd00:44:0:14::/64", (ADDR.spare_node,)),
    # kube-proxy in nftables mode here (GA since 1.33, the planned default): the agent beside either mode
    NodeSpec("gke-prod-general-pool-2b9x", "general-pool", "node2", "10.142.15.210", "10.44.15.0/24",
             "fd00:142::210", "fd00:44:0:15::/64", proxy_mode="nftables"),
)


def state_dir() -> Path:
    default = f"/var/lib/ipmasq/kube-lab{'-' + INSTANCE if INSTANCE else ''}"
    return Path(os.environ.get("IPMASQ_LAB_STATE", default))
