"""Which source address a destination sees from a pod: the whole path of a new connection's first packet through
the node, before the fact, pure.

    path(node: PathFacts, packet: Packet, *, cloud_nat=None) -> PathAnswer

The packet is a pod's (Packet: destination, exact source, protocol, ports, and where known the in-interface and the
mark it arrives with). Its path, each step naming what decided it:

1. mangle and nat PREROUTING (ipmasq.diagnose.mangle): iptables' mangle table and its nat table's PREROUTING
   (legacy or nft, from iptables-save) and every nftables base chain at the prerouting hook of type filter or nat,
   in priority order: MARK, CONNMARK (a new connection's conntrack mark starts at 0, so a restore gives the packet
   the bits a rule of this walk saved), `meta mark set`, `ct mark set`; a DNAT there (a Service) asks for the
   endpoint, traced with --service;
2. the in-interface: given, or the device of the route back to the pod (the reverse lookup);
3. the routing decision (ipmasq.route.lookup): ip rules in priority order, each table's longest prefix and
   metric, the route's type; a multipath route is "one of" its next hops;
4. nat POSTROUTING, as `ipmasq trace` walks it (ipmasq.diagnose.hooks: iptables' nat POSTROUTING and every
   nftables nat chain there, by priority), with the route's out interface and the node's addresses;
5. the address MASQUERADE takes (ipmasq.route.address: inet_select_addr on the next hop; IPv6's source address
   selection on the destination) or SNAT's --to-source;
6. a Cloud NAT gateway behind the node (ipmasq.cloudnat), when one is given.

A route of type local, broadcast, anycast or multicast delivers the packet to the node: it never reaches the nat
POSTROUTING hook, and the node sees the pod's address. A blackhole, unreachable or prohibit route or rule, or no
route, drops it: no destination sees it (`delivered` False). What cannot be decided (a cgroup or socket match, an
expression the walkers do not know, a rule on a field not given, which hop of a multipath route when the hops
differ) makes `source_seen` None and `undecided` says why and which field (flag) to give: never a guess.

`PathFacts` is everything the answer depends on, read from one node (live: ipmasq.diagnose.path_sources; offline:
dumps). Overrides: `packet.out_interface` replaces the route's device for the nat walk and the address;
`packet.local_addresses`' first is taken as the masquerade address (as `trace --local-address` always has).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from ipmasq.cloudnat import CloudNat, is_internet
from ipmasq.diagnose.hooks import IPTABLES_NFT_TABLES, NatHook, iptables_hook, walk_hooks
from ipmasq.diagnose.mangle import walk_mangle
from ipmasq.diagnose.rule_match import PROTOCOL_NUMBERS
from ipmasq.diagnose.trace import Tracer, TraceResult
from ipmasq.diagnose.trace_nft import NftTracer
from ipmasq.errors import NftTraceError
from ipmasq.netfilter.iptables import NatTable
from ipmasq.policy.packet import Outcome, Packet
from ipmasq.prefix import Family, format_address
from ipmasq.route.address import Selected, masquerade_v4, masquerade_v6
from ipmasq.route.facts import NextHop, Routing
from ipmasq.route.lookup import Fib, Flow, RouteDecision

__all__ = ["PathAnswer", "PathFacts", "PathStep", "masquerade_path", "path"]

_LOCAL_DELIVERY = frozenset({"local", "broadcast", "anycast", "multicast"})


@dataclass(frozen=True)
class PathFacts:
    """What one node holds that decides a pod packet's path: its routing (rules, routes, links and addresses;
    None: not read, then the out interface and the masquerade address must be given), its iptables nat and
    mangle tables by family (iptables-save, either variant), its `nft -j list ruleset` text, and whether that
    listing's `ip`/`ip6` nat and mangle tables are iptables-nft's (then read through iptables-save and walked in
    iptables' terms only)."""

    routing: Routing | None = None
    nat: Mapping[Family, NatTable] = field(default_factory=dict)
    mangle: Mapping[Family, NatTable] = field(default_factory=dict)
    nft_ruleset: str | None = None
    iptables_in_nft: bool = False


@dataclass(frozen=True, slots=True)
class PathStep:
    """One step of the path: `stage` (mangle, in-interface, rule, table, route, nat, masquerade, snat, cloud-nat),
    `decided_by` the rule, route or chain that decided (as the node prints it) and `result` what it did."""

    stage: str
    decided_by: str
    result: str


@dataclass(frozen=True, slots=True)
class PathAnswer:
    """What the destination sees, and why.

    `source_seen`: the address the destination sees (after a Cloud NAT gateway, when one was given); None exactly
    when `undecided` says why (a field to give, or that the packet is dropped on the node: `delivered` False).
    `mark`: the packet's mark after mangle and nat PREROUTING (the one the routing decision and nat see); `in_interface`
    and `out_interface`: the devices it came in and leaves by; `nexthop`: the route's gateway (or the destination
    on the link); both None for a multipath route whose hops differ in them (the source the same by every hop);
    `route` the routing decision, `nat` the nat POSTROUTING walk (None when the packet never reached
    it); `outcome` as `trace` speaks it (PRESERVE, MASQUERADE, SNAT, UNDECIDED)."""

    packet: Packet
    steps: tuple[PathStep, ...]
    outcome: Outcome
    source_seen: str | None
    undecided: str | None = None
    mark: int = 0
    in_interface: str | None = None
    out_interface: str | None = None
    nexthop: str | None = None
    route: RouteDecision | None = None
    nat: TraceResult | None = None
    delivered: bool = True
    masquerade_address: str | None = None
    notes: tuple[str, ...] = ()


def nat_walk(node: PathFacts, packet: Packet, *, record_steps: bool = True,
             nft: NftTracer | None = None) -> TraceResult:
    """The nat POSTROUTING hook as `trace` walks it: iptables' nat POSTROUTING of the packet's family and every
    nftables nat chain there, by priority (`nft`: the listing already parsed)."""
    table = node.nat.get(packet.family)
    if nft is None and node.nft_ruleset is not None:
        nft = NftTracer(node.nft_ruleset)
    hooks: list[NatHook] = []
    if table is not None:
        hook = iptables_hook(Tracer(table))
        if hook is not None:
            hooks.append(hook)
    if nft is not None:
        beside = IPTABLES_NFT_TABLES if (node.iptables_in_nft and table is not None) else frozenset()
        hooks += nft.hooks(packet.family, beside=beside)
    return walk_hooks(hooks, packet, record_steps=record_steps)


def path(node: PathFacts, packet: Packet, *, cloud_nat: CloudNat | None = None) -> PathAnswer:
    """The path of `packet` (a pod's new connection) through `node`, to the source its destination sees."""
    steps: list[PathStep] = []
    notes: list[str] = []
    source = packet.source_address
    if source is None:
        return PathAnswer(packet, (), Outcome.UNDECIDED, None, "the pod's address is not one exact address (give "
                          "--source)")
    routing = node.routing
    # a dump of addresses alone tells MASQUERADE's address, not the route: no lookup then (never "no route")
    fib = None if routing is None or "routes" not in routing.read else Fib(routing)
    in_interface = packet.in_interface
    if in_interface is None and fib is not None:
        # the route a reply takes to the pod: from the destination, as the node's own lookup would (a `from POD
        # lookup N` rule, AWS VPC CNI's, is for the pod's own packets and must not match here)
        back = fib.lookup(Flow(packet.family, source, packet.destination, iif="lo"))
        if back.forwarded and back.nexthops and back.nexthops[0].device is not None:
            in_interface = back.nexthops[0].device
            steps.append(PathStep("in-interface", back.described,
                                  f"the route back to the pod: in-interface {in_interface} (give --in-interface "
                                  "when the pod's packets arrive elsewhere)"))
    override = packet.local_addresses[0] if packet.local_addresses else None
    local = packet.local_addresses or (() if routing is None else routing.local_addresses(packet.family))
    arriving = replace(packet, in_interface=in_interface, local_addresses=local)

    try:  # parsed once: the mangle walk and every next hop's nat walk read it
        nft = None if node.nft_ruleset is None else NftTracer(node.nft_ruleset)
    except NftTraceError as exc:
        return _undecided(arriving, steps, notes, f"nft -j list ruleset: {exc}")
    mangled = walk_mangle(node.mangle.get(packet.family), nft, arriving, iptables_in_nft=node.iptables_in_nft,
                          nat=node.nat.get(packet.family))
    steps += [PathStep("mangle", s.decided_by, s.result) for s in mangled.steps]
    notes += mangled.notes
    if mangled.undecided is not None:
        return _undecided(arriving, steps, notes, mangled.undecided, mark=mangled.mark)
    if mangled.dropped is not None:
        return _dropped(arriving, steps, notes, mangled.dropped, mark=mangled.mark)
    marked = replace(arriving, mark=mangled.mark)

    decision: RouteDecision | None = None
    hops: tuple[NextHop, ...] = ()
    if fib is not None:
        protocol = None if packet.protocol is None else PROTOCOL_NUMBERS.get(
            packet.protocol, int(packet.protocol) if packet.protocol.isdigit() else -1)
        decision = fib.lookup(Flow(packet.family, packet.destination, source, in_interface, mangled.mark, protocol,
                                   packet.source_port, packet.port))
        steps += [PathStep(s.what, s.text, s.result) for s in decision.steps]
        if decision.kind == "undecided":
            return _undecided(marked, steps, notes, f"routing: {decision.undecided}", decision=decision,
                              mark=mangled.mark)
        if decision.kind in _LOCAL_DELIVERY:
            steps.append(PathStep("route", decision.described, f"{decision.kind}: delivered to the node itself, "
                                  "never through the nat POSTROUTING hook"))
            return PathAnswer(marked, tuple(steps), Outcome.PRESERVE, packet.exact_source, None, mangled.mark,
                              in_interface, None, None, decision, None, True, None, tuple(notes))
        if not decision.forwarded:
            what = "no route: network unreachable" if decision.kind == "no-route" else \
                f"{decision.kind}: {decision.described}"
            return _dropped(marked, steps, notes, f"the routing decision drops it ({what})", decision=decision,
                            mark=mangled.mark)
        hops = decision.nexthops
    if packet.out_interface is not None:
        # the override: the route's device (and its gateway, when on that device) replaced by the one given
        kept = [h for h in hops if h.device == packet.out_interface]
        hops = tuple(kept) or (NextHop(None, packet.out_interface),)
    if not hops:
        hops = (NextHop(None, None),)

    answers = [_hop(node, marked, hop, decision, override, nft) for hop in hops]
    distinct = {(a.outcome, a.source_seen, a.undecided) for a in answers}
    first = answers[0]
    if len(answers) > 1:
        listed = "; ".join(f"{_hop_text(packet.family, h)}: {a.source_seen or a.undecided}"
                           for h, a in zip(hops, answers, strict=True))
        if len(distinct) > 1:
            steps += [step for answer in answers for step in answer.steps]  # every hop's, not the first's alone
            return _undecided(marked, steps, notes, f"a multipath route: the kernel's hash of the flow picks one "
                              f"of its next hops, and they differ ({listed}); give --out-interface to ask about "
                              "one", decision=decision, mark=mangled.mark)
        notes.append(f"a multipath route: every next hop gives the same answer ({listed})")
    out_interface, nexthop = first.out_interface, first.nexthop
    if len({(a.out_interface, a.nexthop) for a in answers}) > 1:
        # the source is the same whichever hop the kernel's hash picks, the way out is not: naming the first hop's
        # device or gateway would be a guess (the kernel picks another for some flows)
        steps += [step for answer in answers for step in answer.steps]
        nexthop = None
        if len({a.out_interface for a in answers}) > 1:
            out_interface = None
            notes.append("it leaves by one of " + ", ".join(dict.fromkeys(str(a.out_interface) for a in answers))
                         + " (give --out-interface to ask about one)")
    else:
        steps += first.steps
    seen = first.source_seen
    undecided = first.undecided
    if seen is not None and cloud_nat is not None and is_internet(format_address(packet.family, packet.destination)):
        if cloud_nat.translates(seen):
            steps.append(PathStep("cloud-nat", f"Cloud NAT ({cloud_nat.mode.value})",
                                  f"{seen} translated to {cloud_nat.nat_ip}"))
            seen = cloud_nat.nat_ip
        else:
            steps.append(PathStep("cloud-nat", f"Cloud NAT ({cloud_nat.mode.value})",
                                  f"{seen} is not in its source ranges: dropped"))
            return _dropped(marked, steps, notes, f"Cloud NAT is set to {cloud_nat.mode.value}, which does not "
                            f"translate {seen}", decision=decision, mark=mangled.mark, nat=first.nat,
                            out_interface=out_interface)
    return PathAnswer(first.packet, tuple(steps), first.outcome, seen, undecided, mangled.mark, in_interface,
                      out_interface, nexthop, decision, first.nat, True, first.masquerade_address,
                      tuple(notes + list(first.notes)))


# what explain assumes of the node's nat table when it asks the routes: the policy said "masquerade"
_MASQUERADE_ALL = NatTable({"POSTROUTING": "ACCEPT"}, ["-A POSTROUTING -j MASQUERADE"])


def masquerade_path(routing: Routing, packet: Packet) -> PathAnswer:
    """The path of a packet the node masquerades (explain's policy said so): the routing decision, the interface
    it leaves by and the address MASQUERADE takes there; no mangle table (the packet's mark is as given)."""
    return path(PathFacts(routing, {packet.family: _MASQUERADE_ALL}), packet)


def _hop_text(family: Family, hop: NextHop) -> str:
    return hop.text(family) or "the link"


def _hop(node: PathFacts, packet: Packet, hop: NextHop, decision: RouteDecision | None,
         override: int | None, nft: NftTracer | None) -> PathAnswer:
    """The nat walk and the masquerade address for one next hop (a multipath route asks each)."""
    steps: list[PathStep] = []
    device = hop.device
    leaving = replace(packet, out_interface=device if packet.out_interface is None else packet.out_interface)
    if decision is not None and device is not None:
        steps.append(PathStep("route", decision.described, f"leaves by {device}"
                              + (f" via {format_address(hop.gateway_family or packet.family, hop.gateway)}"
                                 if hop.gateway is not None else "")))
    nexthop = hop.gateway if hop.gateway is not None and hop.gateway_family in (None, packet.family) \
        else packet.destination
    nexthop_text = format_address(packet.family, nexthop)
    nat = nat_walk(node, leaving, nft=nft)
    label = "the chain policy (ACCEPT)" if nat.decided_by is None else f"{nat.decided_label}: {nat.decided_by}"
    if nat.outcome is Outcome.UNDECIDED:
        steps.append(PathStep("nat", label, f"cannot decide: {nat.undecided_reason}"))
        return PathAnswer(leaving, tuple(steps), Outcome.UNDECIDED, None, f"nat: {nat.undecided_reason}",
                          nat.mark, packet.in_interface, device, nexthop_text, None, nat, True, None, nat.notes)
    if nat.outcome is Outcome.PRESERVE:
        steps.append(PathStep("nat", label, "source unchanged"))
        return PathAnswer(leaving, tuple(steps), Outcome.PRESERVE, packet.exact_source, None, nat.mark,
                          packet.in_interface, device, nexthop_text, None, nat, True, None, nat.notes)
    if nat.outcome is Outcome.SNAT:
        steps.append(PathStep("snat", label, f"SNAT to {nat.snat_to}"))
        return PathAnswer(leaving, tuple(steps), Outcome.SNAT, nat.snat_to, None, nat.mark, packet.in_interface,
                          device, nexthop_text, None, nat, True, None, nat.notes)
    steps.append(PathStep("nat", label, "masqueraded"))
    if override is not None:
        chosen: Selected = Selected(override, "the first --local-address given")
    else:
        chosen = _masquerade_address(node, packet, leaving.out_interface, nexthop)
    if chosen.address is None:
        reason = chosen.undecided or "no address"
        steps.append(PathStep("masquerade", leaving.out_interface or "?", f"cannot decide: {reason}"))
        return PathAnswer(leaving, tuple(steps), Outcome.MASQUERADE, None, f"masquerade address: {reason}",
                          nat.mark, packet.in_interface, device, nexthop_text, None, nat, True, None, nat.notes)
    address = format_address(packet.family, chosen.address)
    steps.append(PathStep("masquerade", f"{leaving.out_interface}'s addresses", f"{address}: {chosen.why}"))
    return PathAnswer(leaving, tuple(steps), Outcome.MASQUERADE, address, None, nat.mark, packet.in_interface,
                      device, nexthop_text, None, nat, True, address, nat.notes)


def _masquerade_address(node: PathFacts, packet: Packet, device: str | None, nexthop: int) -> Selected:
    if device is None:
        return Selected(None, "", "the out interface is not known (give --out-interface, or the node's routes)")
    if node.routing is None or "links" not in node.routing.read:
        return Selected(None, "", f"the addresses of {device} are not known (give --local-address, or the node's "
                        "addresses: ip -j addr)")
    if packet.family is Family.V4:
        return masquerade_v4(node.routing.links, device, nexthop)
    return masquerade_v6(node.routing.links, device, packet.destination)


def _undecided(packet: Packet, steps: list[PathStep], notes: list[str], why: str, *,
               decision: RouteDecision | None = None, mark: int = 0) -> PathAnswer:
    return PathAnswer(packet, tuple(steps), Outcome.UNDECIDED, None, why, mark, packet.in_interface,
                      packet.out_interface, None, decision, None, True, None, tuple(notes))


def _dropped(packet: Packet, steps: list[PathStep], notes: list[str], why: str, *,
             decision: RouteDecision | None = None, mark: int = 0, nat: TraceResult | None = None,
             out_interface: str | None = None) -> PathAnswer:
    return PathAnswer(packet, tuple(steps), Outcome.UNDECIDED, None, f"dropped: {why}", mark, packet.in_interface,
                      out_interface, None, decision, nat, False, None, tuple(notes))

