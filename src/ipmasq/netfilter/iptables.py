"""iptables-restore text for our chain, rendered and parsed in one dialect.

Rendering follows the reference agent byte for byte (comment first, as its restore input has it); parsing
reads both that and iptables-save's order, and `canonical` turns either into iptables-save's form so that
the agent, `check` and the tests compare rules as the kernel prints them.

Which chains ipmasq wrote, and what it wrote there, is recorded in the kernel, beside them: a chain named after the
one it owns (`marker_chain`: `IPMASQ-OWNS-IP-MASQ-AGENT`), written in the same transaction, never jumped to, so that
the owned chain's rules and its POSTROUTING jump stay the reference agent's text. It holds one rule that no packet
reaches (`marker_rule`), whose comment carries the sha256 of the chain's jumps and rules as ipmasq wrote them
(`chain_digest`). `chain_ownership` reads that record: a chain with the reference agent's comments and no marker is
another program's (GKE's, AKS's agent), and so is a marked one whose rules no longer hash to what its marker records
(another program rewrote it since: the reference agent, after ipmasq's DaemonSet went without an uninstall); neither
is ever removed.
"""

from __future__ import annotations

import itertools
import re
import shlex
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from ipmasq.config.model import Entry, Rule, RuleAction
from ipmasq.errors import RuleParseError
from ipmasq.netfilter.lines import iter_lines
from ipmasq.options import MARKER_CHAIN_PREFIX, PolicyOptions
from ipmasq.policy.policy import Policy
from ipmasq.prefix import Family
from ipmasq.sha256 import sha256, sha256_of_lines

__all__ = [
    "DIGEST_COMMENT",
    "EXCEPTION_COMMENT",
    "MASQ_COMMENT",
    "NON_MASQ_COMMENT",
    "OUR_COMMENT",
    "RULE_COMMENT_PREFIX",
    "ChainOwnership",
    "ChainRules",
    "Condition",
    "IptablesRule",
    "Match",
    "NatTable",
    "canonical",
    "chain_digest",
    "chain_ownership",
    "chain_rules",
    "config_rule_lines",
    "count_foreign_nat",
    "count_rules",
    "is_marker",
    "is_marker_rule",
    "is_our_jump",
    "jump_comment",
    "jump_rule",
    "marker_chain",
    "marker_rule",
    "our_chains",
    "parse_rule",
    "parse_save",
    "recorded_digest",
    "render_restore",
    "rule_comment",
    "rule_target",
    "save_lines",
    "written_digest",
]

NON_MASQ_COMMENT = "ip-masq-agent: local traffic is not subject to MASQUERADE"
MASQ_COMMENT = "ip-masq-agent: outbound traffic is subject to MASQUERADE (must be last in chain)"
EXCEPTION_COMMENT = "ip-masq-agent: masqueradeCIDRs traffic is subject to MASQUERADE"
RULE_COMMENT_PREFIX = "ip-masq-agent: rule "
PROTOCOLS_WITH_PORTS = ("tcp", "udp", "sctp")


def jump_comment(chain: str) -> str:
    return (
        "ip-masq-agent: ensure nat POSTROUTING directs all non-LOCAL destination traffic "
        f"to our custom {chain} chain"
    )


def _quote(token: str) -> str:
    return f'"{token}"'


def jump_rule(chain: str) -> str:
    """The POSTROUTING rule that sends non-local traffic through our chain (restore syntax)."""
    comment = _quote(jump_comment(chain))
    return f"-A POSTROUTING -m comment --comment {comment} -m addrtype ! --dst-type LOCAL -j {chain}"


def _masquerade_rules(chain: str, options: PolicyOptions, *, destination: str | None, comment: str) -> list[str]:
    """MASQUERADE, or with --to-ports one rule per protocol and port range, each range taking its share."""
    dest = f" -d {destination}" if destination else ""
    random_fully = " --random-fully" if options.random_fully else ""
    head = f"-A {chain} -m comment --comment {_quote(comment)}{dest}"
    lines = []
    ranges = options.to_ports
    for protocol in PROTOCOLS_WITH_PORTS if ranges else ():
        for i, port_range in enumerate(ranges):
            remaining = len(ranges) - i
            # 1/remaining of what is left: each of n ranges gets 1/n of the connections
            statistic = f" -m statistic --mode random --probability {_probability(remaining)}" if remaining > 1 else ""
            lines.append(f"{head} -p {protocol}{statistic} -j MASQUERADE --to-ports {port_range}{random_fully}")
    lines.append(f"{head} -j MASQUERADE{random_fully}")
    return lines


def _probability(remaining: int) -> str:
    # xt_statistic keeps lround(p * 2^31) and iptables-save prints that back with %.11f: render the value the
    # kernel will print, so a read-back compares equal (1/3 -> 0.33333333349)
    return f"{round((1 << 31) / remaining) / (1 << 31):.11f}"


@dataclass(frozen=True, slots=True)
class ChainRules:
    """Our chain's rules for one family, in restore syntax, in order."""

    chain: str
    family: Family
    rules: tuple[str, ...]


def chain_rules(policy: Policy, family: Family) -> ChainRules:
    chain = policy.options.masq_chain
    rules: list[str] = []
    for rule in policy.rules(family):  # the config's rules first: the first that matches decides
        rules.extend(config_rule_lines(chain, rule, policy.options))
    for entry in policy.rule_entries(family):
        rules.extend(_entry_rules(chain, entry, policy.options))
    rules.extend(_masquerade_rules(chain, policy.options, destination=None, comment=MASQ_COMMENT))
    return ChainRules(chain, family, tuple(rules))


def rule_comment(name: str) -> str:
    """The comment on the lines of a config rule: iptables-save then says which rule a line comes from."""
    return f"{RULE_COMMENT_PREFIX}{name}"


# the names iptables-save prints for -p (ip6tables-save calls ICMPv6 ipv6-icmp)
_PROTOCOL_NAMES = {"tcp": "tcp", "udp": "udp", "sctp": "sctp", "icmp": "icmp", "icmpv6": "ipv6-icmp"}
# multiport takes at most 15 ports, a range counting as two
_MULTIPORT_SLOTS = 15


def config_rule_lines(chain: str, rule: Rule, options: PolicyOptions) -> list[str]:
    """A rule of the config's `rules` as restore lines: one per source, destination and group of at most 15 ports
    (iptables-save lists a rule with several addresses as that many rules; multiport takes 15)."""
    head = f"-A {chain} -m comment --comment {_quote(rule_comment(rule.name))}"
    random_fully = " --random-fully" if options.random_fully else ""
    if rule.action is RuleAction.PRESERVE:
        target = "-j RETURN"
    elif rule.action is RuleAction.SNAT:
        target = f"-j SNAT --to-source {rule.snat_to}{random_fully}"
    else:
        target = f"-j MASQUERADE{random_fully}"
    protocol = f" -p {_PROTOCOL_NAMES[rule.protocol]}" if rule.protocol is not None else ""
    port_matches = [f" -m multiport --dports {group}" for group in _port_groups(rule.ports)] or [""]
    lines = []
    for source in rule.sources or (None,):
        from_source = "" if source is None else f" -s {source}"
        for destination in rule.destinations:
            for ports in port_matches:
                lines.append(f"{head}{from_source} -d {destination}{protocol}{ports} {target}")
    return lines


def _port_groups(ports: tuple[tuple[int, int], ...]) -> list[str]:
    groups: list[list[str]] = []
    used = _MULTIPORT_SLOTS
    for low, high in ports:
        slots = 1 if low == high else 2
        if used + slots > _MULTIPORT_SLOTS:
            groups.append([])
            used = 0
        groups[-1].append(str(low) if low == high else f"{low}:{high}")
        used += slots
    return [",".join(group) for group in groups]


def _entry_rules(chain: str, entry: Entry, options: PolicyOptions) -> list[str]:
    if entry.masquerade:
        return _masquerade_rules(chain, options, destination=str(entry.prefix), comment=EXCEPTION_COMMENT)
    return [f"-A {chain} -m comment --comment {_quote(NON_MASQ_COMMENT)} -d {entry.prefix} -j RETURN"]


def render_restore(policy: Policy, family: Family, *, with_jump: bool = True, with_marker: bool = False) -> str:
    """The whole iptables-restore --noflush payload: declaring the chain flushes it in the same transaction.

    Without `with_marker` it is the reference agent's text byte for byte; with it, the agent's: the same lines, the
    chain's ownership marker declared right after the chain (created, or flushed if it exists) and its one rule,
    the digest of what the agent writes, last."""
    rules = chain_rules(policy, family)
    lines = ["*nat", f":{rules.chain} - [0:0]"]
    if with_marker:
        lines.append(f":{marker_chain(rules.chain)} - [0:0]")
    if with_jump:
        lines.append(jump_rule(rules.chain))
    lines.extend(rules.rules)
    if with_marker:
        lines.append(marker_rule(rules.chain, written_digest(rules)))
    lines.append("COMMIT")
    return "\n".join(lines) + "\n"


def written_digest(rules: ChainRules) -> str:
    """What the marker records of a chain the agent writes: chain_digest of its jump and rules as the kernel will list
    them (canonical)."""
    return chain_digest(rules.chain, (canonical(jump_rule(rules.chain)),), (canonical(r) for r in rules.rules),
                        count=len(rules.rules))


# --- parsing ------------------------------------------------------------------------------------------------


def rule_target(rule: str) -> str | None:
    """The -j/-g target of a canonical rule line; a cheap look without parse_rule, for scanning whole tables."""
    tokens = rule.split(" ")
    for i, token in enumerate(tokens[:-1]):
        if token in ("-j", "-g"):
            return tokens[i + 1]
    return None


# Options iptables-save prints before any -m match, in this order; each may be negated with a preceding "!".
_LEADING = ("-s", "-d", "-i", "-o", "-p", "-f")
_ALIASES = {
    "--source": "-s",
    "--destination": "-d",
    "--in-interface": "-i",
    "--out-interface": "-o",
    "--protocol": "-p",
    "--append": "-A",
    "--jump": "-j",
    "--goto": "-g",
    "--match": "-m",
}


# iptables-save quotes only with double quotes, escaping '"' and '\\' inside: a regex reads that much faster than
# shlex, which matters at 10,000+ rules read back on every resync. Anything else (single quotes) goes to shlex.
_TOKEN = re.compile(r'"((?:[^"\\]|\\.)*)"|([^\s"]+)')


def _tokens(line: str) -> list[str]:
    if "'" not in line and "\\" not in line and line.count('"') % 2 == 0:
        tokens = []
        size = len(line)
        for m in _TOKEN.finditer(line):
            start, end = m.span()
            # each token must stand alone between blanks; `"a""b"` (one word to a shell) goes to shlex
            if (start and not line[start - 1].isspace()) or (end < size and not line[end].isspace()):
                break
            tokens.append(m.group(1) if m.group(2) is None else m.group(2))
        else:
            return tokens
    try:
        return shlex.split(line)
    except ValueError as exc:
        raise RuleParseError(f"cannot read rule {line!r}: {exc}") from None


# Our RETURN rules, in restore order (comment first) and in save order: the bulk of a 100,000-CIDR chain, so they
# skip the tokenizer (the same answer, property-tested against the general path).
_OUR_RETURN_RESTORE = re.compile(r'-A (\S+) -m comment --comment ("[^"\\]*") -d ([0-9a-fA-F.:]+(?:/\d+)?) -j RETURN\Z')
_OUR_RETURN_SAVE = re.compile(r'-A (\S+) -d ([0-9a-fA-F.:]+(?:/\d+)?) -m comment --comment ("[^"\\]*") -j RETURN\Z')


def canonical(line: str) -> str:
    """A rule line in iptables-save's form: leading options first, then matches and target as given."""
    fast = _OUR_RETURN_RESTORE.match(line)
    if fast is not None:
        chain, comment, address = fast.groups()
        return f"-A {chain} -d {_normalise_address('-d', address)} -m comment --comment {comment} -j RETURN"
    fast = _OUR_RETURN_SAVE.match(line)
    if fast is not None:
        chain, address, comment = fast.groups()
        return f"-A {chain} -d {_normalise_address('-d', address)} -m comment --comment {comment} -j RETURN"
    return _canonical(line)


def _canonical(line: str) -> str:
    raw = _tokens(line)
    # long options to their short form, but never a comment's text (`--comment "--protocol"` stays that word)
    tokens = [t if i and raw[i - 1] == "--comment" else _ALIASES.get(t, t) for i, t in enumerate(raw)]
    if len(tokens) < 2 or tokens[0] != "-A":
        raise RuleParseError(f"not a rule (-A CHAIN ...): {line!r}")
    chain = tokens[1]
    leading: dict[str, list[str]] = {}
    rest: list[str] = []
    i = 2
    while i < len(tokens):
        t = tokens[i]
        if t == "--comment" and i + 1 < len(tokens):
            # a comment is free text: `--comment "-o"` is a value, never an option to move
            rest.extend(tokens[i:i + 2])
            i += 2
            continue
        negated = t == "!" and i + 1 < len(tokens) and tokens[i + 1] in _LEADING
        option = tokens[i + 1] if negated else t
        if option in _LEADING and (negated or t in _LEADING):
            value_at = i + 2 if negated else i + 1
            if value_at >= len(tokens):
                raise RuleParseError(f"{option} without a value in {line!r}")
            leading[option] = (["!"] if negated else []) + [option, _normalise_address(option, tokens[value_at])]
            i = value_at + 1
            continue
        rest.append(t)
        i += 1
    out = ["-A", chain]
    for option in _LEADING:
        out.extend(leading.get(option, []))
    previous = ""
    for t in rest:
        out.append(_quote(t) if previous == "--comment" else t)
        previous = t
    return " ".join(out)


def _normalise_address(option: str, value: str) -> str:
    # iptables-save always prints a prefix length (1.2.3.4 -> 1.2.3.4/32)
    if option in ("-s", "-d") and "/" not in value:
        return f"{value}/128" if ":" in value else f"{value}/32"
    return value


@dataclass
class NatTable:
    """The nat table of an iptables-save dump: chains (with policy or "-") and rules, in order, canonical."""

    chains: dict[str, str]
    rules: list[str]

    def rules_of(self, chain: str) -> list[str]:
        prefix = f"-A {chain} "
        return [r for r in self.rules if r.startswith(prefix)]


def save_lines(text: str | Iterable[str]) -> Iterator[tuple[int, str, str]]:
    """The one reader of iptables-save output (or restore input): (line number, table, line) for every `:CHAIN`
    declaration and rule line, blank lines, comments, table headers and COMMIT skipped."""
    current: str | None = None
    lines = iter_lines(text) if isinstance(text, str) else text
    for number, raw in enumerate(lines, start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("*"):
            current = line[1:]
        elif line == "COMMIT":
            current = None
        elif current is not None:
            yield number, current, line


def parse_save(text: str | Iterable[str], table: str = "nat") -> NatTable:
    """Read one table of iptables-save output (or restore input), given whole or as its lines (iter_lines_of_pieces:
    straight from the program). Counters "[n:m]" before rules are dropped."""
    chains: dict[str, str] = {}
    rules: list[str] = []
    for number, name, line in save_lines(text):
        if name != table:
            continue
        if line.startswith(":"):
            chain, _, rest = line[1:].partition(" ")
            chains[chain] = rest.split(" ")[0] if rest else "-"
            continue
        if line.startswith("[") and "]" in line:
            line = line[line.index("]") + 1 :].strip()  # iptables-save -c puts counters before the rule
        try:
            rules.append(canonical(line))
        except RuleParseError as exc:
            raise RuleParseError(f"line {number}: {exc}") from None
    return NatTable(chains, rules)


def count_rules(text: str, *, table: str | None = None, foreign_only: bool = False) -> int:
    """Rule lines of a dump (of one table, or all), without parsing them; `foreign_only`: not ours (ours carry an
    ip-masq-agent comment, or are an ownership marker's rule). Cheap enough to look at every table of a busy node."""
    return sum(1 for _, name, line in save_lines(text)
               if line.startswith("-") and (table is None or name == table)
               and not (foreign_only and (f'"{OUR_COMMENT}' in line or is_marker_rule(line))))


# kube-proxy's one MASQUERADE (iptables mode): KUBE-POSTROUTING returns unless the packet carries its 0x4000 mark, so
# it masquerades only the Service traffic kube-proxy marked, never plain pod egress (every kube-proxy node has it)
_KUBE_PROXY_MASQUERADE = ('-A KUBE-POSTROUTING ', '--comment "kubernetes service traffic requiring SNAT"')


def count_foreign_nat(text: str | Iterable[str]) -> int:
    """Rules of a dump's nat table, not ours, that masquerade or SNAT (they may override what our chain decides);
    kube-proxy's Service masquerade aside."""
    return sum(1 for _, name, line in save_lines(text)
               if name == "nat" and line.startswith("-A ") and f'"{OUR_COMMENT}' not in line
               and (" -j MASQUERADE" in line or " -j SNAT" in line)
               and not (line.startswith(_KUBE_PROXY_MASQUERADE[0]) and _KUBE_PROXY_MASQUERADE[1] in line))


# --- which objects are ours ---------------------------------------------------------------------------------

# Our objects are found by the reference agent's comments, so a chain left under an old --masq-chain is ours too.
OUR_COMMENT = "ip-masq-agent: "
_JUMP_COMMENT = '--comment "ip-masq-agent: ensure nat POSTROUTING directs'


def is_our_jump(rule: str) -> bool:
    """A canonical POSTROUTING rule carrying our jump comment."""
    return rule.startswith("-A POSTROUTING ") and _JUMP_COMMENT in rule


def our_chains(table: NatTable, chain: str) -> list[str]:
    """Our chains in the table: the configured one first, then stale ones (sorted), each listed once."""
    found = {chain} if chain in table.chains else set()
    for rule in table.rules:
        if is_our_jump(rule):
            target = rule_target(rule)
            if target is not None and target in table.chains:
                found.add(target)
        elif f'--comment "{OUR_COMMENT}' in rule:
            found.add(rule.split(" ", 2)[1])
    found.discard("POSTROUTING")
    return sorted(found, key=lambda name: (name != chain, name))


# --- which chains ipmasq wrote: the ownership markers ---------------------------------------------------------

CHAIN_NAME_MAX = 28  # iptables' longest chain name
# A chain name of up to this many characters is kept whole in its marker's name (at most 27 characters); a longer
# one is abbreviated and hashed into exactly CHAIN_NAME_MAX, so the two forms can never name the same marker.
_MARKER_WHOLE = CHAIN_NAME_MAX - len(MARKER_CHAIN_PREFIX) - 1
_MARKER_KEPT = 7  # characters of a long name kept before its hash, so that `iptables-save` still hints at it
_MARKER_HASH = CHAIN_NAME_MAX - len(MARKER_CHAIN_PREFIX) - _MARKER_KEPT - 1  # hex digits of the hash: 8
_BUILTIN_CHAINS = frozenset({"PREROUTING", "INPUT", "OUTPUT", "POSTROUTING"})


def marker_chain(chain: str) -> str:
    """The name of `chain`'s ownership marker: IPMASQ-OWNS-<chain>, or for a chain of more than 15 characters
    IPMASQ-OWNS-<its first 7>-<8 hex digits of its sha256> (iptables takes chain names of 28 characters at most)."""
    if len(chain) <= _MARKER_WHOLE:
        return MARKER_CHAIN_PREFIX + chain
    digest = sha256(chain.encode()).hexdigest()[:_MARKER_HASH]
    return f"{MARKER_CHAIN_PREFIX}{chain[:_MARKER_KEPT]}-{digest}"


def is_marker(name: str) -> bool:
    """A chain of ipmasq's ownership record (no other program names chains so; --masq-chain may not)."""
    return name.startswith(MARKER_CHAIN_PREFIX)


# The marker's one rule: never reached (no rule jumps to the marker), its comment the record. Not the reference
# agent's comment prefix (`ip-masq-agent: `), so the marker is never taken for a chain of ip-masq-agent's text.
DIGEST_COMMENT = "ipmasq wrote sha256:"  # nftables: the marker set's comment, the same way
_RECORDED = re.compile(r'-A (\S+) -m comment --comment "' + re.escape(DIGEST_COMMENT) + r'([0-9a-f]{64})" -j RETURN\Z')
_MARKER_RULE = f"-A {MARKER_CHAIN_PREFIX}"
# bytes a canonical rule takes at the least: a rough size of a chain, for sha256 to pick OpenSSL for a large one
_RULE_BYTES = 64


def chain_digest(chain: str, jumps: Iterable[str], rules: Iterable[str], *, count: int = 0) -> str:
    """What a marker records: the sha256 of the chain's POSTROUTING jumps (those carrying our jump comment), its
    declaration and its rules, in order, as iptables-save prints them without counters (canonical), one a line.
    `count`: about how many rules (only to pick the faster sha256 for a large chain; the digest is the same)."""
    return sha256_of_lines(itertools.chain(jumps, (f":{chain}",), rules), expected_bytes=count * _RULE_BYTES)


def is_marker_rule(line: str) -> bool:
    """A rule line of an ownership marker: ipmasq's record, never a rule that decides a packet."""
    return line.startswith(_MARKER_RULE)


def marker_rule(chain: str, digest: str) -> str:
    """The marker's one rule (restore syntax, which is also iptables-save's), recording `digest` (chain_digest)."""
    return f'-A {marker_chain(chain)} -m comment --comment "{DIGEST_COMMENT}{digest}" -j RETURN'


def recorded_digest(marker: str, rules: list[str]) -> str | None:
    """The digest a marker records: its rules must be exactly the one marker_rule; None for anything else (an empty
    marker of an earlier development build, a marker someone edited): it vouches for no content."""
    if len(rules) != 1:
        return None
    found = _RECORDED.match(rules[0])
    return found.group(2) if found is not None and found.group(1) == marker else None


@dataclass(frozen=True, slots=True)
class ChainOwnership:
    """Who wrote the chains of one nat table that are, or look like, ipmasq's (all read from the table itself)."""

    owned: tuple[str, ...]  # marked, and their rules still what the marker records: ipmasq's (the configured first)
    unmarked: tuple[str, ...]  # chains with the reference agent's comments and no marker: another program's
    markers: tuple[str, ...]  # every marker chain in the table, sorted
    orphans: tuple[str, ...]  # markers whose chain is gone (a chain deleted by hand): ipmasq's, nothing else's
    # marked, but their jumps and rules no longer hash to what the marker records (or it records nothing): ipmasq
    # wrote them once, another program has rewritten them since; their markers no longer tell the truth
    changed: tuple[str, ...] = ()

    @property
    def empty(self) -> bool:
        return not (self.owned or self.unmarked or self.markers)


def chain_ownership(table: NatTable, chain: str, *, taken: str | None = None) -> ChainOwnership:
    """Which of the table's chains ipmasq wrote: a marked chain is ipmasq's while its jumps and rules hash to the
    digest its marker records (chain_digest); a marked chain that no longer does is `changed`, another program's
    now; a chain found by the reference agent's comments (our_chains: `chain` when it exists, chains under an earlier
    name) without its marker is not ipmasq's, until an agent enforcing it takes it over (writes its marker).
    `taken`: a chain the caller takes over whatever it holds (the agent's own): owned when marked, never hashed."""
    markers = sorted(name for name in table.chains if is_marker(name))
    present = set(markers)
    marked = {name for name in table.chains
              if not is_marker(name) and name not in _BUILTIN_CHAINS and marker_chain(name) in present}
    changed = {name for name in marked if name != taken and not _as_recorded(table, name)}
    commented = our_chains(table, chain)
    owned = sorted(marked - changed, key=lambda name: (name != chain, name))
    unmarked = tuple(name for name in commented if name not in marked)
    orphans = tuple(sorted(present - {marker_chain(name) for name in marked}))
    return ChainOwnership(tuple(owned), unmarked, tuple(markers), orphans,
                          tuple(sorted(changed, key=lambda name: (name != chain, name))))


def _as_recorded(table: NatTable, name: str) -> bool:
    """The marked chain's jumps and rules hash to the digest its marker records."""
    marker = marker_chain(name)
    recorded = recorded_digest(marker, table.rules_of(marker))
    if recorded is None:
        return False
    jumps = [r for r in table.rules if is_our_jump(r) and rule_target(r) == name]
    rules = table.rules_of(name)
    return chain_digest(name, jumps, rules, count=len(rules)) == recorded


# --- structured rules (for check and trace) -----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Condition:
    """One leading option of a rule (-s, -d, -i, -o, -p, -f), possibly negated with "!"."""

    option: str
    value: str
    negated: bool


@dataclass(frozen=True, slots=True)
class Match:
    """One `-m NAME ...` block, its option tokens as iptables-save prints them ("!" kept in place)."""

    name: str
    args: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class IptablesRule:
    """A rule split into what it tests and what it does; `text` is its canonical (iptables-save) form."""

    text: str
    chain: str
    conditions: tuple[Condition, ...]
    matches: tuple[Match, ...]
    target: str | None  # None: a rule without -j/-g only counts packets
    target_args: tuple[str, ...]
    goto: bool  # -g: a RETURN from the target chain returns past this chain's caller

    def condition(self, option: str) -> Condition | None:
        return next((c for c in self.conditions if c.option == option), None)

    def target_option(self, name: str) -> str | None:
        """The value following `name` among the target's options (`--to-source` of SNAT...)."""
        args = self.target_args
        for i, token in enumerate(args[:-1]):
            if token == name:
                return args[i + 1]
        return None


def parse_rule(line: str, *, already_canonical: bool = False) -> IptablesRule:
    """Split one rule (restore or save syntax) into conditions, matches and target; loud on what it cannot place.

    `already_canonical`: the line comes from parse_save (a NatTable), so it is not normalised a second time.
    """
    text = line if already_canonical else canonical(line)
    fast = _OUR_RETURN_SAVE.match(text)
    if fast is not None:  # our RETURN rules: most of a large chain
        chain, address, comment = fast.groups()
        return IptablesRule(text, chain, (Condition("-d", address, False),),
                            (Match("comment", ("--comment", comment[1:-1])),), "RETURN", (), False)
    tokens = _tokens(text)
    chain = tokens[1]
    conditions: list[Condition] = []
    i = 2
    while i < len(tokens):
        negated = tokens[i] == "!" and i + 1 < len(tokens) and tokens[i + 1] in _LEADING
        option = tokens[i + 1] if negated else tokens[i]
        if option not in _LEADING:
            break
        value_at = i + 2 if negated else i + 1
        conditions.append(Condition(option, tokens[value_at], negated))
        i = value_at + 1
    matches: list[Match] = []
    current: tuple[str, list[str]] | None = None
    target: str | None = None
    goto = False
    target_args: list[str] = []
    while i < len(tokens):
        token = tokens[i]
        if target is not None:
            target_args.append(token)
        elif token == "--comment" and current is not None and i + 1 < len(tokens):
            current[1].extend(tokens[i:i + 2])  # free text, even when it reads like `-m` or `-j`
            i += 1
        elif token == "-m" and i + 1 < len(tokens):
            if current is not None:
                matches.append(Match(current[0], tuple(current[1])))
            current = (tokens[i + 1], [])
            i += 1
        elif token in ("-j", "-g") and i + 1 < len(tokens):
            target, goto = tokens[i + 1], token == "-g"
            i += 1
        elif current is not None:
            current[1].append(token)
        else:
            raise RuleParseError(f"cannot place {token!r} (not a -m match option or a target) in {text!r}")
        i += 1
    if current is not None:
        matches.append(Match(current[0], tuple(current[1])))
    return IptablesRule(text, chain, tuple(conditions), tuple(matches), target, tuple(target_args), goto)
