"""The stand-in writer's rule handling (no cluster): it writes any provider's chain with that chain's own jump."""

from __future__ import annotations

import pytest

from ipmasq.errors import ClusterError
from ipmasq.lab.kubernetes import standin
from ipmasq.testing.writers import aws_snat_rules, ip_masq_agent_rules


def test_the_chain_and_its_jump_come_from_the_providers_rules() -> None:
    eks = aws_snat_rules("10.0.0.0/8", ("192.168.0.0/16",), standin.HOST_IP)
    assert standin.chain_of(eks) == "AWS-SNAT-CHAIN-0"
    script = standin._script(1, "AWS-SNAT-CHAIN-0", standin._jump_of(eks, "AWS-SNAT-CHAIN-0"))
    assert 'iptables -t nat -C POSTROUTING -m comment --comment "AWS SNAT CHAIN" -j AWS-SNAT-CHAIN-0' in script
    assert f's/{standin.HOST_IP}/$HOST_IP/g' in script  # the node's own address, from the downward API
    # the restored text keeps the chain only: the jump is ensured once, never appended at each restore
    assert "POSTROUTING" not in standin.chain_only(eks)
    aks = ip_masq_agent_rules("IP-MASQ-AGENT", ("10.0.0.0/8",), random_fully=False)
    assert standin._jump_of(aks, "IP-MASQ-AGENT").endswith("-m addrtype ! --dst-type LOCAL -j IP-MASQ-AGENT")
    # GKE's default set has no jump line: the reference agent's
    assert standin._jump_of(standin.GKE_DEFAULT_RULES, "IP-MASQ") == standin.JUMP
    assert "-C POSTROUTING" not in standin._script(0.5, "IP-MASQ", None)  # beside an enforcing ipmasq


def test_one_chain_only() -> None:
    with pytest.raises(ClusterError, match="one chain"):
        standin.chain_of("*nat\n:A - [0:0]\n:B - [0:0]\nCOMMIT\n")


def test_the_providers_agents_carry_exactly_what_their_provider_labels_them_with() -> None:
    def manifests(agent: standin.StandIn) -> dict[str, dict[str, object]]:
        made = standin._manifests("img", standin.chain_only(agent.rules), "sh", agent.name, agent.env, agent.labels,
                                  agent.rules_configmap, agent.service_account)
        return {str(m["kind"]): m for m in made}

    gke = manifests(standin.GKE)
    # the collision: ipmasq's drop-in's name, label, account and chain; only the addon manager's label tells
    assert gke["DaemonSet"]["metadata"] == {"name": "ip-masq-agent", "namespace": "kube-system", "labels": {
        "k8s-app": "ip-masq-agent", "addonmanager.kubernetes.io/mode": "Reconcile"}}
    assert gke["ServiceAccount"]["metadata"]["name"] == "ip-masq-agent"
    assert gke["DaemonSet"]["spec"]["template"]["spec"]["serviceAccountName"] == "ip-masq-agent"
    assert standin.GKE.chain == "IP-MASQ" and gke["ConfigMap"]["metadata"]["name"] != "ip-masq-agent"
    aks = manifests(standin.AKS)
    assert aks["DaemonSet"]["metadata"]["labels"] == {
        "k8s-app": "azure-ip-masq-agent", "addonmanager.kubernetes.io/mode": "Reconcile",
        "kubernetes.io/cluster-service": "true", "component": "azure-ip-masq-agent",
        "kubernetes.azure.com/managedby": "aks"}
    assert "ServiceAccount" not in aks and standin.AKS.chain == "IP-MASQ-AGENT"
    assert "--random-fully" not in standin.AKS.rules
    eks = manifests(standin.EKS)
    env = eks["DaemonSet"]["spec"]["template"]["spec"]["containers"][0]["env"]
    assert {"name": "AWS_VPC_K8S_CNI_EXCLUDE_SNAT_CIDRS", "value": "192.168.0.0/16"} in env
    assert standin.EKS.chain == "AWS-SNAT-CHAIN-0" and eks["ServiceAccount"]["metadata"]["name"] == "aws-node"
