"""Walk a pod's packet through the hooks that mark it before the routing decision: iptables' mangle PREROUTING
(legacy or nft, as iptables-save prints it) and nat PREROUTING, and every nftables base chain of type filter or nat
at the prerouting hook, in priority order (iptables' mangle sits at -150, its nat at -100); never guess. The nat
chains see a connection's first packet only, which this one is: a mark they set routes it (AWS VPC CNI sets its
CONNMARK there and restores it into the packet's mark). A DNAT there changes the destination (a Service's
address): the walk stops and says to trace the address it becomes with --service; a packet traced with
--service already went through nat PREROUTING (its --mark says what was set there), so nat is not walked again.

What is kept is the packet's mark (the fwmark ip rules test) and its connection's mark (ct mark, CONNMARK). The
packet is a new connection's first: its conntrack entry is new, so its ct mark starts at 0 and a restore
(`CONNMARK --restore-mark`, `meta mark set ct mark`) gives it only what a rule of this walk saved. Understood:
the nat walk's conditions and matches (ipmasq.diagnose.trace, ipmasq.diagnose.trace_nft), `-m connmark --mark`,
`-m conntrack --ctstate`/`-m state --state` (NEW), `ct mark`, `ct state`; MARK, CONNMARK (--set-xmark,
--save-mark, --restore-mark with their masks), `meta mark set`, `ct mark set`, and the verdicts and targets that
change neither (ACCEPT, RETURN, jumps, LOG, counters). Anything else that a reached rule does or tests (a socket
or cgroup match, TPROXY, a map) stops the walk with the reason: the routing decision would depend on it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from ipmasq.diagnose.rule_match import all_hold, apply_mark, condition_holds, match_holds
from ipmasq.diagnose.trace import Tracer
from ipmasq.diagnose.trace_nft import NftTracer, chain_name
from ipmasq.diagnose.walk import MAX_STEPS, ChainWalk
from ipmasq.errors import NftTraceError, PacketDropped, Undecidable, clip
from ipmasq.netfilter.iptables import IptablesRule, NatTable
from ipmasq.policy.packet import Packet
from ipmasq.prefix import Family, format_address

__all__ = ["IPTABLES_MANGLE_PRIORITY", "IPTABLES_NAT_PREROUTING_PRIORITY", "MangleResult", "MangleStep", "walk_mangle"]

IPTABLES_MANGLE_PRIORITY = -150  # NF_IP_PRI_MANGLE
IPTABLES_NAT_PREROUTING_PRIORITY = -100  # NF_IP_PRI_NAT_DST
_IPTABLES_MANGLE_TABLES = frozenset({("ip", "mangle"), ("ip6", "mangle")})
_IPTABLES_NAT_TABLES = frozenset({("ip", "nat"), ("ip6", "nat")})
# targets and statements that change where the packet goes: the question is then about another destination
_DNAT_TARGETS = frozenset({"DNAT", "REDIRECT", "NETMAP", "TPROXY"})
_DNAT_STATEMENTS = frozenset({"dnat", "redirect", "tproxy"})
# targets that change neither mark nor where the packet goes
_HARMLESS_TARGETS = frozenset({"LOG", "NFLOG", "TRACE", "CHECKSUM", "TCPMSS", "DSCP", "TOS", "TTL", "HL", "CLASSIFY",
                               "NOTRACK", "CT", "AUDIT", "NFQUEUE"})
_NEW_STATES = {"NEW": True, "ESTABLISHED": False, "RELATED": False, "INVALID": False, "UNTRACKED": False,
               "SNAT": False, "DNAT": False}
_NFT_NEW_STATES = {"new": True, "established": False, "related": False, "invalid": False, "untracked": False}
_FULL = 0xFFFFFFFF


@dataclass(frozen=True, slots=True)
class MangleStep:
    """A rule that changed the packet's or its connection's mark, or ended the walk: the rule as the node prints
    it (with its chain) and what it did."""

    decided_by: str
    result: str


@dataclass(frozen=True, slots=True)
class MangleResult:
    """The marks after the walk; `undecided`: why it could not be walked (the field to give); `dropped`: the rule
    that drops the packet."""

    mark: int
    ct_mark: int = 0
    steps: tuple[MangleStep, ...] = ()
    undecided: str | None = None
    dropped: str | None = None
    notes: tuple[str, ...] = ()


def walk_mangle(table: NatTable | None, nft_ruleset: str | NftTracer | None, packet: Packet, *,
                iptables_in_nft: bool = False, nat: NatTable | None = None) -> MangleResult:
    """The marks `packet` carries into the routing decision: iptables' mangle PREROUTING (`table`, of the packet's
    family), iptables' nat PREROUTING (`nat`, the nat table of the packet's family) and the listing's nftables
    prerouting filter and nat chains, by priority (`nft_ruleset`: `nft -j list ruleset`, or the NftTracer already
    made of it); no nat chain for a packet traced with --service (`packet.dnat`). `iptables_in_nft`: the listing's
    `ip mangle`/`ip6 mangle` (and `ip nat`/`ip6 nat`) are the tables `table` (and `nat`) were read from, walked in
    iptables' terms only."""
    walks: list[tuple[int, str, Any]] = []
    if table is not None and "PREROUTING" in table.chains:
        walks.append((IPTABLES_MANGLE_PRIORITY, "mangle", Tracer(table)))
    with_nat = not packet.dnat
    if with_nat and nat is not None and "PREROUTING" in nat.chains:
        walks.append((IPTABLES_NAT_PREROUTING_PRIORITY, "nat", Tracer(nat)))
    nft: NftTracer | None = None
    if nft_ruleset is not None:
        try:
            nft = nft_ruleset if isinstance(nft_ruleset, NftTracer) else NftTracer(nft_ruleset)
        except NftTraceError as exc:
            return MangleResult(packet.mark, undecided=f"mangle: {exc}")
        skip = (_IPTABLES_MANGLE_TABLES if table is not None else frozenset()) | (
            _IPTABLES_NAT_TABLES if nat is not None else frozenset()) if iptables_in_nft else frozenset()
        for base in [*nft.prerouting, *(nft.nat_prerouting if with_nat else ())]:
            if packet.family in _families(base.key[0]) and base.key[:2] not in skip:
                walks.append((base.priority, chain_name(base.key), base))
    walks.sort(key=lambda w: w[0])
    mark, ct_mark = packet.mark, 0
    steps: list[MangleStep] = []
    priorities = [w[0] for w in walks]
    notes = []
    if len(set(priorities)) != len(priorities):
        notes.append("prerouting chains of equal priority were walked in listing order (the kernel runs the one "
                     "registered last first)")
    try:
        for _, name, walker in walks:
            if isinstance(walker, Tracer):
                mark, ct_mark = _walk_iptables(walker, packet, mark, ct_mark, steps, name)
            else:
                assert nft is not None
                mark, ct_mark = _walk_nft(nft, walker, packet, mark, ct_mark, steps)
    except PacketDropped as dropped:
        return MangleResult(mark, ct_mark, tuple(steps), dropped=str(dropped), notes=tuple(notes))
    except Undecidable as stop:
        return MangleResult(mark, ct_mark, tuple(steps), undecided=f"prerouting: {stop}", notes=tuple(notes))
    return MangleResult(mark, ct_mark, tuple(steps), notes=tuple(notes))


def _families(family: str) -> tuple[Family, ...]:
    return {"ip": (Family.V4,), "ip6": (Family.V6,), "inet": (Family.V4, Family.V6)}.get(family, ())


def _walk_iptables(tracer: Tracer, packet: Packet, mark: int, ct_mark: int, steps: list[MangleStep],
                   table: str) -> tuple[int, int]:
    walk: ChainWalk[str, Any] = ChainWalk(tracer.chains, "PREROUTING",
                                          ends=frozenset({"PREROUTING", "INPUT", "FORWARD", "OUTPUT",
                                                          "POSTROUTING"}))
    while True:
        rule = walk.next_rule()
        if rule is None:
            policy = tracer.policies.get(walk.current, "ACCEPT")
            if policy == "DROP":
                raise PacketDropped(f"iptables {table} {walk.current} has policy DROP")
            return mark, ct_mark
        if walk.exhausted:
            raise Undecidable(f"depth limit: more than {MAX_STEPS} {table} rules evaluated")
        if not isinstance(rule, IptablesRule):
            raise Undecidable(f"cannot read {table} rule {clip(getattr(rule, 'text', '?'))}")
        shown = f"{table} {rule.text}"
        try:
            if not _iptables_matches(rule, packet, mark, ct_mark):
                continue
        except Undecidable as exc:
            raise Undecidable(f"{rule.text}: {exc}") from None
        target = rule.target
        if target is None or target in _HARMLESS_TARGETS:
            continue
        if target == "MARK":
            try:
                new = apply_mark(rule, mark)
            except Undecidable as exc:
                raise Undecidable(f"{rule.text}: {exc}") from None
            steps.append(MangleStep(shown, f"mark {mark:#x} -> {new:#x}"))
            mark = new
        elif target == "CONNMARK":
            mark, ct_mark = _connmark(rule, mark, ct_mark, steps, shown)
        elif target == "RETURN":
            if walk.can_return():
                walk.return_()
            else:
                return mark, ct_mark
        elif target == "ACCEPT":
            return mark, ct_mark
        elif target == "DROP":
            steps.append(MangleStep(shown, "dropped"))
            raise PacketDropped(f"iptables {table}: {rule.text}")
        elif target in tracer.chains:
            walk.enter(target, goto=rule.goto)
        elif target in _DNAT_TARGETS:
            raise Undecidable(_dnat_reason(f"{table} {rule.text}", packet))
        else:
            raise Undecidable(f"{rule.text}: target {target} is not understood by the mangle walk")


def _dnat_reason(rule: str, packet: Packet) -> str:
    shown = format_address(packet.family, packet.destination)
    return (f"{rule}: the connection's destination {shown} is DNATed before the routing decision (a Service's "
            "address?): trace the address it is DNATed to with --service (and --mark 0x4000 when kube-proxy "
            "marks it for masquerade)")


def _iptables_matches(rule: IptablesRule, packet: Packet, mark: int, ct_mark: int) -> bool:
    """Every test of the rule, as the nat walk judges them (all_hold), with the conntrack matches mangle meets."""
    tests: list[Callable[[], bool]] = [partial(condition_holds, c, packet) for c in rule.conditions]
    tests += [partial(_iptables_match, m, packet, mark, ct_mark) for m in rule.matches]
    return all_hold(tests)


def _iptables_match(match: Any, packet: Packet, mark: int, ct_mark: int) -> bool:
    args = list(match.args)
    if match.name == "connmark":
        negated = args[:1] == ["!"]
        rest = args[1:] if negated else args
        if len(rest) != 2 or rest[0] != "--mark":
            raise Undecidable(f"-m connmark {' '.join(args)} is not understood")
        value, mask = _value_mask(rest[1])
        return ((ct_mark & mask) == value) != negated
    if match.name in ("conntrack", "state"):
        option = "--ctstate" if match.name == "conntrack" else "--state"
        negated = args[:1] == ["!"]
        rest = args[1:] if negated else args
        if len(rest) != 2 or rest[0] != option:
            raise Undecidable(f"-m {match.name} {' '.join(args)}: only {option} is understood")
        states = rest[1].split(",")
        if any(s not in _NEW_STATES for s in states):
            raise Undecidable(f"-m {match.name} {option} {rest[1]} is not understood")
        return any(_NEW_STATES[s] for s in states) != negated
    return match_holds(match, packet, mark)


def _value_mask(text: str) -> tuple[int, int]:
    value, _, mask = text.partition("/")
    try:
        return int(value, 0), int(mask, 0) if mask else _FULL
    except ValueError:
        raise Undecidable(f"cannot read mark {text!r}") from None


def _connmark(rule: IptablesRule, mark: int, ct_mark: int, steps: list[MangleStep],
              shown: str) -> tuple[int, int]:
    args = list(rule.target_args)
    options: dict[str, str] = {}
    action = None
    i = 0
    while i < len(args):
        token = args[i]
        if token in ("--save-mark", "--restore-mark"):
            action = token
            i += 1
        elif token in ("--set-xmark", "--set-mark", "--nfmask", "--ctmask", "--mask", "--and-mark", "--or-mark",
                       "--xor-mark") and i + 1 < len(args):
            if token not in ("--nfmask", "--ctmask", "--mask"):
                action = token
            options[token] = args[i + 1]
            i += 2
        else:
            raise Undecidable(f"{rule.text}: CONNMARK {' '.join(args)} is not understood")
    try:
        both = int(options["--mask"], 0) if "--mask" in options else _FULL
        nfmask = int(options.get("--nfmask", str(both)), 0)
        ctmask = int(options.get("--ctmask", str(both)), 0)
        if action == "--restore-mark":
            new = ((mark & ~nfmask) ^ (ct_mark & ctmask)) & _FULL
            steps.append(MangleStep(shown, f"mark {mark:#x} -> {new:#x} (restored from the connection's mark "
                                    f"{ct_mark:#x}: a new connection's is 0 unless this walk set it)"))
            return new, ct_mark
        if action == "--save-mark":
            new = ((ct_mark & ~ctmask) ^ (mark & nfmask)) & _FULL
            steps.append(MangleStep(shown, f"connection mark {ct_mark:#x} -> {new:#x}"))
            return mark, new
        if action in ("--set-xmark", "--set-mark"):
            value, mask = _value_mask(options[action])
            new = ((ct_mark & ~mask) ^ value) if action == "--set-xmark" else ((ct_mark & ~mask) | value)
            new &= _FULL
        elif action == "--and-mark":
            new = ct_mark & int(options[action], 0)
        elif action == "--or-mark":
            new = ct_mark | int(options[action], 0)
        elif action == "--xor-mark":
            new = ct_mark ^ int(options[action], 0)
        else:
            raise Undecidable(f"{rule.text}: CONNMARK without an action")
    except (ValueError, Undecidable):
        raise Undecidable(f"{rule.text}: cannot read CONNMARK {' '.join(args)}") from None
    steps.append(MangleStep(shown, f"connection mark {ct_mark:#x} -> {new:#x}"))
    return mark, new


def _walk_nft(tracer: NftTracer, base: Any, packet: Packet, mark: int, ct_mark: int,
              steps: list[MangleStep]) -> tuple[int, int]:
    walk: ChainWalk[tuple[str, str, str], Any] = ChainWalk(tracer.chains, base.key)
    while True:
        rule = walk.next_rule()
        if rule is None:
            if base.policy == "drop":
                raise PacketDropped(f"{chain_name(base.key)} has policy drop")
            return mark, ct_mark
        if walk.exhausted:
            raise Undecidable(f"depth limit: more than {MAX_STEPS} rules evaluated")
        table = walk.current[:2]
        shown = f"{rule.chain}: {rule.text} ({rule.label})"
        verdict, mark, ct_mark = _nft_rule(tracer, rule, packet, mark, ct_mark, table, steps, shown)
        if verdict is None or verdict[0] == "continue":
            continue
        action, argument = verdict
        if action == "drop":
            steps.append(MangleStep(shown, "dropped"))
            raise PacketDropped(f"{rule.chain}: {rule.text}")
        if action == "return" and walk.can_return():
            walk.return_()
            continue
        if action in ("return", "accept"):
            return mark, ct_mark
        target = (walk.current[0], walk.current[1], argument or "")
        if target not in tracer.chains:
            raise Undecidable(f"{rule.text}: {action} to a chain the listing lacks: {argument}")
        if len(walk.stack) > 64:
            raise Undecidable("jumps nested deeper than 64 chains (a loop?)")
        walk.enter(target, goto=action == "goto")


def _nft_rule(tracer: NftTracer, rule: Any, packet: Packet, mark: int, ct_mark: int, table: tuple[str, str],
              steps: list[MangleStep], shown: str) -> tuple[tuple[str, str | None] | None, int, int]:
    undecidable: str | None = None
    for statement in rule.expr:
        if not isinstance(statement, dict) or len(statement) != 1:
            raise Undecidable(f"{rule.text}: cannot read statement {clip(json.dumps(statement))}")
        kind, body = next(iter(statement.items()))
        if kind == "match":
            try:
                if not _nft_match(tracer, body, packet, mark, ct_mark, table):
                    return None, mark, ct_mark
            except Undecidable as exc:
                undecidable = undecidable or str(exc)
            continue
        if undecidable is not None:
            raise Undecidable(f"{rule.text}: {undecidable}")
        if kind in ("counter", "log"):
            continue
        if kind in ("return", "accept", "drop"):
            return (kind, None), mark, ct_mark
        if kind in ("jump", "goto") and isinstance(body, dict):
            return (kind, str(body.get("target"))), mark, ct_mark
        if kind in _DNAT_STATEMENTS:
            raise Undecidable(_dnat_reason(f"{rule.chain}: {rule.text}", packet))
        if kind == "vmap" and isinstance(body, dict):
            try:
                verdict = tracer.map_verdict(body.get("key"), body.get("data"), packet, mark, table)
            except Undecidable as exc:
                raise Undecidable(f"{rule.text}: {exc}") from None
            if verdict is None:
                continue
            if isinstance(verdict, dict) and len(verdict) == 1:
                name, argument = next(iter(verdict.items()))
                if name in ("accept", "drop", "return", "continue"):
                    return (name, None), mark, ct_mark
                if name in ("jump", "goto") and isinstance(argument, dict):
                    return (name, str(argument.get("target"))), mark, ct_mark
            raise Undecidable(f"{rule.text}: map verdict {clip(json.dumps(verdict))} is not understood")
        if kind == "mangle" and isinstance(body, dict):
            key = body.get("key")
            value = _nft_value(body.get("value"), mark, ct_mark, rule.text)
            if key == {"meta": {"key": "mark"}}:
                steps.append(MangleStep(shown, f"mark {mark:#x} -> {value:#x}"))
                mark = value
                continue
            if key == {"ct": {"key": "mark"}}:
                steps.append(MangleStep(shown, f"connection mark {ct_mark:#x} -> {value:#x}"))
                ct_mark = value
                continue
        raise Undecidable(f"{rule.text}: statement {kind} is not understood by the mangle walk")
    if undecidable is not None:
        raise Undecidable(f"{rule.text}: {undecidable}")
    return ("continue", None), mark, ct_mark


def _nft_match(tracer: NftTracer, body: Any, packet: Packet, mark: int, ct_mark: int,
               table: tuple[str, str]) -> bool:
    if isinstance(body, dict) and isinstance(body.get("left"), dict) and "ct" in body["left"]:
        key = body["left"]["ct"].get("key") if isinstance(body["left"]["ct"], dict) else None
        op = body.get("op", "==")
        right = body.get("right")
        if key == "mark":
            negated = op == "!="
            if isinstance(right, int) and not isinstance(right, bool) and op in ("==", "!="):
                return bool((ct_mark == right) != negated)
            raise Undecidable(f"ct mark {op} {clip(json.dumps(right))} is not understood")
        if key == "state":
            names = right if isinstance(right, list) else [right]
            if not all(isinstance(n, str) and n in _NFT_NEW_STATES for n in names):
                raise Undecidable(f"ct state {clip(json.dumps(right))} is not understood")
            hit = any(_NFT_NEW_STATES[str(n)] for n in names)
            return bool(hit != (op == "!="))
    return tracer.match(body, packet, mark, table)


def _nft_value(value: Any, mark: int, ct_mark: int, text: str) -> int:
    """The value a `meta mark set` or `ct mark set` statement writes."""
    known = {"mark": mark}
    if isinstance(value, int) and not isinstance(value, bool):
        return value & _FULL
    if value == {"ct": {"key": "mark"}}:
        return ct_mark
    if value == {"meta": {"key": "mark"}}:
        return known["mark"]
    if isinstance(value, dict) and len(value) == 1:
        op, operands = next(iter(value.items()))
        if op in ("|", "^", "&") and isinstance(operands, list) and len(operands) == 2 \
                and isinstance(operands[1], int):
            base = _nft_value(operands[0], mark, ct_mark, text)
            number = operands[1]
            return (base | number if op == "|" else base ^ number if op == "^" else base & number) & _FULL
    raise Undecidable(f"{text}: mark value {clip(json.dumps(value))} is not understood by the mangle walk")
