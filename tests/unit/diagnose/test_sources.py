"""Reading the node's rules: a dump of a format check does not read is named with the command to use, and a live
read with no nat rule at all is told apart from a node."""

from __future__ import annotations

import json

import pytest

from ipmasq.cli import main
from ipmasq.diagnose.check import NodeRules
from ipmasq.diagnose.sources import holds_no_nat_rules
from ipmasq.netfilter.iptables import parse_save
from ipmasq.netfilter.nft import desired_table
from ipmasq.options import PolicyOptions
from ipmasq.prefix import Family
from tests.configs import policy_of
from tests.conftest import ROOT

DUMPS = ROOT / "tests" / "dumps"
EMPTY_NAT = "*nat\n:PREROUTING ACCEPT [0:0]\n:POSTROUTING ACCEPT [0:0]\nCOMMIT\n"


@pytest.mark.parametrize("command", [["check", "--from-dump"], ["trace", "8.8.8.8", "--source", "10.4.0.5", "--dump"]])
def test_an_nft_text_listing_is_named_with_the_json_command(capsys: pytest.CaptureFixture[str],
                                                            command: list[str]) -> None:
    assert main([*command, str(DUMPS / "kube-proxy-nftables.nft")]) == 3
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "kube-proxy-nftables.nft:1: an `nft list ruleset` text listing" in err
    assert "nft -j list ruleset" in err


def test_no_nat_rule_at_all_is_no_node_and_any_rule_is_one() -> None:
    empty = NodeRules("iptables", {Family.V4: parse_save(EMPTY_NAT), Family.V6: parse_save(EMPTY_NAT)})
    assert holds_no_nat_rules(empty)
    assert holds_no_nat_rules(NodeRules("iptables", {}, nft_ruleset='{"nftables": [{"metainfo": {}}]}'))
    one = "*nat\n:POSTROUTING ACCEPT [0:0]\n-A POSTROUTING -o eth0 -j MASQUERADE\nCOMMIT\n"
    assert not holds_no_nat_rules(NodeRules("iptables", {Family.V4: parse_save(one)}))
    # kube-proxy's nftables mode: rules in a table with nat chains
    listing = (DUMPS / "kube-proxy-nftables.json").read_text()
    assert not holds_no_nat_rules(NodeRules("iptables", {Family.V4: parse_save(EMPTY_NAT)}, nft_ruleset=listing))
    # a filter table's rules are no nat rules
    filter_only = json.dumps({"nftables": [
        {"table": {"family": "inet", "name": "fw"}},
        {"chain": {"family": "inet", "table": "fw", "name": "in", "type": "filter", "hook": "input", "prio": 0}},
        {"rule": {"family": "inet", "table": "fw", "chain": "in", "expr": [{"accept": None}]}}]})
    assert holds_no_nat_rules(NodeRules("iptables", {}, nft_ruleset=filter_only))
    assert not holds_no_nat_rules(NodeRules("iptables", {}, nft_ruleset="not json"))  # never a guess from garbage
    ours = desired_table(policy_of("", PolicyOptions()))  # the agent's own table
    assert not holds_no_nat_rules(NodeRules("nftables", {}, nft=ours))
