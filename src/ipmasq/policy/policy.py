"""The decision: for a packet, is pod traffic masqueraded, by which rule or entry, and why.

A Policy is the config plus the flags, resolved into the ordered rule entries the kernel will see, and into a
disjoint interval table that answers `verdict` in O(log n) exactly as the kernel's first-match walk would.

The config's `rules` come first: the first one that matches a packet decides, before any CIDR list. A rule may
test more than the destination (source, protocol, port); asked about a packet whose such fields are unknown (a
caller that knows only the destination), the answer is the one for packets no such rule matches, and says which
rules and fields it depends on (`PolicyVerdict.depends_on`, `PolicyVerdict.conditional`), rather than guessing.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from fnmatch import fnmatchcase
from functools import cached_property

from ipmasq.config.model import LINK_LOCAL_V4, LINK_LOCAL_V6, Entry, MasqConfig, Origin, Rule, RuleAction
from ipmasq.config.source import paused_gc
from ipmasq.options import PolicyOptions
from ipmasq.policy.packet import Packet
from ipmasq.policy.ranges import FirstMatchTable, Span, first_match_table, union_of_prefixes
from ipmasq.policy.rule_index import NO_MATCH, RuleIndex
from ipmasq.prefix import Family, Prefix, format_address, parse_address

__all__ = ["PACKET_FIELDS", "Policy", "PolicyVerdict", "Reason", "rule_match"]


class Reason(Enum):
    DEFAULT = "default"  # matched the built-in non-masquerade list
    CONFIG = "config"  # matched nonMasqueradeCIDRs
    LINK_LOCAL = "link-local"
    EXCEPTION = "exception"  # matched masqueradeCIDRs
    CATCH_ALL = "catch-all"  # matched nothing: the final MASQUERADE
    IPV6_DISABLED = "ipv6-disabled"  # IPv6 not enabled (flag or config): we write no IPv6 rules, the pod IP stays
    LOCAL = "local"  # a node-local destination: our POSTROUTING jump skips it (! --dst-type LOCAL)
    RULE = "rule"  # a rule of the config's `rules` section matched


_REASON_OF_ORIGIN = {
    Origin.DEFAULT: Reason.DEFAULT,
    Origin.CONFIG: Reason.CONFIG,
    Origin.LINK_LOCAL: Reason.LINK_LOCAL,
    Origin.EXCEPTION: Reason.EXCEPTION,
}


PACKET_FIELDS = ("source", "protocol", "port")  # what a rule may test besides the destination


def rule_match(rule: Rule, packet: Packet) -> tuple[str, ...] | None:
    """None: the rule does not match the packet; (): it matches; else the unknown fields (PACKET_FIELDS) that
    decide whether it matches. The node was decided when the rule was selected (Policy.rules)."""
    if rule.family is not packet.family or not any(p.contains(packet.destination) for p in rule.destinations):
        return None
    unknown: list[str] = []
    if rule.sources:
        inside = packet.source_within(rule.sources)
        if inside is None:
            unknown.append("source")
        elif not inside:
            return None
    if rule.protocol is not None:
        if packet.protocol is None:
            unknown.append("protocol")
        elif packet.protocol != rule.protocol:
            return None
    if rule.ports:
        if packet.port is None:
            unknown.append("port")
        elif not any(low <= packet.port <= high for low, high in rule.ports):
            return None
    return tuple(unknown)


@dataclass(frozen=True, slots=True)
class PolicyVerdict:
    """What the agent does to a packet for one destination (masquerade or not), and what decided it."""

    destination: str
    family: Family
    masquerade: bool  # the source address is rewritten (to the node's address, or to snat_to)
    reason: Reason
    entry: Entry | None  # the CIDR entry that decided; None for a rule, the catch-all and the unmanaged cases
    rule: Rule | None = None  # the config rule that decided (Reason.RULE)
    snat_to: str | None = None  # the address the destination sees, when a snat rule decided
    # Earlier rules that match or not depending on fields the caller did not give; the verdict above is for the
    # packets none of them matches. depends_on: those fields, in PACKET_FIELDS order.
    conditional: tuple[Rule, ...] = ()
    depends_on: tuple[str, ...] = ()

    @property
    def matched(self) -> Prefix | None:
        return None if self.entry is None else self.entry.prefix

    @property
    def decided(self) -> bool:
        """True when the packet's given fields are enough: no earlier rule depends on one not given."""
        return not self.conditional


class Policy:
    def __init__(self, config: MasqConfig, options: PolicyOptions) -> None:
        self.config = config
        # IPv6 decided once, here: the --enable-ipv6 flag when given, else the config's enableIPv6
        self.options = options.resolve_ipv6(config.enable_ipv6)

    @property
    def families(self) -> tuple[Family, ...]:
        return (Family.V4, Family.V6) if self.options.enable_ipv6 else (Family.V4,)

    @property
    def node_name(self) -> str | None:
        return self.options.node_name

    def rules(self, family: Family) -> tuple[Rule, ...]:
        """The config's rules that exist on this node for a family the policy manages, in order."""
        return self._rules.get(family, ())

    @cached_property
    def _rules(self) -> dict[Family, tuple[Rule, ...]]:
        node = self.options.node_name
        out: dict[Family, list[Rule]] = {}
        for rule in self.config.rules:
            if rule.family not in self.families:
                continue
            # a rule with nodes on an unknown node is refused when the config is loaded (check_rules_with_flags)
            if rule.nodes and (node is None or not any(fnmatchcase(node, glob) for glob in rule.nodes)):
                continue
            out.setdefault(rule.family, []).append(rule)
        return {family: tuple(rules) for family, rules in out.items()}

    def rule_entries(self, family: Family) -> tuple[Entry, ...]:
        """Entries in the order the chain holds their rules; the catch-all MASQUERADE follows them."""
        return self._rule_entries[family]

    @cached_property
    def _rule_entries(self) -> dict[Family, tuple[Entry, ...]]:
        out: dict[Family, tuple[Entry, ...]] = {}
        for family in Family:
            link_local: list[Entry] = []
            masq_link_local = self.config.masq_link_local if family is Family.V4 else self.config.masq_link_local_ipv6
            if not masq_link_local:
                prefix = LINK_LOCAL_V4 if family is Family.V4 else LINK_LOCAL_V6
                link_local.append(Entry(prefix, False, Origin.LINK_LOCAL))
            preserve = [e for e in self.config.non_masquerade if e.prefix.family is family]
            exceptions = [e for e in self.config.masquerade if e.prefix.family is family]
            if not exceptions:
                # exactly the reference's order: link-local, then the list as written
                out[family] = tuple(link_local + preserve)
            else:
                # longest prefix first, so the kernel's first match is the longest-prefix match; on a tie with
                # link-local the exception (listed first) wins; sorted() is stable
                ordered = exceptions + link_local + preserve
                out[family] = tuple(sorted(ordered, key=lambda e: -e.prefix.length))
        return out

    @cached_property
    def _tables(self) -> dict[Family, FirstMatchTable]:
        with paused_gc():
            return {family: first_match_table([e.prefix for e in self.rule_entries(family)], family.max_address)
                    for family in self.families}

    def verdict(self, destination: str) -> PolicyVerdict:
        """What happens to pod traffic to `destination` (an IP address; ValueError when it is not one), from any
        source, protocol and port: see PolicyVerdict.conditional for the rules that would need those."""
        family, address = parse_address(destination)
        return self.verdict_for(family, address, text=destination)

    def verdict_for(self, family: Family, address: int, *, text: str | None = None, source: int | None = None,
                    protocol: str | None = None, port: int | None = None) -> PolicyVerdict:
        """The verdict for a packet; `source`, `protocol` and `port` None: not known (see PolicyVerdict.depends_on)."""
        shown = text if text is not None else format_address(family, address)
        table = self._tables.get(family)
        if table is None:
            return PolicyVerdict(shown, family, False, Reason.IPV6_DISABLED, None)
        index = self._rule_indexes.get(family)
        if index is not None:
            # the rules whose destinations hold the address, in order: the walk's first match without the walk
            match = index.first_match(address, source, protocol, port)
            if match is not NO_MATCH:
                rule = match.rule
                if rule is not None:
                    return PolicyVerdict(shown, family, rule.action is not RuleAction.PRESERVE, Reason.RULE, None, rule,
                                         rule.snat_to, match.conditional, match.depends_on)
                listed = self._list_verdict(table, family, address, shown)
                return PolicyVerdict(shown, family, listed.masquerade, listed.reason, listed.entry,
                                     conditional=match.conditional, depends_on=match.depends_on)
        return self._list_verdict(table, family, address, shown)

    def rule_index(self, family: Family) -> RuleIndex | None:
        """The family's rules on this node indexed by destination (None: no rule), built on first use."""
        return self._rule_indexes.get(family)

    @cached_property
    def _rule_indexes(self) -> dict[Family, RuleIndex]:
        with paused_gc():
            return {family: RuleIndex(rules) for family, rules in self._rules.items()}

    def _list_verdict(self, table: FirstMatchTable, family: Family, address: int, shown: str) -> PolicyVerdict:
        label = table.label_at(address)
        if label < 0:
            return PolicyVerdict(shown, family, True, Reason.CATCH_ALL, None)
        entry = self.rule_entries(family)[label]
        return PolicyVerdict(shown, family, entry.masquerade, _REASON_OF_ORIGIN[entry.origin], entry)

    def preserved_ranges(self, family: Family) -> list[Span]:
        """The addresses whose pod traffic keeps the pod IP; a family the policy does not manage keeps all."""
        if family not in self.families:
            return [(0, family.max_address)]  # no rules for this family: every pod address leaves unchanged
        return self.non_masquerade_ranges(family)

    def non_masquerade_ranges(self, family: Family) -> list[Span]:
        """The exact set of addresses not masqueraded, as sorted, disjoint, non-adjacent inclusive ranges."""
        if family not in self.families:
            return []
        entries = self.rule_entries(family)
        if not any(e.masquerade for e in entries):
            # no exceptions: the plain union of the prefixes, without the sweep (the agent's 100,000-CIDR path)
            with paused_gc():
                return union_of_prefixes([e.prefix for e in entries], family.bits)
        table = self._tables[family]
        ranges: list[tuple[int, int]] = []
        starts = table.starts
        for i, label in enumerate(table.labels):
            if label < 0 or entries[label].masquerade:
                continue
            first = starts[i]
            last = starts[i + 1] - 1 if i + 1 < len(starts) else family.max_address
            if ranges and ranges[-1][1] + 1 == first:
                ranges[-1] = (ranges[-1][0], last)
            else:
                ranges.append((first, last))
        return ranges
