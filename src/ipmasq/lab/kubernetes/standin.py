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

Used by observe mode's lab tests (ipmasq beside it in observe mode), by the two-writers test (ipmasq enforcing the
same chain beside it: there the stand-in leaves the jump to ipmasq and restores twice a second), and by the uninstall
beside a provider. `GKE`, `AKS` and `EKS` are those providers' agents as the API shows them and as they write their
chain (`deploy_as`): GKE's `kube-system/ip-masq-agent` DaemonSet and ServiceAccount (the k8s-app label and the addon
manager's, exactly the names, label and chain ipmasq's drop-in uses: IP-MASQ with the reference agent's comments),
AKS's `azure-ip-masq-agent` labelled as aks-engine's addon template labels it (IP-MASQ-AGENT, no --random-fully),
EKS's `aws-node` with the VPC CNI's AWS-SNAT-CHAIN-0 and its SNAT settings in the env; each one's rules in a ConfigMap
of the lab's own (never the user's `ip-masq-agent`). `clear` takes a stand-in's chain off the nodes once it is gone
(a provider's agent leaves its rules behind; the next test starts from nodes without them).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from ipmasq.errors import ClusterError
from ipmasq.lab.kubernetes.cluster import Cluster
from ipmasq.lab.kubernetes.layout import NodeSpec
from ipmasq.testing.writers import aws_snat_rules, ip_masq_agent_rules

__all__ = ["ADDON_LABELS", "AKS", "EKS", "EKS_EXCLUDED", "EKS_VPC", "GKE", "GKE_DEFAULT_RULES", "HOST_IP", "JUMP",
           "LABEL", "NAME", "StandIn", "catch_up", "chain_of", "chain_only", "clear", "deploy", "deploy_as",
           "node_rules", "remove", "remove_as", "wait_rolled_out", "wait_written"]

NAME = "gke-ip-masq-standin"
# what GKE's addon manifest labels its ip-masq-agent with (the addon manager reconciles it)
ADDON_LABELS = {"addonmanager.kubernetes.io/mode": "Reconcile", "kubernetes.io/cluster-service": "true"}
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



@dataclass(frozen=True)
class StandIn:
    """A provider's agent as the stand-in plays it: its DaemonSet (and container) `name`, the labels on its DaemonSet
    and ServiceAccount besides `k8s-app: NAME`, the rules it writes, its ServiceAccount (None: none), its
    container's env, and the lab's ConfigMap that holds its rules."""

    name: str
    labels: Mapping[str, str]
    rules: str
    service_account: str | None
    rules_configmap: str
    env: Mapping[str, str] = field(default_factory=dict)

    @property
    def chain(self) -> str:
        return chain_of(self.rules)


# GKE's managed ip-masq-agent (kubernetes/kubernetes cluster/addons/ip-masq-agent): the very names, label and chain
# of ipmasq's drop-in; only the addon manager's label says it is GKE's
GKE = StandIn("ip-masq-agent", {"addonmanager.kubernetes.io/mode": "Reconcile"}, GKE_DEFAULT_RULES, "ip-masq-agent",
              "gke-ip-masq-agent-standin-rules")
# AKS's azure-ip-masq-agent as aks-engine's addon template labels it, and as AKS labels what it manages
AKS = StandIn("azure-ip-masq-agent", {**ADDON_LABELS, "component": "azure-ip-masq-agent",
                                      "kubernetes.azure.com/managedby": "aks"},
              ip_masq_agent_rules("IP-MASQ-AGENT", ("10.0.0.0/8",), random_fully=False), None,
              "aks-ip-masq-agent-standin-rules")
EKS_VPC = "10.0.0.0/8"  # the lab's nodes, pods and services: in-cluster traffic keeps its address, as in a VPC
EKS_EXCLUDED = ("192.168.0.0/16",)  # what the CNI was started with
# the Amazon VPC CNI's aws-node as its chart labels it, its SNAT settings in the container's env
EKS = StandIn("aws-node", {"app.kubernetes.io/name": "aws-node", "app.kubernetes.io/instance": "aws-vpc-cni"},
              aws_snat_rules(EKS_VPC, EKS_EXCLUDED, HOST_IP), "aws-node", "eks-aws-node-standin-rules",
              {"AWS_VPC_K8S_CNI_EXCLUDE_SNAT_CIDRS": ",".join(EKS_EXCLUDED)})


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


def _manifests(image: str, rules: str, script: str, name: str, env: Mapping[str, str],
               extra_labels: Mapping[str, str], rules_configmap: str,
               service_account: str | None) -> list[dict[str, object]]:
    labels = {"k8s-app": name}
    configmap: dict[str, object] = {"apiVersion": "v1", "kind": "ConfigMap",
                                    "metadata": {"name": rules_configmap, "namespace": "kube-system",
                                                 "labels": {**labels, **extra_labels}},
                                    "data": {"rules": rules}}
    accounts: list[dict[str, object]] = [] if service_account is None else [{
        "apiVersion": "v1", "kind": "ServiceAccount",
        "metadata": {"name": service_account, "namespace": "kube-system", "labels": {**labels, **extra_labels}}}]
    account: dict[str, object] = {} if service_account is None else {"serviceAccountName": service_account}
    host_ip: dict[str, object] = {"name": "HOST_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.hostIP"}}}
    variables = [host_ip, *({"name": k, "value": v} for k, v in env.items())]
    daemonset: dict[str, object] = {
        "apiVersion": "apps/v1", "kind": "DaemonSet", "metadata": {"name": name, "namespace": "kube-system",
                                                                   "labels": {**labels, **extra_labels}},
        "spec": {"selector": {"matchLabels": labels}, "template": {"metadata": {"labels": labels}, "spec": {
            **account, "hostNetwork": True, "automountServiceAccountToken": False,
            "tolerations": [{"operator": "Exists"}],
            "terminationGracePeriodSeconds": 1,
            "containers": [{
                "name": name, "image": image, "command": ["/bin/sh", "-c", script], "env": variables,
                "securityContext": {"runAsUser": 0, "capabilities": {"drop": ["ALL"], "add": ["NET_ADMIN",
                                                                                             "NET_RAW"]}},
                "volumeMounts": [{"name": "rules", "mountPath": "/rules", "readOnly": True},
                                 {"name": "xtables-lock", "mountPath": "/run/xtables.lock"}]}],
            "volumes": [{"name": "rules", "configMap": {"name": rules_configmap}},
                        {"name": "xtables-lock", "hostPath": {"path": "/run/xtables.lock", "type": "FileOrCreate"}}],
        }}}}
    return [*accounts, configmap, daemonset]


def deploy(cluster: Cluster, rules: str = GKE_DEFAULT_RULES, *, period: float = LOOP_SECONDS, jump: bool = True,
           wait: bool = True, timeout: float = 120.0, name: str = NAME, env: Mapping[str, str] | None = None,
           labels: Mapping[str, str] | None = None, configmap: str | None = None,
           service_account: str | None = None) -> None:
    """The stand-in on every node as the DaemonSet `name` (its container named alike, with `env`; `labels` besides
    its k8s-app one; running as `service_account`, made with the same labels, when given), writing `rules` (from the
    ConfigMap `configmap`, default `name`) every `period` seconds (and their POSTROUTING jump once, with `jump`);
    returns once it runs everywhere and, with `wait`, once its chain is on every node (not where an enforcing agent
    fights it)."""
    chain = chain_of(rules)
    script = _script(period, chain, _jump_of(rules, chain) if jump else None)
    for manifest in _manifests(cluster.artifacts.image, chain_only(rules), script, name, env or {}, labels or {},
                               configmap or name, service_account):
        cluster.kubectl("apply", "-f", "-", stdin=json.dumps(manifest))
    wait_rolled_out(cluster, name, timeout=timeout)
    for node in cluster.nodes if wait else ():
        wait_written(cluster, node, rules, timeout=timeout)


def deploy_as(cluster: Cluster, agent: StandIn, *, timeout: float = 120.0) -> None:
    """A provider's agent (GKE, AKS, EKS) on every node, its chain written everywhere."""
    deploy(cluster, agent.rules, name=agent.name, env=agent.env, labels=agent.labels,
           configmap=agent.rules_configmap, service_account=agent.service_account, timeout=timeout)


def remove_as(cluster: Cluster, agent: StandIn, *, timeout: float = 90.0) -> None:
    """Its DaemonSet, ConfigMap and ServiceAccount deleted, its pods gone (its chain stays on the nodes: `clear`)."""
    remove(cluster, name=agent.name, configmap=agent.rules_configmap, timeout=timeout)
    if agent.service_account is not None:
        cluster.kubectl("delete", "serviceaccount", agent.service_account, "-n", "kube-system", "--ignore-not-found")


def clear(cluster: Cluster, rules: str) -> None:
    """The chain these rules declare, and every POSTROUTING jump to it, taken off every node (run in the node's
    namespace with iptables itself, as the provider's agent's own clean-up would: no ipmasq code decides it)."""
    chain = chain_of(rules)
    for node in cluster.nodes:
        namespace = cluster.namespace(node)
        save = namespace.run(["iptables-save", "-t", "nat"]).stdout
        jumps = [line for line in save.splitlines() if line.startswith("-A POSTROUTING ")
                 and line.endswith(f"-j {chain}")]
        if not jumps and f":{chain} " not in save:
            continue
        text = "*nat\n" + "".join(line.replace("-A ", "-D ", 1) + "\n" for line in jumps)
        text += f"-F {chain}\n-X {chain}\nCOMMIT\n" if f":{chain} " in save else "COMMIT\n"
        result = namespace.run(["iptables-restore", "--noflush"], stdin=text, check=False)
        if result.returncode != 0:
            raise ClusterError(f"{node.name}: the stand-in's {chain} could not be cleared: {result.stderr.strip()}")


def wait_rolled_out(cluster: Cluster, name: str = NAME, *, timeout: float = 120.0) -> None:
    """Until every node runs the DaemonSet's current pod (after a change of its env, say)."""
    result = cluster.kubectl("rollout", "status", f"daemonset/{name}", "-n", "kube-system",
                             f"--timeout={timeout:.0f}s", check=False, timeout=timeout + 10)
    if result.returncode != 0:
        raise ClusterError(f"the stand-in writer did not roll out: {result.stderr.strip()[-300:]}")


def remove(cluster: Cluster, *, name: str = NAME, timeout: float = 90.0, configmap: str | None = None) -> None:
    """The DaemonSet and its ConfigMap deleted, and its pods waited for (from then on nobody else writes; its rules
    stay, as a provider's agent leaves them)."""
    cluster.kubectl("delete", f"daemonset/{name}", f"configmap/{configmap or name}", "-n", "kube-system",
                    "--ignore-not-found", "--wait", f"--timeout={timeout:.0f}s", timeout=timeout + 30)
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
