"""A stand-in for a provider's own ip-masq-agent on the lab's cluster: not ipmasq, but a DaemonSet that re-applies a
fixed rule set with `iptables-nft-restore --noflush` in a loop, as the hand-made "fix-nat" DaemonSets do and as GKE's
managed agent does every resync (it rewrites its chain whether or not it changed). Observe mode and the two-writers
scene run beside it. It uses the lab's image only for Debian's iptables in it; no ipmasq code runs.
"""

from __future__ import annotations

import json
import time
from typing import Any

from ipmasq.lab.kubernetes.cluster import Cluster, ClusterError

__all__ = ["STAND_IN", "STAND_IN_LABEL", "deploy_stand_in", "gke_defaults_rules", "remove_stand_in"]

STAND_IN = "provider-stand-in"
STAND_IN_LABEL = f"k8s-app={STAND_IN}"
# GKE's agent with no ConfigMap: --nomasq-all-reserved-ranges' list and link-local (kubernetes-sigs/ip-masq-agent
# NewMasqConfig, syncMasqRules), in its chain IP-MASQ
GKE_DEFAULTS = ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10", "192.0.0.0/24", "192.0.2.0/24",
                "192.88.99.0/24", "198.18.0.0/15", "198.51.100.0/24", "203.0.113.0/24", "240.0.0.0/4")


def gke_defaults_rules(chain: str = "IP-MASQ") -> str:
    """The iptables-restore input GKE's agent writes without a ConfigMap (comments as the reference writes them)."""
    non_masq = '-m comment --comment "ip-masq-agent: local traffic is not subject to MASQUERADE"'
    masq = '-m comment --comment "ip-masq-agent: outbound traffic is subject to MASQUERADE (must be last in chain)"'
    body = "".join(f"-A {chain} {non_masq} -d {cidr} -j RETURN\n" for cidr in ("169.254.0.0/16", *GKE_DEFAULTS))
    return f"*nat\n:{chain} - [0:0]\n{body}-A {chain} {masq} -j MASQUERADE --random-fully\nCOMMIT\n"


def _manifests(image: str, rules: str, period: float) -> list[dict[str, Any]]:
    labels = {"k8s-app": STAND_IN}
    loop = (f"while :; do iptables-nft-restore --noflush < /rules/rules || echo 'restore failed' >&2; "
            f"sleep {period:g}; done")
    return [
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": STAND_IN, "namespace": "kube-system"},
         "data": {"rules": rules}},
        {"apiVersion": "apps/v1", "kind": "DaemonSet", "metadata": {"name": STAND_IN, "namespace": "kube-system"},
         "spec": {"selector": {"matchLabels": labels}, "template": {"metadata": {"labels": labels}, "spec": {
             "hostNetwork": True, "tolerations": [{"operator": "Exists"}], "automountServiceAccountToken": False,
             "terminationGracePeriodSeconds": 1,
             "containers": [{"name": "stand-in", "image": image, "command": ["sh", "-c", loop],
                             "securityContext": {"runAsUser": 0, "capabilities": {
                                 "drop": ["ALL"], "add": ["NET_ADMIN", "NET_RAW"]}},
                             "volumeMounts": [{"name": "rules", "mountPath": "/rules", "readOnly": True},
                                              {"name": "xtables-lock", "mountPath": "/run/xtables.lock"}]}],
             "volumes": [{"name": "rules", "configMap": {"name": STAND_IN}},
                         {"name": "xtables-lock", "hostPath": {"path": "/run/xtables.lock",
                                                              "type": "FileOrCreate"}}]}}}},
    ]


def deploy_stand_in(cluster: Cluster, rules: str, *, period: float = 0.5, timeout: float = 120.0) -> None:
    """The stand-in on every node, writing `rules` every `period` seconds; returns once it runs everywhere."""
    for manifest in _manifests(cluster.artifacts.image, rules, period):
        cluster.kubectl("apply", "-f", "-", stdin=json.dumps(manifest))
    result = cluster.kubectl("rollout", "status", f"daemonset/{STAND_IN}", "-n", "kube-system",
                             f"--timeout={timeout:.0f}s", check=False, timeout=timeout + 10)
    if result.returncode != 0:
        raise ClusterError(f"the provider stand-in did not roll out: {result.stderr.strip()[-300:]}")


def remove_stand_in(cluster: Cluster, *, timeout: float = 90.0) -> None:
    """Delete it and wait until its pods are gone: from then on nobody but the agent writes."""
    cluster.kubectl("delete", "daemonset,configmap", STAND_IN, "-n", "kube-system", "--ignore-not-found",
                    "--wait", f"--timeout={timeout:.0f}s", timeout=timeout + 30)
    deadline = time.monotonic() + timeout
    while cluster.kubectl_json("get", "pods", "-n", "kube-system", "-l", STAND_IN_LABEL)["items"]:
        if time.monotonic() > deadline:
            raise ClusterError(f"the provider stand-in's pods are still there {timeout:.0f} s after its deletion")
        time.sleep(0.5)
