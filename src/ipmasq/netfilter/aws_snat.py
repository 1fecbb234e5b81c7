"""The Amazon VPC CNI's node SNAT chain, read from an iptables-save nat table (NatTable).

Its shape, as aws/amazon-vpc-cni-k8s pkg/networkutils/network.go (buildIptablesSNATRules) writes it:

    -A POSTROUTING -m comment --comment "AWS SNAT CHAIN" -j AWS-SNAT-CHAIN-0
    -A AWS-SNAT-CHAIN-0 -d VPC_CIDR -m comment --comment "AWS SNAT CHAIN" -j RETURN            (one per VPC CIDR)
    -A AWS-SNAT-CHAIN-0 -d CIDR -m comment --comment "AWS SNAT CHAIN EXCLUSION" -j RETURN      (one per exclusion)
    -A AWS-SNAT-CHAIN-0 ! -o vlan+ -m comment --comment "AWS, SNAT" -m addrtype ! --dst-type LOCAL
        -j SNAT --to-source PRIMARY_IP [--random-fully | --random]

(the CIDR rules are inserted at position 1, ahead of the SNAT rule). Older releases chained AWS-SNAT-CHAIN-0..N with
`! -d CIDR -j AWS-SNAT-CHAIN-n+1`; `check` walks whatever the table holds, this reader only names the parts.
Pure: a NatTable in, an AwsSnatChain out.
"""

from __future__ import annotations

from dataclasses import dataclass

from ipmasq.errors import PrefixError
from ipmasq.netfilter.iptables import NatTable, parse_rule
from ipmasq.prefix import Prefix, parse_cidr

__all__ = ["CHAIN", "EXCLUSION_COMMENT", "SNAT_COMMENT", "VPC_COMMENT", "AwsSnatChain", "read_aws_snat_chain"]

CHAIN = "AWS-SNAT-CHAIN-0"
VPC_COMMENT = "AWS SNAT CHAIN"
EXCLUSION_COMMENT = "AWS SNAT CHAIN EXCLUSION"
SNAT_COMMENT = "AWS, SNAT"


@dataclass(frozen=True, slots=True)
class AwsSnatChain:
    """What the node's AWS-SNAT-CHAIN-0 holds, by part."""

    jump: bool  # POSTROUTING jumps to it
    vpc_cidrs: tuple[Prefix, ...]  # RETURN rules commented "AWS SNAT CHAIN"
    exclusions: tuple[Prefix, ...]  # RETURN rules commented "AWS SNAT CHAIN EXCLUSION"
    snat_to: str | None  # the SNAT rule's --to-source (None: no SNAT rule)
    others: tuple[str, ...]  # every other rule of the chain, as iptables-save prints it


def _comment(rule_text: str) -> str | None:
    rule = parse_rule(rule_text, already_canonical=True)
    for match in rule.matches:
        if match.name == "comment" and len(match.args) >= 2 and match.args[0] == "--comment":
            return match.args[1]
    return None


def read_aws_snat_chain(table: NatTable) -> AwsSnatChain | None:
    """The chain's parts; None when the table has no such chain."""
    if CHAIN not in table.chains:
        return None
    jump = any(parse_rule(r, already_canonical=True).target == CHAIN for r in table.rules_of("POSTROUTING"))
    vpc: list[Prefix] = []
    excluded: list[Prefix] = []
    others: list[str] = []
    snat_to: str | None = None
    for text in table.rules_of(CHAIN):
        rule = parse_rule(text, already_canonical=True)
        comment = _comment(text)
        destination = rule.condition("-d")
        if rule.target == "RETURN" and destination is not None and not destination.negated \
                and comment in (VPC_COMMENT, EXCLUSION_COMMENT) and len(rule.conditions) == 1:
            try:
                prefix = parse_cidr(destination.value)
            except PrefixError:
                others.append(text)
                continue
            (excluded if comment == EXCLUSION_COMMENT else vpc).append(prefix)
        elif rule.target == "SNAT" and comment == SNAT_COMMENT and snat_to is None:
            snat_to = rule.target_option("--to-source")
        else:
            others.append(text)
    return AwsSnatChain(jump, tuple(vpc), tuple(excluded), snat_to, tuple(others))
