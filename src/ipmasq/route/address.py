"""The source address MASQUERADE gives a packet, as the kernel picks it.

IPv4 (nf_nat_masquerade_ipv4 → inet_select_addr(out, next hop, universe)): of the out interface's primary
addresses of global scope, in the kernel's order, the first whose subnet holds the next hop (the route's gateway,
else the destination), else the first of them; an interface with none falls back to the first primary global
address of any interface in device order. The route's `src` (its preferred source) is not used: it names the
source of packets the node itself makes.

IPv6 (nf_nat_masquerade_ipv6 → ipv6_dev_get_saddr(out, destination, 0)): RFC 6724's source address selection as
the kernel implements it. Candidates are every interface's addresses (only the out interface's for a link-local
or multicast destination), tentative ones left out; each rule in order prefers one: the destination itself,
the smallest scope that reaches the destination's, not deprecated, the out interface, the same label (the
default policy table: `ip addrlabel` changes are not read), not temporary (unless use_tempaddr >= 2: when that
changes the answer it is undecided), ORCHID alike, the longest common prefix (up to the candidate's prefix
length); on a tie, the first in device and address order.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from ipmasq.prefix import Family, format_address
from ipmasq.route.facts import Address, Link

__all__ = ["Selected", "masquerade_v4", "masquerade_v6"]

_LINK = 253
_HOST = 254


@dataclass(frozen=True, slots=True)
class Selected:
    """The address chosen (None: the kernel has none to give, the packet is dropped) and why, in words that name
    the interface and the kernel's rule that decided."""

    address: int | None
    why: str
    undecided: str | None = None


def masquerade_v4(links: tuple[Link, ...], device: str, nexthop: int) -> Selected:
    """inet_select_addr(device, nexthop, RT_SCOPE_UNIVERSE)."""
    shown_hop = format_address(Family.V4, nexthop)
    link = next((candidate for candidate in links if candidate.name == device), None)
    if link is None:
        return Selected(None, "", f"the out interface {device} is not among the node's links (ip -j addr)")
    fallback: Address | None = None
    for address in link.of_family(Family.V4):
        if address.secondary or address.scope > 0:
            continue
        if address.on_subnet(nexthop):
            return Selected(address.address, f"{device}'s first primary address whose subnet holds the next hop "
                            f"{shown_hop}: {address.text}/{address.prefix_length}")
        if fallback is None:
            fallback = address
    if fallback is not None:
        return Selected(fallback.address, f"{device}'s first primary address ({fallback.text}/"
                        f"{fallback.prefix_length}): none of its subnets holds the next hop {shown_hop}")
    for other in links:
        for address in other.of_family(Family.V4):
            if not address.secondary and address.scope not in (_LINK,) and address.scope <= 0:
                return Selected(address.address, f"{device} has no primary global IPv4 address: the first of the "
                                f"node's, {other.name}'s {address.text}")
    return Selected(None, "", f"no interface has a global IPv4 address: MASQUERADE drops the packet ({device} "
                    "ate my IP address)")


# RFC 6724's default policy table as the kernel holds it (net/ipv6/addrlabel.c), longest prefix first
_LABELS = sorted([
    ("::1", 128, 0), ("::", 0, 1), ("fc00::", 7, 5), ("fec0::", 10, 11), ("2002::", 16, 2), ("3ffe::", 16, 12),
    ("2001::", 32, 6), ("2001:10::", 28, 7), ("::ffff:0:0", 96, 4), ("::", 96, 3)], key=lambda x: -x[1])


def _v6(text: str) -> int:
    return int(ipaddress.IPv6Address(text))


_LABEL_TABLE = [(_v6(prefix), length, label) for prefix, length, label in _LABELS]
_ORCHID = (_v6("2001:10::"), 28)


def _label(address: int) -> int:
    for network, length, label in _LABEL_TABLE:
        if length == 0 or address >> (128 - length) == network >> (128 - length):
            return label
    return 1


def _scope(address: int) -> int:
    """__ipv6_addr_src_scope: 1 node-local (loopback), 2 link, 5 site, 14 global; a multicast address its own."""
    if address == 1:
        return 1
    if address >> 118 == 0x3FA:  # fe80::/10
        return 2
    if address >> 118 == 0x3FB:  # fec0::/10
        return 5
    if address >> 120 == 0xFF:
        return (address >> 112) & 0xF
    return 14


def _orchid(address: int) -> bool:
    return address >> (128 - _ORCHID[1]) == _ORCHID[0] >> (128 - _ORCHID[1])


def _common_prefix(a: int, b: int) -> int:
    return 128 - (a ^ b).bit_length()


_RULES = ("the destination's own address", "the smallest scope reaching the destination", "not deprecated",
          "on the out interface", "the destination's label", "not temporary", "ORCHID alike",
          "the longest common prefix")


def _scores(address: Address, link: Link, destination: int, out_index: int, dst_scope: int, dst_label: int,
            prefer_temporary: bool) -> tuple[int, ...]:
    scope = _scope(address.address)
    loopback = address.address == 1
    preferred = loopback or not ({"deprecated", "optimistic"} & address.flags)
    prefix = min(_common_prefix(address.address, destination), address.prefix_length)
    return (
        int(address.address == destination),
        -scope if scope >= dst_scope else scope - 128,
        int(preferred),
        int(link.index == out_index),
        int(_label(address.address) == dst_label),
        int(("temporary" not in address.flags) != prefer_temporary),
        int(_orchid(address.address) == _orchid(destination)),
        prefix,
    )


def _best(candidates: list[tuple[Address, Link]], destination: int, out_index: int,
          prefer_temporary: bool) -> tuple[Address, Link, int] | None:
    dst_scope = _scope(destination)
    dst_label = _label(destination)
    best: tuple[Address, Link, int] | None = None
    best_score: tuple[int, ...] = ()
    for address, link in candidates:
        score = _scores(address, link, destination, out_index, dst_scope, dst_label, prefer_temporary)
        if best is None:
            best, best_score = (address, link, -1), score
            continue
        for rule, (mine, theirs) in enumerate(zip(score, best_score, strict=True)):
            if mine > theirs:
                best, best_score = (address, link, rule), score
                break
            if mine < theirs:
                if best[2] < rule:
                    best = (best[0], best[1], rule)  # the rule that kept the leader ahead
                break
    return best


def masquerade_v6(links: tuple[Link, ...], device: str, destination: int) -> Selected:
    """ipv6_dev_get_saddr(net, device, destination, 0)."""
    out = next((candidate for candidate in links if candidate.name == device), None)
    if out is None:
        return Selected(None, "", f"the out interface {device} is not among the node's links (ip -j addr)")
    only_out = _scope(destination) <= 2 or destination >> 120 == 0xFF
    candidates = [(address, link) for link in (links if not only_out else (out,))
                  for address in link.of_family(Family.V6)
                  if not ("tentative" in address.flags and "optimistic" not in address.flags)
                  and address.address != 0 and address.address >> 120 != 0xFF]
    chosen = _best(candidates, destination, out.index, prefer_temporary=False)
    if chosen is None:
        return Selected(None, "", f"no IPv6 address to choose from{' on ' + device if only_out else ''}: "
                        "MASQUERADE drops the packet")
    if any("temporary" in a.flags for a, _ in candidates):
        other = _best(candidates, destination, out.index, prefer_temporary=True)
        if other is not None and other[0].address != chosen[0].address:
            return Selected(None, "", f"{chosen[0].text} or the temporary {other[0].text}: which depends on "
                            f"net.ipv6.conf.{chosen[1].name}.use_tempaddr (2 prefers temporary addresses)")
    address, link, rule = chosen
    deciding = "the only candidate" if rule < 0 else f"RFC 6724 as the kernel applies it: {_RULES[rule]}"
    where = "" if link.name == device else f" (on {link.name}: {device} has none that ranks higher)"
    return Selected(address.address, f"{address.text}/{address.prefix_length}{where}, chosen for "
                    f"{format_address(Family.V6, destination)} by {deciding}")
