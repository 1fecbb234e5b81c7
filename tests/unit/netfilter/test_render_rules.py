"""Config rules rendered for both backends: ahead of the CIDR rules, in the form the kernel lists them back."""

from __future__ import annotations

import json
import logging

import pytest

from ipmasq.agent.reconcile import Reconciler, SyncResult
from ipmasq.backends.iptables import IptablesBackend, Variant
from ipmasq.backends.nftables import NftablesBackend
from ipmasq.config import ConfigInput, config_from_bytes
from ipmasq.netfilter.iptables import chain_rules, render_restore
from ipmasq.netfilter.nft import (
    CHAIN,
    RULES_CHAIN,
    RULES_JUMP_COMMENT,
    desired_table,
    format_elements,
    parse_list_json,
    render_script,
    rule_from_json,
)
from ipmasq.options import PolicyOptions
from ipmasq.policy.policy import Policy
from ipmasq.policy.prefix import Family
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


def test_nft_rules_sit_in_their_chain_entered_after_local_and_before_the_sets() -> None:
    table = desired_table(policy())
    base, rules_chain = table.chain_named(CHAIN), table.chain_named(RULES_CHAIN)
    assert base is not None and rules_chain is not None
    assert (rules_chain.type, rules_chain.hook, rules_chain.policy) == ("", "", "")  # regular: entered by jump only
    assert base.rules[0].startswith("fib daddr type local return")
    # where the rules stood: one set lookup per family sends the destinations they name into their chain
    assert base.rules[1:3] == (
        f'ip daddr @rules_dst_v4 jump config-rules comment "{RULES_JUMP_COMMENT}"',
        f'ip6 daddr @rules_dst_v6 jump config-rules comment "{RULES_JUMP_COMMENT}"',
    )
    assert base.rules[3].startswith("ip daddr @nomasq_v4 return")
    assert not any("ip-masq-agent: rule " in r for r in base.rules)
    # each config rule counts its packets (ipmasq_rule_packets_total); nothing else does; first match wins in order
    assert rules_chain.rules == (
        "ip saddr 100.64.0.0/16 ip daddr { 10.1.2.7, 10.1.2.100 } tcp dport { 443, 8000-8080 } "
        'counter snat ip to 10.142.0.50 fully-random comment "ip-masq-agent: rule partner-endpoint"',
        'ip daddr 10.3.0.0/24 udp dport 53 counter masquerade fully-random comment "ip-masq-agent: rule dns"',
        # two halves merged into one prefix, as nft lists an anonymous set; preserve ends the decision: accept,
        # never return (which would resume the base chain at the set lookups and the masquerade)
        'ip daddr 192.168.0.0/16 meta l4proto icmp counter accept comment "ip-masq-agent: rule keep-icmp"',
        "ip6 saddr fd10::/48 ip6 daddr { fd00:1::/64, fd00:2::5 } meta l4proto ipv6-icmp counter snat ip6 to fd00::5 "
        'fully-random comment "ip-masq-agent: rule v6-partner"',
    )
    # the union of this node's rule destinations, per family (the other node's rule is not there)
    v4, v6 = table.set_named("rules_dst_v4"), table.set_named("rules_dst_v6")
    assert v4 is not None and v6 is not None and v4.flags == v6.flags == ("interval",)
    assert format_elements(Family.V4, v4.elements) == ["10.1.2.7", "10.1.2.100", "10.3.0.0/24", "192.168.0.0/16"]
    assert format_elements(Family.V6, v6.elements) == ["fd00:1::/64", "fd00:2::5"]


def test_nft_rules_of_one_family_only_add_that_family_s_set_and_jump() -> None:
    text = "rules:\n  - name: keep\n    destinations: [34.0.0.0/8]\n    action: preserve\n"
    table = desired_table(policy(text))
    assert [s.name for s in table.sets] == ["nomasq_v4", "nomasq_v6", "rules_dst_v4"]
    base = table.chain_named(CHAIN)
    assert base is not None and [r for r in base.rules if "jump" in r] == [
        f'ip daddr @rules_dst_v4 jump config-rules comment "{RULES_JUMP_COMMENT}"']


def test_without_rules_there_is_no_rules_chain_nor_set() -> None:
    table = desired_table(policy("nonMasqueradeCIDRs: [10.0.0.0/8]\n"))
    assert [c.name for c in table.chains] == [CHAIN]
    assert [s.name for s in table.sets] == ["nomasq_v4", "nomasq_v6"]
    assert not any("jump" in r for r in table.chains[0].rules)


def test_the_rules_chain_and_sets_read_back_equal_from_the_fake_listing() -> None:
    nft = FakeNft()
    assert nft(["nft", "-f", "-"], render_script(policy())).returncode == 0
    listed = nft(["nft", "-j", "list", "ruleset"]).stdout
    jumps = [o["rule"]["expr"][-1] for o in json.loads(listed)["nftables"] if "rule" in o and
             o["rule"]["expr"][-1].get("jump")]
    assert jumps == [{"jump": {"target": "config-rules"}}] * 2  # as nft -j lists a jump
    assert parse_list_json(listed) == desired_table(policy())
    # the terse listing (no elements) still carries every config rule's counter, from the rules' chain
    nft.count("ip-masq-agent: rule dns", 3, 180)
    terse = parse_list_json(nft(["nft", "-j", "-t", "list", "ruleset", "inet"]).stdout)
    assert terse is not None
    assert {name for name, _, _ in terse.counters} == {"partner-endpoint", "dns", "keep-icmp", "v6-partner"}
    assert ("dns", 3, 180) in terse.counters


def test_a_jump_reads_back_as_its_text_and_other_verdict_shapes_are_unrecognised() -> None:
    rule = {"expr": [{"match": {"op": "==", "left": {"payload": {"protocol": "ip", "field": "daddr"}},
                                "right": "@rules_dst_v4"}}, {"jump": {"target": "config-rules"}}],
            "comment": RULES_JUMP_COMMENT}
    assert rule_from_json(rule) == f'ip daddr @rules_dst_v4 jump config-rules comment "{RULES_JUMP_COMMENT}"'
    assert rule_from_json({"expr": [{"jump": {"target": "x", "extra": 1}}]}).startswith("unrecognised: ")
    assert rule_from_json({"expr": [{"goto": "x"}]}).startswith("unrecognised: ")


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
    for chain in desired_table(policy()).chains:
        for rule in chain.rules:
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
