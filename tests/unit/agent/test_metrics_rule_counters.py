"""Per-rule kernel counters as metrics (ipmasq_rule_packets_total / ipmasq_rule_bytes_total), over both fakes: taken
from the reads a pass already makes, one counters-only read on an idle pass, nothing more for configs without rules."""

from __future__ import annotations

import logging

from prometheus_client.parser import text_string_to_metric_families

from ipmasq.agent.metrics import AgentVitals, render_metrics
from ipmasq.agent.reconcile import Reconciler
from ipmasq.agent.reports import RuleCount, SyncResult
from ipmasq.backends.iptables import IptablesBackend, Variant
from ipmasq.backends.nftables import NftablesBackend
from ipmasq.options import PolicyOptions
from ipmasq.prefix import Family
from ipmasq.testing import FakeIptables, FakeNft
from tests.configs import agent_config

LOG = logging.getLogger("test.rule-counters")
RULES = """\
nonMasqueradeCIDRs: [10.0.0.0/8]
rules:
  - name: two-destinations
    destinations: [172.30.0.0/16, 192.168.0.0/16]
    action: preserve
  - name: partner-https
    destinations: [203.0.113.0/24]
    protocol: tcp
    ports: [443]
    action: masquerade
"""
PLAIN = "nonMasqueradeCIDRs: [10.0.0.0/8]\n"


def scraped(status: AgentVitals) -> dict[tuple[str, str, str], float]:
    """{(sample name, rule, family): value} of the rule counters, as prometheus-client parses /metrics."""
    out = {}
    for family in text_string_to_metric_families(render_metrics(status).decode()):
        if family.name in ("ipmasq_rule_packets", "ipmasq_rule_bytes"):
            assert family.type == "counter"
            for sample in family.samples:
                out[(sample.name, sample.labels["rule"], sample.labels["family"])] = sample.value
    return out


def run(rec: Reconciler, status: AgentVitals) -> SyncResult:
    report = rec.reconcile()
    status.reconciled(report, 0.001)
    return report.result


def saves(fake: FakeIptables) -> int:
    return sum(1 for call in fake.calls if call[0].endswith("-save"))


def test_iptables_counters_summed_over_a_rules_lines_from_the_passs_own_read() -> None:
    fake = FakeIptables()
    rec = Reconciler(IptablesBackend(fake, chain="IP-MASQ-AGENT", variant=Variant.NFT), PolicyOptions(), log=LOG,
                     fingerprint=lambda: "unchanged")
    status = AgentVitals(version="t", backend="iptables")
    rec.take_config(agent_config(RULES))
    assert run(rec, status) is SyncResult.APPLIED
    assert scraped(status) == {("ipmasq_rule_packets_total", "two-destinations", "ipv4"): 0,
                               ("ipmasq_rule_bytes_total", "two-destinations", "ipv4"): 0,
                               ("ipmasq_rule_packets_total", "partner-https", "ipv4"): 0,
                               ("ipmasq_rule_bytes_total", "partner-https", "ipv4"): 0}
    assert run(rec, status) is SyncResult.IN_SYNC  # a full read that matched: the fast path from now on
    fake.count("IP-MASQ-AGENT", 5)  # 5 packets through every rule of the chain
    before = saves(fake)
    assert run(rec, status) is SyncResult.IN_SYNC  # the fast path: no full read, one counters-only read
    assert saves(fake) - before == 1 and fake.calls[-1] == ("iptables-nft-save", "-c", "-t", "nat")
    counts = scraped(status)
    # two-destinations is two kernel rules: their counters summed
    assert counts[("ipmasq_rule_packets_total", "two-destinations", "ipv4")] == 10
    assert counts[("ipmasq_rule_bytes_total", "two-destinations", "ipv4")] == 600
    assert counts[("ipmasq_rule_packets_total", "partner-https", "ipv4")] == 5
    # a full pass (the fingerprint changed) takes them from the reads it makes anyway: no extra program
    rec.fingerprint = lambda: "changed"
    fake.count("IP-MASQ-AGENT", 1)
    before = saves(fake)
    assert run(rec, status) is SyncResult.IN_SYNC
    # the pass's own reads (IPv4's, and IPv6's which holds nothing of ours): no counters-only read on top
    assert saves(fake) - before == 2
    assert scraped(status)[("ipmasq_rule_packets_total", "two-destinations", "ipv4")] == 12


def test_without_rules_no_counters_and_no_extra_read() -> None:
    fake = FakeIptables()
    rec = Reconciler(IptablesBackend(fake, chain="IP-MASQ-AGENT", variant=Variant.NFT), PolicyOptions(), log=LOG,
                     fingerprint=lambda: "unchanged")
    status = AgentVitals(version="t", backend="iptables")
    rec.take_config(agent_config(PLAIN))
    run(rec, status)
    run(rec, status)
    before = len(fake.calls)
    assert run(rec, status) is SyncResult.IN_SYNC and len(fake.calls) == before  # an idle pass runs nothing
    assert scraped(status) == {}
    assert not any("-c" in call for call in fake.calls)  # read exactly as before: no counters asked for


def test_nftables_counters_from_the_listing_and_the_terse_listing_when_idle() -> None:
    fake = FakeNft()
    rec = Reconciler(NftablesBackend(fake), PolicyOptions(), log=LOG, fingerprint=lambda: "unchanged")
    status = AgentVitals(version="t", backend="nftables")
    rec.take_config(agent_config(RULES))
    assert run(rec, status) is SyncResult.APPLIED
    assert run(rec, status) is SyncResult.IN_SYNC
    fake.count("ip-masq-agent: rule partner-https", 3, 180)
    fake.listings.clear()
    assert run(rec, status) is SyncResult.IN_SYNC
    assert fake.listings == [["nft", "-j", "-t", "list", "ruleset", "inet"]]  # the structure alone, no set elements
    counts = scraped(status)
    assert counts[("ipmasq_rule_packets_total", "partner-https", "ipv4")] == 3
    assert counts[("ipmasq_rule_bytes_total", "partner-https", "ipv4")] == 180
    assert counts[("ipmasq_rule_packets_total", "two-destinations", "ipv4")] == 0


def test_a_pass_report_carries_the_counts_of_this_nodes_rules_only() -> None:
    fake = FakeIptables()
    options = PolicyOptions(node_name="general-1")
    rec = Reconciler(IptablesBackend(fake, chain="IP-MASQ-AGENT", variant=Variant.NFT), options, log=LOG)
    rec.take_config(agent_config(RULES + "  - name: egress-only\n    destinations: [10.2.0.0/16]\n"
                                 "    nodes: ['egress-*']\n    action: masquerade\n"))
    report = rec.reconcile()
    assert [c.rule for c in report.rule_counters] == ["two-destinations", "partner-https"]
    assert report.rule_counters[0] == RuleCount("two-destinations", Family.V4, 0, 0)
