"""A stand-in for a provider's ip-masq-agent on the lab's cluster, that is not ipmasq: a DaemonSet on the host network
whose container only runs a shell loop of `iptables-restore --noflush` of a fixed rule set, as the hand-made "fix-nat"
DaemonSets do, and as GKE's managed agent behaves from the node's point of view (it writes IP-MASQ and keeps it).

The rule set is GKE's default one as the reference agent writes it (chain IP-MASQ, every reserved range preserved,
no --random-fully: the reference v2.9.1's output on a GKE 1.14 node), from a ConfigMap; the script ensures the
POSTROUTING jump once and then restores the chain every LOOP_SECONDS (a restore with a chain declared replaces that
chain whole, leaving the rest of the table). `catch_up` makes the writer on one node take another rule set (what a
provider's agent does when it finally reads the new ConfigMap): it writes /tmp/rules in that node's pod, which the
loop prefers. The container image is the lab's agent image, used only for its iptables and /bin/sh.

Another provider's agent is played the same way: `deploy(cluster, rules, name=..., env=...)` with that agent's rules
(ipmasq.testing.writers: AKS's IP-MASQ-AGENT, the VPC CNI's AWS-SNAT-CHAIN-0; the chain and its POSTROUTING jump are
taken from the rules) under that agent's DaemonSet and container name (EKS: aws-node, whose container env is the
CNI's settings, which observe mode reads; the loop ignores it, as ipamd applies it only when it starts). HOST_IP in
the rules stands for the node's address (the VPC CNI SNATs to the node's primary address).

Used by observe mode's lab tests (ipmasq beside it in observe mode) and by the two-writers test (ipmasq enforcing the
same chain beside it: there the stand-in leaves the jump to ipmasq and restores twice a second).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping

from ipmasq.errors import ClusterError
from ipmasq.lab.kubernetes.cluster import Cluster, NodeSpec

__all__ = ["GKE_DEFAULT_RULES", "HOST_IP", "JUMP", "LABEL", "NAME", "catch_up", "chain_of", "chain_only", "deploy",
           "node_rules", "remove", "wait_rolled_out", "wait_written"]

NAME = "gke-ip-masq-standin"
LABEL = f"k8s-app={NAME}"
LOOP_SECONDS = 1
CHAIN = "IP-MASQ"
HOST_IP = "@HOST_IP@"  # in the rules: the node's address (the pod's status.hostIP: a host-network pod's own)
JUMP = ('-m comment --comment "ip-masq-agent: ensure nat POSTROUTING directs all non-LOCAL destination traffic to '
        f'our custom {CHAIN} chain" -m addrtype ! --dst-type LOCAL -j {CHAIN}')
_RESERVED = ("169.254.0.0/16", "10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10", "192.0.0.0/24",
             "192.0.2.0/24", "192.88.99.0/24", "198.18.0.0/15", "198.51.100.0/24", "203.0.113.0/24", "240.0.0.0/4")
GKE_DEFAULT_RULES = "".join(
    ["*nat\n", f":{CHAIN} - [0:0]\n"]
    + [f'-A {CHAIN} -d {cidr} -m comment --comment "ip-masq-agent: local traffic is not subject to MASQUERADE" '
       "-j RETURN\n" for cidr in _RESERVED]
    + [f'-A {CHAIN} -m comment --comment "ip-masq-agent: outbound traffic is subject to MASQUERADE (must be last '
       'in chain)" -j MASQUERADE\n', "COMMIT\n"])

# the loop: the jump once (checked, never duplicated; left out where an enforcing ipmasq beside it writes its own),
# then the chain restored every `period` seconds from the rules the pod was given (/tmp/rules once catch_up wrote it,
# else the ConfigMap's), HOST_IP replaced by the node's address
def _jump_once(chain: str, jump: str) -> str:
    return f"""iptables -t nat -N {chain} 2>/dev/null || true
iptables -t nat -C POSTROUTING {jump} 2>/dev/null || iptables -t nat -A POSTROUTING {jump}
"""


def _script(period: float, chain: str, jump: str | None) -> str:
    return "set -u\n" + (_jump_once(chain, jump) if jump is not None else "") + f"""while true; do
  rules=/rules/rules; [ -s /tmp/rules ] && rules=/tmp/rules
  sed "s/{HOST_IP}/$HOST_IP/g" "$rules" | iptables-restore --noflush || echo "restore failed" >&2
  sleep {period:g}
done
"""


def chain_of(rules: str) -> str:
    """The chain an iptables-restore text declares (the writer's own)."""
    chains = [line[1:].split(" ", 1)[0] for line in rules.splitlines() if line.startswith(":")]
    if len(chains) != 1:
        raise ClusterError(f"the stand-in writes one chain; these rules declare {len(chains)}")
    return chains[0]


def _jump_of(rules: str, chain: str) -> str:
    """The POSTROUTING jump as the rules write it (GKE's default set has none: the reference agent's)."""
    jumps = [line.removeprefix("-A POSTROUTING ") for line in rules.splitlines()
             if line.startswith("-A POSTROUTING ") and line.endswith(f"-j {chain}")]
    return jumps[0] if jumps else JUMP


def _manifests(image: str, rules: str, script: str, name: str,
               env: Mapping[str, str]) -> list[dict[str, object]]:
    labels = {"k8s-app": name}
    configmap: dict[str, object] = {"apiVersion": "v1", "kind": "ConfigMap",
                                    "metadata": {"name": name, "namespace": "kube-system"}, "data": {"rules": rules}}
    host_ip: dict[str, object] = {"name": "HOST_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.hostIP"}}}
    variables = [host_ip, *({"name": k, "value": v} for k, v in env.items())]
    daemonset: dict[str, object] = {
        "apiVersion": "apps/v1", "kind": "DaemonSet", "metadata": {"name": name, "namespace": "kube-system",
                                                                   "labels": labels},
        "spec": {"selector": {"matchLabels": labels}, "template": {"metadata": {"labels": labels}, "spec": {
            "hostNetwork": True, "automountServiceAccountToken": False, "tolerations": [{"operator": "Exists"}],
            "terminationGracePeriodSeconds": 1,
            "containers": [{
                "name": name, "image": image, "command": ["/bin/sh", "-c", script], "env": variables,
                "securityContext": {"runAsUser": 0, "capabilities": {"drop": ["ALL"], "add": ["NET_ADMIN",
                                                                                             "NET_RAW"]}},
                "volumeMounts": [{"name": "rules", "mountPath": "/rules", "readOnly": True},
                                 {"name": "xtables-lock", "mountPath": "/run/xtables.lock"}]}],
            "volumes": [{"name": "rules", "configMap": {"name": name}},
                        {"name": "xtables-lock", "hostPath": {"path": "/run/xtables.lock", "type": "FileOrCreate"}}],
        }}}}
    return [configmap, daemonset]


def deploy(cluster: Cluster, rules: str = GKE_DEFAULT_RULES, *, period: float = LOOP_SECONDS, jump: bool = True,
           wait: bool = True, timeout: float = 120.0, name: str = NAME, env: Mapping[str, str] | None = None) -> None:
    """The stand-in on every node as the DaemonSet `name` (its container named alike, with `env`), writing `rules`
    every `period` seconds (and their POSTROUTING jump once, with `jump`); returns once it runs everywhere and, with
    `wait`, once its chain is on every node (not where an enforcing agent fights it)."""
    chain = chain_of(rules)
    script = _script(period, chain, _jump_of(rules, chain) if jump else None)
    for manifest in _manifests(cluster.artifacts.image, chain_only(rules), script, name, env or {}):
        cluster.kubectl("apply", "-f", "-", stdin=json.dumps(manifest))
    wait_rolled_out(cluster, name, timeout=timeout)
    for node in cluster.nodes if wait else ():
        wait_written(cluster, node, rules, timeout=timeout)


def wait_rolled_out(cluster: Cluster, name: str = NAME, *, timeout: float = 120.0) -> None:
    """Until every node runs the DaemonSet's current pod (after a change of its env, say)."""
    result = cluster.kubectl("rollout", "status", f"daemonset/{name}", "-n", "kube-system",
                             f"--timeout={timeout:.0f}s", check=False, timeout=timeout + 10)
    if result.returncode != 0:
        raise ClusterError(f"the stand-in writer did not roll out: {result.stderr.strip()[-300:]}")


def remove(cluster: Cluster, *, name: str = NAME, timeout: float = 90.0) -> None:
    """The DaemonSet and its ConfigMap deleted, and its pods waited for (from then on nobody else writes; its rules
    stay, as a provider's agent leaves them)."""
    cluster.kubectl("delete", "daemonset,configmap", name, "-n", "kube-system", "--ignore-not-found", "--wait",
                    f"--timeout={timeout:.0f}s", timeout=timeout + 30)
    deadline = time.monotonic() + timeout
    while cluster.kubectl_json("get", "pods", "-n", "kube-system", "-l", f"k8s-app={name}")["items"]:
        if time.monotonic() > deadline:
            raise ClusterError(f"the stand-in's pods are still there {timeout:.0f} s after its deletion")
        time.sleep(0.5)


def node_rules(cluster: Cluster, node: NodeSpec, chain: str = CHAIN) -> list[str]:
    """The stand-in's chain on the node as iptables-save prints it (its rules, in order)."""
    save = cluster.namespace(node).run(["iptables-save", "-t", "nat"]).stdout
    return [line for line in save.splitlines() if line.startswith(f"-A {chain} ")]


def _wanted(rules: str, chain: str, node: NodeSpec) -> list[str]:
    return [line.replace(HOST_IP, node.address) for line in rules.splitlines() if line.startswith(f"-A {chain} ")]


def wait_written(cluster: Cluster, node: NodeSpec, rules: str, *, timeout: float = 60.0) -> float:
    """Until the node's chain holds `rules` (as iptables-save prints them: the comment's place may move); seconds."""
    def canonical(lines: list[str]) -> list[list[str]]:
        return [sorted(line.split(" -")) for line in lines]

    chain = chain_of(rules)
    want = canonical(_wanted(rules, chain, node))
    started = time.monotonic()
    while canonical(node_rules(cluster, node, chain)) != want:
        if time.monotonic() - started > timeout:
            raise ClusterError(f"{node.name}: the stand-in's rules are not on the node after {timeout:.0f} s")
        time.sleep(0.2)
    return time.monotonic() - started


def _pod(cluster: Cluster, node: NodeSpec, name: str) -> str:
    pods = cluster.kubectl_json("get", "pods", "-n", "kube-system", "-l", f"k8s-app={name}", "--field-selector",
                                f"spec.nodeName={node.name}")
    running = [p["metadata"]["name"] for p in pods["items"] if p.get("status", {}).get("phase") == "Running"
               and not p["metadata"].get("deletionTimestamp")]
    if not running:
        raise ClusterError(f"{node.name}: no running stand-in writer pod")
    return str(running[0])


def chain_only(rules: str) -> str:
    """An iptables-restore text kept to the chain itself (a POSTROUTING jump in it would be appended again at
    every restore of the loop, which ensures the jump once)."""
    chain = chain_of(rules)
    kept = [line for line in rules.splitlines()
            if line in ("*nat", "COMMIT") or line.startswith((f":{chain} ", f"-A {chain} "))]
    return "\n".join(kept) + "\n"


def catch_up(cluster: Cluster, node: NodeSpec, rules: str, *, name: str = NAME) -> None:
    """The writer on `node` takes `rules` (its chain's part) from now on (the other nodes' keep theirs, and a new pod
    there starts again from the ConfigMap's)."""
    cluster.kubectl("exec", "-i", "-n", "kube-system", _pod(cluster, node, name), "--", "/bin/sh", "-c",
                    "cat > /tmp/rules.new && mv /tmp/rules.new /tmp/rules", stdin=chain_only(rules))
