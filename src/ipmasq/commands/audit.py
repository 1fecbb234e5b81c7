"""`ipmasq audit`: find pod-source flows in VPC flow logs.

Read VPC flow logs (AWS default/v2 format or GCP JSON lines; gzip too), keep the flows whose source is a pod address
(traffic that left a node unmasqueraded), group them by destination, and say what the given config does to each
group now. Exit 1 when rejected pod-source flows would still leave with the pod IP under this config, 0 otherwise.
"""

from __future__ import annotations

import argparse
from typing import Any

from ipmasq import documents
from ipmasq.audit import AuditReport, Group, audit, count_flows
from ipmasq.commands import common, policy_source
from ipmasq.errors import UsageError
from ipmasq.prefix import Family

__all__ = ["register", "run"]


def register(subparsers: Any) -> None:
    parser = common.command_parser(subparsers, __doc__)
    parser.add_argument("flowlogs", nargs="+", metavar="FLOWLOG", help="flow log file (plain or .gz)")
    parser.add_argument("--pod-range", action="append", required=True, metavar="CIDR",
                        help="the pods' address range (repeatable)")
    parser.add_argument("--group-prefix", type=int, default=32, metavar="BITS",
                        help="group IPv4 destinations by this prefix length (default 32: one group per address; "
                        "IPv6 uses /128, or BITS+96 when BITS < 32)")
    common.add_policy_flags(parser, config_help="config file or directory (default: none, the built-in defaults)")
    common.add_output_flag(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if not 0 <= args.group_prefix <= 32:
        raise UsageError(f"--group-prefix: {args.group_prefix} is not between 0 and 32")
    common.at_most_one_stdin(*(("FLOWLOG", path) for path in args.flowlogs), ("--config", args.config))
    pods = common.cidr_flag("--pod-range", args.pod_range)
    policy = policy_source.load_policy(args, "audit")
    bits = {Family.V4: args.group_prefix, Family.V6: 128 if args.group_prefix == 32 else args.group_prefix + 96}
    report = audit(count_flows(args.flowlogs, pods), policy, group_bits=bits)
    if args.output != "text":
        documents.print_document(args.output, "AuditReport", as_dict(report))
    else:
        print(f"{report.records} flow records ({report.skipped} without addresses skipped); {report.pod_flows} from "
              f"pod addresses, to {len(report.groups)} destination(s)")
        for group in report.groups:
            print(as_text(group))
    return 1 if any(g.still_failing for g in report.groups) else 0


def as_text(g: Group) -> str:
    sources = ", ".join(g.sources) + (f" and {g.source_count - len(g.sources)} more" if g.source_count > 5 else "")
    decided = f"matched {', '.join(g.matched)}; " if g.matched else ""
    warn = "  <- still leaves with the pod IP" if g.still_failing else ""
    return (f"{g.shown}: pod source, {g.status}; with this config: {g.with_config} "
            f"[{decided}{g.flows} flow(s) from {sources}]{warn}")


def as_dict(report: AuditReport) -> dict[str, Any]:
    return {
        "records": report.records,
        "skipped": report.skipped,
        "pod_flows": report.pod_flows,
        "groups": [{
            "destination": g.shown,
            "flows": g.flows,
            "accepted": g.accepted,
            "rejected": g.rejected,
            "unknown": g.unknown,
            "sources": list(g.sources),
            "source_count": g.source_count,
            "masquerade": g.masquerade,
            "matched": list(g.matched),
            "reasons": list(g.reasons),
            "still_failing": g.still_failing,
            "summary": as_text(g),
        } for g in report.groups],
    }
