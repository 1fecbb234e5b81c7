"""`check`: the intent (a Policy) against the node's real nat rules, as findings with stable ids and fix hints.

Two passes over an iptables-save table. The structural pass compares our objects with what the agent would
write (the same renderer and canonical form the agent uses): chain-missing, jump-missing, config-not-applied,
rules-differ, stale-chain. The config's `rules` are compared one by one, by
the name their comment carries: rule-missing, rule-extra, rule-edited, rule-order (each naming the rule and, for a
config rule, its file:line). The semantic pass traces a pod packet through the whole POSTROUTING, once per class of
packets that every rule and the policy treat alike, and compares the outcome (unchanged, masqueraded, SNAT to
which address) with the policy's verdict: a foreign rule that changes it is foreign-masquerade (it NATs) or
jump-shadowed (it lets the packet go before our chain sees it); a rule the tracer cannot evaluate is unsupported,
quoted. The classes are exact: destination intervals, and where a rule also tests the source, the protocol or the
destination port (config rules, or foreign ones), the destination interval is split further by source (inside
--pod-range, or the config rules' sources), protocol and port range; elsewhere one packet per interval, as before.

Pure: tables and policies in, findings (ipmasq.findings) out (ipmasq.diagnose.sources reads the tables).
"""

from __future__ import annotations

import re
from bisect import bisect_right
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import NamedTuple, Protocol

from ipmasq.config.model import Rule
from ipmasq.diagnose.hooks import IPTABLES_NFT_TABLES, iptables_hook, walk_hooks
from ipmasq.diagnose.trace import PROTOCOL_NUMBERS, RuleShape, Tracer, TraceResult
from ipmasq.diagnose.trace_nft import NftTracer
from ipmasq.errors import NftTraceError
from ipmasq.findings import Finding, Severity, has_errors
from ipmasq.netfilter.iptables import (
    RULE_COMMENT_PREFIX,
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
from ipmasq.policy.packet import Outcome, Packet
from ipmasq.policy.policy import Policy
from ipmasq.policy.prefix import Family, Prefix, parse_cidr
from ipmasq.policy.ranges import Span, append_span, subtract, to_prefixes, union, union_of_prefixes
from ipmasq.writers import Ignored

__all__ = ["CheckReport", "FindingId", "NodeRules", "check_iptables", "check_nft", "check_node",
           "ignored_findings", "semantic_findings", "tracer_beside"]

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
    RULE_MISSING = "rule-missing"  # a config rule with no line on the node
    RULE_EXTRA = "rule-extra"  # lines of a rule (by its comment) the config does not have
    RULE_EDITED = "rule-edited"  # a config rule whose lines on the node differ from what it renders to
    RULE_ORDER = "rule-order"  # the config rules in another order, or not ahead of the CIDR entries
    IGNORED_BY_WRITER = "ignored-by-writer"  # a key the provider's agent does not read (ipmasq's extensions)


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
    # iptables: the nat table of each family read; nftables: iptables-nft's nat tables beside ours (kube-proxy's
    # iptables mode), walked in iptables' terms with the nftables chains
    tables: Mapping[Family, NatTable]
    nft: NftTable | None = None  # nftables: our table, None when the node has none
    # the whole `nft -j list ruleset`, for the semantic pass: on nftables every nat chain; on iptables the nftables
    # nat chains beside iptables' (kube-proxy's nftables mode, others), iptables-nft's own tables aside
    nft_ruleset: str | None = None


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
        findings.extend(_semantic(policy, table, family, set(ours), pod_ranges, local_addresses, beside))
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


# --- the config's rules, one by one ---------------------------------------------------------------------------


_RULE_NAME = re.compile(re.escape(RULE_COMMENT_PREFIX) + r'([^"]*)"')


def _rule_name(line: str) -> str | None:
    """The config rule a line belongs to, by the comment the renderers put on it (iptables and nft alike)."""
    found = _RULE_NAME.search(line)
    return None if found is None else found.group(1)


def _compare_config_rules(config_rules: list[tuple[Rule, list[str]]], want: list[str], have: list[str],
                          shown: Callable[[str], str], where: str) -> tuple[list[Finding], list[str], list[str]]:
    """Findings for the config's rules (by name): missing, extra, edited, out of order; and the other lines of
    `want` and `have`, for the CIDR-list comparison."""
    findings: list[Finding] = []
    have_lines: dict[str, list[str]] = {}
    for line in have:
        name = _rule_name(line)
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
            detail = (f"missing {_quote([shown(r) for r in missing]) or 'nothing'}; extra "
                      f"{_quote([shown(r) for r in extra]) or 'nothing'}") if missing or extra else "lines reordered"
            findings.append(Finding(
                FindingId.RULE_EDITED, Severity.ERROR,
                f"the config's rule {rule.name} ({rule.where()}) differs in {where}: {detail}", hint,
                missing=tuple(shown(r) for r in missing), extra=tuple(shown(r) for r in extra)))
    for name, lines in have_lines.items():
        if name not in configured:
            findings.append(Finding(
                FindingId.RULE_EXTRA, Severity.ERROR,
                f"{where} holds rule {name}, which this config does not have (another config, or a rule not for "
                f"this node: --node-name): {_quote([shown(r) for r in lines])}", hint,
                extra=tuple(shown(r) for r in lines)))
    rest_want = [r for r in want if _rule_name(r) is None]
    rest_have = [r for r in have if _rule_name(r) is None]
    order_want = [rule.name for rule, _ in config_rules if rule.name in have_lines]
    order_have = list(dict.fromkeys(n for r in have if (n := _rule_name(r)) in configured))
    # the config rules must come first, in order: the first that matches decides, ahead of the CIDR lists
    rule_positions = [i for i, r in enumerate(have) if _rule_name(r) in configured]
    # the lines the config rules must precede: those the config puts after them (nft's local and IPv6 returns
    # come first)
    first_rule = next((i for i, r in enumerate(want) if _rule_name(r) is not None), len(want))
    entries = {r for r in want[first_rule:] if _rule_name(r) is None}
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


def _compare_chain(policy: Policy, table: NatTable, family: Family, chain: str,
                   writer: str | None = None) -> list[Finding]:
    want = [canonical(r) for r in chain_rules(policy, family).rules]
    have = table.rules_of(chain)
    if have == want:
        return []
    config_rules = [(rule, [canonical(r) for r in config_rule_lines(chain, rule, policy.options)])
                    for rule in policy.rules(family)]
    if config_rules or any(_rule_name(r) is not None for r in have):
        if _is_catch_all_only(have):
            return _not_applied(chain, want)
        rule_findings, want, have = _compare_config_rules(config_rules, want, have, _short, chain)
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
            parts.append(f"missing {_quote([_short(r) for r in missing])}")
        if extra:
            parts.append(f"extra {_quote([_short(r) for r in extra])}")
        message = f"{chain} differs from the config: " + "; ".join(parts)
    return [Finding(FindingId.RULES_DIFFER, Severity.ERROR, message,
                    "the agent rewrites the chain on its next sync (resyncInterval); if it does not, it runs with "
                    "another config or other flags than these: compare them, and read its logs",
                    missing=tuple(_short(r) for r in missing), extra=tuple(_short(r) for r in extra))]


class _Traffic(NamedTuple):
    """A class of (source, protocol, port) every rule treats alike, for one destination interval."""

    sources: tuple[Prefix, ...]  # for the tracer: the class's source prefixes; () unknown
    source: int | None  # for the policy: an address of the class; None: outside every config rule's sources
    protocol: str | None  # None: no rule tests it here
    ports: Span | None  # destination ports, inclusive; None: no rule tests them (or the protocol has none)


_CONFIG_PROTOCOLS = ("tcp", "udp", "sctp", "icmp", "icmpv6")
_PORT_PROTOCOLS = frozenset({6, 17, 132, 136, 33})  # tcp, udp, sctp, udplite, dccp


class _Space:
    """How check cuts the packets a pod sends: destination interval starts, the destination spans where some rule
    tests more than the destination, and the traffic classes there."""

    def __init__(self, shapes: Iterable[RuleShape], policy: Policy, family: Family, local: tuple[int, ...],
                 pod_ranges: tuple[Prefix, ...]) -> None:
        everything = (0, family.max_address)
        points = {0}
        rich: list[Span] = []
        source_points: set[int] = set()
        protocols: set[int] = set()
        ports: set[int] = set()
        for shape in shapes:
            for first, last in shape.destinations or ():
                points.update((first, last + 1))
            if not shape.rich:
                continue
            if shape.destinations is not None and not shape.negated_destination:
                rich.extend(shape.destinations)
            else:
                rich.append(everything)
            for first, last in shape.sources:
                source_points.update((first, last + 1))
            protocols.update(n for n in shape.protocols if n != 0)
            for low, high in shape.ports:
                ports.update((low, high + 1))
        config_rules = policy.rules(family) if family in policy.families else ()
        config_sources: list[Prefix] = []
        for config_rule in config_rules:
            for prefix in config_rule.destinations:
                points.update((prefix.first, prefix.last + 1))
                if config_rule.sources or config_rule.protocol or config_rule.ports:
                    rich.append((prefix.first, prefix.last))
            config_sources.extend(config_rule.sources)
            for prefix in config_rule.sources:
                source_points.update((prefix.first, prefix.last + 1))
            if config_rule.protocol is not None:
                protocols.add(PROTOCOL_NUMBERS[config_rule.protocol])
            for low, high in config_rule.ports:
                ports.update((low, high + 1))
        for entry in policy.rule_entries(family) if family in policy.families else ():
            points.update((entry.prefix.first, entry.prefix.last + 1))
        for address in local:
            points.update((address, address + 1))
        self.points = sorted(p for p in points if p <= family.max_address)
        merged = union(rich)
        self.rich_starts = [first for first, _ in merged]
        self.rich_spans = merged
        self.plain = _Traffic(pod_ranges, None, None, None)
        self.classes = self._classes(family, pod_ranges, config_sources, source_points, protocols, ports)
        # how messages name each class's protocol: by its name, and the class of every protocol no rule names
        # (traced as one number, _OTHER_PROTOCOL) as what it stands for
        named = sorted(_protocol_words(str(n)) for n in protocols)
        self.protocol_words = {str(n): _protocol_words(str(n)) for n in protocols}
        if protocols:
            self.protocol_words[_protocol_name(_other_protocol(protocols))] = (
                "protocols other than " + ", ".join(named))

    def is_rich(self, destination: int) -> bool:
        i = bisect_right(self.rich_starts, destination) - 1
        return i >= 0 and self.rich_spans[i][1] >= destination

    @staticmethod
    def _classes(family: Family, pod_ranges: tuple[Prefix, ...], config_sources: list[Prefix],
                 source_points: set[int], protocols: set[int], ports: set[int]) -> list[_Traffic]:
        # sources: the pod ranges, or without them the config rules' sources (and one class for all the others),
        # cut wherever a rule's -s begins or ends
        if pod_ranges:
            sources = union_of_prefixes(list(pod_ranges), family.bits)
            outside: list[Span] = []
        else:
            sources = union_of_prefixes(config_sources, family.bits)
            outside = subtract([(0, family.max_address)], sources) if sources else []
        source_classes: list[tuple[tuple[Prefix, ...], int | None]] = []
        cuts = sorted(source_points)
        for first, last in sources:
            inner = [c for c in cuts if first < c <= last]
            for a, b in zip([first, *inner], [*inner, last + 1], strict=True):
                source_classes.append((tuple(to_prefixes(family, a, b - 1)), a))
        if outside:
            source_classes.append((tuple(p for a, b in outside for p in to_prefixes(family, a, b)), None))
        if not source_classes:
            source_classes.append(((), None))
        protocol_classes: list[tuple[str | None, list[Span | None]]] = [(None, [None])]
        if protocols:
            other = _other_protocol(protocols)
            port_cuts = sorted(p for p in ports | {0} if p <= 65535)
            port_spans: list[Span | None] = [(a, b - 1) for a, b in zip(port_cuts, [*port_cuts[1:], 65536],
                                                                         strict=True)]
            protocol_classes = [(_protocol_name(n), port_spans if n in _PORT_PROTOCOLS else [None])
                                for n in sorted(protocols | {other})]
        return [_Traffic(prefixes, first, protocol, span) for prefixes, first in source_classes
                for protocol, spans in protocol_classes for span in spans]


def _other_protocol(named: set[int]) -> int:
    """The number traced for every protocol no rule names: IANA's 253 ("use for experimentation and testing"), which
    no real traffic carries, unless a rule names that too."""
    return next(n for n in range(253, 0, -1) if n not in named)


# IANA's keywords for the protocols a nat rule is likely to name (the config's own names are kept as they are)
_IANA_PROTOCOLS = {1: "icmp", 2: "igmp", 4: "ipip", 6: "tcp", 17: "udp", 33: "dccp", 41: "ipv6", 47: "gre",
                   50: "esp", 51: "ah", 58: "icmpv6", 89: "ospf", 103: "pim", 112: "vrrp", 132: "sctp", 136: "udplite",
                   253: "experimental protocol 253", 254: "experimental protocol 254"}


def _protocol_words(protocol: str) -> str:
    """A class's protocol as a message names it: the config's name, IANA's keyword, else "protocol N"."""
    if not protocol.isdigit():
        return protocol
    return _IANA_PROTOCOLS.get(int(protocol), f"protocol {protocol}")


def _protocol_name(number: int) -> str:
    """The config's name for a protocol it knows, else the number (which the tracer and the policy both read)."""
    return next((name for name in _CONFIG_PROTOCOLS if PROTOCOL_NUMBERS[name] == number), str(number))


class _Wrong(NamedTuple):
    kind: FindingId
    rule: str
    label: str | None


class _Walker(Protocol):
    """Tracer (iptables) or NftTracer: what the semantic pass needs of a tracer."""

    def trace(self, packet: Packet, *, record_steps: bool = True) -> TraceResult: ...

    def shapes(self, family: Family) -> Iterator[RuleShape]: ...


class _IptablesBeside:
    """iptables' nat POSTROUTING and the nftables nat chains beside it, walked together as the kernel runs them
    (ipmasq.diagnose.hooks): the semantic pass's walker on an iptables node that also has nftables nat tables."""

    def __init__(self, tracer: Tracer, nft: NftTracer, family: Family) -> None:
        self._tracer, self._nft = tracer, nft
        hook = iptables_hook(tracer)
        self._hooks = [*([] if hook is None else [hook]), *nft.hooks(family, beside=IPTABLES_NFT_TABLES)]

    def trace(self, packet: Packet, *, record_steps: bool = True) -> TraceResult:
        return walk_hooks(self._hooks, packet, record_steps=record_steps)

    def shapes(self, family: Family) -> Iterator[RuleShape]:
        yield from self._tracer.shapes(family)
        yield from self._nft.shapes(family, beside=IPTABLES_NFT_TABLES)


def semantic_findings(policy: Policy, table: NatTable, family: Family, *, ours: set[str],
                      pod_ranges: tuple[Prefix, ...] = (), local: tuple[int, ...] = (),
                      beside: NftTracer | None = None, out_interface: str | None = None) -> list[Finding]:
    """The semantic pass alone, for a chain another writer owns (policy.options.masq_chain names it): every class of
    pod packets traced through POSTROUTING and compared with the policy. A wrong answer decided in a chain of
    `ours` is left to the caller's structural pass; one decided in the writer's chain itself is rules-differ.
    `out_interface`: the interface pod traffic leaves by, for rules that test -o (the VPC CNI's `! -o vlan+`)."""
    return _semantic(policy, table, family, ours, pod_ranges, local, beside, out_interface)


def _semantic(policy: Policy, table: NatTable, family: Family, ours: set[str],
              pod_ranges: tuple[Prefix, ...], local: tuple[int, ...],
              beside: NftTracer | None = None, out_interface: str | None = None) -> list[Finding]:
    tracer = Tracer(table)
    if beside is None:
        return _semantic_walk(policy, tracer, family, ours, policy.options.masq_chain, pod_ranges, local,
                              out_interface)
    # our own nftables table beside iptables is a leftover of the other backend: other-variant-rules says so (the
    # live check looks for it), once, rather than a foreign-masquerade finding per destination
    ours = ours | {f"{TABLE_FAMILY} {TABLE} {CHAIN}", f"{TABLE_FAMILY} {TABLE} {RULES_CHAIN}"}
    return _semantic_walk(policy, _IptablesBeside(tracer, beside, family), family, ours, policy.options.masq_chain,
                          pod_ranges, local, out_interface)


def _semantic_walk(policy: Policy, tracer: _Walker, family: Family, ours: set[str], our_chain: str,
                   pod_ranges: tuple[Prefix, ...], local: tuple[int, ...],
                   out_interface: str | None = None) -> list[Finding]:
    """Every class of pod packets traced and compared with the policy; `ours`: the chains of ours, whose wrong
    answers the structural pass explains; `our_chain`: the chain a packet must reach for the config to apply."""
    pods = tuple(p for p in pod_ranges if p.family is family)
    space = _Space(tracer.shapes(family), policy, family, local, pods)
    points = space.points
    loopback = parse_cidr("127.0.0.0/8" if family is Family.V4 else "::1/128")
    # per deciding rule: per traffic class, the destination ranges it gets wrong / cannot decide
    wrong: dict[_Wrong, dict[_Traffic, list[Span]]] = {}
    shadowed: dict[_Wrong, dict[str, Rule]] = {}
    reasons: dict[str, str] = {}
    plain = (space.plain,)
    any_rich = bool(space.rich_spans)  # without rules testing more than destinations: one packet per interval
    for i, start in enumerate(points):
        end = points[i + 1] - 1 if i + 1 < len(points) else family.max_address
        if start in local or loopback.contains(start):
            continue  # node-local destinations never reach our chain (! --dst-type LOCAL), by design
        for traffic in space.classes if any_rich and space.is_rich(start) else plain:
            port = None if traffic.ports is None else traffic.ports[0]
            packet = Packet(family, start, traffic.sources, traffic.protocol, port, local_addresses=local,
                            out_interface=out_interface)
            result = tracer.trace(packet, record_steps=False)
            if result.outcome is Outcome.UNDECIDED:
                rule = result.decided_by or "(dump)"
                reasons[rule] = result.undecided_reason or ""
                _add(wrong, _Wrong(FindingId.UNSUPPORTED, rule, result.decided_label), traffic, start, end)
                continue
            verdict = policy.verdict_for(family, start, source=traffic.source, protocol=traffic.protocol, port=port)
            actual = result.outcome in (Outcome.MASQUERADE, Outcome.SNAT)
            if actual == verdict.masquerade and (verdict.snat_to is None or (
                    result.outcome is Outcome.SNAT and result.snat_to == verdict.snat_to)):
                continue
            decider = result.decided_by
            if result.decided_in in ours:
                continue  # our own chain decided: rules-differ or stale-chain already says why
            reached_ours = our_chain in result.chains
            if decider is not None and actual:  # a MASQUERADE or SNAT decided: that rule NATs
                kind = FindingId.FOREIGN_MASQUERADE
            elif not reached_ours:
                kind = FindingId.JUMP_SHADOWED
            else:
                kind = FindingId.FOREIGN_MASQUERADE if actual else FindingId.JUMP_SHADOWED
            key = _Wrong(kind, decider or "(POSTROUTING policy)", result.decided_label)
            _add(wrong, key, traffic, start, end)
            if verdict.rule is not None:
                shadowed.setdefault(key, {})[verdict.rule.name] = verdict.rule
    all_sources = {t.sources for t in space.classes}
    findings = []
    for key, by_traffic in wrong.items():
        union: list[Span] = []
        for first, last in sorted(span for spans in by_traffic.values() for span in spans):
            if union and first <= union[-1][1] + 1:  # the classes' spans overlap: merge, never repeat
                union[-1] = (union[-1][0], max(last, union[-1][1]))
            else:
                union.append((first, last))
        prefixes = [str(p) for first, last in union for p in to_prefixes(family, first, last)]
        findings.append(_semantic_finding(key, prefixes, _describe(by_traffic, family, all_sources,
                                                                   space.protocol_words),
                                          reasons.get(key.rule, ""), policy, tuple(shadowed.get(key, {}).values())))
    return findings


def _sources_text(sources: set[tuple[Prefix, ...]], all_sources: set[tuple[Prefix, ...]]) -> str:
    """" from X" for the sources concerned, or " from all but Y" when that is shorter; "" for all of them."""
    if sources == all_sources:
        return ""
    inside = sorted({str(p) for group in sources for p in group})
    outside = sorted({str(p) for group in all_sources - sources for p in group})
    if () in all_sources or len(inside) <= len(outside):
        return " from " + ", ".join(inside)
    return " from all but " + ", ".join(outside)


def _describe(by_traffic: dict[_Traffic, list[Span]], family: Family, all_sources: set[tuple[Prefix, ...]],
              protocol_words: Mapping[str, str]) -> str:
    """The destinations and the traffic to them, exactly: "10.1.0.0/16 (tcp port 443); 34.0.0.0/8 (udp port 53)".
    Classes with the same destinations read as one; sources are named only when not all of them are concerned,
    adjacent port classes as one range."""
    by_spans: dict[tuple[Span, ...], dict[tuple[str | None, Span | None], set[tuple[Prefix, ...]]]] = {}
    for traffic, spans in by_traffic.items():
        kinds = by_spans.setdefault(tuple(spans), {})
        kinds.setdefault((traffic.protocol, traffic.ports), set()).add(traffic.sources)
    parts = []
    for dest_spans, kinds in by_spans.items():
        dests = _quote([str(p) for first, last in dest_spans for p in to_prefixes(family, first, last)])
        merged: list[tuple[str | None, Span | None, str]] = []
        for (protocol, ports), sources in sorted(kinds.items(), key=lambda kv: (kv[0][0] or "", kv[0][1] or (0, 0))):
            source_text = _sources_text(sources, all_sources)
            last = merged[-1] if merged else None
            if (last is not None and ports is not None and last[1] is not None and last[0] == protocol
                    and last[2] == source_text and last[1][1] + 1 == ports[0]):
                merged[-1] = (protocol, (last[1][0], ports[1]), source_text)
            else:
                merged.append((protocol, ports, source_text))
        texts = []
        for protocol, ports, source_text in merged:
            words = [] if protocol is None else [protocol_words.get(protocol) or _protocol_words(protocol)]
            if ports is not None:
                words.append(f"port {ports[0]}" if ports[0] == ports[1] else f"ports {ports[0]}-{ports[1]}")
            text = (" ".join(words) + source_text).strip()
            if text:
                texts.append(text)
        parts.append(dests + (f" ({'; '.join(texts)})" if texts else ""))
    return "; ".join(parts)


def _add(wrong: dict[_Wrong, dict[_Traffic, list[Span]]], key: _Wrong, traffic: _Traffic, first: int,
         last: int) -> None:
    append_span(wrong.setdefault(key, {}).setdefault(traffic, []), first, last)


def _semantic_finding(key: _Wrong, prefixes: list[str], dests: str, reason: str, policy: Policy,
                      shadowed: tuple[Rule, ...]) -> Finding:
    kind, rule = key.kind, key.rule
    delete = f"iptables -t nat -D {rule[3:]}" if rule.startswith("-A ") else (
        f"nft delete rule {key.label}" if key.label and " handle " in key.label else "remove it")
    named = f"{key.label} " if key.label else ""
    over = ""
    if shadowed:
        over = "; it overrides the config's " + ", ".join(
            f"rule {r.name} ({r.where()}: {r.action.value}{' to ' + r.snat_to if r.snat_to else ''})"
            for r in shadowed)
    if rule.startswith(f"-A {policy.options.masq_chain} ") and kind is not FindingId.UNSUPPORTED:
        # the writer's own chain decided otherwise than its inputs say (a chain another program owns: check's
        # structural pass compares only ours)
        return Finding(FindingId.RULES_DIFFER, Severity.ERROR,
                       f"{policy.options.masq_chain} decides pod traffic to {dests} otherwise than its writer's "
                       f"inputs say{over}: {named}{rule}",
                       "the writer has not applied its current inputs: read its logs (and restart it if it only "
                       "reads them at start)", rule=rule, destinations=tuple(prefixes))
    if kind is FindingId.FOREIGN_MASQUERADE:
        hint = (f"if this traffic must be masqueraded, say so in the config (masqueradeCIDRs or a rule) and delete "
                f"the rule: {delete}; otherwise delete the rule and whatever re-adds it")
        if "kubenet" in rule:
            hint = ("kubenet masquerades everything outside kubelet's --non-masquerade-cidr: run kubelet with "
                    "--non-masquerade-cidr=0.0.0.0/0 so that ip-masq-agent alone decides")
        return Finding(kind, Severity.ERROR,
                       f"a rule outside {policy.options.masq_chain} NATs pod traffic otherwise than the "
                       f"config says ({dests}){over}: {named}{rule}", hint, rule=rule, destinations=tuple(prefixes))
    if kind is FindingId.JUMP_SHADOWED:
        return Finding(kind, Severity.ERROR,
                       f"pod traffic to {dests} is decided before it reaches {policy.options.masq_chain}, "
                       f"against the config{over}, by: {named}{rule}",
                       f"move the jump to {policy.options.masq_chain} above that rule, or delete the rule: {delete}",
                       rule=rule, destinations=tuple(prefixes))
    if "source" in reason and "port" not in reason:
        hint = "pass --pod-range so that the rule's source test can be decided"
    elif "interface" in reason:
        hint = ("the rule depends on the out interface, which check does not know: trace the destination with "
                "`ipmasq trace DEST --source POD_IP --out-interface IFACE`")
    else:
        hint = "the rule uses matches check does not evaluate: read it by hand, or move its intent into the config"
    return Finding(kind, Severity.WARNING,
                   f"cannot decide what happens to pod traffic to {dests}: {reason}: {named}{rule}",
                   hint, rule=rule, destinations=tuple(prefixes))


# --- nftables -----------------------------------------------------------------------------------------------


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
                                        f"missing {_quote(missing) or 'nothing'}; extra {_quote(extra) or 'nothing'}"
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
            f"{_quote(missing) or 'none'}; kept unmasqueraded on the node against the config: "
            f"{_quote(extra) or 'none'}",
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
            walker: _Walker = tracer if beside is None else _IptablesBeside(Tracer(beside), tracer, family)
            findings.extend(_semantic_walk(policy, walker, family, {ours, f"{TABLE_FAMILY} {TABLE} {RULES_CHAIN}"},
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
    rule_findings, want_rest, have_rest = _compare_config_rules(
        config_rules, want_rules, have_rules, lambda r: r, f"chain {RULES_CHAIN}")
    findings.extend(rule_findings)
    if want_rest != have_rest:
        missing = [r for r in want_rest if r not in have_rest]
        extra = [r for r in have_rest if r not in want_rest]
        findings.append(Finding(FindingId.RULES_DIFFER, Severity.ERROR,
                                f"chain {RULES_CHAIN} differs from the config: missing "
                                f"{_quote(missing) or 'nothing'}; extra {_quote(extra) or 'nothing'}",
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
        f"{_quote(missing) or 'none'}; entered without need for {_quote(extra) or 'none'}",
        "the agent rewrites the table on its next sync; if not, it runs with another config: compare them",
        missing=tuple(missing), extra=tuple(extra))]


def ignored_findings(ignored: Iterable[Ignored]) -> list[Finding]:
    """One finding per key the writer does not read: an error when pod traffic is treated otherwise than the key
    says (never rules-differ: the writer will not write it, on any sync), a warning when nothing changes."""
    return [Finding(FindingId.IGNORED_BY_WRITER, Severity.ERROR if item.changes_traffic else Severity.WARNING,
                    item.message(), item.hint(), destinations=item.changed) for item in ignored]


def tracer_beside(rules: NodeRules) -> tuple[NftTracer | None, list[Finding]]:
    """The nftables nat chains beside iptables' (kube-proxy's nftables mode, others), walked with them; a listing the
    tracer cannot read is a warning, and the comparison goes on without them."""
    if rules.nft_ruleset is None:
        return None, []
    try:
        return NftTracer(rules.nft_ruleset), []
    except NftTraceError as exc:
        return None, [Finding(FindingId.UNSUPPORTED, Severity.WARNING,
                              f"the nftables nat chains beside iptables are not compared: {exc}",
                              "read them by hand: nft list ruleset")]


def check_node(policy: Policy, rules: NodeRules, *, pod_ranges: tuple[Prefix, ...] = (),
               local_addresses: tuple[tuple[Family, int], ...] = (), writer: str | None = None) -> CheckReport:
    """Every family the rules hold (iptables), or our nftables table, against the policy. `writer`: the provider's
    agent whose flags the policy's options are (check_iptables)."""
    if rules.backend == "nftables":
        return check_nft(policy, rules.nft, ruleset=rules.nft_ruleset, pod_ranges=pod_ranges,
                         local_addresses=local_addresses, iptables=rules.tables)
    beside, findings = tracer_beside(rules)
    for family, table in rules.tables.items():
        local = tuple(address for f, address in local_addresses if f is family)
        findings.extend(check_iptables(policy, table, family, pod_ranges=pod_ranges, local_addresses=local,
                                       beside=beside, writer=writer).findings)
    return CheckReport(tuple(findings))
