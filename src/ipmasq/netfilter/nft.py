"""The nftables table for our policy: rendered as an `nft -f` script, parsed back from `nft -j list` JSON.

One table, ``inet ip-masq-agent``: an interval set per family holding the exact disjoint non-masquerade ranges the
Policy computes (so masqueradeCIDRs exceptions need no rules of their own), and one nat chain at postrouting that
returns for local destinations and for addresses in the sets, and masquerades the rest. A new connection costs one
set lookup whatever the number of CIDRs.

The config's `rules`, when it has some, live in a regular chain of their own (config-rules, both families' rules
in the config's order), which the postrouting chain enters, where the rules would stand, only for destinations in
an interval set of every rule destination of that family (rules_dst_v4, rules_dst_v6): traffic to any other
destination costs one more set lookup instead of a walk over every rule. Inside the chain the first match decides:
masquerade and snat end it; preserve is `accept`, which ends our table's decision as the base chain's `return`
would (a `return` there would fall back to the set lookups and the masquerade); a packet that no rule matches
returns from the jump to the lookups. A config without rules renders exactly as before.

The table carries its ownership marker: an empty set `ipmasq-owns-this-table`, defined in the same transaction as
every other object of the table, whose comment records the digest of the rest of the table as written
(table_digest: its sets with their elements, its chains with their rules; nft 1.0.6's JSON listing, which the agent
reads, shows a set's comment, even the terse listing, but not a table's). A table `inet ip-masq-agent` without it is
another program's, and so is a marked one that no longer hashes to the digest it records: `ipmasq uninstall` and the
agent's clean-up of the backend it does not use leave it alone (and take the stale marker away), and remove a
marked one with a transaction that deletes the marker first, so that the kernel itself refuses it when the marker is
gone (marked_delete_script).

Rules are kept as text in the form `nft list` prints them (our canonical form, like iptables-save's for the
iptables backend); `rule_from_json` (ipmasq.netfilter.nft_json, with `parse_list_json`, the reading of `nft -j list`
back into an NftTable) reads the kernel's JSON into that form (its inverse, for the stateful fake, is
in ipmasq.testing). Only our own dialect is read: anything else becomes an "unrecognised" rule that never equals a
desired one, so the agent repairs it and `check` shows it.
"""

from __future__ import annotations

import re
import socket
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace

from ipmasq.config.model import Rule, RuleAction
from ipmasq.netfilter.iptables import DIGEST_COMMENT, MASQ_COMMENT, NON_MASQ_COMMENT, rule_comment
from ipmasq.options import PolicyOptions
from ipmasq.policy.policy import Policy
from ipmasq.policy.ranges import union_of_prefixes
from ipmasq.prefix import Family, Prefix
from ipmasq.sha256 import sha256_of_lines

__all__ = [
    "CHAIN",
    "LOCAL_COMMENT",
    "MARKER_SET",
    "OUR_SET_NAMES",
    "RULES_CHAIN",
    "RULES_JUMP_COMMENT",
    "RULES_SET_NAMES",
    "SET_NAMES",
    "TABLE",
    "TABLE_FAMILY",
    "V6_UNMANAGED_COMMENT",
    "NftChain",
    "NftSet",
    "NftTable",
    "config_rule_text",
    "count_foreign_nat",
    "delete_script",
    "desired_table",
    "desired_table_and_elements",
    "format_element",
    "format_elements",
    "is_marked",
    "marked_delete_script",
    "marker_delete_script",
    "recorded_digest",
    "render_definition",
    "render_script",
    "replace_script",
    "table_digest",
]


TABLE_FAMILY = "inet"
TABLE = "ip-masq-agent"
CHAIN = "postrouting"
SRCNAT_PRIORITY = 100  # nft's "srcnat" keyword; the JSON listing prints the number
SET_NAMES = {Family.V4: "nomasq_v4", Family.V6: "nomasq_v6"}
RULES_CHAIN = "config-rules"  # the config's rules, entered from CHAIN for the destinations they name
RULES_SET_NAMES = {Family.V4: "rules_dst_v4", Family.V6: "rules_dst_v6"}  # every rule destination, per family
OUR_SET_NAMES = frozenset({*SET_NAMES.values(), *RULES_SET_NAMES.values()})  # the families' sets
SET_TYPES = {Family.V4: "ipv4_addr", Family.V6: "ipv6_addr"}
# ipmasq's ownership marker: an empty set no rule looks up (a type is required; the set is never matched)
MARKER_SET = "ipmasq-owns-this-table"
LOCAL_COMMENT = "ip-masq-agent: local destinations are not subject to MASQUERADE"
V6_UNMANAGED_COMMENT = "ip-masq-agent: IPv6 is not managed without --enable-ipv6"
RULES_JUMP_COMMENT = "ip-masq-agent: the config's rules decide first for the destinations they name"
PROTOCOLS_WITH_PORTS = "{ tcp, udp, sctp }"


@dataclass(frozen=True, slots=True)
class NftSet:
    """A named set of our table: its type and flags, and its elements as ranges of addresses."""

    name: str
    type: str
    flags: tuple[str, ...]
    elements: tuple[tuple[int, int], ...]  # sorted, disjoint inclusive ranges of addresses as integers
    comment: str = ""  # the marker's records the table's digest; none of our other sets has one

    @property
    def family(self) -> Family:
        return Family.V6 if self.type == "ipv6_addr" else Family.V4


@dataclass(frozen=True, slots=True)
class NftChain:
    """A chain of our table: its base-chain hook, priority and policy, and its rules as nft lists them."""

    name: str
    type: str  # "" for a regular (non-base) chain
    hook: str
    priority: int
    policy: str
    rules: tuple[str, ...]  # canonical text, as `nft list` prints them (without handles)


@dataclass(frozen=True, slots=True)
class NftTable:
    """Our table, normalised: two tables are equal when the kernel would treat every packet the same way."""

    sets: tuple[NftSet, ...]  # sorted by name
    chains: tuple[NftChain, ...]  # sorted by name
    # (config rule name, packets, bytes) of each listed rule of ours with a counter statement: traffic, not content,
    # so not compared (a rule's text shows its `counter` without the values)
    counters: tuple[tuple[str, int, int], ...] = field(default=(), compare=False)

    def set_named(self, name: str) -> NftSet | None:
        return next((s for s in self.sets if s.name == name), None)

    def chain_named(self, name: str) -> NftChain | None:
        return next((c for c in self.chains if c.name == name), None)


def is_marked(table: NftTable) -> bool:
    """The table carries ipmasq's ownership marker: ipmasq wrote it (whether it still holds what ipmasq wrote there:
    recorded_digest against table_digest)."""
    return table.set_named(MARKER_SET) is not None


_RECORDED = re.compile(re.escape(DIGEST_COMMENT) + r"([0-9a-f]{64})\Z")
# bytes an element takes at the least as text: a rough size of a set, for sha256 to pick OpenSSL for a large one
_ELEMENT_BYTES = 8


def recorded_digest(table: NftTable) -> str | None:
    """The digest the table's marker records; None without a marker, or for one that records none (an empty marker
    of an earlier development build, a comment someone changed): it vouches for no content."""
    marker = table.set_named(MARKER_SET)
    found = None if marker is None else _RECORDED.match(marker.comment)
    return None if found is None else found.group(1)


def table_digest(table: NftTable, *, formatted: Mapping[str, Sequence[str]] | None = None) -> str:
    """What the marker records: the sha256 of the table's every object but the marker, as normalised here (each set
    with its type, flags, comment and elements as text; each chain with its hook and its rules as `nft list` prints
    them), one a line. `formatted`: the sets' elements as text, when the caller has them (format_elements)."""
    count = sum(len(s.elements) for s in table.sets)
    return sha256_of_lines(_digest_lines(table, formatted), expected_bytes=count * _ELEMENT_BYTES)


def _digest_lines(table: NftTable, formatted: Mapping[str, Sequence[str]] | None) -> Iterator[str]:
    for s in table.sets:
        if s.name == MARKER_SET:
            continue
        yield f'set {s.name} type {s.type} flags {",".join(s.flags)} comment "{s.comment}"'
        texts = formatted[s.name] if formatted is not None else format_elements(s.family, s.elements)
        yield from (f"element {s.name} {text}" for text in texts)
    for c in table.chains:
        yield f"chain {c.name} type {c.type} hook {c.hook} priority {c.priority} policy {c.policy}"
        yield from (f"rule {c.name} {rule}" for rule in c.rules)


# --- desired state ----------------------------------------------------------------------------------------------


def _comment(text: str) -> str:
    return f' comment "{text}"'


def _masquerade_rules(options: PolicyOptions) -> list[str]:
    """MASQUERADE, or with --to-ports one rule per port range, each taking its share like the iptables backend's."""
    random_fully = " fully-random" if options.random_fully else ""
    rules = []
    ranges = options.to_ports
    for i, port_range in enumerate(ranges):
        remaining = len(ranges) - i
        # nft lists "numgen random mod N 0" without "==": keep the listed form so read-back compares equal
        pick = f"numgen random mod {remaining} 0 " if remaining > 1 else ""
        rules.append(f"meta l4proto {PROTOCOLS_WITH_PORTS} {pick}masquerade to :{port_range}{random_fully}"
                     + _comment(MASQ_COMMENT))
    rules.append(f"masquerade{random_fully}" + _comment(MASQ_COMMENT))
    return rules


def config_rule_text(rule: Rule, options: PolicyOptions) -> str:
    """A rule of the config's `rules` in the form `nft list` prints it, as it stands in RULES_CHAIN: several
    addresses or ports become an anonymous set, merged and sorted as nft lists them (it merges
    `{ 0.0.0.0/1, 128.0.0.0/1 }` to one prefix). preserve is `accept`: in the jumped-to chain a `return` would
    resume the base chain at its set lookups and masquerade; `accept` ends our table's decision, source kept."""
    protocol = "ip" if rule.family is Family.V4 else "ip6"
    parts = []
    if rule.sources:
        parts.append(f"{protocol} saddr {_address_set(rule.family, rule.sources)}")
    parts.append(f"{protocol} daddr {_address_set(rule.family, rule.destinations)}")
    if rule.ports:
        parts.append(f"{rule.protocol} dport {_port_set(rule.ports)}")
    elif rule.protocol is not None:
        parts.append(f"meta l4proto {'ipv6-icmp' if rule.protocol == 'icmpv6' else rule.protocol}")
    random_fully = " fully-random" if options.random_fully else ""
    # only config rules count (ipmasq_rule_packets_total): configs without rules render byte for byte as before
    parts.append("counter")
    if rule.action is RuleAction.PRESERVE:
        parts.append("accept")
    elif rule.action is RuleAction.SNAT:
        parts.append(f"snat {protocol} to {rule.snat_to}{random_fully}")
    else:
        parts.append(f"masquerade{random_fully}")
    return " ".join(parts) + _comment(rule_comment(rule.name))


def _braced(elements: list[str]) -> str:
    return elements[0] if len(elements) == 1 else "{ " + ", ".join(elements) + " }"


def _address_set(family: Family, prefixes: tuple[Prefix, ...]) -> str:
    return _braced([format_element(family, a, b) for a, b in union_of_prefixes(list(prefixes), family.bits)])


def _port_set(ports: tuple[tuple[int, int], ...]) -> str:
    merged: list[tuple[int, int]] = []
    for low, high in sorted(ports):
        if merged and low <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(high, merged[-1][1]))
        else:
            merged.append((low, high))
    return _braced([str(low) if low == high else f"{low}-{high}" for low, high in merged])


def desired_table(policy: Policy) -> NftTable:
    """Our whole table for a policy (every family it manages), with its marker recording its digest."""
    return desired_table_and_elements(policy)[0]


def desired_table_and_elements(policy: Policy) -> tuple[NftTable, dict[str, list[str]]]:
    """desired_table, and each set's elements as text (format_elements, by set name): made once for the digest, and
    kept for the script (100,000 elements are formatted once)."""
    table = _unmarked_table(policy)
    formatted = {s.name: format_elements(s.family, s.elements) for s in table.sets}
    marker = NftSet(MARKER_SET, SET_TYPES[Family.V4], (), (), DIGEST_COMMENT + table_digest(table, formatted=formatted))
    formatted[MARKER_SET] = []
    return replace(table, sets=tuple(sorted((*table.sets, marker), key=lambda s: s.name))), formatted


def _unmarked_table(policy: Policy) -> NftTable:
    families = policy.families
    sets = tuple(
        NftSet(SET_NAMES[f], SET_TYPES[f], ("interval",), tuple(policy.non_masquerade_ranges(f))) for f in families
    )
    rules = ["fib daddr type local return" + _comment(LOCAL_COMMENT)]
    if Family.V6 not in families:
        # an inet chain sees IPv6 too; without --enable-ipv6 the reference writes no IPv6 rules, so pod IPs stay
        rules.append("meta nfproto ipv6 return" + _comment(V6_UNMANAGED_COMMENT))
    config_rules: list[str] = []
    for family in families:  # the config's rules ahead of the set lookups: the first that matches decides
        family_rules = policy.rules(family)
        if not family_rules:
            continue
        config_rules.extend(config_rule_text(rule, policy.options) for rule in family_rules)
        # one lookup stands for the walk: traffic to a destination no rule names never enters the rules' chain
        destinations = tuple(union_of_prefixes([p for rule in family_rules for p in rule.destinations], family.bits))
        sets += (NftSet(RULES_SET_NAMES[family], SET_TYPES[family], ("interval",), destinations),)
        rules.append(f"{_protocol(family)} daddr @{RULES_SET_NAMES[family]} jump {RULES_CHAIN}"
                     + _comment(RULES_JUMP_COMMENT))
    for family in families:
        rules.append(f"{_protocol(family)} daddr @{SET_NAMES[family]} return" + _comment(NON_MASQ_COMMENT))
    rules.extend(_masquerade_rules(policy.options))
    chains = [NftChain(CHAIN, "nat", "postrouting", SRCNAT_PRIORITY, "accept", tuple(rules))]
    if config_rules:
        chains.append(NftChain(RULES_CHAIN, "", "", 0, "", tuple(config_rules)))
    return NftTable(tuple(sorted(sets, key=lambda s: s.name)), tuple(sorted(chains, key=lambda c: c.name)))


def _protocol(family: Family) -> str:
    return "ip" if family is Family.V4 else "ip6"


# --- rendering ----------------------------------------------------------------------------------------------------


def _v4(n: int) -> str:
    return f"{n >> 24}.{(n >> 16) & 255}.{(n >> 8) & 255}.{n & 255}"


def _v6(n: int) -> str:
    return socket.inet_ntop(socket.AF_INET6, n.to_bytes(16, "big"))


def format_element(family: Family, first: int, last: int) -> str:
    """A range as nft writes it: an address, a CIDR when the range is exactly one prefix, else first-last."""
    fmt = _v4 if family is Family.V4 else _v6
    if first == last:
        return fmt(first)
    size = last - first + 1
    if size & (size - 1) == 0 and first & (size - 1) == 0:
        return f"{fmt(first)}/{family.bits - size.bit_length() + 1}"
    return f"{fmt(first)}-{fmt(last)}"


def format_elements(family: Family, elements: tuple[tuple[int, int], ...]) -> list[str]:
    """format_element over a whole set; IPv4 inlined, because a set may hold 100,000 ranges (agent --once)."""
    if family is Family.V6:
        return [format_element(family, a, b) for a, b in elements]
    ntoa = socket.inet_ntoa
    out: list[str] = []
    append = out.append
    for a, b in elements:
        first = ntoa(a.to_bytes(4, "big"))
        if a == b:
            append(first)
            continue
        size = b - a + 1
        if size & (size - 1) == 0 and a & (size - 1) == 0:
            append(f"{first}/{33 - size.bit_length()}")
        else:
            append(f"{first}-{ntoa(b.to_bytes(4, 'big'))}")
    return out


def _priority(chain: NftChain) -> str:
    return "srcnat" if chain.type == "nat" and chain.priority == SRCNAT_PRIORITY else str(chain.priority)


def render_definition(table: NftTable, *, formatted: Mapping[str, Sequence[str]] | None = None) -> str:
    """`table inet ip-masq-agent { ... }` for a normalised table; `formatted`: each set's elements as text, when
    the caller already has them (format_elements)."""
    out = [f"table {TABLE_FAMILY} {TABLE} {{"]
    for s in table.sets:
        out.append(f"\tset {s.name} {{")
        out.append(f"\t\ttype {s.type}")
        if s.flags:
            out.append(f"\t\tflags {', '.join(s.flags)}")
        if s.comment:
            out.append(f'\t\tcomment "{s.comment}"')
        if s.elements:  # "elements = { }" is a syntax error
            texts = formatted[s.name] if formatted is not None else format_elements(s.family, s.elements)
            out.append("\t\telements = { " + ",\n\t\t\t".join(texts) + " }")
        out.append("\t}")
    for c in table.chains:
        out.append(f"\tchain {c.name} {{")
        if c.type:
            out.append(f"\t\ttype {c.type} hook {c.hook} priority {_priority(c)}; policy {c.policy};")
        out.extend(f"\t\t{rule}" for rule in c.rules)
        out.append("\t}")
    out.append("}")
    return "\n".join(out) + "\n"


def render_script(policy: Policy) -> str:
    """One `nft -f -` transaction that replaces our table whatever state it is in (absent, drifted, current).

    Declaring the table first makes the delete valid when it does not exist yet; the kernel applies the three
    commands atomically, so no packet ever sees the table half-written or missing.
    """
    return replace_script(desired_table(policy))


def replace_script(table: NftTable, *, formatted: Mapping[str, Sequence[str]] | None = None) -> str:
    """render_script for an already built table (see render_definition for `formatted`)."""
    return delete_script() + render_definition(table, formatted=formatted)


def delete_script() -> str:
    """Remove our table if it exists, in one transaction (nft 1.0.6 has no `destroy`)."""
    return f"table {TABLE_FAMILY} {TABLE}\ndelete table {TABLE_FAMILY} {TABLE}\n"


def marker_delete_script() -> str:
    """Remove only the table's ownership marker (one that no longer tells the truth), in one transaction that the
    kernel refuses when it is not there."""
    return f"delete set {TABLE_FAMILY} {TABLE} {MARKER_SET}\n"


def marked_delete_script() -> str:
    """Remove our table only if it carries its ownership marker, in one transaction: deleting the marker first makes
    the kernel refuse the whole transaction when it is not there (the table stays exactly as it is)."""
    return f"delete set {TABLE_FAMILY} {TABLE} {MARKER_SET}\ndelete table {TABLE_FAMILY} {TABLE}\n"


def count_foreign_nat(ruleset_text: str) -> int:
    """Rules in `nft list ruleset` text, outside our table, that masquerade or SNAT. iptables-nft's own tables are
    left out: the iptables reading counts those rules in iptables' terms; so is kube-proxy's table (nftables mode),
    whose masquerades take only the Service traffic it marked and its hairpin connections, never plain pod egress."""
    count = 0
    table = ""
    for raw in ruleset_text.splitlines():
        line = raw.strip()
        if line.startswith("table "):
            table = line.removesuffix("{").strip()
        elif table not in (f"table {TABLE_FAMILY} {TABLE}", "table ip nat", "table ip6 nat", "table ip kube-proxy",
                           "table ip6 kube-proxy") and (
                line.endswith(" masquerade") or " masquerade " in line or " snat " in line or line.startswith("snat ")):
            count += 1
    return count
