"""`check` on our nftables table (from `nft -j list ruleset`): its chains and sets against what the agent would
write, the config's rules one by one in their own chain (ipmasq.diagnose.check_rules) and the set that leads into
them; with the whole ruleset, the semantic pass (ipmasq.diagnose.check_semantic) over every nat postrouting chain."""

from __future__ import annotations

from collections.abc import Mapping

from ipmasq.diagnose.check_report import CheckReport, FindingId, quote
from ipmasq.diagnose.check_rules import compare_config_rules
from ipmasq.diagnose.check_semantic import IptablesBeside, Walker, semantic_walk
from ipmasq.diagnose.trace import Tracer
from ipmasq.diagnose.trace_nft import NftTracer
from ipmasq.findings import Finding, Severity
from ipmasq.netfilter.iptables import NatTable
from ipmasq.netfilter.nft import (
    CHAIN,
    RULES_CHAIN,
    RULES_SET_NAMES,
    SET_NAMES,
    TABLE,
    TABLE_FAMILY,
    NftTable,
    config_rule_text,
    desired_table,
)
from ipmasq.policy.policy import Policy
from ipmasq.policy.ranges import subtract, to_prefixes
from ipmasq.prefix import Family, Prefix

__all__ = ["check_nft"]


def check_nft(policy: Policy, table: NftTable | None, *, ruleset: str | None = None,
              pod_ranges: tuple[Prefix, ...] = (), local_addresses: tuple[tuple[Family, int], ...] = (),
              iptables: Mapping[Family, NatTable] | None = None) -> CheckReport:
    """Our nftables table (from `nft -j list ruleset`) against the policy; with the whole `ruleset`, also every
    class of pod packets traced through all nat postrouting chains (other tables' included) against the policy.
    `iptables`: iptables-nft's nat tables of the listing, read with iptables-nft-save and walked in iptables' terms
    beside the nftables chains (the listing shows their matches only as `xt` stubs)."""
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
        elif have_chain.rules != want_chain.rules:
            missing = [r for r in want_chain.rules if r not in have_chain.rules]
            extra = [r for r in have_chain.rules if r not in want_chain.rules]
            findings.append(Finding(FindingId.RULES_DIFFER, Severity.ERROR,
                                    f"chain {CHAIN} differs from the config: " + (
                                        f"missing {quote(missing) or 'nothing'}; extra {quote(extra) or 'nothing'}"
                                        if missing or extra else "its rules are in another order"),
                                    "the agent rewrites the table on its next sync; if not, it runs with other "
                                    "flags", missing=tuple(missing), extra=tuple(extra)))
    findings.extend(_compare_rules_chain(policy, want, table))
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
            f"{quote(missing) or 'none'}; kept unmasqueraded on the node against the config: "
            f"{quote(extra) or 'none'}",
            "the agent rewrites the table on its next sync; if not, it runs with another config: compare them",
            missing=tuple(missing), extra=tuple(extra)))
    for family in Family:
        findings.extend(_compare_rules_set(RULES_SET_NAMES[family], family, want, table))
    for chain in table.chains:
        if chain.name not in (CHAIN, RULES_CHAIN):
            findings.append(Finding(FindingId.UNSUPPORTED, Severity.WARNING,
                                    f"table {TABLE} holds a chain the agent does not write: {chain.name}",
                                    "delete the table and let the agent re-create it"))
    if ruleset is not None and have_chain is not None:
        tracer = NftTracer(ruleset)
        ours = f"{TABLE_FAMILY} {TABLE} {CHAIN}"
        for family in policy.families:
            local = tuple(address for f, address in local_addresses if f is family)
            beside = (iptables or {}).get(family)
            walker: Walker = tracer if beside is None else IptablesBeside(Tracer(beside), tracer, family)
            findings.extend(semantic_walk(policy, walker, family, {ours, f"{TABLE_FAMILY} {TABLE} {RULES_CHAIN}"},
                                          ours, pod_ranges, local))
    return CheckReport(tuple(findings))


def _compare_rules_chain(policy: Policy, want: NftTable, table: NftTable) -> list[Finding]:
    """The config's rules in their own chain: missing, edited, extra (also when the config has none), out of
    order, and any other line the chain holds or lacks."""
    want_chain, have_chain = want.chain_named(RULES_CHAIN), table.chain_named(RULES_CHAIN)
    if want_chain == have_chain:
        return []
    findings: list[Finding] = []
    if have_chain is not None and have_chain.type:
        findings.append(Finding(FindingId.RULES_DIFFER, Severity.ERROR,
                                f"chain {RULES_CHAIN} is a base chain ({have_chain.type} "
                                f"{have_chain.hook or 'no hook'}): its rules run for every packet of that hook, not "
                                f"only from {CHAIN}",
                                "delete the table and let the agent re-create it"))
    config_rules = [(rule, [config_rule_text(rule, policy.options)]) for family in policy.families
                    for rule in policy.rules(family)]
    want_rules = list(want_chain.rules) if want_chain is not None else []
    have_rules = list(have_chain.rules) if have_chain is not None else []
    rule_findings, want_rest, have_rest = compare_config_rules(
        config_rules, want_rules, have_rules, lambda r: r, f"chain {RULES_CHAIN}")
    findings.extend(rule_findings)
    if want_rest != have_rest:
        missing = [r for r in want_rest if r not in have_rest]
        extra = [r for r in have_rest if r not in want_rest]
        findings.append(Finding(FindingId.RULES_DIFFER, Severity.ERROR,
                                f"chain {RULES_CHAIN} differs from the config: missing "
                                f"{quote(missing) or 'nothing'}; extra {quote(extra) or 'nothing'}",
                                "the agent rewrites the table on its next sync; if not, it runs with other flags",
                                missing=tuple(missing), extra=tuple(extra)))
    return findings


def _compare_rules_set(name: str, family: Family, want: NftTable, table: NftTable) -> list[Finding]:
    """The set that sends traffic into the config's rules: a destination it lacks skips every rule for the CIDR
    lists (an error); one it holds too many only costs that traffic a walk over the rules that match none."""
    want_set, have_set = want.set_named(name), table.set_named(name)
    want_elements = want_set.elements if want_set is not None else ()
    have_elements = have_set.elements if have_set is not None else ()
    if want_elements == have_elements:
        return []
    missing = [str(p) for a, b in subtract(want_elements, have_elements) for p in to_prefixes(family, a, b)]
    extra = [str(p) for a, b in subtract(have_elements, want_elements) for p in to_prefixes(family, a, b)]
    return [Finding(
        FindingId.RULES_DIFFER, Severity.ERROR if missing else Severity.WARNING,
        f"set {name} differs from the config's rule destinations: the config's rules are skipped for "
        f"{quote(missing) or 'none'}; entered without need for {quote(extra) or 'none'}",
        "the agent rewrites the table on its next sync; if not, it runs with another config: compare them",
        missing=tuple(missing), extra=tuple(extra))]

