"""`ipmasq check --writer` live on real netfilter, per provider profile whose agent writes a chain: the test writes
that agent's rules itself with iptables-restore (the shapes the providers' sources write, never ipmasq), check reads
them live inside the node's namespace, and a real TCP connection from the pod shows the source address the peer saw
agrees with what check said."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ipmasq.lab.netns import Network
from ipmasq.testing.writers import aws_snat_rules, ip_masq_agent_rules
from tests.kernel.agent_harness import AWS_DB, NODE, ONPREM, POD, World, world


def configmap(name: str, key: str, config: str) -> str:
    indented = "".join(f"    {line}\n" for line in config.splitlines())
    return (f"apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: {name}\n  namespace: kube-system\n"
            f"data:\n  {key}: |\n{indented}")


def check(w: World, *args: str) -> tuple[int, set[str], str]:
    out = w.node.run([sys.executable, "-m", "ipmasq", "check", *args, "-o", "json"], check=False)
    findings = json.loads(out.stdout)["findings"] if out.stdout.strip() else []
    return out.returncode, {f["id"] for f in findings if f["severity"] == "error"}, out.stdout + out.stderr


def test_gke_and_reference_profiles(net: Network, tmp_path: Path) -> None:
    config = tmp_path / "cm.yaml"
    config.write_text(configmap("ip-masq-agent", "config", "nonMasqueradeCIDRs: [10.0.0.0/8]\n"))
    with world(net) as w:
        w.node.run(["iptables-restore", "--noflush"], stdin=ip_masq_agent_rules("IP-MASQ", ("10.0.0.0/8",),
                                                                                 random_fully=True))
        code, errors, out = check(w, "--writer", "gke", "--config", str(config))
        assert code == 0 and not errors, out
        assert w.seen(AWS_DB) == NODE and w.seen(ONPREM) == POD
        # GKE's agent without the ConfigMap applied: its defaults (172.16.0.0/12 keeps the pod's address)
        defaults = ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10", "192.0.0.0/24", "192.0.2.0/24",
                    "192.88.99.0/24", "198.18.0.0/15", "198.51.100.0/24", "203.0.113.0/24", "240.0.0.0/4")
        w.node.run(["iptables-restore", "--noflush"], stdin=ip_masq_agent_rules("IP-MASQ", defaults,
                                                                                 random_fully=True))
        code, errors, out = check(w, "--writer", "gke", "--config", str(config))
        assert code == 1 and errors == {"rules-differ"} and "172.16.0.0/12" in out, out
        assert w.seen(AWS_DB) == POD  # what check said: kept the pod's address against the ConfigMap
        code, errors, out = check(w, "--writer", "gke")  # no ConfigMap: that is GKE's intent
        assert code == 0, out
        # the reference agent's chain name: GKE's chain is not its own
        code, errors, out = check(w, "--writer", "reference")
        assert code == 1 and "IP-MASQ" in out


def test_aks_profile_unions_the_fragments(net: Network, tmp_path: Path) -> None:
    fragments = tmp_path / "aks.yaml"
    fragments.write_text(configmap("azure-ip-masq-agent-config-reconciled", "ip-masq-agent-reconciled",
                                   "nonMasqueradeCIDRs: [10.224.0.0/12]\nmasqLinkLocal: false\n")
                         + "---\n" + configmap("azure-ip-masq-agent-config", "ip-masq-agent",
                                               "nonMasqueradeCIDRs: [10.0.0.0/8]\n"))
    with world(net) as w:
        # ip-masq-agent-v2 writes MASQUERADE without --random-fully; the merger's union, in its order
        w.node.run(["iptables-restore", "--noflush"],
                   stdin=ip_masq_agent_rules("IP-MASQ-AGENT", ("10.0.0.0/8", "10.224.0.0/12"), random_fully=False))
        code, errors, out = check(w, "--writer", "aks", "--manifest", str(fragments))
        assert code == 0 and not errors, out
        assert w.seen(ONPREM) == POD and w.seen(AWS_DB) == NODE
        # only the provider's fragment applied (the user's was not merged yet): 10.2.1.100 is masqueraded
        w.node.run(["iptables-restore", "--noflush"],
                   stdin=ip_masq_agent_rules("IP-MASQ-AGENT", ("10.224.0.0/12",), random_fully=False))
        code, errors, out = check(w, "--writer", "aks", "--manifest", str(fragments))
        assert code == 1 and "rules-differ" in errors and "10.0.0.0/8" in out, out
        assert w.seen(ONPREM) == NODE


def test_eks_profile_reads_aws_snat_chain_live(net: Network, tmp_path: Path) -> None:
    def aws_node(exclusions: str) -> Path:
        path = tmp_path / "aws-node.yaml"
        path.write_text("apiVersion: apps/v1\nkind: DaemonSet\nmetadata: {name: aws-node, namespace: kube-system}\n"
                        "spec:\n  template:\n    spec:\n      containers:\n      - name: aws-node\n        env:\n"
                        f"        - {{name: AWS_VPC_K8S_CNI_EXCLUDE_SNAT_CIDRS, value: '{exclusions}'}}\n")
        return path

    with world(net) as w:
        w.node.run(["iptables-restore", "--noflush"], stdin=aws_snat_rules("10.142.0.0/16", ("10.2.0.0/16",), NODE))
        code, errors, out = check(w, "--writer", "eks", "--manifest", str(aws_node("10.2.0.0/16")))
        assert code == 0 and not errors, out
        assert w.seen(ONPREM) == POD and w.seen(AWS_DB) == NODE  # excluded; SNATed to the node
        # the env now also excludes 172.30.0.0/16, which ipamd has not applied: check says so, the peer agrees
        code, errors, out = check(w, "--writer", "eks", "--manifest", str(aws_node("10.2.0.0/16,172.30.0.0/16")))
        assert code == 1 and errors == {"config-not-applied", "rules-differ"} and "172.30.0.0/16" in out, out
        assert w.seen(AWS_DB) == NODE
        # external SNAT: no node SNAT is intended, the chain is still there
        path = tmp_path / "aws-node.yaml"
        path.write_text(path.read_text() + "        - {name: AWS_VPC_K8S_CNI_EXTERNALSNAT, value: 'true'}\n")
        code, errors, out = check(w, "--writer", "eks", "--manifest", str(path))
        assert code == 1 and "EXTERNALSNAT=true" in out, out


def test_a_key_gke_ignores_is_said_with_what_the_peer_really_sees(net: Network, tmp_path: Path) -> None:
    # masqueradeCIDRs is ipmasq's own: GKE's agent writes the chain of nonMasqueradeCIDRs alone, and the on-prem
    # host inside 10/8 keeps seeing the pod's address; check says that (ignored-by-writer), not rules-differ
    config = tmp_path / "cm.yaml"
    config.write_text(configmap("ip-masq-agent", "config",
                                "nonMasqueradeCIDRs: [10.0.0.0/8]\nmasqueradeCIDRs: [10.2.1.0/24]\n"))
    with world(net) as w:
        w.node.run(["iptables-restore", "--noflush"], stdin=ip_masq_agent_rules("IP-MASQ", ("10.0.0.0/8",),
                                                                                 random_fully=True))
        code, errors, out = check(w, "--writer", "gke", "--config", str(config))
        assert code == 1 and errors == {"ignored-by-writer"}, out
        assert "10.2.1.0/24 stays un-masqueraded" in out and "next sync" not in out, out
        assert w.seen(ONPREM) == POD and w.seen(AWS_DB) == NODE


def test_a_machine_with_no_nat_rule_is_not_a_node(net: Network) -> None:
    with world(net) as w:
        out = w.node.run([sys.executable, "-m", "ipmasq", "check"], check=False)
        assert out.returncode == 3 and out.stdout == "", out
        assert out.stderr.count("\n") == 1 and "holds no nat rule at all" in out.stderr, out.stderr
