"""`check`'s semantic pass: a pod packet traced through the whole nat POSTROUTING, once per class of packets that
every rule and the policy treat alike, and the outcome (unchanged, masqueraded, SNAT to which address) compared with
the policy's verdict: a foreign rule that changes it is foreign-masquerade (it NATs) or jump-shadowed (it lets the
packet go before our chain sees it); a rule the tracer cannot evaluate is unsupported, quoted. The classes are exact:
destination intervals, and where a rule also tests the source, the protocol or the destination port (config rules,
or foreign ones), the destination interval is split further by source (inside --pod-range, or the config rules'
sources), protocol and port range; elsewhere one packet per interval."""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable, Iterator, Mapping
from typing import NamedTuple, Protocol

from ipmasq.config.model import Rule
from ipmasq.diagnose.check_report import FindingId, quote
from ipmasq.diagnose.hooks import IPTABLES_NFT_TABLES, iptables_hook, walk_hooks
from ipmasq.diagnose.rule_match import PROTOCOL_NUMBERS
from ipmasq.diagnose.trace import RuleShape, Tracer, TraceResult
from ipmasq.diagnose.trace_nft import NftTracer
from ipmasq.findings import Finding, Severity
from ipmasq.netfilter.iptables import NatTable
from ipmasq.netfilter.nft import CHAIN, RULES_CHAIN, TABLE, TABLE_FAMILY
from ipmasq.policy.packet import Outcome, Packet
from ipmasq.policy.policy import Policy
from ipmasq.policy.ranges import Span, append_span, subtract, to_prefixes, union, union_of_prefixes
from ipmasq.prefix import Family, Prefix, parse_cidr

__all__ = ["IptablesBeside", "Walker", "semantic_findings", "semantic_walk"]


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


class Walker(Protocol):
    """Tracer (iptables) or NftTracer: what the semantic pass needs of a tracer."""

    def trace(self, packet: Packet, *, record_steps: bool = True) -> TraceResult: ...

    def shapes(self, family: Family) -> Iterator[RuleShape]: ...


class IptablesBeside:
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
    tracer = Tracer(table)
    if beside is None:
        return semantic_walk(policy, tracer, family, ours, policy.options.masq_chain, pod_ranges, local,
                             out_interface)
    # our own nftables table beside iptables is a leftover of the other backend: other-variant-rules says so (the
    # live check looks for it), once, rather than a foreign-masquerade finding per destination
    ours = ours | {f"{TABLE_FAMILY} {TABLE} {CHAIN}", f"{TABLE_FAMILY} {TABLE} {RULES_CHAIN}"}
    return semantic_walk(policy, IptablesBeside(tracer, beside, family), family, ours, policy.options.masq_chain,
                         pod_ranges, local, out_interface)


def semantic_walk(policy: Policy, tracer: Walker, family: Family, ours: set[str], our_chain: str,
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
        dests = quote([str(p) for first, last in dest_spans for p in to_prefixes(family, first, last)])
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
