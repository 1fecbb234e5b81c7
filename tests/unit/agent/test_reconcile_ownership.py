"""The agent's clean-up of the places it does not use removes only what ipmasq wrote (its ownership marker): a
provider's chain with the reference agent's comments stays byte for byte, is named once in the log and never makes
the agent not ready."""

from __future__ import annotations

import logging

import pytest

from ipmasq.agent.reconcile import Reconciler
from ipmasq.agent.reports import SyncResult
from ipmasq.backends.choose import make_backend
from ipmasq.backends.iptables import IptablesBackend, Variant
from ipmasq.netfilter.iptables import render_restore
from ipmasq.options import PolicyOptions
from ipmasq.prefix import Family
from tests.configs import agent_config, policy_of
from tests.unit.backends.test_choose_switch import Node

LOG = logging.getLogger("test.ownership")
CONFIG = "nonMasqueradeCIDRs: [10.0.0.0/8]\n"
OPTIONS = PolicyOptions()


def aks(node: Node) -> None:
    """AKS's agent: the reference's IP-MASQ-AGENT in iptables-nft, both families, no marker."""
    for tool, family in (("iptables", Family.V4), ("ip6tables", Family.V6)):
        text = render_restore(policy_of("nonMasqueradeCIDRs: [10.0.0.0/8, 'fd00::/8']\n",
                                        PolicyOptions(enable_ipv6=True)), family)
        assert node.iptables.restore(tool, text).returncode == 0


def test_a_providers_chain_in_the_other_backend_stays_and_is_named_once(caplog: pytest.LogCaptureFixture) -> None:
    node = Node()
    aks(node)
    before = {tool: node.iptables.save(tool, "nat") for tool in ("iptables", "ip6tables")}
    backend, others = make_backend("nftables", OPTIONS, node, variant="nft")
    rec = Reconciler(backend, OPTIONS, log=LOG, others=others)
    rec.take_config(agent_config(CONFIG))
    with caplog.at_level(logging.INFO):
        for _ in range(3):
            report = rec.reconcile()
            assert report.result in (SyncResult.APPLIED, SyncResult.IN_SYNC)
            assert report.leftovers == () and report.removed_leftovers == () and report.readiness.ok
    assert {tool: node.iptables.save(tool, "nat") for tool in before} == before
    kept = [r.getMessage() for r in caplog.records if r.getMessage().startswith("kept ")]
    assert kept == [
        "kept IP-MASQ-AGENT (iptables-nft, ipv4): no ipmasq ownership marker: another program wrote it (this agent "
        "uses nftables and removes only what ipmasq wrote)",
        "kept IP-MASQ-AGENT (iptables-nft, ipv6): no ipmasq ownership marker: another program wrote it (this agent "
        "uses nftables and removes only what ipmasq wrote)"]


def test_a_marked_leftover_goes_in_the_same_pass_and_the_look_alike_beside_it_stays() -> None:
    node = Node()
    # ipmasq on iptables-legacy under GKE's name (marked), AKS's look-alike in iptables-nft
    legacy = PolicyOptions(masq_chain="IP-MASQ")
    rec = Reconciler(IptablesBackend(node, chain="IP-MASQ", variant=Variant.LEGACY), legacy, log=LOG)
    rec.take_config(agent_config(CONFIG))
    assert rec.reconcile().result is SyncResult.APPLIED
    aks(node)
    backend, others = make_backend("nftables", legacy, node, variant="nft")
    rec = Reconciler(backend, legacy, log=LOG, others=others)
    rec.take_config(agent_config(CONFIG))
    report = rec.reconcile()
    assert report.removed_leftovers == ("iptables (legacy)",) and report.readiness.ok
    assert node.ours_in_iptables(node.legacy) == []
    assert "IP-MASQ-AGENT" in node.iptables.table("iptables").chains
    assert rec.reconcile().removed_leftovers == ()


def test_a_chain_another_program_rewrote_in_the_other_place_stays_and_only_its_stale_marker_goes(
        caplog: pytest.LogCaptureFixture) -> None:
    node = Node()
    # ipmasq ran on iptables-nft, was deleted without an uninstall, and the reference agent writes the chain now
    rec = Reconciler(IptablesBackend(node, chain="IP-MASQ-AGENT", variant=Variant.NFT), OPTIONS, log=LOG)
    rec.take_config(agent_config(CONFIG))
    assert rec.reconcile().result is SyncResult.APPLIED
    text = render_restore(policy_of("nonMasqueradeCIDRs: [10.0.0.0/9]\n", OPTIONS), Family.V4, with_jump=False)
    assert node.iptables.restore("iptables", text).returncode == 0
    chain = node.iptables.table("iptables").rules("IP-MASQ-AGENT")
    backend, others = make_backend("nftables", OPTIONS, node, variant="nft")
    rec = Reconciler(backend, OPTIONS, log=LOG, others=others)
    rec.take_config(agent_config(CONFIG))
    with caplog.at_level(logging.INFO):
        for _ in range(3):
            report = rec.reconcile()
            assert report.leftovers == () and report.removed_leftovers == () and report.readiness.ok
    assert node.iptables.table("iptables").rules("IP-MASQ-AGENT") == chain
    assert "IPMASQ-OWNS-IP-MASQ-AGENT" not in node.iptables.table("iptables").chains
    kept = [r.getMessage() for r in caplog.records if r.getMessage().startswith("kept ")]
    assert kept == [
        "kept IP-MASQ-AGENT (iptables-nft, ipv4): its rules changed since ipmasq wrote them: another program writes "
        "it now (this agent uses nftables and removes only what ipmasq wrote)",
        # the next pass: the marker is gone, and the chain is plainly another program's
        "kept IP-MASQ-AGENT (iptables-nft, ipv4): no ipmasq ownership marker: another program wrote it (this agent "
        "uses nftables and removes only what ipmasq wrote)"]
