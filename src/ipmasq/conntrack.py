"""Which conntrack entries a policy change makes stale (pure).

The nat table is consulted only for a connection's first packet; the NAT decision (masquerade or not) then
lives in the conntrack entry. After a change, a connection whose destination flipped keeps its old decision,
including one that is still failing: its retransmitted SYNs match the existing entry and never see the new
rules. Deleting the entries whose original destination lies in a flipped range makes the next packet a new
connection for netfilter, decided by the new rules.
"""

from __future__ import annotations

from dataclasses import dataclass

from ipmasq.flips import flipped_ranges
from ipmasq.policy import Policy
from ipmasq.prefix import Family, Prefix

__all__ = ["StaleDestinations", "delete_argv", "stale_destinations"]


@dataclass(frozen=True, slots=True)
class StaleDestinations:
    """The fewest prefixes covering exactly the destinations whose verdict changed, for one family."""

    family: Family
    prefixes: tuple[Prefix, ...]


def stale_destinations(before: Policy, after: Policy) -> tuple[StaleDestinations, ...]:
    """Both families: a family one policy does not manage counts as "never masqueraded" there (flips' rule)."""
    out = []
    for family in Family:
        prefixes = tuple(p for flip in flipped_ranges(before, after, family) for p in flip.prefixes())
        if prefixes:
            out.append(StaleDestinations(family, prefixes))
    return tuple(out)


def delete_argv(prefix: Prefix) -> list[str]:
    """conntrack-tools >= 1.4.6 takes CIDR notation for --orig-dst (it implies --mask-dst)."""
    return ["conntrack", "-D", "-f", "ipv4" if prefix.family is Family.V4 else "ipv6", "--orig-dst", str(prefix)]
