"""`ipmasq explain`: for each destination, masqueraded or not, which rule decided, and the source IP it sees."""

from __future__ import annotations

import argparse
import os
from typing import Any

from ipmasq.cloudnat import CloudNat, CloudNatMode, follow_path
from ipmasq.commands.common import add_output_flag, add_policy_flags, address_flag, cidr_flag
from ipmasq.commands.policy_source import load_policy
from ipmasq.config.model import Rule, RuleAction
from ipmasq.diagnose.path import PathAnswer, masquerade_path
from ipmasq.diagnose.sources import read_dump_file
from ipmasq.documents import print_document
from ipmasq.errors import UsageError, clip, one_line
from ipmasq.policy.packet import Packet
from ipmasq.policy.policy import Policy, PolicyVerdict, Reason
from ipmasq.prefix import parse_address
from ipmasq.route.facts import Routing
from ipmasq.route.iproute2 import parse_routing

_REASON_TEXT = {
    Reason.DEFAULT: "in the agent's default non-masquerade list",
    Reason.CONFIG: "in nonMasqueradeCIDRs",
    Reason.LINK_LOCAL: "link-local, never masqueraded unless masqLinkLocal is set",
    Reason.EXCEPTION: "in masqueradeCIDRs (an exception that wins over a shorter non-masquerade prefix)",
    Reason.CATCH_ALL: "matches no non-masquerade CIDR, so the final MASQUERADE rule applies",
    Reason.IPV6_DISABLED: "IPv6 is not enabled (--enable-ipv6, or enableIPv6: true in the config): the agent "
                          "writes no IPv6 rules",
    Reason.LOCAL: "a node-local address: the POSTROUTING jump skips it (! --dst-type LOCAL)",
    Reason.RULE: "the first rule of the config's rules section that matches the packet decides",
}
RULE_PROTOCOLS = ("tcp", "udp", "sctp", "icmp", "icmpv6")
_ACTION_TEXT = {RuleAction.MASQUERADE: "masquerade", RuleAction.PRESERVE: "preserve", RuleAction.SNAT: "snat"}


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "explain", help="what source IP a destination sees, and why",
        description="For each destination: masqueraded or not, the prefix and rule that decided, "
        "and the source IP the destination sees.",
    )
    parser.add_argument("destinations", nargs="+", metavar="DEST", help="destination IP address")
    add_policy_flags(parser, config_help="config file or directory, ConfigMap manifest, or - for standard input "
                                         "(default: none, the built-in defaults)")
    parser.add_argument("--source", metavar="POD_IP",
                        help="the pod's IP: selects config rules with sources, and is shown when not masqueraded")
    parser.add_argument("--protocol", choices=RULE_PROTOCOLS, type=str.lower,
                        help="the packet's protocol (selects config rules): tcp or Kubernetes' TCP, udp, sctp, "
                        "icmp, icmpv6")
    parser.add_argument("--port", type=_port, metavar="PORT", help="the destination port (selects config rules)")
    parser.add_argument("--node-name", default=os.environ.get("NODE_NAME") or None, metavar="NAME",
                        help="the node's name: selects config rules with nodes (default: $NODE_NAME)")
    parser.add_argument("--node-ip", metavar="NODE_IP", help="the node's IP (shown as the source when masqueraded)")
    parser.add_argument("--routes", metavar="FILE",
                        help="a routing dump of the node (the output of `{ ip -j -4 rule; ip -j -6 rule; ip -j route "
                        "show table all; ip -j addr; }`): a masqueraded packet's source is then the address the "
                        "kernel gives it on the interface its route leaves by (needs --source)")
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


def _port(text: str) -> int:
    if not (text.isascii() and text.isdigit()) or not 1 <= int(text) <= 65535:
        raise argparse.ArgumentTypeError(f"{clip(repr(text))} is not a port (1-65535)")
    return int(text)


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
    if args.port is not None and args.protocol not in ("tcp", "udp", "sctp"):
        raise UsageError("--port needs --protocol tcp, udp or sctp")
    policy = load_policy(args, "explain")
    source = None if args.source is None else parse_address(args.source)
    cloud_nat = _cloud_nat(args)
    routing: Routing | None = None
    if args.routes is not None:
        if args.source is None:
            raise UsageError("--routes needs --source: the pod's address is what the node's ip rules test")
        shown, text = read_dump_file(args.routes, "the output of ip -j rule, ip -j route, ip -j addr")
        routing = parse_routing(text, shown)
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
        verdict = policy.verdict_for(family, address, text=destination, source=None if source is None else source[1],
                                     protocol=args.protocol, port=args.port)
        if args.node_ip is not None and parse_address(args.node_ip) == (family, address):
            verdict = PolicyVerdict(verdict.destination, verdict.family, False, Reason.LOCAL, None)
        egress = None
        if routing is not None and verdict.masquerade and verdict.snat_to is None:
            egress = masquerade_path(routing, Packet.of(destination, source=args.source, protocol=args.protocol,
                                                        port=args.port))
        results.append(_as_dict(verdict, policy, args, cloud_nat, egress))
    if args.output != "text":
        print_document(args.output, "ExplainReport", {"results": results})
    else:
        for r in results:
            print(_as_text(r))
    return 0


def _as_dict(verdict: PolicyVerdict, policy: Policy, args: argparse.Namespace,
             cloud_nat: CloudNat | None, egress: PathAnswer | None = None) -> dict[str, Any]:
    entry = verdict.entry
    chain = policy.options.masq_chain
    matched = None if verdict.matched is None else str(verdict.matched)
    rule: str | None
    if verdict.rule is not None:
        rule = f"rule {verdict.rule.name}"
        matched = next(str(p) for p in verdict.rule.destinations
                       if p.family is verdict.family and p.contains(parse_address(verdict.destination)[1]))
    elif entry is None:
        rule = "final MASQUERADE" if verdict.reason is Reason.CATCH_ALL else None
    else:
        target = "MASQUERADE" if entry.masquerade else "RETURN"
        rule = f"-A {chain} -d {entry.prefix} -j {target}"
    node_ip = args.node_ip
    if egress is not None and node_ip is None:
        node_ip = egress.source_seen  # the address the kernel gives it on its route's interface
    path = follow_path(verdict, pod_ip=args.source, node_ip=node_ip, cloud_nat=cloud_nat)
    defined_at = verdict.rule.where() if verdict.rule is not None else None if entry is None else entry.where()
    return {
        "destination": verdict.destination,
        "masquerade": verdict.masquerade,
        "matched": matched,
        "reason": verdict.reason.value,
        "rule_name": None if verdict.rule is None else verdict.rule.name,
        "action": None if verdict.rule is None else _ACTION_TEXT[verdict.rule.action],
        "snat_to": verdict.snat_to,
        "depends_on": list(verdict.depends_on),
        "if_matched_first": [_conditional(r) for r in verdict.conditional],
        "source_seen": path.source_seen,
        "source_after_node": path.source_after_node,
        "dropped": path.source_seen is None,
        "dropped_because": path.dropped_because,
        "path": list(path.hops),
        "rule": rule,
        "defined_at": defined_at,
        "explanation": _REASON_TEXT[verdict.reason],
        **({} if egress is None else {
            "egress_interface": egress.out_interface,
            "route": None if egress.route is None else egress.route.described,
            "node_address_reason": egress.undecided,
        }),
    }


def _conditional(rule: Rule) -> dict[str, Any]:
    """An earlier rule that decides instead when the fields not given match it."""
    return {"rule_name": rule.name, "defined_at": rule.where(), "action": _ACTION_TEXT[rule.action],
            "snat_to": rule.snat_to}


_SEEN_TEXT = {"pod": "the pod's IP", "node": "the node's IP"}


def _as_text(r: dict[str, Any]) -> str:
    if r["snat_to"] is not None:
        action = f"SNAT to {r['snat_to']}"
    else:
        action = "MASQUERADED to the node IP" if r["masquerade"] else "NOT masqueraded (keeps the pod IP)"
    # "pod"/"node": the address was not given (--source, --node-ip); the JSON keeps the word, the sentence names it
    source = _SEEN_TEXT.get(r["source_seen"], r["source_seen"])
    seen = f"the destination sees {source}" if not r["dropped"] else f"DROPPED: {r['dropped_because']}"
    if r.get("egress_interface"):
        seen += f" (leaving by {one_line(r['egress_interface'])}, {one_line(str(r['route']))})"
    elif r.get("node_address_reason"):
        seen += f" (the node's address not known: {one_line(r['node_address_reason'])})"
    if r["rule_name"] is not None:
        matched = f" Rule {r['rule_name']} ({r['defined_at']}) matched {r['matched']}."
    else:
        matched = f" Matched {r['matched']} ({r['defined_at']})." if r["matched"] else ""
    text = f"{r['destination']}: {action}; {seen}.{matched} Why: {r['explanation']}."
    if r["depends_on"]:
        earlier = "; ".join(f"rule {c['rule_name']} ({c['defined_at']}): "
                            + (f"snat to {c['snat_to']}" if c["snat_to"] else c["action"])
                            for c in r["if_matched_first"])
        text += (f" Depends on {'/'.join(r['depends_on'])} (not given): that answer is for packets that "
                 f"these earlier rules do not match: {earlier}.")
    return text
