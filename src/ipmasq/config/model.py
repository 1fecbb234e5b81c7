"""The validated configuration: what the operator asked for, with where each entry came from."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import NamedTuple

from ipmasq.prefix import Family, Prefix, parse_cidr

__all__ = [
    "DEFAULT_CIDR_LIMIT",
    "DEFAULT_NON_MASQUERADE",
    "DEFAULT_RESYNC_SECONDS",
    "LINK_LOCAL_V4",
    "LINK_LOCAL_V6",
    "RESERVED_NON_MASQUERADE",
    "Entry",
    "MasqConfig",
    "Origin",
    "Rule",
    "RuleAction",
]


class Origin(Enum):
    """Why an entry is in the policy; `explain` prints it."""

    DEFAULT = "default"  # the agent's built-in non-masquerade list (no config file, or the key absent)
    CONFIG = "config"  # nonMasqueradeCIDRs of a config file
    LINK_LOCAL = "link-local"  # 169.254.0.0/16 or fe80::/10, exempt unless masqLinkLocal(IPv6)
    EXCEPTION = "exception"  # masqueradeCIDRs of a config file (our extension)


class Entry(NamedTuple):
    """One CIDR of the policy and where it came from (a NamedTuple: configs hold 100,000 of them)."""

    prefix: Prefix
    masquerade: bool
    origin: Origin
    source: str | None = None
    line: int | None = None

    def where(self) -> str:
        if self.source is None:
            return "built-in"
        return self.source if self.line is None else f"{self.source}:{self.line}"


class RuleAction(Enum):
    """What a rule of the `rules` section does to the packets it matches."""

    MASQUERADE = "masquerade"  # the node's address (the kernel picks the outgoing interface's)
    PRESERVE = "preserve"  # the pod's address, unchanged
    SNAT = "snat"  # a fixed address (snatTo), e.g. the one a partner's firewall allows


@dataclass(frozen=True, slots=True)
class Rule:
    """One entry of `rules`: ordered, the first that matches a packet decides (ahead of the CIDR lists).

    Empty `sources`, `ports` or `nodes`, and a None `protocol`, mean "any". `ports` are inclusive (low, high)
    destination port ranges; `destinations` and `sources` are of one family, `family`.
    """

    name: str
    family: Family
    destinations: tuple[Prefix, ...]
    action: RuleAction
    sources: tuple[Prefix, ...] = ()
    protocol: str | None = None  # tcp | udp | sctp | icmp | icmpv6
    ports: tuple[tuple[int, int], ...] = ()
    nodes: tuple[str, ...] = ()  # node-name globs (fnmatch, case-sensitive)
    snat_to: str | None = None  # the address SNAT writes, as the kernel prints it; only with RuleAction.SNAT
    source: str | None = None  # the file
    line: int | None = None

    def where(self) -> str:
        if self.source is None:
            return "built-in"
        return self.source if self.line is None else f"{self.source}:{self.line}"


# The reference agent's defaults (RFC 1918), and with --nomasq-all-reserved-ranges the other reserved ranges.
DEFAULT_NON_MASQUERADE: tuple[str, ...] = ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16")
RESERVED_NON_MASQUERADE: tuple[str, ...] = (
    "100.64.0.0/10",  # RFC 6598
    "192.0.0.0/24",  # RFC 6890
    "192.0.2.0/24",  # RFC 5737
    "192.88.99.0/24",  # RFC 7526
    "198.18.0.0/15",  # RFC 6815
    "198.51.100.0/24",  # RFC 5737
    "203.0.113.0/24",  # RFC 5737
    "240.0.0.0/4",  # RFC 5735, former class E
)
LINK_LOCAL_V4 = parse_cidr("169.254.0.0/16")
LINK_LOCAL_V6 = Prefix(Family.V6, 0xFE80 << 112, 10)  # fe80::/10, not parsed: IPv6 parsing loads ipaddress
DEFAULT_CIDR_LIMIT = 64
DEFAULT_RESYNC_SECONDS = 60.0


def default_entries(*, all_reserved: bool) -> tuple[Entry, ...]:
    texts = DEFAULT_NON_MASQUERADE + (RESERVED_NON_MASQUERADE if all_reserved else ())
    return tuple(Entry(parse_cidr(t), False, Origin.DEFAULT) for t in texts)


@dataclass(frozen=True, slots=True)
class MasqConfig:
    """A validated ip-masq-agent config: the CIDR lists, the rules, the resync interval and their files."""

    non_masquerade: tuple[Entry, ...]
    masquerade: tuple[Entry, ...] = ()
    cidr_limit: int = DEFAULT_CIDR_LIMIT
    masq_link_local: bool = False
    masq_link_local_ipv6: bool = False
    resync_interval: float = DEFAULT_RESYNC_SECONDS
    sources: tuple[str, ...] = ()  # the files this came from; empty: built-in defaults
    rules: tuple[Rule, ...] = ()  # the `rules` sections of every file, in file-name order
    enable_ipv6: bool | None = None  # the config's enableIPv6 (None: not set); --enable-ipv6, when given, wins
    warnings: tuple[str, ...] = field(default=(), compare=False)

    def families(self) -> set[Family]:
        return {e.prefix.family for e in self.non_masquerade + self.masquerade} | {r.family for r in self.rules}
