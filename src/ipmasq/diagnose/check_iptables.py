"""`check` on an iptables nat table: the structural pass compares our objects with what the agent would write (the
same renderer and canonical form the agent uses): chain-missing, jump-missing, config-not-applied, rules-differ,
stale-chain, and the config's rules one by one (ipmasq.diagnose.check_rules); then the semantic pass
(ipmasq.diagnose.check_semantic) once the chain and its jump are there."""

from __future__ import annotations

from ipmasq.diagnose.check_report import CheckReport, FindingId, quote
from ipmasq.diagnose.check_rules import compare_config_rules, rule_name
from ipmasq.diagnose.check_semantic import semantic_findings
from ipmasq.diagnose.trace_nft import NftTracer
from ipmasq.findings import Finding, Severity
from ipmasq.netfilter.iptables import (
    NatTable,
    canonical,
    chain_ownership,
    chain_rules,
    config_rule_lines,
    jump_rule,
    marker_chain,
    our_chains,
    parse_rule,
    rule_target,
)
from ipmasq.policy.policy import Policy
from ipmasq.prefix import Family, Prefix

__all__ = ["check_iptables"]


def _short(rule: str) -> str:
    """A rule of our chain without the chain name and comment: what it does, e.g. `-d 10.0.0.0/8 -j RETURN`."""
    parsed = parse_rule(rule)
    parts = [("! " if c.negated else "") + f"{c.option} {c.value}" for c in parsed.conditions]
    for m in parsed.matches:
        if m.name != "comment":
            parts.append(" ".join(("-m", m.name, *m.args)))
    if parsed.target is not None:
        parts.append(" ".join(("-g" if parsed.goto else "-j", parsed.target, *parsed.target_args)))
    return " ".join(parts) or "(no match, no target)"


def _without_random_fully(rule: str) -> str:
    return rule.replace(" --random-fully", "")


def _is_catch_all_only(rules: list[str]) -> bool:
    if len(rules) != 1:
        return False
    parsed = parse_rule(rules[0])
    return parsed.target == "MASQUERADE" and not parsed.conditions


def check_iptables(policy: Policy, table: NatTable, family: Family, *, pod_ranges: tuple[Prefix, ...] = (),
                   local_addresses: tuple[int, ...] = (), beside: NftTracer | None = None,
                   writer: str | None = None) -> CheckReport:
    """`beside`: the node's nftables nat chains, walked with iptables' nat POSTROUTING by the semantic pass (the
    kernel runs both: a masquerade in either decides). `writer`: how a message names the provider's agent whose
    flags the policy's options are (`check --writer`: no flag of check's changes them), None for the user's own."""
    chain = policy.options.masq_chain
    findings: list[Finding] = []
    ours = our_chains(table, chain)
    stale = [c for c in ours if c != chain]
    want_jump = canonical(jump_rule(chain))
    postrouting = table.rules_of("POSTROUTING")
    chain_present = chain in table.chains
    live = [name for name in stale if any(rule_target(r) == name for r in postrouting)]
    if not chain_present and len(live) == 1:
        # Not a stale chain: the agent on this node runs under another --masq-chain (GKE's IP-MASQ). Advising to
        # delete it would tear down the node's working rules; the comparison needs the node's chain name.
        return CheckReport((Finding(
            FindingId.CHAIN_MISSING, Severity.ERROR,
            f"this node uses chain {live[0]}, not {chain}: pass --masq-chain={live[0]} (and the agent's other flags, "
            "e.g. --nomasq-all-reserved-ranges on GKE) to compare its rules with the config",
            f"ipmasq check --masq-chain={live[0]} ... ; nothing on the node needs to change for this"),))
    if stale:
        ownership = chain_ownership(table, chain, taken=chain)  # the checked chain is not stale: not hashed
        findings.extend(_stale(name, postrouting, chain, owned=name in ownership.owned,
                               changed=name in ownership.changed) for name in stale)
    if not chain_present:
        hint = ("is the agent running on this node? `kubectl -n kube-system get pods -l k8s-app=ip-masq-agent` "
                "and its logs")
        if stale:
            hint = (f"the node has an ip-masq-agent chain named {stale[0]}: if the agent runs with "
                    f"--masq-chain={stale[0]}, pass the same flag to check; " + hint)
        findings.append(Finding(FindingId.CHAIN_MISSING, Severity.ERROR,
                                f"the nat table has no {chain} chain: pod traffic is not handled by ip-masq-agent",
                                hint))
    jump_present = want_jump in postrouting
    if not jump_present and chain_present:  # iptables refuses a jump to a missing chain: chain-missing says it
        others = [r for r in postrouting if parse_rule(r).target == chain]
        detail = f" (a different jump is there: {others[0]})" if others else ""
        findings.append(Finding(
            FindingId.JUMP_MISSING, Severity.ERROR,
            f"POSTROUTING has no jump to {chain}{detail}: no pod traffic reaches the chain",
            "the agent writes it on every sync: check that it is running and not crash-looping; by hand: "
            f"iptables -t nat -A POSTROUTING -m comment --comment \"...\" -m addrtype ! --dst-type LOCAL -j {chain}",
            rule=want_jump))
    if chain_present:
        findings.extend(_compare_chain(policy, table, family, chain, writer))
    if chain_present and jump_present:
        findings.extend(semantic_findings(policy, table, family, ours=set(ours), pod_ranges=pod_ranges,
                                          local=local_addresses, beside=beside))
    return CheckReport(tuple(findings))


def _stale(name: str, postrouting: list[str], chain: str, *, owned: bool, changed: bool) -> Finding:
    """`owned`: ipmasq's ownership marker is beside it and records its rules, so ipmasq wrote it and its agent
    removes it; `changed`: the marker records other rules (another program rewrote it since); without one another
    program may have written it (GKE's, AKS's or the reference agent's chain carries the same comments)."""
    jumps = [r for r in postrouting if parse_rule(r).target == name]
    live = bool(jumps)
    where = "and POSTROUTING still jumps to it" if live else "(no jump reaches it)"
    marker = marker_chain(name)
    if owned:
        whose = (f"; iptables -t nat -F {marker}; iptables -t nat -X {marker} (ipmasq's agent removes it, and its "
                 "marker, on its next sync)")
    elif changed:
        whose = (" (its rules changed since ipmasq wrote them, as its ownership marker records them: another program "
                 "writes it now, and ipmasq's agent never removes it, only the stale marker)")
    else:
        whose = (" (no ipmasq ownership marker beside it: ipmasq's agent never removes it; another program may still "
                 "write it)")
    return Finding(
        FindingId.STALE_CHAIN, Severity.ERROR if live else Severity.WARNING,
        f"an ip-masq-agent chain {name} is left beside {chain} {where}",
        f"if the agent now runs with --masq-chain={chain}, remove the old one: "
        + (f"iptables -t nat -D {jumps[0][3:]}; " if live else "")
        + f"iptables -t nat -F {name}; iptables -t nat -X {name}" + whose,
        rule=jumps[0] if live else None)


def _compare_chain(policy: Policy, table: NatTable, family: Family, chain: str,
                   writer: str | None = None) -> list[Finding]:
    want = [canonical(r) for r in chain_rules(policy, family).rules]
    have = table.rules_of(chain)
    if have == want:
        return []
    config_rules = [(rule, [canonical(r) for r in config_rule_lines(chain, rule, policy.options)])
                    for rule in policy.rules(family)]
    if config_rules or any(rule_name(r) is not None for r in have):
        if _is_catch_all_only(have):
            return _not_applied(chain, want)
        rule_findings, want, have = compare_config_rules(config_rules, want, have, _short, chain)
        if have == want:
            return rule_findings
        return rule_findings + _compare_rest(chain, want, have, writer)
    return _compare_rest(chain, want, have, writer)


def _not_applied(chain: str, want: list[str]) -> list[Finding]:
    return [Finding(
        FindingId.CONFIG_NOT_APPLIED, Severity.ERROR,
        f"{chain} holds only the MASQUERADE catch-all: every pod connection is masqueraded, the config's "
        f"{len(want) - 1} non-masquerade rule(s) are not there",
        "the ConfigMap is not reaching the agent: it must be named ip-masq-agent in kube-system with the "
        "file under the key `config` (`config: |`); run `ipmasq lint` on it and read the agent's logs",
        missing=tuple(_short(r) for r in want[:-1]))]


def _random_fully_hint(want: list[str], writer: str | None) -> str:
    """What to do about a chain that differs only in --random-fully: a provider's agent decides it by its own
    version and flags (check's --random-fully is refused beside --writer); the user's agent by the flag given."""
    if writer is not None:
        return (f"nothing to do: the agent behind {writer} sets --random-fully by its own version and flags (the "
                "reference before v2.10 never wrote it), and it only spreads source ports: every destination sees the "
                "same address")
    if any("--random-fully" in r for r in want):
        return "pass --random-fully=false if the agent runs without it; otherwise its next sync fixes it"
    return "drop --random-fully=false (the default is true) if the agent runs with it; otherwise its next sync fixes it"


def _compare_rest(chain: str, want: list[str], have: list[str], writer: str | None = None) -> list[Finding]:
    if _is_catch_all_only(have):
        return _not_applied(chain, want)
    missing = [r for r in want if r not in have]
    extra = [r for r in have if r not in want]
    if [_without_random_fully(r) for r in have] == [_without_random_fully(r) for r in want]:
        # the reference before v2.10 never wrote --random-fully, and it only spreads source ports: same outcome
        return [Finding(FindingId.RULES_DIFFER, Severity.WARNING,
                        f"{chain} differs from the config only in MASQUERADE's --random-fully",
                        _random_fully_hint(want, writer),
                        missing=tuple(_short(r) for r in missing), extra=tuple(_short(r) for r in extra))]
    if not missing and not extra:
        message = f"{chain} holds the config's rules in a different order (the first match decides)"
    else:
        parts = []
        if missing:
            parts.append(f"missing {quote([_short(r) for r in missing])}")
        if extra:
            parts.append(f"extra {quote([_short(r) for r in extra])}")
        message = f"{chain} differs from the config: " + "; ".join(parts)
    return [Finding(FindingId.RULES_DIFFER, Severity.ERROR, message,
                    "the agent rewrites the chain on its next sync (resyncInterval); if it does not, it runs with "
                    "another config or other flags than these: compare them, and read its logs",
                    missing=tuple(_short(r) for r in missing), extra=tuple(_short(r) for r in extra))]
