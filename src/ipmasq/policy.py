"""The decision: for a destination, is pod traffic masqueraded, by which entry, and why.

A Policy is the config plus the flags, resolved into the ordered rule entries the kernel will see, and into a
disjoint interval table that answers `verdict` in O(log n) exactly as the kernel's first-match walk would.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from functools import cached_property

from ipmasq.config.model import LINK_LOCAL_V4, LINK_LOCAL_V6, Entry, MasqConfig, Origin
from ipmasq.config.source import paused_gc
from ipmasq.options import PolicyOptions
from ipmasq.prefix import Family, Prefix, format_address, parse_address
from ipmasq.ranges import FirstMatchTable, Span, first_match_table, union_of_prefixes

__all__ = ["Policy", "Reason", "Verdict"]


class Reason(Enum):
    DEFAULT = "default"  # matched the built-in non-masquerade list
    CONFIG = "config"  # matched nonMasqueradeCIDRs
    LINK_LOCAL = "link-local"
    EXCEPTION = "exception"  # matched masqueradeCIDRs
    CATCH_ALL = "catch-all"  # matched nothing: the final MASQUERADE
    IPV6_DISABLED = "ipv6-disabled"  # no --enable-ipv6: we write no IPv6 rules, the pod IP leaves unchanged
    LOCAL = "local"  # a node-local destination: our POSTROUTING jump skips it (! --dst-type LOCAL)


_REASON_OF_ORIGIN = {
    Origin.DEFAULT: Reason.DEFAULT,
    Origin.CONFIG: Reason.CONFIG,
    Origin.LINK_LOCAL: Reason.LINK_LOCAL,
    Origin.EXCEPTION: Reason.EXCEPTION,
}


@dataclass(frozen=True, slots=True)
class Verdict:
    destination: str
    family: Family
    masquerade: bool
    reason: Reason
    entry: Entry | None  # the rule that decided; None for the catch-all and the unmanaged cases

    @property
    def matched(self) -> Prefix | None:
        return None if self.entry is None else self.entry.prefix


class Policy:
    def __init__(self, config: MasqConfig, options: PolicyOptions) -> None:
        self.config = config
        self.options = options

    @property
    def families(self) -> tuple[Family, ...]:
        return (Family.V4, Family.V6) if self.options.enable_ipv6 else (Family.V4,)

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

    def verdict(self, destination: str) -> Verdict:
        """What happens to pod traffic to `destination` (an IP address; ValueError when it is not one)."""
        family, address = parse_address(destination)
        return self.verdict_for(family, address, text=destination)

    def verdict_for(self, family: Family, address: int, *, text: str | None = None) -> Verdict:
        shown = text if text is not None else format_address(family, address)
        table = self._tables.get(family)
        if table is None:
            return Verdict(shown, family, False, Reason.IPV6_DISABLED, None)
        label = table.label_at(address)
        if label < 0:
            return Verdict(shown, family, True, Reason.CATCH_ALL, None)
        entry = self.rule_entries(family)[label]
        return Verdict(shown, family, entry.masquerade, _REASON_OF_ORIGIN[entry.origin], entry)

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
