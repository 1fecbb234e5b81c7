"""`ipmasq explain`: for each destination, masqueraded or not, which rule decided, and the source IP it sees."""

from __future__ import annotations

import argparse
from typing import Any

from ipmasq.cloudnat import CloudNat, CloudNatMode, follow_path
from ipmasq.commands.common import add_output_flag, add_policy_flags, address_flag, cidr_flag, load_policy, print_json
from ipmasq.errors import UsageError, clip
from ipmasq.policy import Policy, Reason, Verdict
from ipmasq.prefix import parse_address

_REASON_TEXT = {
    Reason.DEFAULT: "in the agent's default non-masquerade list",
    Reason.CONFIG: "in nonMasqueradeCIDRs",
    Reason.LINK_LOCAL: "link-local, never masqueraded unless masqLinkLocal is set",
    Reason.EXCEPTION: "in masqueradeCIDRs (an exception that wins over a shorter non-masquerade prefix)",
    Reason.CATCH_ALL: "matches no non-masquerade CIDR, so the final MASQUERADE rule applies",
    Reason.IPV6_DISABLED: "IPv6 without --enable-ipv6: the agent writes no IPv6 rules",
    Reason.LOCAL: "a node-local address: the POSTROUTING jump skips it (! --dst-type LOCAL)",
}


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "explain", help="what source IP a destination sees, and why",
        description="For each destination: masqueraded or not, the prefix and rule that decided, "
        "and the source IP the destination sees.",
    )
    parser.add_argument("destinations", nargs="+", metavar="DEST", help="destination IP address")
    add_policy_flags(parser, config_help="config file or directory, ConfigMap manifest, or - for standard input "
                                         "(default: none, the built-in defaults)")
    parser.add_argument("--source", metavar="POD_IP", help="the pod's IP (shown as the source when not masqueraded)")
    parser.add_argument("--node-ip", metavar="NODE_IP", help="the node's IP (shown as the source when masqueraded)")
    nat = parser.add_argument_group("second NAT layer (Cloud NAT behind the node)")
    nat.add_argument("--pod-range", action="append", default=[], metavar="CIDR",
                     help="the secondary range pods take their IPs from (repeatable)")
    nat.add_argument("--node-range", action="append", default=[], metavar="CIDR",
                     help="the subnet's primary range the node IP is in (repeatable)")
    nat.add_argument("--cloud-nat", choices=[m.value for m in CloudNatMode], metavar="MODE",
                     help="Cloud NAT's source ranges: ALL_IP_RANGES, PRIMARY_IP_RANGE or LIST_OF_SECONDARY_IP_RANGES")
    nat.add_argument("--nat-ip", metavar="IP", help="the Cloud NAT gateway's public address")
    add_output_flag(parser)
    parser.set_defaults(func=run)


def _cloud_nat(args: argparse.Namespace) -> CloudNat | None:
    if args.cloud_nat is None:
        if args.nat_ip:
            raise UsageError("--nat-ip needs --cloud-nat MODE")
        return None
    if not (args.nat_ip and args.source and args.node_ip and args.pod_range and args.node_range):
        raise UsageError("--cloud-nat needs --nat-ip, --source, --node-ip, --pod-range and --node-range")
    address_flag("--nat-ip", args.nat_ip)
    return CloudNat(CloudNatMode(args.cloud_nat), args.nat_ip, cidr_flag("--node-range", args.node_range),
                    cidr_flag("--pod-range", args.pod_range))


def run(args: argparse.Namespace) -> int:
    for flag, text in (("--source", args.source), ("--node-ip", args.node_ip)):
        if text is not None:
            address_flag(flag, text)
    policy = load_policy(args, "explain")
    cloud_nat = _cloud_nat(args)
    results = []
    for destination in args.destinations:
        try:
            family, address = parse_address(destination)
        except ValueError:
            raise UsageError(f"{clip(repr(destination))} is not an IP address") from None
        for flag, text in (("--source", args.source), ("--node-ip", args.node_ip)):
            if text is not None and parse_address(text)[0] is not family:
                raise UsageError(f"{flag} {text} is IPv{parse_address(text)[0].value} and the destination "
                                 f"{destination} is IPv{family.value}: a packet has one family")
        verdict = policy.verdict_for(family, address, text=destination)
        if args.node_ip is not None and parse_address(args.node_ip) == (family, address):
            verdict = Verdict(verdict.destination, verdict.family, False, Reason.LOCAL, None)
        results.append(_as_dict(verdict, policy, args, cloud_nat))
    if args.output == "json":
        print_json(results)
    else:
        for r in results:
            print(_as_text(r))
    return 0


def _as_dict(verdict: Verdict, policy: Policy, args: argparse.Namespace, cloud_nat: CloudNat | None) -> dict[str, Any]:
    entry = verdict.entry
    chain = policy.options.masq_chain
    if entry is None:
        rule = "final MASQUERADE" if verdict.reason is Reason.CATCH_ALL else None
    else:
        target = "MASQUERADE" if entry.masquerade else "RETURN"
        rule = f"-A {chain} -d {entry.prefix} -j {target}"
    path = follow_path(verdict, pod_ip=args.source, node_ip=args.node_ip, cloud_nat=cloud_nat)
    return {
        "destination": verdict.destination,
        "masquerade": verdict.masquerade,
        "matched": None if verdict.matched is None else str(verdict.matched),
        "reason": verdict.reason.value,
        "source_seen": path.source_seen,
        "source_after_node": path.source_after_node,
        "dropped": path.source_seen is None,
        "dropped_because": path.dropped_because,
        "path": list(path.hops),
        "rule": rule,
        "defined_at": None if entry is None else entry.where(),
        "explanation": _REASON_TEXT[verdict.reason],
    }


def _as_text(r: dict[str, Any]) -> str:
    action = "MASQUERADED to the node IP" if r["masquerade"] else "NOT masqueraded (keeps the pod IP)"
    matched = f" matched {r['matched']} ({r['defined_at']})" if r["matched"] else ""
    seen = f"the destination sees {r['source_seen']}" if not r["dropped"] else f"DROPPED: {r['dropped_because']}"
    return f"{r['destination']}: {action}; {seen}.{matched} Why: {r['explanation']}."
