"""`ipmasq trace`: walk a packet through the node's nat POSTROUTING.

Walk a new connection's first packet through every nat chain of the postrouting hook, in priority order, as the
kernel does: iptables' nat POSTROUTING (iptables-save) and every nftables nat postrouting chain (nft -j list ruleset:
the agent's table, kube-proxy's nftables mode, any other), following jumps and returns; print every rule it met, the
outcome, the rule that decided (a config rule by its name, any other as CHAIN:N or by its handle) and the source the
destination sees. The first chain that masquerades or SNATs decides; chains of the same priority run in an order no
listing shows, so when they would NAT the packet differently it says so. A rule it cannot evaluate, or one testing a
field not given (--protocol, --port, --source-port), stops the trace with the field to give: it never guesses.

The route: on a node, trace reads the node's ip rules, routes and addresses itself (iproute2's JSON) and its
mangle table, and walks the whole path: mangle and nat PREROUTING (the marks ip rules test), the routing decision
(which rule and route, which out interface), nat POSTROUTING on that interface, and the address MASQUERADE takes as
the kernel picks it (not the route's src). Offline, --routes FILE gives a routing dump (the output of
`{ ip -j -4 rule; ip -j -6 rule; ip -j route show table all; ip -j addr; }`) and --dump a full iptables-save (nat
and mangle). --out-interface and --local-address still override the route's device and the masquerade address.

Service traffic: give --service when the connection was made to a Service (a ClusterIP, a NodePort, an external or
load-balancer IP) and DEST is the endpoint kube-proxy DNATed it to, and --mark 0x4000 when kube-proxy marked it for
masquerade (its default --masquerade-bit 14: a ClusterIP reached from outside the cluster CIDR, a NodePort or an
external IP with externalTrafficPolicy Cluster); kube-proxy then masquerades it in its own chain.
"""

from __future__ import annotations

import argparse
from typing import Any

from ipmasq.backends.iptables import Variant, detect_variant
from ipmasq.backends.runner import SubprocessRunner
from ipmasq.commands.common import add_output_flag, command_parser
from ipmasq.diagnose.hooks import IPTABLES_NFT_TABLES, NatHook, iptables_hook, walk_hooks
from ipmasq.diagnose.path import PathAnswer, PathFacts, path
from ipmasq.diagnose.path_sources import read_live_routing, read_mangle_save
from ipmasq.diagnose.sources import (
    parse_save_dump,
    read_dump_file,
    read_iptables_nft_beside,
    read_nat_save,
    read_nft_ruleset,
)
from ipmasq.diagnose.trace import Tracer, TraceResult, trace
from ipmasq.diagnose.trace_nft import NftTracer
from ipmasq.documents import print_document
from ipmasq.errors import IpmasqError, NftParseError, NftTraceError, RuleParseError, UsageError, clip, one_line
from ipmasq.netfilter.iptables import NatTable, parse_save
from ipmasq.netfilter.nft_json import parse_list_json
from ipmasq.policy.packet import Outcome, Packet
from ipmasq.route.facts import Routing
from ipmasq.route.iproute2 import parse_routing

__all__ = ["register", "run"]

_WITH_PORTS = ("tcp", "udp", "sctp", "udplite", "dccp")
# kube-proxy's default masquerade mark (--masquerade-bit 14), as its nftables and iptables rules test it
KUBE_PROXY_MASQUERADE_MARK = 0x4000

_OUTCOME_TEXT = {
    Outcome.PRESERVE: "source unchanged",
    Outcome.MASQUERADE: "masqueraded to the out interface's address",
    Outcome.SNAT: "SNAT",
    Outcome.UNDECIDED: "CANNOT DECIDE",
}
# the words `trace --json` has always printed for each outcome (scripts read them)
_OUTCOME_JSON = {Outcome.PRESERVE: "unchanged", Outcome.MASQUERADE: "masqueraded", Outcome.SNAT: "snat",
                 Outcome.UNDECIDED: "cannot-decide"}
_OUTCOME_OF_JSON = {word: outcome for outcome, word in _OUTCOME_JSON.items()}


def register(subparsers: Any) -> None:
    parser = command_parser(subparsers, __doc__)
    parser.add_argument("destination", metavar="DEST", help="destination IP address")
    parser.add_argument("--source", required=True, metavar="IP",
                        help="the packet's source (the pod's IP; for Service traffic from outside, the client's)")
    parser.add_argument("--dump", metavar="FILE", action="append", default=[],
                        help="iptables-save output or nft -j list ruleset output, - for standard input (default: "
                        "read the live node); give both of one node (--dump nat.save --dump ruleset.json) to walk "
                        "them together, the listing's iptables-nft tables (ip nat, ip6 nat) then read from the "
                        "iptables-save dump")
    parser.add_argument("--backend", choices=["iptables", "nftables", "auto"], default="auto",
                        help="live mode: which rules to walk (default auto: nftables when the agent's nftables "
                        "table is there, else iptables); iptables walks iptables' nat POSTROUTING and every "
                        "nftables nat chain beside it (kube-proxy's nftables mode), nftables every nftables nat "
                        "chain")
    parser.add_argument("--routes", metavar="FILE",
                        help="a routing dump of the node, - for standard input: the output of `{ ip -j -4 rule; "
                        "ip -j -6 rule; ip -j route show table all; ip -j addr; }` (default: read the live node's "
                        "when no --dump is given)")
    parser.add_argument("--local-address", action="append", default=[], metavar="IP",
                        help="an address of the node (for -m addrtype LOCAL); the first is taken as the out "
                        "interface's address when the packet is masqueraded, instead of the one the kernel would "
                        "pick from the node's addresses (repeatable)")
    parser.add_argument("--out-interface", metavar="NAME",
                        help="the interface the packet leaves by (for -o), instead of the route's")
    parser.add_argument("--in-interface", metavar="NAME", help="the interface the packet came in by (for -i)")
    parser.add_argument("--protocol", metavar="PROTO",
                        help="tcp, udp, sctp, icmp... (rules testing -p need it; not given: such a rule cannot "
                        "be decided)")
    parser.add_argument("--port", type=_port, metavar="PORT",
                        help="the destination port (rules testing --dport/--dports need it)")
    parser.add_argument("--source-port", type=_port, metavar="PORT",
                        help="the pod's source port (only rules testing --sport/--sports need it)")
    parser.add_argument("--mark", default="0", metavar="N",
                        help="the packet's fwmark (default 0); 0x4000: a Service connection kube-proxy marked for "
                        "masquerade (its default --masquerade-bit 14)")
    parser.add_argument("--service", action="store_true",
                        help="the connection was made to a Service (ClusterIP, NodePort, external or load-balancer "
                        "IP) and DNATed to DEST, its endpoint (conntrack's status dnat: kube-proxy masquerades "
                        "such a connection from an endpoint to itself); without it, the pod connected to DEST")
    add_output_flag(parser)
    parser.set_defaults(func=run)


def _port(text: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise argparse.ArgumentTypeError(f"{clip(repr(text))} is not a port (1-65535)")
    return int(text)


def _packet(args: argparse.Namespace) -> Packet:
    try:
        mark = int(args.mark, 0)
    except ValueError:
        raise UsageError(f"--mark: {args.mark!r} is not a number") from None
    if not 0 <= mark <= 0xFFFFFFFF:
        raise UsageError(f"--mark: {args.mark!r} is not a 32-bit mark")
    if (args.port is not None or args.source_port is not None) and (args.protocol or "").lower() not in _WITH_PORTS:
        raise UsageError("--port and --source-port need --protocol tcp, udp or sctp")
    try:
        return Packet.of(args.destination, source=args.source, out_interface=args.out_interface,
                         in_interface=args.in_interface, protocol=args.protocol, mark=mark,
                         local_addresses=args.local_address, port=args.port, source_port=args.source_port,
                         dnat=args.service)
    except ValueError as exc:
        raise UsageError(f"{exc}" if "famil" in str(exc) else f"not an IP address: {exc}") from None


def _nft_tracer(text: str, shown: str) -> NftTracer:
    try:
        parse_list_json(text)  # read as check reads it: a listing check refuses, trace refuses in the same words
    except NftParseError as exc:
        raise IpmasqError(one_line(f"{shown}: {exc}")) from None  # the error may quote the listing's names
    try:
        return NftTracer(text)
    except NftTraceError as exc:
        raise IpmasqError(one_line(f"{shown}: {exc}")) from None


def _walk(packet: Packet, table: NatTable | None, nft: NftTracer | None, *, iptables_in_nft: bool) -> TraceResult:
    """iptables' nat POSTROUTING (`table`) and the nftables chains (`nft`) walked together; with only one of them,
    that one's walk as it has always been. `iptables_in_nft`: the listing's `ip nat`/`ip6 nat` are the tables
    `table` was read from (iptables-nft), walked in iptables' terms only."""
    if nft is None:
        assert table is not None
        return trace(table, packet)
    if table is None:
        return nft.trace(packet)
    hooks: list[NatHook] = nft.hooks(packet.family, beside=IPTABLES_NFT_TABLES if iptables_in_nft else frozenset())
    hook = iptables_hook(Tracer(table))
    return walk_hooks(hooks if hook is None else [hook, *hooks], packet)


def _dumps(paths: list[str]) -> tuple[NatTable | None, NftTracer | None, NatTable | None, str | None]:
    """At most one iptables-save dump and one nft -j listing, of the same node: the nat table, the listing, the
    dump's mangle table (a full iptables-save holds it; None when the dump has none) and the listing's text."""
    if len(paths) > 2 or paths.count("-") > 1:
        raise UsageError("--dump: at most two files, one iptables-save dump and one nft -j listing of the same node "
                         "(standard input once)")
    table: NatTable | None = None
    nft: NftTracer | None = None
    mangle: NatTable | None = None
    ruleset: str | None = None
    saves: list[tuple[str, str]] = []
    for given in paths:
        path, text = read_dump_file(given)
        if text.lstrip().startswith("{"):  # nft -j list ruleset
            if nft is not None:
                raise UsageError("--dump: two nft -j listings: give one, and at most one iptables-save dump")
            nft = _nft_tracer(text, path)
            ruleset = text
        else:
            if saves:
                raise UsageError("--dump: two iptables-save dumps: give one (of the packet's family), and at most "
                                 "one nft -j listing")
            saves.append((path, text))
    for path, text in saves:
        # beside an nft listing, a dump without a nat table is a node whose nat rules are all nftables' (its mangle
        # table may still mark packets); alone, it is not what trace walks
        table = parse_save_dump(text, path, nat_required=nft is None)
        if not table.chains and not table.rules:
            table = None
        mangle = _mangle_of(text, path)
    return table, nft, mangle, ruleset


def _mangle_of(text: str, shown: str) -> NatTable | None:
    """The mangle table of a full iptables-save dump (None when it holds none)."""
    try:
        table = parse_save(text, "mangle")
    except RuleParseError as exc:
        raise IpmasqError(one_line(f"{shown}: mangle table: {exc}")) from None
    return table if table.chains or table.rules else None


def _routes_file(given: str) -> Routing:
    shown, text = read_dump_file(given, "the output of ip -j rule, ip -j route, ip -j addr")
    return parse_routing(text, shown)


def _read_live_ruleset(run: SubprocessRunner) -> str | IpmasqError | OSError:
    """`nft -j list ruleset`, read once per trace: its text, or why it could not be read (no nft, or it cannot
    list), for the caller to raise or to say."""
    try:
        return read_nft_ruleset(run)
    except (IpmasqError, OSError) as exc:
        return exc


def _holds_ours(ruleset: str | IpmasqError | OSError) -> bool:
    """The agent's nftables table is in the listing (then its rules, and every nat chain, are nftables')."""
    if not isinstance(ruleset, str):
        return False  # no nft, or it cannot list: the iptables reading says the rest
    try:
        return parse_list_json(ruleset) is not None
    except NftParseError:
        return False


def _nft_beside(ruleset: str | IpmasqError | OSError, notes: list[str]) -> NftTracer | None:
    """The node's nftables chains beside its iptables rules; None, with a note, where nft could not list them."""
    try:
        if not isinstance(ruleset, str):
            raise ruleset
        return _nft_tracer(ruleset, "nft -j list ruleset")
    except (IpmasqError, OSError) as exc:
        # the iptables walk still answers; what it cannot see is said, not hidden
        notes.append(f"nftables chains not walked ({clip(str(exc))}): a chain there, such as kube-proxy's in "
                     "nftables mode, is not in this answer")
        return None


def _kube_proxy_hint(result: TraceResult, packet: Packet) -> str | None:
    """When the walk met kube-proxy's masquerading chain without its mark: how to trace the Service traffic it
    masquerades there."""
    if packet.mark & KUBE_PROXY_MASQUERADE_MARK or result.outcome is Outcome.UNDECIDED:
        return None
    if not any(c.endswith(" kube-proxy masquerading") for c in result.chains):
        return None
    if result.decided_in is not None and result.decided_in.endswith(" kube-proxy masquerading"):
        return None
    return ("kube-proxy's masquerading chain let this packet go: it masquerades only Service connections it marked "
            f"{KUBE_PROXY_MASQUERADE_MARK:#x} (a ClusterIP reached from outside the cluster CIDR, a NodePort, an "
            "external IP with externalTrafficPolicy Cluster) and an endpoint reaching itself through its Service; "
            f"trace one with --service --mark {KUBE_PROXY_MASQUERADE_MARK:#x}")


def run(args: argparse.Namespace) -> int:
    packet = _packet(args)
    notes: list[str] = []
    routing: Routing | None = None
    mangle: NatTable | None = None
    ruleset_text: str | None = None
    if args.routes is not None:
        routing = _routes_file(args.routes)
    if args.dump:
        table, nft, mangle, ruleset_text = _dumps(args.dump)
        in_nft = True
    else:
        runner = SubprocessRunner()
        ruleset = _read_live_ruleset(runner)
        if routing is None:
            routing = _live_routing(runner, notes)
        if args.backend == "nftables" or (args.backend == "auto" and _holds_ours(ruleset)):
            if not isinstance(ruleset, str):
                raise ruleset  # asked for nftables: why nft could not list is the answer
            # iptables-nft's nat table in that listing (kube-proxy's iptables mode) walked in iptables' terms
            table = read_iptables_nft_beside(runner, ruleset, (packet.family,)).get(packet.family)
            nft = _nft_tracer(ruleset, "nft -j list ruleset")
            mangle = read_mangle_save(runner, packet.family, Variant.NFT, ruleset=ruleset)
            in_nft = True
        else:
            variant = detect_variant(runner)
            table = parse_save(read_nat_save(runner, packet.family, variant=variant))
            nft = _nft_beside(ruleset, notes)
            mangle = read_mangle_save(runner, packet.family, variant)
            in_nft = variant is Variant.NFT
        ruleset_text = ruleset if isinstance(ruleset, str) and nft is not None else None
    if routing is None and mangle is None:
        # no routes and no mangle table: the nat walk alone, as trace has always walked it
        result = _walk(packet, table, nft, iptables_in_nft=in_nft)
        answer = None
    else:
        facts = PathFacts(routing, {} if table is None else {packet.family: table},
                          {} if mangle is None else {packet.family: mangle}, ruleset_text, iptables_in_nft=in_nft)
        answer = path(facts, packet)
        result = answer.nat if answer.nat is not None else TraceResult((), Outcome.UNDECIDED, None, None,
                                                                      mark=answer.mark,
                                                                      undecided_reason=answer.undecided)
    hint = _kube_proxy_hint(result, packet)
    notes = [*result.notes, *notes, *(answer.notes if answer is not None else ()), *([hint] if hint else [])]
    masquerade_address = args.local_address[0] if args.local_address else None
    document = as_dict(result, packet, masquerade_address=masquerade_address, notes=notes, answer=answer)
    if args.output != "text":
        print_document(args.output, "TraceReport", document)
    else:
        print(as_text(document))
    return 1 if document["outcome"] == _OUTCOME_JSON[Outcome.UNDECIDED] else 0


def _live_routing(runner: SubprocessRunner, notes: list[str]) -> Routing | None:
    """The node's routing, or None with a note when iproute2 cannot be run (the nat walk still answers)."""
    try:
        return read_live_routing(runner)
    except (IpmasqError, OSError) as exc:
        notes.append(f"the node's routes were not read ({clip(str(exc))}): give --out-interface and "
                     "--local-address, or --routes")
        return None


def as_dict(result: TraceResult, packet: Packet, *, masquerade_address: str | None,
            notes: list[str] | None = None, answer: PathAnswer | None = None) -> dict[str, Any]:
    """The TraceReport. With the path (`answer`: the node's routes were read), `source_seen` is the path's and the
    route, the marks and the interfaces are said; without it, the nat walk's as trace has always printed it."""
    if answer is None:
        seen = result.source_seen(packet, masquerade_address=masquerade_address)
        why = None if seen is not None else result.undecided_reason if result.outcome is Outcome.UNDECIDED else (
            "the masquerade address is the out interface's: give --local-address, or the node's routes "
            "(--routes)" if result.outcome is Outcome.MASQUERADE else "the pod's address is not known")
        outcome = result.outcome
    else:
        seen, why, outcome = answer.source_seen, answer.undecided, answer.outcome
    document: dict[str, Any] = {
        "steps": [{"chain": s.chain, "rule": s.rule, "matched": s.matched} for s in result.steps],
        "outcome": _OUTCOME_JSON[outcome],
        "source_seen": seen,
        "source_seen_reason": why,
        "decided_by": result.decided_by,
        "decided_by_name": result.decided_label,
        "snat_to": result.snat_to,
        "mark": result.mark,
        "cannot_decide": (result.undecided_reason if answer is None else answer.undecided)
        if outcome is Outcome.UNDECIDED else None,
        "notes": list(result.notes if notes is None else notes),
    }
    if answer is not None:
        document.update(_path_fields(answer))
    return document


def _path_fields(answer: PathAnswer) -> dict[str, Any]:
    decision = answer.route
    route = None
    if decision is not None:
        route = {"type": decision.kind,
                 "rule": None if decision.rule is None else decision.rule.text,
                 "table": None if decision.route is None else decision.route.table,
                 "route": None if decision.route is None else decision.route.text,
                 "nexthop": answer.nexthop}
    return {
        "path": [{"stage": s.stage, "decided_by": s.decided_by, "result": s.result} for s in answer.steps],
        "route": route,
        "routing_mark": answer.mark,
        "ingress_interface": answer.in_interface,
        "egress_interface": answer.out_interface,
        "masquerade_address": answer.masquerade_address,
        "delivered": answer.delivered,
    }


def as_text(d: dict[str, Any]) -> str:
    """The walk for a terminal. Every string read from the rules (chain and table names, rules and their comments,
    notes quoting them) is escaped with ipmasq.errors.one_line where it becomes a line: a rule's comment may hold
    an escape sequence, a C1 control, a bidi override or a newline, and none of them reaches the terminal raw."""
    lines = []
    if d.get("path"):
        lines.append("path:")
        lines.extend(f"  {one_line(p['stage'])}: {one_line(p['decided_by'])}: {one_line(p['result'])}"
                     for p in d["path"] if p["stage"] not in ("nat", "snat"))
        if d["steps"]:
            lines.append("nat POSTROUTING:")
    chain = None
    for step in d["steps"]:
        if step["chain"] != chain:
            chain = step["chain"]
            lines.append(f"  [{one_line(chain)}]")
        lines.append(f"  {'MATCH' if step['matched'] else '  no '}  {one_line(step['rule'])}")
    outcome = _OUTCOME_OF_JSON[d["outcome"]]
    head = _OUTCOME_TEXT[outcome]
    if outcome is Outcome.SNAT:
        head += f" to {one_line(str(d['snat_to']))}"
    if outcome is Outcome.UNDECIDED:
        lines.append(f"{head}: {one_line(str(d['cannot_decide']))}")
    else:
        decided = ("the chain policy (ACCEPT)" if d["decided_by"] is None
                   else one_line(f"{d['decided_by_name']}: {d['decided_by']}"))
        seen = one_line(d["source_seen"] or f"(not known: {d['source_seen_reason']})")
        via = f" by {one_line(d['egress_interface'])}" if d.get("egress_interface") else ""
        lines.append(f"outcome: {head}; the destination sees {seen}{via}; decided by: {decided}")
    lines.extend(f"note: {one_line(note)}" for note in d.get("notes", ()))
    return "\n".join(lines)
