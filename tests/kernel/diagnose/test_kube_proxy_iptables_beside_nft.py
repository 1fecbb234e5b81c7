"""check and trace with the agent on nftables beside kube-proxy in iptables mode (iptables-nft).

kube-proxy 1.37's nat table in iptables mode (tests/dumps/kube-proxy-iptables-nat.save: read off the Kubernetes
lab's egress node, the agent's own chain left out) restored with iptables-nft, the agent's nftables table beside it.
nft's JSON listing shows iptables' matches and targets in iptables-nft's `ip nat` table only as bare `xt` stubs
(`-m comment`, `-j MASQUERADE --random-fully` without their arguments), so check and trace read that table with
iptables-nft-save and walk it in iptables' terms: no "cannot decide" about kube-proxy's rules, and marked Service
traffic is shown masqueraded by KUBE-POSTROUTING.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from ipmasq.config import ConfigInput, config_from_bytes
from ipmasq.lab.netns import Namespace, Network
from ipmasq.netfilter.nft import render_script
from ipmasq.options import PolicyOptions
from ipmasq.policy.policy import Policy
from tests.conftest import ROOT

FIXTURE = ROOT / "tests" / "dumps" / "kube-proxy-iptables-nat.save"
CONFIG = "nonMasqueradeCIDRs: [10.0.0.0/8]\n"


def _ipmasq(node: Namespace, *args: str) -> tuple[int, dict[str, Any]]:
    result = node.run([sys.executable, "-m", "ipmasq", *args, "-o", "json"], check=False)
    assert result.returncode in (0, 1), result.stderr
    document: dict[str, Any] = json.loads(result.stdout)
    return result.returncode, document


def test_the_agent_on_nftables_beside_kube_proxys_iptables_mode(net: Network, tmp_path: Path) -> None:
    options = PolicyOptions()
    policy = Policy(config_from_bytes(ConfigInput((("/etc/config/ip-masq-agent", CONFIG.encode()),)), options),
                    options)
    config = tmp_path / "ip-masq-agent"
    config.write_text(CONFIG)
    node = net.add("node")
    # a node has a way out: trace reads its routes, and a namespace without one would drop every packet
    net.link(node, ["10.142.0.2/24"], net.add("uplink"), ["10.142.0.254/24"])
    node.run(["ip", "route", "add", "default", "via", "10.142.0.254"])
    node.run(["iptables-nft-restore"], stdin=FIXTURE.read_text())
    node.run(["nft", "-f", "-"], stdin=render_script(policy))
    listed = node.run(["nft", "-j", "list", "table", "ip", "nat"]).stdout
    assert '"xt"' in listed  # what made the JSON walk give up: iptables' matches as stubs

    code, report = _ipmasq(node, "check", "--backend", "nftables", f"--config={config}", "--agent", "none")
    assert (code, report["ok"], report["findings"]) == (0, True, []), report

    # NodePort traffic kube-proxy marked for masquerade, leaving toward a pod on another node
    code, traced = _ipmasq(node, "trace", "10.44.15.7", "--source", "10.142.0.1", "--protocol", "tcp", "--port",
                           "8080", "--mark", "0x4000", "--backend", "nftables")
    assert (code, traced["outcome"]) == (0, "masqueraded"), traced
    assert "KUBE-POSTROUTING" in traced["decided_by"] and "--random-fully" in traced["decided_by"]
    # plain pod egress: the agent's table decides, kube-proxy's chain hands it on
    code, traced = _ipmasq(node, "trace", "203.0.113.10", "--source", "10.44.14.2", "--backend", "nftables")
    assert (code, traced["outcome"]) == (0, "masqueraded") and "ip-masq-agent" in traced["decided_by"], traced
    code, traced = _ipmasq(node, "trace", "10.130.0.6", "--source", "10.44.14.2", "--backend", "nftables")
    assert (code, traced["outcome"], traced["cannot_decide"]) == (0, "unchanged", None), traced
