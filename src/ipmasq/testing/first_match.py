"""The config rules' first match written plainly, as the reference the rules index (ipmasq.policy.rule_index) must
equal: rule_match over every rule in order. The property tests compare the index with it, and bench_verdict.py
measures the index against it. Never used by the agent or the tools."""

from __future__ import annotations

from ipmasq.config.model import Rule
from ipmasq.policy.packet import Packet
from ipmasq.policy.policy import PACKET_FIELDS, rule_match

__all__ = ["first_match_walk"]


def first_match_walk(rules: tuple[Rule, ...], packet: Packet) -> tuple[Rule | None, tuple[Rule, ...], tuple[str, ...]]:
    """(the rule that decides or None, the earlier rules that would match if the packet's unknown fields allowed,
    those fields in PACKET_FIELDS order)."""
    conditional: list[Rule] = []
    unknown: set[str] = set()
    for rule in rules:
        needs = rule_match(rule, packet)
        if needs is None:
            continue
        if needs:
            conditional.append(rule)
            unknown.update(needs)
            continue
        return rule, tuple(conditional), tuple(f for f in PACKET_FIELDS if f in unknown)
    return None, tuple(conditional), tuple(f for f in PACKET_FIELDS if f in unknown)
