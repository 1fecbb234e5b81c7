"""iptables-restore text for our chain, rendered and parsed in one dialect.

Rendering follows the reference agent byte for byte (comment first, as its restore input has it); parsing
reads both that and iptables-save's order, and `canonical` turns either into iptables-save's form so that
the agent, `check` and the tests compare rules as the kernel prints them.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from ipmasq.config.model import Entry, Rule, RuleAction
from ipmasq.errors import RuleParseError
from ipmasq.netfilter.lines import iter_lines
from ipmasq.options import PolicyOptions
from ipmasq.policy.policy import Policy
from ipmasq.policy.prefix import Family

__all__ = [
    "EXCEPTION_COMMENT",
    "MASQ_COMMENT",
    "NON_MASQ_COMMENT",
    "OUR_COMMENT",
    "RULE_COMMENT_PREFIX",
    "ChainRules",
    "Condition",
    "IptablesRule",
    "Match",
    "NatTable",
    "canonical",
    "chain_rules",
    "config_rule_lines",
    "count_foreign_nat",
    "count_rules",
    "is_our_jump",
    "jump_comment",
    "jump_rule",
    "our_chains",
    "parse_rule",
    "parse_save",
    "render_restore",
    "rule_comment",
    "rule_target",
    "save_lines",
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


def render_restore(policy: Policy, family: Family, *, with_jump: bool = True) -> str:
    """The whole iptables-restore --noflush payload: declaring the chain flushes it in the same transaction."""
    rules = chain_rules(policy, family)
    lines = ["*nat", f":{rules.chain} - [0:0]"]
    if with_jump:
        lines.append(jump_rule(rules.chain))
    lines.extend(rules.rules)
    lines.append("COMMIT")
    return "\n".join(lines) + "\n"


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
    tokens = [_ALIASES.get(t, t) for t in _tokens(line)]
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
    ip-masq-agent comment). Cheap enough to look at every table of a busy node."""
    return sum(1 for _, name, line in save_lines(text)
               if line.startswith("-") and (table is None or name == table)
               and not (foreign_only and f'"{OUR_COMMENT}' in line))


def count_foreign_nat(text: str | Iterable[str]) -> int:
    """Rules of a dump's nat table, not ours, that masquerade or SNAT (they may override what our chain decides)."""
    return sum(1 for _, name, line in save_lines(text)
               if name == "nat" and line.startswith("-A ") and f'"{OUR_COMMENT}' not in line
               and (" -j MASQUERADE" in line or " -j SNAT" in line))


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
