"""The agent takes over the chain it enforces, on real netfilter with real TCP: a reference agent's chain of the same
name (migration) and what ipmasq 0.2.0 wrote before ownership markers existed are marked by its first pass, a deleted
marker is repaired as drift, and `ipmasq uninstall` then removes them, leaving what another program wrote."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

from ipmasq.lab.netns import Namespace, Network
from ipmasq.netfilter.iptables import render_restore
from ipmasq.netfilter.nft import MARKER_SET, desired_table, replace_script
from ipmasq.options import PolicyOptions
from ipmasq.prefix import Family
from tests.configs import policy_of
from tests.eventually import eventually
from tests.kernel.agent_harness import AWS_DB, NODE, NODE6, ONPREM, PEER6_FAR, POD, agent, more_passes, world
from tests.kernel.commands.test_uninstall import KUBE, Place, reference_chains
from tests.kernel.flavors import nft_table

CONFIG = "nonMasqueradeCIDRs: [10.0.0.0/8, 'fd00::/8']\nresyncInterval: 100ms\n"
MARKER = ":IPMASQ-OWNS-IP-MASQ-AGENT -"


def uninstall(node: Namespace) -> list[str]:
    result = node.run([sys.executable, "-m", "ipmasq", "uninstall"], check=False)
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()


def jumps(lines: list[str]) -> int:
    return sum(line.startswith("-A POSTROUTING") and line.endswith("-j IP-MASQ-AGENT") for line in lines)


@pytest.mark.parametrize("variant", ["legacy", "nft"])
def test_migration_takes_the_reference_agents_chain_over_and_uninstall_then_removes_it(
        net: Network, tmp_path: Path, variant: str) -> None:
    places = [Place(variant, 4), Place(variant, 6)]
    with world(net, ipv6=True) as w:
        for place in places:
            place.restore(w.node, KUBE)
        before = {str(place): place.nat(w.node) for place in places}
        for place in places:
            # AKS's IP-MASQ-AGENT (and GKE's IP-MASQ beside it: not this agent's chain, it must stay)
            place.restore(w.node, reference_chains(place.family))
        gke = {str(place): [line for line in place.nat(w.node) if "IP-MASQ " in line or line.endswith(" IP-MASQ")]
               for place in places}
        # the reference's defaults keep 172.16.0.0/12 and IPv6 beyond fd00::/8 is masqueraded by both chains
        assert w.seen(AWS_DB) == POD and w.seen(PEER6_FAR) == NODE6
        config = tmp_path / "ip-masq-agent"
        config.write_text(CONFIG)
        with agent(w.node, tmp_path / "agent.log", f"--config={config}", "--enable-ipv6", "--backend=iptables",
                   f"--iptables-variant={variant}") as running:
            eventually(lambda: all(MARKER in p.nat(w.node) for p in places),
                       lambda: f"every place marked\n{running.log}")
            eventually(lambda: w.seen(AWS_DB) == NODE, "the AWS VPC seeing the node")
            assert w.seen(ONPREM) == POD and w.seen(PEER6_FAR) == NODE6
            for place in places:
                nat = place.nat(w.node)
                assert jumps(nat) == 1, nat  # its jump kept, not doubled
                assert [line for line in nat if "IP-MASQ " in line or line.endswith(" IP-MASQ")] == gke[str(place)]
            # a deleted marker is drift: repaired (iptables-legacy: seen through its table's digest)
            applied = len(running.lines("applied"))
            w.node.run([places[0].tool("restore"), "--noflush"],
                       stdin="*nat\n-F IPMASQ-OWNS-IP-MASQ-AGENT\n-X IPMASQ-OWNS-IP-MASQ-AGENT\nCOMMIT\n")
            eventually(lambda: MARKER in places[0].nat(w.node) and len(running.lines("applied")) > applied,
                       lambda: f"the marker written again\n{running.log}")
        assert uninstall(w.node) == [
            f"removed: IP-MASQ-AGENT (iptables-{variant}, ipv4)",
            f"kept IP-MASQ (iptables-{variant}, ipv4): no ipmasq ownership marker: another program wrote it",
            f"removed: IP-MASQ-AGENT (iptables-{variant}, ipv6)",
            f"kept IP-MASQ (iptables-{variant}, ipv6): no ipmasq ownership marker: another program wrote it"]
        for place in places:
            assert [line for line in place.nat(w.node) if line not in gke[str(place)]] == before[str(place)]
        assert w.seen(AWS_DB) == POD and w.seen(PEER6_FAR) == NODE6  # GKE's chain decides again, as before


def test_an_ipmasq_0_2_0_chain_with_config_rules_is_adopted_by_the_first_pass(net: Network, tmp_path: Path) -> None:
    """0.2.0 wrote the reference's text plus its config rules' lines, and no marker: its transaction on an empty node
    was exactly render_restore's text."""
    text = ("nonMasqueradeCIDRs: [10.0.0.0/8]\nresyncInterval: 100ms\nrules:\n  - name: aws-db\n"
            "    destinations: [172.30.12.110/32]\n    action: preserve\n")
    place = Place("nft", 4)
    with world(net) as w:
        place.restore(w.node, KUBE)
        old = render_restore(policy_of(text, PolicyOptions(enable_ipv6=False)), Family.V4)
        place.restore(w.node, old)
        written = place.nat(w.node)
        assert w.seen(AWS_DB) == POD and MARKER not in written
        config = tmp_path / "ip-masq-agent"
        config.write_text(text)
        with agent(w.node, tmp_path / "agent.log", f"--config={config}", "--backend=iptables") as running:
            eventually(lambda: MARKER in place.nat(w.node), lambda: f"the adopted chain marked\n{running.log}")
            # the same rules, marked: the marker and its record of them
            assert [line for line in place.nat(w.node) if "IPMASQ-OWNS-" not in line] == written
            assert sum(line.startswith("-A IPMASQ-OWNS-IP-MASQ-AGENT ") for line in place.nat(w.node)) == 1
            more_passes(w.node, 5)  # five resyncs: adopted once, nothing more written
            assert len(running.lines("applied")) == 1 and not running.lines("ERROR")
            assert w.seen(AWS_DB) == POD  # the config rule still decides
        assert uninstall(w.node) == ["removed: IP-MASQ-AGENT (iptables-nft, ipv4)"]


def test_an_ipmasq_0_2_0_table_is_adopted_by_the_first_pass(net: Network, tmp_path: Path) -> None:
    config = tmp_path / "ip-masq-agent"
    config.write_text(CONFIG)
    policy = policy_of(CONFIG, PolicyOptions(enable_ipv6=True))
    table = desired_table(policy)
    old = replace_script(dataclasses.replace(table, sets=tuple(s for s in table.sets if s.name != MARKER_SET)))
    with world(net, ipv6=True) as w:
        w.node.run(["nft", "-f", "-"], stdin=old)  # what 0.2.0 wrote: the same table, no marker
        listed = nft_table(w.node)
        assert w.seen(AWS_DB) == NODE
        with agent(w.node, tmp_path / "agent.log", f"--config={config}", "--enable-ipv6",
                   "--backend=nftables") as running:
            eventually(lambda: f"\tset {MARKER_SET} {{" in nft_table(w.node),
                       lambda: f"the adopted table marked\n{running.log}")
            recorded = next(s for s in table.sets if s.name == MARKER_SET).comment  # the digest of the rest
            marker = ["\tset ipmasq-owns-this-table {", "\t\ttype ipv4_addr", f'\t\tcomment "{recorded}"', "\t}", ""]
            assert nft_table(w.node) == [listed[0], *marker, *listed[1:]]
            more_passes(w.node, 5)
            assert len(running.lines("applied")) == 1 and not running.lines("ERROR")
            assert w.seen(AWS_DB) == NODE and w.seen(ONPREM) == POD
        assert uninstall(w.node) == ["removed: table inet ip-masq-agent (nftables)"]
        assert not nft_table(w.node)
        assert w.seen(AWS_DB) == POD
