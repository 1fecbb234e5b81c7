"""A pod's packet as the rules see it, and what happens to it: the one Packet and the one Outcome of ipmasq.

`explain`, `diff`, `lint`, `trace` and `check` all ask "what does the node do to this packet"; they ask it of the
same Packet and answer with the same Outcome, whether the answer comes from the policy (what the config says) or
from a walk of the node's rules (what the kernel does).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

from ipmasq.prefix import Family, Prefix, format_address, parse_address

__all__ = ["Outcome", "Packet"]


class Outcome(Enum):
    """What the destination sees as the packet's source."""

    PRESERVE = "preserve"  # the pod's own address: the source leaves unchanged
    MASQUERADE = "masquerade"  # the node's address (the out interface's)
    SNAT = "snat"  # the address a snat rule names
    UNDECIDED = "undecided"  # the node's rules cannot tell from what is known of the packet (trace, check)
    MIXED = "mixed"  # of a range of packets: some are treated one way, some another (diff's probes)


@dataclass(frozen=True, slots=True)
class Packet:
    """What is known of a new connection's first packet at POSTROUTING; None (or empty): not known, and the answer
    then says which rules and fields it depends on rather than guessing.

    `source` is a set of prefixes the source lies in: one /32 (/128) for an exact address, a class of pod
    addresses for `check`, empty when unknown. The interfaces, the mark, `dnat` and the node's own addresses
    matter only to a walk of the kernel's rules (trace): the policy's rules test destination, source, protocol and
    port. `dnat`: the connection was addressed elsewhere (a Service's IP or node port) and destination-NATed to
    `destination` before POSTROUTING (conntrack's status dnat, which kube-proxy's nftables rules test); False: the
    pod connected to `destination` itself.
    """

    family: Family
    destination: int
    source: tuple[Prefix, ...] = ()
    protocol: str | None = None  # a name (tcp, udp, ...) or a number as text
    port: int | None = None  # the destination port
    source_port: int | None = None
    out_interface: str | None = None
    in_interface: str | None = None
    mark: int = 0
    local_addresses: tuple[int, ...] = ()
    dnat: bool = False

    @classmethod
    def of(cls, destination: str, *, source: str | None = None, out_interface: str | None = None,
           in_interface: str | None = None, protocol: str | None = None, mark: int = 0,
           local_addresses: Sequence[str] = (), port: int | None = None,
           source_port: int | None = None, dnat: bool = False) -> Packet:
        """From text (ValueError on an address that does not parse or a family mix)."""
        family, dest = parse_address(destination)
        sources: tuple[Prefix, ...] = ()
        if source is not None:
            source_family, address = parse_address(source)
            if source_family is not family:
                raise ValueError(f"source {source} and destination {destination} are of different families")
            sources = (Prefix(family, address, family.bits),)
        local = []
        for text in local_addresses:
            local_family, address = parse_address(text)
            if local_family is family:
                local.append(address)
        return cls(family, dest, sources, None if protocol is None else protocol.lower(), port, source_port,
                   out_interface, in_interface, mark, tuple(local), dnat)

    @classmethod
    def exact(cls, family: Family, destination: int, source: int | None = None, protocol: str | None = None,
              port: int | None = None) -> Packet:
        """From numbers: an exact source address, or None."""
        return cls(family, destination, () if source is None else (Prefix(family, source, family.bits),), protocol,
                   port)

    @property
    def source_address(self) -> int | None:
        """The source when it is one exact address."""
        if len(self.source) == 1 and self.source[0].length == self.family.bits:
            return self.source[0].network
        return None

    @property
    def exact_source(self) -> str | None:
        address = self.source_address
        return None if address is None else format_address(self.family, address)

    def source_within(self, prefixes: Sequence[Prefix]) -> bool | None:
        """Whether the source lies in `prefixes`: None when that is not known (no source given, or a class of
        sources only part of which lies there)."""
        if not self.source:
            return None
        if all(any(p.covers(s) for p in prefixes) for s in self.source):
            return True
        if not any(p.covers(s) or s.covers(p) for p in prefixes for s in self.source):
            return False
        return None
