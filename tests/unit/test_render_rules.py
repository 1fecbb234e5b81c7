"""Config rules rendered for both backends: ahead of the CIDR rules, in the form the kernel lists them back."""

from __future__ import annotations

import json
import logging

import pytest

from ipmasq.agent.reconcile import Reconciler, SyncResult
from ipmasq.backends.iptables import IptablesBackend, Variant
from ipmasq.backends.nftables import NftablesBackend
from ipmasq.config import ConfigInput, config_from_bytes
from ipmasq.options import PolicyOptions
from ipmasq.policy import Policy
from ipmasq.prefix import Family
from ipmasq.rules.iptables import chain_rules, render_restore
from ipmasq.rules.nft import desired_table, rule_from_json
from ipmasq.testing import FakeIptables, FakeNft
from ipmasq.testing.nft import rule_to_json

CONFIG = """\
nonMasqueradeCIDRs: [10.0.0.0/8]
rules:
  - name: partner-endpoint
    destinations: [10.1.2.100/32, 10.1.2.7/32]
    sources: [100.64.0.0/16]
    protocol: tcp
    ports: [443, "8000-8080"]
    action: snat
    snatTo: 10.142.0.50
  - name: dns
    destinations: [10.3.0.0/24]
    protocol: udp
    ports: [53]
    action: masquerade
  - name: keep-icmp
    destinations: [192.168.0.0/17, 192.168.128.0/17]
    protocol: icmp
    action: preserve
  - name: elsewhere
    destinations: [8.8.8.8/32]
    nodes: [other-*]
    action: preserve
  - name: v6-partner
    destinations: ["fd00:1::/64", "fd00:2::5/128"]
    sources: ["fd10::/48"]
    protocol: icmpv6
    action: snat
    snatTo: "fd00::0:5"
"""
OPTIONS = PolicyOptions(enable_ipv6=True, node_name="node-1")


def policy(text: str = CONFIG, options: PolicyOptions = OPTIONS) -> Policy:
    return Policy(config_from_bytes(ConfigInput((("/c", text.encode()),)), options), options)


def test_iptables_rules_come_first_one_line_per_address_pair() -> None:
    rules = chain_rules(policy(), Family.V4).rules
    comment = '-A IP-MASQ-AGENT -m comment --comment "ip-masq-agent: rule '
    assert rules[:5] == (
        f'{comment}partner-endpoint" -s 100.64.0.0/16 -d 10.1.2.100/32 -p tcp -m multiport --dports 443,8000:8080 '
        "-j SNAT --to-source 10.142.0.50 --random-fully",
        f'{comment}partner-endpoint" -s 100.64.0.0/16 -d 10.1.2.7/32 -p tcp -m multiport --dports 443,8000:8080 '
        "-j SNAT --to-source 10.142.0.50 --random-fully",
        f'{comment}dns" -d 10.3.0.0/24 -p udp -m multiport --dports 53 -j MASQUERADE --random-fully',
        f'{comment}keep-icmp" -d 192.168.0.0/17 -p icmp -j RETURN',
        f'{comment}keep-icmp" -d 192.168.128.0/17 -p icmp -j RETURN',
    )
    assert "local traffic" in rules[5]  # then the reference's rules, unchanged
    v6 = chain_rules(policy(), Family.V6).rules
    assert v6[0] == (f'{comment}v6-partner" -s fd10::/48 -d fd00:1::/64 -p ipv6-icmp -j SNAT --to-source fd00::5 '
                     "--random-fully")
    assert not any("elsewhere" in r for r in rules)  # another node's rule


def test_iptables_multiport_takes_fifteen_slots_per_rule() -> None:
    ports = ", ".join(f'"{p}-{p + 1}"' for p in range(1000, 1020, 2))  # 10 ranges: 20 slots
    text = (f"rules:\n  - name: many\n    destinations: [10.1.0.0/16]\n    protocol: tcp\n    ports: [{ports}]\n"
            "    action: preserve\n")
    lines = chain_rules(policy(text), Family.V4).rules[:2]
    assert [line.split("--dports ")[1].split(" ")[0] for line in lines] == [
        "1000:1001,1002:1003,1004:1005,1006:1007,1008:1009,1010:1011,1012:1013",
        "1014:1015,1016:1017,1018:1019"]


def test_without_rules_the_rendering_is_what_it_was() -> None:
    plain = "nonMasqueradeCIDRs: [10.0.0.0/8]\n"
    # with the rules section empty the output is byte-identical to a config without the key
    for options in (PolicyOptions(), OPTIONS):
        assert render_restore(policy(plain, options), Family.V4) == render_restore(
            policy(plain + "rules:\n", options), Family.V4)
        assert desired_table(policy(plain, options)) == desired_table(policy(plain + "rules:\n", options))


def test_nft_rules_come_after_local_and_before_the_sets() -> None:
    rules = desired_table(policy()).chains[0].rules
    assert rules[0].startswith("fib daddr type local return")
    # each config rule counts its packets (ipmasq_rule_packets_total); nothing else does
    assert rules[1:5] == (
        "ip saddr 100.64.0.0/16 ip daddr { 10.1.2.7, 10.1.2.100 } tcp dport { 443, 8000-8080 } "
        'counter snat ip to 10.142.0.50 fully-random comment "ip-masq-agent: rule partner-endpoint"',
        'ip daddr 10.3.0.0/24 udp dport 53 counter masquerade fully-random comment "ip-masq-agent: rule dns"',
        # two halves merged into one prefix, as nft lists an anonymous set
        'ip daddr 192.168.0.0/16 meta l4proto icmp counter return comment "ip-masq-agent: rule keep-icmp"',
        "ip6 saddr fd10::/48 ip6 daddr { fd00:1::/64, fd00:2::5 } meta l4proto ipv6-icmp counter snat ip6 to fd00::5 "
        'fully-random comment "ip-masq-agent: rule v6-partner"',
    )
    assert rules[5].startswith("ip daddr @nomasq_v4 return")


# What nft 1.0.6 lists (`nft -j list ruleset`) for rules of this dialect, recorded from the kernel.
KERNEL_JSON = [
    ('{"expr": [{"match": {"op": "==", "left": {"payload": {"protocol": "ip", "field": "saddr"}}, "right": {"prefix": '
     '{"addr": "100.64.0.0", "len": 16}}}}, {"match": {"op": "==", "left": {"payload": {"protocol": "ip", "field": '
     '"daddr"}}, "right": "10.1.2.100"}}, {"match": {"op": "==", "left": {"payload": {"protocol": "tcp", "field": '
     '"dport"}}, "right": {"set": [443, {"range": [8000, 8080]}]}}}, {"snat": {"family": "ip", "addr": '
     '"10.142.0.50", "flags": "fully-random"}}], "comment": "ip-masq-agent: rule a"}',
     "ip saddr 100.64.0.0/16 ip daddr 10.1.2.100 tcp dport { 443, 8000-8080 } snat ip to 10.142.0.50 fully-random "
     'comment "ip-masq-agent: rule a"'),
    ('{"expr": [{"match": {"op": "==", "left": {"payload": {"protocol": "ip", "field": "saddr"}}, "right": {"set": '
     '[{"prefix": {"addr": "100.64.0.0", "len": 16}}, {"prefix": {"addr": "100.66.0.0", "len": 16}}]}}}, {"match": '
     '{"op": "==", "left": {"payload": {"protocol": "ip", "field": "daddr"}}, "right": {"set": [{"prefix": {"addr": '
     '"10.1.0.0", "len": 16}}, {"range": ["10.3.0.0", "10.3.0.5"]}]}}}, {"match": {"op": "==", "left": {"meta": '
     '{"key": "l4proto"}}, "right": "udp"}}, {"masquerade": null}], "comment": "ip-masq-agent: rule b"}',
     "ip saddr { 100.64.0.0/16, 100.66.0.0/16 } ip daddr { 10.1.0.0/16, 10.3.0.0-10.3.0.5 } meta l4proto udp "
     'masquerade comment "ip-masq-agent: rule b"'),
    ('{"expr": [{"match": {"op": "==", "left": {"payload": {"protocol": "ip6", "field": "daddr"}}, "right": {"prefix": '
     '{"addr": "fd00::", "len": 64}}}}, {"match": {"op": "==", "left": {"meta": {"key": "l4proto"}}, "right": '
     '"ipv6-icmp"}}, {"snat": {"family": "ip6", "addr": "fd00::5"}}], "comment": "ip-masq-agent: rule d"}',
     'ip6 daddr fd00::/64 meta l4proto ipv6-icmp snat ip6 to fd00::5 comment "ip-masq-agent: rule d"'),
    ('{"expr": [{"match": {"op": "==", "left": {"payload": {"protocol": "ip6", "field": "daddr"}}, "right": {"prefix": '
     '{"addr": "fd00::", "len": 64}}}}, {"match": {"op": "==", "left": {"payload": {"protocol": "sctp", "field": '
     '"dport"}}, "right": 9}}, {"masquerade": {"flags": "fully-random"}}], "comment": "ip-masq-agent: rule e"}',
     'ip6 daddr fd00::/64 sctp dport 9 masquerade fully-random comment "ip-masq-agent: rule e"'),
]


@pytest.mark.parametrize(("listed", "text"), KERNEL_JSON)
def test_the_kernel_listing_reads_back_as_the_rendered_text_and_the_fake_lists_it_alike(listed: str,
                                                                                       text: str) -> None:
    assert rule_from_json(json.loads(listed)) == text
    assert rule_to_json(text) == json.loads(listed)


def test_every_rendered_rule_round_trips_through_the_fake() -> None:
    for rule in desired_table(policy()).chains[0].rules:
        assert rule_from_json(rule_to_json(rule)) == rule


def test_an_snat_statement_we_do_not_write_is_unrecognised() -> None:
    odd = {"expr": [{"snat": {"family": "ip", "addr": "10.0.0.1", "port": 80}}]}
    assert rule_from_json(odd).startswith("unrecognised: ")


def test_both_backends_converge_and_then_idle() -> None:
    nft = FakeNft()
    nft_reconciler = Reconciler(NftablesBackend(nft), OPTIONS, log=logging.getLogger("test"))
    ipt = FakeIptables()
    ipt_reconciler = Reconciler(IptablesBackend(ipt, chain="IP-MASQ-AGENT", variant=Variant.NFT), OPTIONS,
                                log=logging.getLogger("test"))
    for reconciler in (nft_reconciler, ipt_reconciler):
        reconciler.observe(ConfigInput((("/c", CONFIG.encode()),)))
        assert reconciler.reconcile().result is SyncResult.APPLIED
        assert reconciler.reconcile().result is SyncResult.IN_SYNC
    assert nft.transactions == 1
    assert any("rule partner-endpoint" in r for r in ipt.table().rules("IP-MASQ-AGENT"))
