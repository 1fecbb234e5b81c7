"""`check` on the config's `rules`, one by one, by the name their comment carries (iptables and nftables alike):
rule-missing, rule-extra, rule-edited, rule-order, each naming the rule and its file:line."""

from __future__ import annotations

import re
from collections.abc import Callable

from ipmasq.config.model import Rule
from ipmasq.diagnose.check_report import FindingId, quote
from ipmasq.findings import Finding, Severity
from ipmasq.netfilter.iptables import RULE_COMMENT_PREFIX

__all__ = ["compare_config_rules", "rule_name"]


_RULE_NAME = re.compile(re.escape(RULE_COMMENT_PREFIX) + r'([^"]*)"')


def rule_name(line: str) -> str | None:
    """The config rule a line belongs to, by the comment the renderers put on it (iptables and nft alike)."""
    found = _RULE_NAME.search(line)
    return None if found is None else found.group(1)


def compare_config_rules(config_rules: list[tuple[Rule, list[str]]], want: list[str], have: list[str],
                         shown: Callable[[str], str], where: str) -> tuple[list[Finding], list[str], list[str]]:
    """Findings for the config's rules (by name): missing, extra, edited, out of order; and the other lines of
    `want` and `have`, for the CIDR-list comparison."""
    findings: list[Finding] = []
    have_lines: dict[str, list[str]] = {}
    for line in have:
        name = rule_name(line)
        if name is not None:
            have_lines.setdefault(name, []).append(line)
    hint = ("the agent rewrites its rules on its next sync (resyncInterval); if it does not, it runs with another "
            "config or other flags than these: compare them, and read its logs")
    configured = {rule.name for rule, _ in config_rules}
    for rule, lines in config_rules:
        present = have_lines.get(rule.name)
        if present is None:
            findings.append(Finding(
                FindingId.RULE_MISSING, Severity.ERROR,
                f"the config's rule {rule.name} ({rule.where()}) is not in {where}: the traffic it matches falls "
                "through to the CIDR lists", hint, missing=tuple(shown(r) for r in lines)))
        elif present != lines:
            missing = [r for r in lines if r not in present]
            extra = [r for r in present if r not in lines]
            detail = (f"missing {quote([shown(r) for r in missing]) or 'nothing'}; extra "
                      f"{quote([shown(r) for r in extra]) or 'nothing'}") if missing or extra else "lines reordered"
            findings.append(Finding(
                FindingId.RULE_EDITED, Severity.ERROR,
                f"the config's rule {rule.name} ({rule.where()}) differs in {where}: {detail}", hint,
                missing=tuple(shown(r) for r in missing), extra=tuple(shown(r) for r in extra)))
    for name, lines in have_lines.items():
        if name not in configured:
            findings.append(Finding(
                FindingId.RULE_EXTRA, Severity.ERROR,
                f"{where} holds rule {name}, which this config does not have (another config, or a rule not for "
                f"this node: --node-name): {quote([shown(r) for r in lines])}", hint,
                extra=tuple(shown(r) for r in lines)))
    rest_want = [r for r in want if rule_name(r) is None]
    rest_have = [r for r in have if rule_name(r) is None]
    order_want = [rule.name for rule, _ in config_rules if rule.name in have_lines]
    order_have = list(dict.fromkeys(n for r in have if (n := rule_name(r)) in configured))
    # the config rules must come first, in order: the first that matches decides, ahead of the CIDR lists
    rule_positions = [i for i, r in enumerate(have) if rule_name(r) in configured]
    # the lines the config rules must precede: those the config puts after them (nft's local and IPv6 returns
    # come first)
    first_rule = next((i for i, r in enumerate(want) if rule_name(r) is not None), len(want))
    entries = {r for r in want[first_rule:] if rule_name(r) is None}
    first_other = next((i for i, r in enumerate(have) if r in entries), len(have))
    late = any(i > first_other for i in rule_positions)
    if order_have != order_want or late:
        findings.append(Finding(
            FindingId.RULE_ORDER, Severity.ERROR,
            f"{where} holds the config's rules in another order ({', '.join(order_have)}; the config: "
            f"{', '.join(order_want)})" if order_have != order_want else
            f"{where} holds config rules after the CIDR entries: the entries decide first",
            "the first rule that matches decides: " + hint))
    return findings, rest_want, rest_have
