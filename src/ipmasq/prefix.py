"""IP prefixes (CIDRs) as plain integers: fast to parse, compare and nest.

`parse_cidr` follows Go's ``net.ParseCIDR`` as the reference agent uses it, including its error texts,
because operators grep logs for those texts.
"""

from __future__ import annotations

import ipaddress
import socket
from enum import IntEnum
from typing import NamedTuple

from ipmasq.errors import PrefixError

__all__ = ["Family", "Prefix", "format_address", "parse_address", "parse_cidr"]


class Family(IntEnum):
    V4 = 4
    V6 = 6

    @property
    def bits(self) -> int:
        return 32 if self is Family.V4 else 128

    @property
    def max_address(self) -> int:
        return (1 << self.bits) - 1


# host masks by family (4 or 6) and length: `last` is on every hot path of the rules' checks, and a table read is
# about twice as fast as working the mask out through Family.bits
_HOST_MASKS: tuple[tuple[int, ...], ...] = (
    (), (), (), (), tuple((1 << (32 - n)) - 1 for n in range(33)), (), tuple((1 << (128 - n)) - 1 for n in range(129)))


class Prefix(NamedTuple):
    """A CIDR; a NamedTuple because 100,000-entry configs create this many of them (a frozen dataclass is slower)."""

    family: Family
    network: int
    length: int

    @property
    def first(self) -> int:
        return self.network

    @property
    def last(self) -> int:
        return self.network | _HOST_MASKS[self.family][self.length]

    def contains(self, address: int) -> bool:
        return self.network <= address <= self.last

    def covers(self, other: Prefix) -> bool:
        """True when every address of `other` is inside self."""
        return self.family == other.family and self.length <= other.length and self.contains(other.network)

    def __str__(self) -> str:
        if self.family is Family.V4:
            n = self.network
            return f"{n >> 24}.{(n >> 16) & 255}.{(n >> 8) & 255}.{n & 255}/{self.length}"
        return f"{ipaddress.IPv6Address(self.network)}/{self.length}"


def _cannot_parse(text: str) -> PrefixError:
    return PrefixError(f'CIDR "{text}" could not be parsed, invalid CIDR address: {text}')


_V4_MASKS = [(0xFFFFFFFF << (32 - n)) & 0xFFFFFFFF for n in range(33)]
_from_bytes = int.from_bytes


def parse_cidr(text: str) -> Prefix:
    """Parse and check alignment, like the reference agent's validateCIDR."""
    address_text, slash, length_text = text.partition("/")
    if slash and ":" not in address_text:
        # Fast path for IPv4: inet_pton is as strict as Go (no leading zeros, no short forms, no spaces).
        try:
            address = _from_bytes(socket.inet_pton(socket.AF_INET, address_text), "big")
        except (OSError, ValueError):  # ValueError: a NUL in the text (inet_pton takes a C string)
            raise _cannot_parse(text) from None
        if not (length_text.isdigit() and length_text.isascii() and len(length_text) <= 2 and int(length_text) <= 32):
            raise _cannot_parse(text)
        length = int(length_text)
        network = address & _V4_MASKS[length]
        if network != address:
            prefix = Prefix(Family.V4, network, length)
            raise PrefixError(f'CIDR "{text}" is not aligned to a CIDR block, ip: "{address_text}" network: "{prefix}"')
        return Prefix(Family.V4, network, length)
    if "/" not in text or ":" not in text:
        raise _cannot_parse(text)
    address_text, _, length_text = text.partition("/")
    if not length_text.isascii() or not length_text.isdigit() or "%" in address_text:
        raise _cannot_parse(text)
    try:
        ip6 = ipaddress.IPv6Address(address_text)
    except ValueError:
        raise _cannot_parse(text) from None
    length = int(length_text)
    if length > 128:
        raise _cannot_parse(text)
    network = int(ip6) & ~((1 << (128 - length)) - 1) & Family.V6.max_address
    prefix = Prefix(Family.V6, network, length)
    if network != int(ip6):
        raise PrefixError(f'CIDR "{text}" is not aligned to a CIDR block, ip: "{ip6}" network: "{prefix}"')
    return prefix


def parse_address(text: str) -> tuple[Family, int]:
    """An IP address (no prefix length) as (family, integer), an IPv4-mapped IPv6 address as the IPv4 address it
    maps; ValueError when it is not an address."""
    try:  # fast path: explain answers hundreds of thousands of destinations a second
        return Family.V4, _from_bytes(socket.inet_pton(socket.AF_INET, text), "big")
    except OSError:
        pass
    ip = ipaddress.ip_address(text.strip())
    if ip.version == 6 and ip.ipv4_mapped is not None:
        # ::ffff:a.b.c.d is how an IPv6 socket shows an IPv4 peer: the packet on the wire is IPv4
        return Family.V4, int(ip.ipv4_mapped)
    return (Family.V4 if ip.version == 4 else Family.V6), int(ip)


def format_address(family: Family, value: int) -> str:
    return str(ipaddress.IPv4Address(value) if family is Family.V4 else ipaddress.IPv6Address(value))
