"""`ipmasq trace`: walk a packet through the node's nat POSTROUTING.

Walk a new connection's first packet through POSTROUTING of the nat table (an iptables-save dump, or the live node
read with iptables-save), following jumps and returns; print every rule it met and the outcome. A rule it cannot
evaluate stops the trace: it never guesses.
"""

from __future__ import annotations

import argparse
from typing import Any

from ipmasq.backends.runner import SubprocessRunner
from ipmasq.commands.common import add_output_flag, command_parser, print_json, read_dump_input
from ipmasq.diagnose.sources import parse_save_dump, read_nat_save
from ipmasq.diagnose.trace import Outcome, Packet, TraceResult, trace
from ipmasq.errors import UsageError
from ipmasq.rules.iptables import parse_save

__all__ = ["register", "run"]

_OUTCOME_TEXT = {
    Outcome.UNCHANGED: "source unchanged",
    Outcome.MASQUERADE: "masqueraded to the out interface's address",
    Outcome.SNAT: "SNAT",
    Outcome.UNDECIDED: "CANNOT DECIDE",
}


def register(subparsers: Any) -> None:
    parser = command_parser(subparsers, __doc__)
    parser.add_argument("destination", metavar="DEST", help="destination IP address")
    parser.add_argument("--source", required=True, metavar="IP", help="the packet's source (the pod's IP)")
    parser.add_argument("--dump", metavar="FILE",
                        help="iptables-save output, - for standard input (default: read the live node)")
    parser.add_argument("--local-address", action="append", default=[], metavar="IP",
                        help="an address of the node (for -m addrtype LOCAL); the first is taken as the out "
                        "interface's address when the packet is masqueraded (repeatable)")
    parser.add_argument("--out-interface", metavar="NAME", help="the interface the packet leaves by (for -o)")
    parser.add_argument("--in-interface", metavar="NAME", help="the interface the packet came in by (for -i)")
    parser.add_argument("--protocol", default="tcp", metavar="PROTO", help="tcp, udp, icmp... (default tcp)")
    parser.add_argument("--mark", default="0", metavar="N", help="the packet's fwmark (default 0)")
    add_output_flag(parser)
    parser.set_defaults(func=run)


def _packet(args: argparse.Namespace) -> Packet:
    try:
        mark = int(args.mark, 0)
    except ValueError:
        raise UsageError(f"--mark: {args.mark!r} is not a number") from None
    if not 0 <= mark <= 0xFFFFFFFF:
        raise UsageError(f"--mark: {args.mark!r} is not a 32-bit mark")
    try:
        return Packet.of(args.destination, source=args.source, out_interface=args.out_interface,
                         in_interface=args.in_interface, protocol=args.protocol, mark=mark,
                         local_addresses=args.local_address)
    except ValueError as exc:
        raise UsageError(f"{exc}" if "famil" in str(exc) else f"not an IP address: {exc}") from None


def run(args: argparse.Namespace) -> int:
    packet = _packet(args)
    if args.dump is not None:
        path, text = read_dump_input(args.dump)
        table = parse_save_dump(text, path)
    else:
        table = parse_save(read_nat_save(SubprocessRunner(), packet.family))
    result = trace(table, packet)
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
        "outcome": result.outcome.value,
        "source_seen": result.source_seen(packet, masquerade_address=masquerade_address),
        "decided_by": result.decided_by,
        "snat_to": result.snat_to,
        "mark": result.mark,
        "cannot_decide": result.undecided_reason,
    }


def as_text(d: dict[str, Any]) -> str:
    lines = []
    for step in d["steps"]:
        lines.append(f"  {'MATCH' if step['matched'] else '  no '}  {step['rule']}")
    outcome = Outcome(d["outcome"])
    head = _OUTCOME_TEXT[outcome]
    if outcome is Outcome.SNAT:
        head += f" to {d['snat_to']}"
    if outcome is Outcome.UNDECIDED:
        lines.append(f"{head}: {d['cannot_decide']}")
    else:
        decided = d["decided_by"] or "the chain policy (ACCEPT)"
        seen = d["source_seen"] or "(the out interface's address: give --local-address to name it)"
        lines.append(f"outcome: {head}; the destination sees {seen}; decided by: {decided}")
    return "\n".join(lines)
