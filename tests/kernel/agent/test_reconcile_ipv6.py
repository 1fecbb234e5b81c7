"""IPv6 switched by the config alone (`enableIPv6`, no --enable-ipv6 flag), once per backend: switched on, the IPv6
peer sees the source explain answers; switched off by a config reload, our IPv6 objects are gone from the kernel
(a foreign ip6tables rule stays) and IPv6 pod traffic leaves with the pod IP, as explain then says."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ipmasq.lab.netns import Namespace, Network
from tests.eventually import eventually
from tests.kernel.agent_harness import (
    AWS_DB,
    NODE,
    NODE6,
    PEER6_FAR,
    PEER6_GW,
    POD6,
    PORT,
    agent,
    world,
)
from tests.kernel.flavors import FLAVORS, Flavor, nft_table, save

ON = f"""\
enableIPv6: true
nonMasqueradeCIDRs: [10.0.0.0/8, "2001:db8:ff::/48"]
rules:
  - name: far-v6
    destinations: ["{PEER6_FAR}/128"]
    protocol: tcp
    ports: [{PORT}]
    action: masquerade
"""
OFF = "enableIPv6: false\nnonMasqueradeCIDRs: [10.0.0.0/8]\n"
# a rule of someone else's in the IPv6 nat table: switching IPv6 off must leave it
FOREIGN6 = ["ip6tables", "-t", "nat", "-A", "POSTROUTING", "-d", "fd00:77::/64", "-m", "comment", "--comment",
            "not-ours-v6", "-j", "RETURN"]


def explained(config: Path, destination: str, source: str) -> dict[str, object]:
    """explain without --enable-ipv6: the config's enableIPv6 decides, as in the agent."""
    result = subprocess.run([sys.executable, "-m", "ipmasq", "explain", destination, f"--config={config}",
                             f"--source={source}", "--protocol=tcp", f"--port={PORT}", f"--node-ip={NODE6}",
                             "-o", "json"], capture_output=True, text=True, check=True)
    (answer,) = json.loads(result.stdout)["results"]
    return dict(answer)


def ipv6_objects(flavor: Flavor, node: Namespace) -> list[str]:
    """Our IPv6 objects: ip6tables lines of ours, or the nft table's IPv6 set and IPv6 rules."""
    if flavor.backend == "iptables":
        return [line for line in save(node, 6).splitlines() if "IP-MASQ-AGENT" in line or "ip-masq-agent" in line]
    return [line for line in nft_table(node)
            if "nomasq_v6" in line or "ip6 " in line or "rule far-v6" in line]


@pytest.mark.parametrize("flavor", FLAVORS, ids=str)
def test_enable_ipv6_from_the_config_installs_then_removes_ipv6(net: Network, tmp_path: Path, flavor: Flavor) -> None:
    config = tmp_path / "ip-masq-agent"
    config.write_text(ON)
    with world(net, ipv6=True) as w:
        w.peer.sysctl("net.ipv4.tcp_max_tw_buckets", "0")
        w.node.run(FOREIGN6)
        with agent(w.node, tmp_path / "agent.log", f"--config={config}", flavor.flag,
                   f"--lock-file={tmp_path / 'agent.lock'}") as running:
            eventually(lambda: "rule far-v6" in flavor.dump(w.node, 6), lambda: f"the IPv6 rule written\n{running.log}")
            assert ipv6_objects(flavor, w.node), running.log
            # IPv6 from the config alone: the rule (ahead of the list, which preserves 2001:db8:ff::/48) and the
            # list's catch-all both masquerade
            assert explained(config, "2001:db8:ff::99", POD6)["source_seen"] == POD6
            for destination, expected in ((PEER6_FAR, NODE6), (PEER6_GW, NODE6)):
                answer = explained(config, destination, POD6)
                assert answer["source_seen"] == expected, answer
                assert w.seen(destination) == expected, running.log

            config.write_text(OFF)  # a reload switches IPv6 off: our IPv6 objects go, nobody else's
            eventually(lambda: not ipv6_objects(flavor, w.node),
                       lambda: f"our IPv6 objects removed\n{(running.log, flavor.dump(w.node, 6))}")
            assert "not-ours-v6" in save(w.node, 6)
            answer = explained(config, PEER6_FAR, POD6)
            assert answer["source_seen"] == POD6, answer
            assert w.seen(PEER6_FAR) == POD6, running.log
            assert w.seen(PEER6_GW) == POD6, running.log
            # IPv4 is managed throughout: the catch-all still masquerades
            assert "ip-masq-agent" in flavor.dump(w.node, 4)
            assert w.seen(AWS_DB) == NODE, running.log
            # iptables: the IPv6 family's own removal; nftables: the one table, rewritten for IPv4 alone
            assert ("removed our IPv6 objects" in running.log) == (flavor.backend == "iptables"), running.log
            assert "Traceback" not in running.log
