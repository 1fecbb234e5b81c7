"""`ipmasq uninstall` over the fakes of every place (both iptables variants, both families; nftables): the lines it
says, one per place and kind, and what it leaves."""

from __future__ import annotations

import logging
import re

import pytest

from ipmasq.agent.reconcile import Reconciler
from ipmasq.agent.reports import SyncResult
from ipmasq.backends.base import Adopt
from ipmasq.backends.iptables import IptablesBackend, Variant
from ipmasq.backends.nftables import NftablesBackend
from ipmasq.commands.uninstall import uninstall
from ipmasq.netfilter.iptables import render_restore
from ipmasq.options import PolicyOptions
from ipmasq.prefix import Family
from tests.configs import agent_config, policy_of
from tests.unit.backends.test_choose_switch import Node

LOG = logging.getLogger("test.uninstall")
TERMINATION_MESSAGE_BYTES = 4096  # what kubelet keeps of the per-node pod's output for `kubectl ipmasq uninstall`
CONFIG = "nonMasqueradeCIDRs: [10.0.0.0/8]\n"
DUAL = PolicyOptions(enable_ipv6=True)


def said(node: Node, chain: str = "IP-MASQ-AGENT", adopt: Adopt = Adopt.NONE) -> list[str]:
    lines: list[str] = []
    uninstall(node, chain, adopt, say=lines.append)
    return lines


def enforce(node: Node, backend: IptablesBackend | NftablesBackend, options: PolicyOptions = DUAL) -> None:
    rec = Reconciler(backend, options, log=LOG)
    rec.take_config(agent_config(CONFIG))
    assert rec.reconcile().result is SyncResult.APPLIED


def gke(node: Node) -> None:
    """GKE's managed agent: the reference's IP-MASQ in iptables-nft, no marker."""
    text = render_restore(policy_of(CONFIG, PolicyOptions(masq_chain="IP-MASQ")), Family.V4)
    assert node.iptables.restore("iptables", text).returncode == 0


def test_an_empty_node_has_nothing_to_remove() -> None:
    assert said(Node()) == ["nothing to remove"]


def test_every_place_ipmasq_wrote_is_one_line_and_a_second_run_finds_nothing() -> None:
    node = Node()
    enforce(node, IptablesBackend(node, chain="IP-MASQ-AGENT", variant=Variant.NFT))
    enforce(node, IptablesBackend(node, chain="IP-MASQ-AGENT", variant=Variant.LEGACY))
    enforce(node, NftablesBackend(node))
    assert said(node) == ["removed: IP-MASQ-AGENT (iptables-legacy, ipv4)",
                          "removed: IP-MASQ-AGENT (iptables-legacy, ipv6)",
                          "removed: IP-MASQ-AGENT (iptables-nft, ipv4)",
                          "removed: IP-MASQ-AGENT (iptables-nft, ipv6)",
                          "removed: table inet ip-masq-agent (nftables)"]
    assert node.ours_in_iptables() == [] and not node.nft.tables
    assert said(node) == ["nothing to remove"]


def test_another_programs_chain_is_kept_and_named() -> None:
    node = Node()
    gke(node)
    before = node.iptables.save("iptables", "nat")
    assert said(node, "IP-MASQ") == [
        "kept IP-MASQ (iptables-nft, ipv4): no ipmasq ownership marker: another program wrote it",
        "nothing to remove"]
    assert node.iptables.save("iptables", "nat") == before
    # the operator's word: the look-alike goes too
    assert said(node, "IP-MASQ", Adopt.ALL) == [
        "removed: IP-MASQ (iptables-nft, ipv4): no ipmasq ownership marker (--remove-unmarked)"]
    assert node.ours_in_iptables() == []


def test_ours_beside_another_programs_chain() -> None:
    node = Node()
    gke(node)
    enforce(node, IptablesBackend(node, chain="IP-MASQ-AGENT", variant=Variant.NFT), PolicyOptions())
    assert said(node) == [
        "removed: IP-MASQ-AGENT (iptables-nft, ipv4)",
        "kept IP-MASQ (iptables-nft, ipv4): no ipmasq ownership marker: another program wrote it"]


def test_a_chain_another_program_rewrote_is_kept_with_why() -> None:
    node = Node()
    enforce(node, IptablesBackend(node, chain="IP-MASQ-AGENT", variant=Variant.NFT), PolicyOptions())
    text = render_restore(policy_of("nonMasqueradeCIDRs: [10.0.0.0/9]\n", PolicyOptions()), Family.V4,
                          with_jump=False)
    assert node.iptables.restore("iptables", text).returncode == 0  # the reference agent, after ipmasq went
    assert said(node) == ["kept IP-MASQ-AGENT (iptables-nft, ipv4): its rules changed since ipmasq wrote them: "
                          "another program writes it now", "nothing to remove"]
    assert said(node) == ["kept IP-MASQ-AGENT (iptables-nft, ipv4): no ipmasq ownership marker: another program "
                          "wrote it", "nothing to remove"]


def test_the_lines_fit_a_termination_message_on_a_crowded_node() -> None:
    node = Node()
    for variant in (Variant.NFT, Variant.LEGACY):
        for n in range(40):  # forty look-alikes per place, under the longest names iptables takes
            options = PolicyOptions(masq_chain=f"OTHER-AGENT-CHAIN-NUMBER-{n:03d}", enable_ipv6=True)
            fake = node.iptables if variant is Variant.NFT else node.legacy
            for tool, family in (("iptables", Family.V4), ("ip6tables", Family.V6)):
                assert fake.restore(tool, render_restore(policy_of(CONFIG, options), family)).returncode == 0
    lines = said(node)
    assert len(lines) == 5  # one per place with a look-alike, and `nothing to remove`
    named = ", ".join(f"OTHER-AGENT-CHAIN-NUMBER-{n:03d}" for n in range(5))
    assert lines[0] == (f"kept {named} and 35 more (iptables-legacy, ipv4): no ipmasq ownership marker: another "
                        "program wrote them")
    assert len("\n".join(lines).encode()) < TERMINATION_MESSAGE_BYTES


def crowded() -> Node:
    """Every place of a node crowded with forty chains of each kind, under the longest names iptables takes: ours,
    another program's, ours rewritten since (the marker records other rules); our nftables table."""
    node = Node()
    for fake in (node.iptables, node.legacy):
        for tool, family in (("iptables", Family.V4), ("ip6tables", Family.V6)):
            for n in range(120):
                options = PolicyOptions(masq_chain=f"OTHER-AGENT-CHAIN-NUMBER-{n:03d}", enable_ipv6=True)
                text = render_restore(policy_of(CONFIG, options), family, with_marker=n < 80)
                if n >= 40:
                    text = re.sub("sha256:[0-9a-f]{64}", "sha256:" + "f" * 64, text)
                assert fake.restore(tool, text).returncode == 0
    enforce(node, NftablesBackend(node))
    return node


@pytest.mark.parametrize("adopt", [Adopt.NONE, Adopt.ALL], ids=["kept", "remove-unmarked"])
def test_every_kind_of_line_still_fits_a_termination_message(adopt: Adopt) -> None:
    lines = said(crowded(), adopt=adopt)
    assert len(lines) == 13  # three kinds in each of four places, and the table
    assert len("\n".join(lines).encode()) < TERMINATION_MESSAGE_BYTES, lines
