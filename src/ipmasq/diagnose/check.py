"""`check`: the intent (a Policy) against the node's real nat rules, as findings with stable ids and fix hints.

Two passes over an iptables-save table. The structural pass compares our objects with what the agent would
write (the same renderer and canonical form the agent uses): chain-missing, jump-missing, config-not-applied,
rules-differ, stale-chain. The semantic pass traces a pod packet through the whole POSTROUTING, once per
interval of destinations that every rule and the policy treat alike, and compares the outcome with the
policy's verdict: a foreign rule that changes it is foreign-masquerade (it NATs) or jump-shadowed (it lets
the packet go before our chain sees it); a rule the tracer cannot evaluate is unsupported, quoted.

Pure: tables and policies in, findings (ipmasq.findings) out (ipmasq.diagnose.sources reads the tables).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from functools import lru_cache

from ipmasq.diagnose.trace import Outcome, Packet, Tracer
from ipmasq.findings import Finding, Severity, has_errors
from ipmasq.policy import Policy
from ipmasq.prefix import Family, Prefix, PrefixError, parse_cidr
from ipmasq.ranges import Span, append_span, subtract, to_prefixes
from ipmasq.rules.iptables import (
    NatTable,
    canonical,
    chain_rules,
    jump_rule,
    our_chains,
    parse_rule,
    rule_target,
)
from ipmasq.rules.nft import CHAIN, SET_NAMES, TABLE, TABLE_FAMILY, NftTable, desired_table

__all__ = ["CheckReport", "FindingId", "NodeRules", "check_iptables", "check_nft", "check_node"]

# How many destinations a message quotes before "and N more" (the JSON field has them all).
_QUOTED = 6


class FindingId(StrEnum):
    """check's stable ids: Finding.id holds the member itself, so `f.id is FindingId.X` and `f.id == "x"` both hold."""

    CHAIN_MISSING = "chain-missing"
    JUMP_MISSING = "jump-missing"
    CONFIG_NOT_APPLIED = "config-not-applied"
    RULES_DIFFER = "rules-differ"
    FOREIGN_MASQUERADE = "foreign-masquerade"
    JUMP_SHADOWED = "jump-shadowed"
    STALE_CHAIN = "stale-chain"
    UNSUPPORTED = "unsupported"


@dataclass(frozen=True, slots=True)
class CheckReport:
    findings: tuple[Finding, ...] = field(default=())

    @property
    def ok(self) -> bool:
        return not has_errors(self.findings)


@dataclass(frozen=True, slots=True)
class NodeRules:
    """The nat rules `check` compares with the intent: iptables nat tables by family, or our nftables table."""

    backend: str  # "iptables" or "nftables"
    tables: Mapping[Family, NatTable]  # iptables: the nat table of each family read
    nft: NftTable | None = None  # nftables: our table, None when the node has none


def _quote(items: list[str]) -> str:
    shown = ", ".join(items[:_QUOTED])
    return shown + (f" and {len(items) - _QUOTED} more" if len(items) > _QUOTED else "")


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


# --- iptables -----------------------------------------------------------------------------------------------


def check_iptables(policy: Policy, table: NatTable, family: Family, *, pod_ranges: tuple[Prefix, ...] = (),
                   local_addresses: tuple[int, ...] = ()) -> CheckReport:
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
    for name in stale:
        findings.append(_stale(name, postrouting, chain))
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
        findings.extend(_compare_chain(policy, table, family, chain))
    if chain_present and jump_present:
        findings.extend(_semantic(policy, table, family, set(ours), pod_ranges, local_addresses))
    return CheckReport(tuple(findings))


def _stale(name: str, postrouting: list[str], chain: str) -> Finding:
    jumps = [r for r in postrouting if parse_rule(r).target == name]
    live = bool(jumps)
    where = "and POSTROUTING still jumps to it" if live else "(no jump reaches it)"
    return Finding(
        FindingId.STALE_CHAIN, Severity.ERROR if live else Severity.WARNING,
        f"an ip-masq-agent chain {name} is left beside {chain} {where}",
        f"if the agent now runs with --masq-chain={chain}, remove the old one: "
        + (f"iptables -t nat -D {jumps[0][3:]}; " if live else "")
        + f"iptables -t nat -F {name}; iptables -t nat -X {name} (the agent's next sync does it too)",
        rule=jumps[0] if live else None)


def _compare_chain(policy: Policy, table: NatTable, family: Family, chain: str) -> list[Finding]:
    want = [canonical(r) for r in chain_rules(policy, family).rules]
    have = table.rules_of(chain)
    if have == want:
        return []
    if _is_catch_all_only(have):
        return [Finding(
            FindingId.CONFIG_NOT_APPLIED, Severity.ERROR,
            f"{chain} holds only the MASQUERADE catch-all: every pod connection is masqueraded, the config's "
            f"{len(want) - 1} non-masquerade rule(s) are not there",
            "the ConfigMap is not reaching the agent: it must be named ip-masq-agent in kube-system with the "
            "file under the key `config` (`config: |`); run `ipmasq lint` on it and read the agent's logs",
            missing=tuple(_short(r) for r in want[:-1]))]
    missing = [r for r in want if r not in have]
    extra = [r for r in have if r not in want]
    if [_without_random_fully(r) for r in have] == [_without_random_fully(r) for r in want]:
        # the reference before v2.10 never wrote --random-fully, and it only spreads source ports: same outcome
        return [Finding(FindingId.RULES_DIFFER, Severity.WARNING,
                        f"{chain} differs from the config only in MASQUERADE's --random-fully",
                        "pass --random-fully=false if the agent runs without it; otherwise its next sync fixes it",
                        missing=tuple(_short(r) for r in missing), extra=tuple(_short(r) for r in extra))]
    if not missing and not extra:
        message = f"{chain} holds the config's rules in a different order (the first match decides)"
    else:
        parts = []
        if missing:
            parts.append(f"missing {_quote([_short(r) for r in missing])}")
        if extra:
            parts.append(f"extra {_quote([_short(r) for r in extra])}")
        message = f"{chain} differs from the config: " + "; ".join(parts)
    return [Finding(FindingId.RULES_DIFFER, Severity.ERROR, message,
                    "the agent rewrites the chain on its next sync (resyncInterval); if it does not, it runs with "
                    "another config or other flags than these: compare them, and read its logs",
                    missing=tuple(_short(r) for r in missing), extra=tuple(_short(r) for r in extra))]


def _boundaries(tracer: Tracer, policy: Policy, family: Family, local: tuple[int, ...]) -> list[int]:
    """Starts of the destination intervals that every reachable rule and the policy treat alike."""
    points = {0}
    for name in tracer.reachable():
        for rule in tracer.rules_of(name):
            condition = rule.condition("-d")
            if condition is None:
                continue
            try:
                prefix = parse_cidr(condition.value)
            except PrefixError:
                continue
            if prefix.family is family:
                points.update((prefix.first, prefix.last + 1))
    for entry in policy.rule_entries(family) if family in policy.families else ():
        points.update((entry.prefix.first, entry.prefix.last + 1))
    for address in local:
        points.update((address, address + 1))
    return sorted(p for p in points if p <= family.max_address)


@lru_cache(maxsize=1024)  # the same few foreign rules decide thousands of destination intervals
def _nat_rule(text: str) -> bool:
    return parse_rule(text, already_canonical=True).target in ("MASQUERADE", "SNAT")


def _semantic(policy: Policy, table: NatTable, family: Family, ours: set[str],
              pod_ranges: tuple[Prefix, ...], local: tuple[int, ...]) -> list[Finding]:
    tracer = Tracer(table)
    points = _boundaries(tracer, policy, family, local)
    loopback = parse_cidr("127.0.0.0/8" if family is Family.V4 else "::1/128")
    sources = tuple(p for p in pod_ranges if p.family is family)
    # per deciding rule: the destination ranges it gets wrong / cannot decide
    wrong: dict[tuple[FindingId, str], list[Span]] = {}
    reasons: dict[str, str] = {}
    for i, start in enumerate(points):
        end = points[i + 1] - 1 if i + 1 < len(points) else family.max_address
        if start in local or loopback.contains(start):
            continue  # node-local destinations never reach our chain (! --dst-type LOCAL), by design
        packet = Packet(family, start, sources, local_addresses=local)
        result = tracer.trace(packet, record_steps=False)
        if result.outcome is Outcome.UNDECIDED:
            rule = result.decided_by or "(dump)"
            reasons[rule] = result.undecided_reason or ""
            _add(wrong, (FindingId.UNSUPPORTED, rule), start, end)
            continue
        expected = policy.verdict_for(family, start).masquerade
        actual = result.outcome in (Outcome.MASQUERADE, Outcome.SNAT)
        if actual == expected:
            continue
        decider = result.decided_by
        if result.decided_in in ours:
            continue  # our own chain decided: rules-differ or stale-chain already says why
        reached_ours = policy.options.masq_chain in result.chains
        if decider is not None and actual and _nat_rule(decider):
            _add(wrong, (FindingId.FOREIGN_MASQUERADE, decider), start, end)
        elif not reached_ours:
            _add(wrong, (FindingId.JUMP_SHADOWED, decider or "(POSTROUTING policy)"), start, end)
        else:
            _add(wrong, (FindingId.FOREIGN_MASQUERADE if actual else FindingId.JUMP_SHADOWED,
                         decider or "(POSTROUTING policy)"), start, end)
    findings = []
    for (kind, rule), ranges in wrong.items():
        prefixes = [str(p) for first, last in ranges for p in to_prefixes(family, first, last)]
        findings.append(_semantic_finding(kind, rule, prefixes, reasons.get(rule, ""), policy))
    return findings


def _add(wrong: dict[tuple[FindingId, str], list[Span]], key: tuple[FindingId, str], first: int, last: int) -> None:
    append_span(wrong.setdefault(key, []), first, last)


def _semantic_finding(kind: FindingId, rule: str, prefixes: list[str], reason: str, policy: Policy) -> Finding:
    dests = _quote(prefixes)
    delete = f"iptables -t nat -D {rule[3:]}" if rule.startswith("-A ") else "remove it"
    if kind is FindingId.FOREIGN_MASQUERADE:
        hint = (f"if these destinations must be masqueraded, say so in the config (masqueradeCIDRs) and delete "
                f"the rule: {delete}; otherwise delete the rule and whatever re-adds it")
        if "kubenet" in rule:
            hint = ("kubenet masquerades everything outside kubelet's --non-masquerade-cidr: run kubelet with "
                    "--non-masquerade-cidr=0.0.0.0/0 so that ip-masq-agent alone decides")
        return Finding(kind, Severity.ERROR,
                       f"a rule outside {policy.options.masq_chain} NATs pod traffic the config keeps unmasqueraded "
                       f"({dests}): {rule}", hint, rule=rule, destinations=tuple(prefixes))
    if kind is FindingId.JUMP_SHADOWED:
        return Finding(kind, Severity.ERROR,
                       f"pod traffic to {dests} is decided before it reaches {policy.options.masq_chain}, "
                       f"against the config, by: {rule}",
                       f"move the jump to {policy.options.masq_chain} above that rule, or delete the rule: {delete}",
                       rule=rule, destinations=tuple(prefixes))
    if "source" in reason:
        hint = "pass --pod-range so that the rule's source test can be decided"
    elif "interface" in reason:
        hint = ("the rule depends on the out interface, which check does not know: trace the destination with "
                "`ipmasq trace DEST --source POD_IP --out-interface IFACE`")
    else:
        hint = "the rule uses matches check does not evaluate: read it by hand, or move its intent into the config"
    return Finding(kind, Severity.WARNING,
                   f"cannot decide what happens to pod traffic to {dests}: {reason}: {rule}",
                   hint, rule=rule, destinations=tuple(prefixes))


# --- nftables -----------------------------------------------------------------------------------------------


def check_nft(policy: Policy, table: NftTable | None) -> CheckReport:
    """Our nftables table (from `nft -j list ruleset`) against the policy."""
    if table is None:
        return CheckReport((Finding(
            FindingId.CHAIN_MISSING, Severity.ERROR,
            f"there is no nftables table {TABLE_FAMILY} {TABLE}: pod traffic is not handled by the agent",
            "is the agent running with --backend nftables? `kubectl -n kube-system get pods -l "
            "k8s-app=ip-masq-agent` and its logs"),))
    want = desired_table(policy)
    findings: list[Finding] = []
    have_chain = table.chain_named(CHAIN)
    want_chain = want.chain_named(CHAIN)
    assert want_chain is not None
    if have_chain is None:
        findings.append(Finding(FindingId.JUMP_MISSING, Severity.ERROR,
                                f"table {TABLE} has no {CHAIN} chain hooked at postrouting: no traffic is handled",
                                "the agent re-creates the table on its next sync; read its logs"))
    elif have_chain != want_chain:
        if have_chain.hook != want_chain.hook or have_chain.type != want_chain.type:
            findings.append(Finding(FindingId.JUMP_MISSING, Severity.ERROR,
                                    f"chain {CHAIN} is not a nat chain at postrouting ({have_chain.type or 'regular'} "
                                    f"{have_chain.hook or 'no hook'})",
                                    "the agent re-creates the table on its next sync; read its logs"))
        elif all("masquerade" in r for r in have_chain.rules) and len(want_chain.rules) > len(have_chain.rules):
            findings.append(Finding(FindingId.CONFIG_NOT_APPLIED, Severity.ERROR,
                                    f"chain {CHAIN} holds only masquerade rules: every pod connection is masqueraded",
                                    "the ConfigMap is not reaching the agent: run `ipmasq lint` on it and read the "
                                    "agent's logs"))
        else:
            missing = [r for r in want_chain.rules if r not in have_chain.rules]
            extra = [r for r in have_chain.rules if r not in want_chain.rules]
            findings.append(Finding(FindingId.RULES_DIFFER, Severity.ERROR,
                                    f"chain {CHAIN} differs from the config: missing {_quote(missing) or 'nothing'}; "
                                    f"extra {_quote(extra) or 'nothing'}",
                                    "the agent rewrites the table on its next sync; if not, it runs with other flags",
                                    missing=tuple(missing), extra=tuple(extra)))
    for family in Family:
        name = SET_NAMES[family]
        want_set, have_set = want.set_named(name), table.set_named(name)
        if want_set is None and have_set is None:
            continue
        want_elements = want_set.elements if want_set is not None else ()
        have_elements = have_set.elements if have_set is not None else ()
        if want_elements == have_elements:
            continue
        missing = [str(p) for a, b in subtract(want_elements, have_elements) for p in to_prefixes(family, a, b)]
        extra = [str(p) for a, b in subtract(have_elements, want_elements) for p in to_prefixes(family, a, b)]
        findings.append(Finding(
            FindingId.RULES_DIFFER, Severity.ERROR,
            f"set {name} differs from the config: not masqueraded per config but masqueraded on the node: "
            f"{_quote(missing) or 'none'}; kept unmasqueraded on the node against the config: "
            f"{_quote(extra) or 'none'}",
            "the agent rewrites the table on its next sync; if not, it runs with another config: compare them",
            missing=tuple(missing), extra=tuple(extra)))
    for chain in table.chains:
        if chain.name != CHAIN:
            findings.append(Finding(FindingId.UNSUPPORTED, Severity.WARNING,
                                    f"table {TABLE} holds a chain the agent does not write: {chain.name}",
                                    "delete the table and let the agent re-create it"))
    return CheckReport(tuple(findings))


def check_node(policy: Policy, rules: NodeRules, *, pod_ranges: tuple[Prefix, ...] = (),
               local_addresses: tuple[tuple[Family, int], ...] = ()) -> CheckReport:
    """Every family the rules hold (iptables), or our nftables table, against the policy."""
    if rules.backend == "nftables":
        return check_nft(policy, rules.nft)
    findings: list[Finding] = []
    for family, table in rules.tables.items():
        local = tuple(address for f, address in local_addresses if f is family)
        findings.extend(check_iptables(policy, table, family, pod_ranges=pod_ranges, local_addresses=local).findings)
    return CheckReport(tuple(findings))
