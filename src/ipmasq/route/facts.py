"""What a node's routing is made of, as values: links with their addresses, ip rules, routes.

Each value keeps the text a person reads (`ip rule`'s and `ip route`'s words) so that an answer can name what
decided it. The values are what iproute2's JSON says (ipmasq.route.iproute2 reads them); a field the JSON held
that this model does not know is kept in `unknown`, and a rule or route carrying one cannot be decided when the
lookup reaches it: it is never silently taken as matching or not.

Tables are named as iproute2 names them: "local" (255), "main" (254), "default" (253), else the number or the
name /etc/iproute2/rt_tables gives it, as text.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from ipmasq.prefix import Family, Prefix, format_address

__all__ = ["TABLE_NAMES", "Address", "IpRule", "Link", "NextHop", "Route", "Routing", "table_name"]

TABLE_NAMES = {"255": "local", "254": "main", "253": "default", "0": "unspec"}

# The scopes of an address or a route, as the kernel numbers them (RT_SCOPE_*): a smaller number reaches further.
SCOPES = {"global": 0, "universe": 0, "site": 200, "link": 253, "host": 254, "nowhere": 255}


def table_name(text: str) -> str:
    """A table as iproute2 prints it: the reserved numbers by their names, any other as given."""
    return TABLE_NAMES.get(text, text)


@dataclass(frozen=True, slots=True)
class Address:
    """One address of a link, in the order the kernel keeps them (the order `ip addr` lists them: IPv4 primaries
    by scope then secondaries; IPv6 sorted by scope, newest first within one).

    `peer`: the other end of a point-to-point address (`ip addr add A peer B`), whose subnet then says which
    destinations the address is "on the link" for; `flags`: iproute2's words (secondary, tentative, deprecated,
    temporary, optimistic, dadfailed, nodad, ...)."""

    family: Family
    address: int
    prefix_length: int
    scope: int = 0
    flags: frozenset[str] = frozenset()
    peer: int | None = None

    @property
    def secondary(self) -> bool:
        return "secondary" in self.flags

    @property
    def text(self) -> str:
        return format_address(self.family, self.address)

    def on_subnet(self, address: int) -> bool:
        """`address` lies in this address's subnet (the kernel's inet_ifa_match: the peer's, on a point-to-point
        address)."""
        base = self.address if self.peer is None else self.peer
        shift = self.family.bits - self.prefix_length
        return (base >> shift) == (address >> shift)


@dataclass(frozen=True, slots=True)
class Link:
    """A network interface: its index (the kernel's device order), name, state and addresses."""

    index: int
    name: str
    up: bool = True
    addresses: tuple[Address, ...] = ()
    master: str | None = None  # a bridge or VRF it is enslaved to
    group: str = "default"

    def of_family(self, family: Family) -> tuple[Address, ...]:
        return tuple(a for a in self.addresses if a.family is family)


@dataclass(frozen=True, slots=True)
class IpRule:
    """One policy routing rule (`ip rule`), of one family.

    `action`: "lookup" (in `table`), "goto" (to the first rule of priority `goto`), "nop", "blackhole",
    "unreachable" or "prohibit". Selectors left None do not test anything; `iif`/`oif` name a device (a rule whose
    device is gone tests nothing that exists: `iif_detached`). `ports`: inclusive ranges; `uid_range`: inclusive.
    `unknown`: fields of the JSON this model does not know (the lookup cannot decide such a rule)."""

    family: Family
    priority: int
    action: str = "lookup"
    table: str | None = None
    goto: int | None = None
    invert: bool = False
    source: Prefix | None = None
    destination: Prefix | None = None
    fwmark: int | None = None
    fwmask: int = 0xFFFFFFFF
    iif: str | None = None
    iif_detached: bool = False
    oif: str | None = None
    oif_detached: bool = False
    ipproto: int | None = None
    sport: tuple[int, int] | None = None
    dport: tuple[int, int] | None = None
    uid_range: tuple[int, int] | None = None
    tos: int | None = None
    suppress_prefixlength: int | None = None
    suppress_ifgroup: str | None = None
    l3mdev: bool = False
    unknown: tuple[str, ...] = ()
    text: str = ""  # as `ip rule` prints it: "32765: from 10.44.0.0/14 to 172.30.0.0/16 lookup 100"


class NextHop(NamedTuple):
    """Where a route sends a packet: a gateway (None: the destination is on the link) and a device; a multipath
    route has several, each with its weight. `gateway_family` differs from the route's for an IPv4 route via an
    IPv6 gateway. A NamedTuple, as Route: a node of 100,000 routes makes as many."""

    gateway: int | None = None
    device: str | None = None
    weight: int = 1
    flags: frozenset[str] = frozenset()
    gateway_family: Family | None = None

    def text(self, family: Family) -> str:
        parts = []
        if self.gateway is not None:
            parts.append(f"via {format_address(self.gateway_family or family, self.gateway)}")
        if self.device is not None:
            parts.append(f"dev {self.device}")
        return " ".join(parts)


class Route(NamedTuple):
    """One route of one table. `kind`: unicast, local, broadcast, anycast, multicast, blackhole, unreachable,
    prohibit, throw, nat; `metric`: the priority (lower wins among routes to one prefix); `preferred_source`: the
    route's `src`, which a locally made packet takes and MASQUERADE does not; `source_prefix`: an IPv6 route's
    `from` (source-specific routing). `unknown`: fields this model does not know (such a route cannot be
    decided when it would be chosen). A NamedTuple because a node of 100,000 routes makes as many (a frozen
    dataclass costs twice the time to build: docs/measurements.md)."""

    family: Family
    table: str
    destination: Prefix
    kind: str = "unicast"
    metric: int = 0
    scope: int = 0
    nexthops: tuple[NextHop, ...] = ()
    preferred_source: int | None = None
    tos: int | None = None
    source_prefix: Prefix | None = None
    unknown: tuple[str, ...] = ()
    text: str = ""  # as `ip route` prints it, with its table: "172.30.0.0/16 via 192.168.20.1 dev eth1 table 100"


@dataclass(frozen=True, slots=True)
class Routing:
    """A node's routing, both families: rules (any order: the lookup sorts them by priority, stably, as the
    kernel keeps them), routes of every table, and links with their addresses in the kernel's device order.

    `read`: what was read, for the answer to say what it does not know ("rules", "routes", "links"); a Routing of
    only links (addresses) still tells MASQUERADE's address when the out interface is given."""

    rules: tuple[IpRule, ...] = ()
    routes: tuple[Route, ...] = ()
    links: tuple[Link, ...] = ()
    read: frozenset[str] = field(default_factory=lambda: frozenset({"rules", "routes", "links"}))

    def link(self, name: str) -> Link | None:
        for link in self.links:
            if link.name == name:
                return link
        return None

    def local_addresses(self, family: Family) -> tuple[int, ...]:
        """Every address of the node's links (what `-m addrtype --dst-type LOCAL` calls local), of one family."""
        return tuple(a.address for link in self.links for a in link.addresses if a.family is family)
