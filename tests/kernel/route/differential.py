"""The path model against the kernel on generated nodes: a hypothesis strategy of topologies, values that print as
the ip and iptables commands that build them (tests/kernel/route/differential_kernel.py builds them in namespaces
and compares each probe's answer twice, with `ip route get` and with the source a real TCP peer saw).

A topology: a node namespace with 1-3 uplinks (a veth each to a peer namespace; one to three addresses on each, in
one or two subnets, so some are secondary), a pod namespace behind a veth, ip rules of every selector and action
this model reads, routes of every type in a few tables, nat POSTROUTING (MASQUERADE, SNAT, RETURN) and mangle
PREROUTING MARK rules, and probes: a destination and a port. Every peer holds every destination (on its link's
device: IPv6 answers a neighbour solicitation only for the receiving device's addresses, and a route without a
gateway resolves the destination itself on the link) and listens on every port, so the peer that accepts a
connection is the uplink the kernel chose, and the source it saw is the answer to compare with the model's
`source_seen`.

What the generator keeps out, and why (the model's scope, or the harness's):
- the fixed rule `5: to POD-SUBNET lookup main`: the peers' replies must find the pod whatever the random rules say
  (the kernel's source validation of a forwarded packet, with custom rules, looks the pod's address up and refuses
  the packet when that gives anything but a unicast route), and the model's reverse lookup of the in-interface
  takes the same way; rules of their own start at priority 10;
- destinations are never on a link's subnet or the node's own (but one probe may ask `ip route get` about a node's
  address: the local route), so a packet that leaves reaches a peer that holds it;
- gateways are the peers' addresses on the uplink's subnets, SNAT's --to-source a node address or one address no
  link holds (the peers route it back to the node by their default route);
- no `oif`, `uidrange`, `tos`, sport rules or TOS routes: a forwarded pod packet has no socket and no out device
  (the model answers those without asking), and TOS is not set by the probe;
- what the kernel refuses to add is not generated: a route twice, a rule the kernel takes for one it holds (see
  Topology._rules), an IPv6 multipath next hop without a gateway, an IPv6 route's src not on its device, `! -d`
  of the whole space; routes are added before rules, whose lookups the kernel's check of a gateway goes through.
  Anything it still refuses is reported (`rejected`) and is simply not part of that node: the model reads the
  node live.

A multipath route's hops: the kernel's hash picks one, so `ip route get`'s must be one of the model's, and the
peer that saw a connection one of the hops' devices; when the hops differ in the source, the model says it cannot
know and that probe is skipped (counted, with the model's reason).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st

from ipmasq.prefix import Family

__all__ = ["PORTS", "Topology", "plain", "topologies"]

PORTS = (80, 443, 5432)
TABLES = ("100", "101", "main", "102")
MARKS = (0x0, 0x1, 0x2, 0x80, 0x81)
MASKS = (0xFFFFFFFF, 0xFF, 0x80, 0x1, 0x3)

@dataclass(frozen=True)
class RuleSpec:
    priority: int
    action: str  # lookup, goto, blackhole, prohibit, unreachable
    table: str = "main"
    goto: int = 0
    invert: bool = False
    source: str | None = None
    to: tuple[int, int] | None = None  # (destination index, prefix length)
    fwmark: tuple[int, int] | None = None
    iif: str | None = None
    ipproto: str | None = None
    dport: tuple[int, int] | None = None
    suppress: int | None = None


@dataclass(frozen=True)
class Hop:
    uplink: int
    gateway: int | None  # index among the peer's addresses on that uplink; None: on the link (dev only)


@dataclass(frozen=True)
class RouteSpec:
    table: str
    to: tuple[int, int] | None  # None: default
    kind: str = "unicast"  # unicast, blackhole, unreachable, prohibit, throw
    hops: tuple[Hop, ...] = ()
    metric: int | None = None
    src: int | None = None  # index among the node's uplink addresses


@dataclass(frozen=True)
class NatSpec:
    target: str  # MASQUERADE, SNAT, RETURN
    to: tuple[int, int] | None = None
    negate: bool = False
    out: int | None = None
    dport: int | None = None
    snat: int = -1  # index among the node's uplink addresses; -1: the address no link holds


@dataclass(frozen=True)
class MarkSpec:
    value: int
    mask: int
    to: tuple[int, int] | None = None
    dport: int | None = None
    from_pod: bool = False


@dataclass(frozen=True)
class Topology:
    """A generated node. Its repr is the script that builds it (hypothesis prints it for a failing example)."""

    family: Family
    pod_host: int
    uplinks: tuple[tuple[tuple[int, int, int], ...], ...]  # per uplink: (subnet, host, style) per address
    destinations: tuple[tuple[int, int, int, int], ...]
    probes: tuple[tuple[int, int], ...]  # (destination index, port)
    rules: tuple[RuleSpec, ...] = ()
    routes: tuple[RouteSpec, ...] = ()
    nat: tuple[NatSpec, ...] = ()
    mangle: tuple[MarkSpec, ...] = ()
    local_probe: bool = False

    # addresses -------------------------------------------------------------------------------------------------
    @property
    def v6(self) -> bool:
        return self.family is Family.V6

    @property
    def length(self) -> int:
        return 64 if self.v6 else 24

    def _subnet(self, uplink: int, subnet: int, style: int) -> str:
        if not self.v6:
            return f"192.168.{10 * (uplink + 1) + subnet}."
        return (f"fd1{uplink}:{subnet}::", f"2001:db8:1{uplink}:{subnet}::", f"3fff:1{uplink}:{subnet}::")[style]

    def node_addresses(self, uplink: int) -> list[str]:
        """The node's addresses on the uplink, in the order they are added."""
        return [plain(f"{self._subnet(uplink, s, style)}{host:x}" if self.v6 else
                       f"{self._subnet(uplink, s, style)}{host}") for s, host, style in self.uplinks[uplink]]

    def all_node_addresses(self) -> list[str]:
        return [a for i in range(len(self.uplinks)) for a in self.node_addresses(i)]

    def peer_addresses(self, uplink: int) -> list[str]:
        """The peer's addresses: host 1 of each subnet the node has there, in the node's order."""
        seen: dict[tuple[int, int], str] = {}
        for s, _, style in self.uplinks[uplink]:
            if (s, style) not in seen:
                seen[(s, style)] = plain(f"{self._subnet(uplink, s, style)}1")
        return list(seen.values())

    @property
    def pod(self) -> str:
        return f"fd44::{self.pod_host:x}" if self.v6 else f"10.44.0.{self.pod_host}"

    @property
    def pod_gateway(self) -> str:
        return "fd44::1" if self.v6 else "10.44.0.1"

    @property
    def pod_subnet(self) -> str:
        return "fd44::/64" if self.v6 else "10.44.0.0/24"

    @property
    def snat_only(self) -> str:
        return "fd99::1" if self.v6 else "198.51.100.1"

    def destination(self, index: int) -> str:
        style, a, b, c = self.destinations[index % len(self.destinations)]
        if not self.v6:
            return f"100.{64 + a}.{b}.{c}"
        return plain((f"fdff:{a}:{b}::{c:x}", f"2001:db8:ff{a}:{b}::{c:x}", f"3fff:ff{a}:{b}::{c:x}")[style])

    def prefix(self, to: tuple[int, int] | None) -> str:
        if to is None:
            return "::/0" if self.v6 else "0.0.0.0/0"
        index, length = to
        return str(ipaddress.ip_network(f"{self.destination(index)}/{length}", strict=False))

    def _source(self, choice: str) -> str:
        return {"pod": f"{self.pod}/{128 if self.v6 else 32}", "subnet": self.pod_subnet,
                "wide": "fd00::/8" if self.v6 else "10.0.0.0/8", "other": "fd98::/16" if self.v6 else "10.99.0.0/16",
                }[choice]

    def probe_packets(self) -> list[tuple[str, int]]:
        return [(self.destination(d), port) for d, port in self.probes]

    # commands --------------------------------------------------------------------------------------------------
    def node_batch(self, peers: Sequence[str], pod: str) -> list[str]:
        """`ip -batch` lines for the node (peers and pod: their namespaces' names)."""
        lines = [f"link add pod0 type veth peer name eth0 netns {pod}", f"addr add {self.pod_gateway}/{self.length} "
                 f"dev pod0{' nodad' if self.v6 else ''}", "link set pod0 up"]
        for i, peer in enumerate(peers):
            lines.append(f"link add up{i} type veth peer name eth0 netns {peer}")
            lines += [f"addr add {a}/{self.length} dev up{i}{' nodad' if self.v6 else ''}"
                      for a in self.node_addresses(i)]
            lines.append(f"link set up{i} up")
        # routes before rules: the kernel checks a gateway by a lookup, through the rules when the route's table
        # has no way to it, and a rule of the topology would refuse it (No route to host)
        lines += self._routes()
        lines.append(f"rule add priority 5 to {self.pod_subnet} lookup main")
        return lines + self._rules()

    def _rules(self) -> list[str]:
        """The rules the kernel takes: it refuses one that "exists" (File exists), and its comparison leaves out
        `not` and a goto's target, and compares from and to only when the new rule names them."""
        kept: list[tuple[tuple[object, ...], str | None, str | None]] = []
        out = []
        for rule in self.rules:
            lookup = rule.action == "lookup"
            fields = (rule.priority, rule.action, rule.table if lookup else None, rule.fwmark, rule.iif, rule.ipproto,
                      rule.dport, rule.suppress if lookup else None)
            source = None if rule.source is None else self._source(rule.source)
            to = self.prefix(rule.to) if rule.to is not None and rule.to[1] > 0 else None
            if any(f == fields and source in (None, s) and to in (None, t) for f, s, t in kept):
                continue
            kept.append((fields, source, to))
            out.append(self._rule(rule))
        return out

    def _routes(self) -> list[str]:
        """One route per table, prefix and metric: the kernel refuses a second (File exists)."""
        kept: dict[tuple[str, str, int], str] = {}
        for route in self.routes:
            metric = route.metric if route.metric is not None else (1024 if self.v6 else 0)
            kept.setdefault((route.table, self.prefix(route.to), metric), self._route(route))
        return list(kept.values())

    def _rule(self, rule: RuleSpec) -> str:
        words = ["rule add priority", str(rule.priority)]
        if rule.invert:
            words.append("not")
        if rule.source is not None:
            words += ["from", self._source(rule.source)]
        if rule.to is not None and rule.to[1] > 0:  # `to ::/0` is no selector: the same rule as without it
            words += ["to", self.prefix(rule.to)]
        if rule.fwmark is not None:
            words += ["fwmark", f"{rule.fwmark[0]:#x}/{rule.fwmark[1]:#x}"]
        if rule.iif is not None:
            words += ["iif", rule.iif]
        if rule.ipproto is not None:
            words += ["ipproto", rule.ipproto]
        if rule.dport is not None:
            low, high = rule.dport
            words += ["dport", str(low) if low == high else f"{low}-{high}"]
        if rule.action == "lookup":
            words += ["lookup", rule.table]
            if rule.suppress is not None:
                words += ["suppress_prefixlength", str(rule.suppress)]
        elif rule.action == "goto":
            words += ["goto", str(rule.goto)]
        else:
            words.append(rule.action)
        return " ".join(words)

    def _hop(self, hop: Hop) -> str:
        uplink = hop.uplink % len(self.uplinks)
        if hop.gateway is None:
            return f"dev up{uplink}"
        peers = self.peer_addresses(uplink)
        return f"via {peers[hop.gateway % len(peers)]} dev up{uplink}"

    def _route(self, route: RouteSpec) -> str:
        words = ["route add"]
        if route.kind != "unicast":
            words.append(route.kind)
        words.append(self.prefix(route.to))
        hops = list(dict.fromkeys(self._hop(h) for h in route.hops))  # one next hop twice: refused
        if route.kind == "unicast" and len(hops) == 1:
            words.append(hops[0])
        if route.kind == "unicast" and route.src is not None and not (self.v6 and len(hops) > 1):
            # IPv6 takes a route's src only from its device's addresses (IPv4 from any of the node's)
            addresses = self.node_addresses(route.hops[0].uplink % len(self.uplinks)) if self.v6 else \
                self.all_node_addresses()
            words += ["src", addresses[route.src % len(addresses)]]
        words += ["table", route.table]
        if route.metric is not None:
            words += ["metric", str(route.metric)]
        if route.kind == "unicast" and len(hops) > 1:
            words += [f"nexthop {h}" for h in hops]
        return " ".join(words)

    def peer_batch(self, uplink: int) -> list[str]:
        lines = [f"addr add {a}/{self.length} dev eth0{' nodad' if self.v6 else ''}"
                 for a in self.peer_addresses(uplink)]
        lines.append("link set eth0 up")
        lines.append(f"route add {'::/0' if self.v6 else 'default'} via {self.node_addresses(uplink)[0]}")
        bits = 128 if self.v6 else 32
        lines += [f"addr add {self.destination(i)}/{bits} dev eth0{' nodad' if self.v6 else ''}"
                  for i in range(len(self.destinations))]
        return lines

    def pod_batch(self) -> list[str]:
        return [f"addr add {self.pod}/{self.length} dev eth0{' nodad' if self.v6 else ''}", "link set eth0 up",
                f"route add {'::/0' if self.v6 else 'default'} via {self.pod_gateway}"]

    def restore(self) -> str:
        """iptables-restore's input: nat POSTROUTING and mangle PREROUTING."""
        lines = ["*nat", ":PREROUTING ACCEPT [0:0]", ":INPUT ACCEPT [0:0]", ":OUTPUT ACCEPT [0:0]",
                 ":POSTROUTING ACCEPT [0:0]"]
        addresses = self.all_node_addresses()
        for rule in self.nat:
            words = ["-A POSTROUTING"]
            if rule.to is not None:
                # `! -d 0.0.0.0/0` is refused by iptables-nft: a negated prefix is never the whole space
                negate = rule.negate and rule.to[1] > 0
                words += (["!"] if negate else []) + ["-d", self.prefix(rule.to)]
            if rule.out is not None:
                words += ["-o", f"up{rule.out % len(self.uplinks)}"]
            if rule.dport is not None:
                words += ["-p", "tcp", "--dport", str(rule.dport)]
            words += ["-j", rule.target]
            if rule.target == "SNAT":
                words += ["--to-source", self.snat_only if rule.snat < 0 else addresses[rule.snat % len(addresses)]]
            lines.append(" ".join(words))
        lines += ["COMMIT", "*mangle", ":PREROUTING ACCEPT [0:0]", ":INPUT ACCEPT [0:0]", ":FORWARD ACCEPT [0:0]",
                  ":OUTPUT ACCEPT [0:0]", ":POSTROUTING ACCEPT [0:0]"]
        for mark in self.mangle:
            words = ["-A PREROUTING"]
            if mark.from_pod:
                words += ["-s", self.pod_subnet]
            if mark.to is not None:
                words += ["-d", self.prefix(mark.to)]
            if mark.dport is not None:
                words += ["-p", "tcp", "--dport", str(mark.dport)]
            words += ["-j", "MARK", "--set-xmark", f"{mark.value:#x}/{mark.mask:#x}"]
            lines.append(" ".join(words))
        lines.append("COMMIT")
        return "\n".join(lines) + "\n"

    def script(self) -> str:
        """The topology as the commands that build it."""
        ip = "ip -6" if self.v6 else "ip -4"
        peers = [f"peer{i}" for i in range(len(self.uplinks))]
        out = [f"# IPv{self.family.value}: pod {self.pod}; probes (tcp): "
               + ", ".join(f"{d} port {p}" for d, p in self.probe_packets())
               + (f", ip route get {self.all_node_addresses()[0]} (local)" if self.local_probe else "")]
        out += [f"node: {ip} {line}" for line in self.node_batch(peers, "pod")]
        for i in range(len(self.uplinks)):
            out += [f"peer{i}: {ip} {line}" for line in self.peer_batch(i)]
        out += [f"pod: {ip} {line}" for line in self.pod_batch()]
        tool = "ip6tables-restore" if self.v6 else "iptables-restore"
        out += [f"node: {tool} <<", *("    " + line for line in self.restore().splitlines())]
        return "\n".join(out)

    def __repr__(self) -> str:
        return "Topology(\n" + self.script() + "\n)"

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(repr(self))  # hypothesis prints a failing example by its pretty printer: the commands


# the strategy ----------------------------------------------------------------------------------------------------

def _to(family: Family) -> st.SearchStrategy[tuple[int, int]]:
    lengths = (0, 16, 32, 48, 64, 128) if family is Family.V6 else (0, 10, 16, 24, 25, 32)
    return st.tuples(st.integers(0, 3), st.sampled_from(lengths))


@st.composite
def topologies(draw: st.DrawFn, family: Family) -> Topology:
    """A node of `family` (see the module docstring); shrinks towards one uplink, one probe, nothing else."""
    v6 = family is Family.V6
    uplink_count = draw(st.integers(1, 3))
    uplinks = []
    for _ in range(uplink_count):
        styles = draw(st.tuples(st.integers(0, 2), st.integers(0, 2))) if v6 else (0, 0)
        addresses = draw(st.lists(st.tuples(st.integers(0, 1), st.sampled_from((2, 99, 150))), min_size=1,
                                  max_size=3, unique=True))
        uplinks.append(tuple((s, host, styles[s]) for s, host in addresses))
    destinations = draw(st.lists(st.tuples(st.integers(0, 2) if v6 else st.just(0), st.integers(0, 1),
                                           st.integers(0, 3), st.sampled_from((10, 1, 129, 200))),
                                 min_size=1, max_size=4, unique=True))
    probes = draw(st.lists(st.tuples(st.integers(0, len(destinations) - 1), st.sampled_from(PORTS)), min_size=1,
                           max_size=4, unique=True))
    to = _to(family)
    suppress = st.sampled_from((0, 48, 64) if v6 else (0, 16, 24))
    priority = st.sampled_from(range(10, 70, 5))

    @st.composite
    def rule(draw: st.DrawFn) -> RuleSpec:
        action = draw(st.sampled_from(("lookup", "lookup", "lookup", "goto", "blackhole", "prohibit",
                                       "unreachable")))
        at = draw(priority)
        low = draw(st.sampled_from(PORTS))
        return RuleSpec(
            at, action, draw(st.sampled_from(TABLES)), at + draw(st.sampled_from((5, 10, 15, 7))),
            draw(st.booleans()) if draw(st.integers(0, 5)) == 0 else False,
            draw(st.none() | st.sampled_from(("pod", "subnet", "wide", "other"))),
            draw(st.none() | to),
            draw(st.none() | st.tuples(st.sampled_from(MARKS), st.sampled_from(MASKS))),
            draw(st.none() | st.sampled_from(("pod0", "up0", "lo"))),
            draw(st.none() | st.sampled_from(("tcp", "udp"))),
            draw(st.none() | st.sampled_from([(low, low), (80, 443), (444, 6000), (1000, 9000)])),
            draw(st.none() | suppress) if action == "lookup" else None)

    hop = st.builds(Hop, st.integers(0, 2), st.none() | st.integers(0, 1))

    @st.composite
    def route(draw: st.DrawFn) -> RouteSpec:
        kind = draw(st.sampled_from(("unicast", "unicast", "unicast", "blackhole", "unreachable", "prohibit",
                                     "throw")))
        hops: tuple[Hop, ...] = ()
        if kind == "unicast":
            hops = tuple(draw(st.lists(hop, min_size=1, max_size=2)))
            if len(hops) > 1 and v6:
                # IPv6 refuses a multipath route with a device-only next hop
                hops = tuple(Hop(h.uplink, h.gateway or 0) for h in hops)
        return RouteSpec(draw(st.sampled_from(TABLES)), draw(st.none() | to), kind, hops,
                         draw(st.none() | st.sampled_from((5, 10))),
                         draw(st.none() | st.integers(0, 5)) if kind == "unicast" else None)

    nat = st.builds(NatSpec, st.sampled_from(("MASQUERADE", "SNAT", "RETURN")), st.none() | to, st.booleans(),
                    st.none() | st.integers(0, 2), st.none() | st.sampled_from(PORTS), st.integers(-1, 5))
    mark = st.builds(MarkSpec, st.sampled_from(MARKS[1:]), st.sampled_from(MASKS), st.none() | to,
                     st.none() | st.sampled_from(PORTS), st.booleans())
    routes = draw(st.lists(route(), max_size=6))
    return Topology(
        family, draw(st.sampled_from((5, 77))), tuple(uplinks), tuple(destinations), tuple(probes),
        tuple(draw(st.lists(rule(), max_size=5))), tuple(routes), tuple(draw(st.lists(nat, max_size=4))),
        tuple(draw(st.lists(mark, max_size=3))), draw(st.booleans()))


def plain(address: str) -> str:
    """An address as iproute2 and the model print it (fdff:0:0::81 is fdff::81; a mapped IPv4 address plain)."""
    return str(ipaddress.ip_address(address.removeprefix("::ffff:")))
