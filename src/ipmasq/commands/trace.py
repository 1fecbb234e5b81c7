"""`ipmasq trace`: walk a packet through the node's nat POSTROUTING.

Walk a new connection's first packet through POSTROUTING of the nat table (an iptables-save dump, or the live node
read with iptables-save), or through every nftables nat postrouting chain in priority order (nft -j list ruleset),
following jumps and returns; print every rule it met, the outcome, the rule that decided
(a config rule by its name, any other as CHAIN:N) and the source the destination sees. A rule it cannot evaluate,
or one testing a field not given (--protocol, --port, --source-port), stops the trace with the field to give: it
never guesses.
"""

from __future__ import annotations

import argparse
from typing import Any

from ipmasq.backends.runner import SubprocessRunner
from ipmasq.commands.common import add_output_flag, command_parser, print_json
from ipmasq.diagnose.sources import parse_save_dump, read_dump_file, read_nat_save, read_nft_ruleset
from ipmasq.diagnose.trace import TraceResult, trace
from ipmasq.diagnose.trace_nft import NftTracer
from ipmasq.errors import IpmasqError, NftParseError, NftTraceError, UsageError, clip
from ipmasq.netfilter.iptables import parse_save
from ipmasq.netfilter.nft import parse_list_json
from ipmasq.policy.packet import Outcome, Packet

__all__ = ["register", "run"]

_WITH_PORTS = ("tcp", "udp", "sctp", "udplite", "dccp")

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
    parser.add_argument("--source", required=True, metavar="IP", help="the packet's source (the pod's IP)")
    parser.add_argument("--dump", metavar="FILE",
                        help="iptables-save output or nft -j list ruleset output, - for standard input (default: "
                        "read the live node)")
    parser.add_argument("--backend", choices=["iptables", "nftables", "auto"], default="auto",
                        help="live mode: which rules to walk (default auto: nftables when the agent's nftables "
                        "table is there, else iptables)")
    parser.add_argument("--local-address", action="append", default=[], metavar="IP",
                        help="an address of the node (for -m addrtype LOCAL); the first is taken as the out "
                        "interface's address when the packet is masqueraded (repeatable)")
    parser.add_argument("--out-interface", metavar="NAME", help="the interface the packet leaves by (for -o)")
    parser.add_argument("--in-interface", metavar="NAME", help="the interface the packet came in by (for -i)")
    parser.add_argument("--protocol", metavar="PROTO",
                        help="tcp, udp, sctp, icmp... (rules testing -p need it; not given: such a rule cannot "
                        "be decided)")
    parser.add_argument("--port", type=_port, metavar="PORT",
                        help="the destination port (rules testing --dport/--dports need it)")
    parser.add_argument("--source-port", type=_port, metavar="PORT",
                        help="the pod's source port (only rules testing --sport/--sports need it)")
    parser.add_argument("--mark", default="0", metavar="N", help="the packet's fwmark (default 0)")
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
                         local_addresses=args.local_address, port=args.port, source_port=args.source_port)
    except ValueError as exc:
        raise UsageError(f"{exc}" if "famil" in str(exc) else f"not an IP address: {exc}") from None


def _nft_trace(text: str, shown: str, packet: Packet) -> TraceResult:
    try:
        parse_list_json(text)  # read as check reads it: a listing check refuses, trace refuses in the same words
    except NftParseError as exc:
        raise IpmasqError(f"{shown}: {exc}") from None
    try:
        return NftTracer(text).trace(packet)
    except NftTraceError as exc:
        raise IpmasqError(f"{shown}: {exc}") from None


def _node_uses_nft() -> bool:
    """The agent's nftables table is on the node (then its rules, and every nat chain, are nftables')."""
    try:
        text = read_nft_ruleset(SubprocessRunner())
    except (IpmasqError, OSError):
        return False  # no nft, or it cannot list: the iptables reading says the rest
    try:
        return parse_list_json(text) is not None
    except NftParseError:
        return False


def run(args: argparse.Namespace) -> int:
    packet = _packet(args)
    if args.dump is not None:
        path, text = read_dump_file(args.dump)
        if text.lstrip().startswith("{"):  # nft -j list ruleset
            result = _nft_trace(text, path, packet)
        else:
            result = trace(parse_save_dump(text, path), packet)
    elif args.backend == "nftables" or (args.backend == "auto" and _node_uses_nft()):
        result = _nft_trace(read_nft_ruleset(SubprocessRunner()), "nft -j list ruleset", packet)
    else:
        result = trace(parse_save(read_nat_save(SubprocessRunner(), packet.family)), packet)
    masquerade_address = args.local_address[0] if args.local_address else None
    document = as_dict(result, packet, masquerade_address=masquerade_address)
    if args.output == "json":
        print_json(document)
    else:
        print(as_text(document))
    return 1 if result.outcome is Outcome.UNDECIDED else 0


def as_dict(result: TraceResult, packet: Packet, *, masquerade_address: str | None) -> dict[str, Any]:
    return {
        "steps": [{"chain": s.chain, "rule": s.rule, "matched": s.matched} for s in result.steps],
        "outcome": _OUTCOME_JSON[result.outcome],
        "source_seen": result.source_seen(packet, masquerade_address=masquerade_address),
        "decided_by": result.decided_by,
        "decided_by_name": result.decided_label,
        "snat_to": result.snat_to,
        "mark": result.mark,
        "cannot_decide": result.undecided_reason,
    }


def as_text(d: dict[str, Any]) -> str:
    lines = []
    for step in d["steps"]:
        lines.append(f"  {'MATCH' if step['matched'] else '  no '}  {step['rule']}")
    outcome = _OUTCOME_OF_JSON[d["outcome"]]
    head = _OUTCOME_TEXT[outcome]
    if outcome is Outcome.SNAT:
        head += f" to {d['snat_to']}"
    if outcome is Outcome.UNDECIDED:
        lines.append(f"{head}: {d['cannot_decide']}")
    else:
        decided = ("the chain policy (ACCEPT)" if d["decided_by"] is None
                   else f"{d['decided_by_name']}: {d['decided_by']}")
        seen = d["source_seen"] or "(the out interface's address: give --local-address to name it)"
        lines.append(f"outcome: {head}; the destination sees {seen}; decided by: {decided}")
    return "\n".join(lines)
