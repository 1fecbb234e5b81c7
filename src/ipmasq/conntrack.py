"""Conntrack cleanup after a policy change: which entries are stale, and deleting them through the runner.

The nat table is consulted only for a connection's first packet; the NAT decision (masquerade or not) then
lives in the conntrack entry. After a change, a connection whose destination flipped keeps its old decision,
including one that is still failing: its retransmitted SYNs match the existing entry and never see the new
rules. Deleting the entries whose original destination lies in a flipped range makes the next packet a new
connection for netfilter, decided by the new rules.

With config rules on either side, a connection's outcome depends on its source, protocol and port (and the node) as
well as its destination. The stale set is then the destinations of every region of packets whose outcome differs
(ipmasq.diff.diff_rule_policies, exact: a packet is in a region iff its outcome changed, masquerade / preserve / snat
to which address). Entries are selected by original destination only, so this OVER-approximates by destination: a
connection to such a destination whose own source, protocol or port kept its outcome is deleted too (its next
packet is decided again, the same way). It never under-approximates: every changed packet's destination is flushed.

The decision (`stale_destinations`, `delete_argv`) is pure; `flush_stale_conntrack` runs
`conntrack -D -f FAMILY --orig-dst CIDR` through the injected runner, and `conntrack_flusher` is the agent's
`--flush-conntrack`: it runs that after every verified policy change.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ipmasq.backends.base import Runner
from ipmasq.diff.diff import diff_rule_policies, flipped_ranges, has_rules
from ipmasq.errors import BackendError, IpmasqError
from ipmasq.policy.policy import Policy
from ipmasq.policy.ranges import Span, to_prefixes, union
from ipmasq.prefix import Family, Prefix

__all__ = ["FlushResult", "StaleDestinations", "conntrack_flusher", "delete_argv", "delete_by_orig_dst",
           "flush_stale_conntrack", "stale_destinations"]

_DELETED = re.compile(r"(\d+) flow entries have been deleted")


@dataclass(frozen=True, slots=True)
class StaleDestinations:
    """The fewest prefixes covering exactly the destinations whose verdict changed, for one family."""

    family: Family
    prefixes: tuple[Prefix, ...]


def stale_destinations(before: Policy, after: Policy) -> tuple[StaleDestinations, ...]:
    """Both families: a family one policy does not manage counts as "never masqueraded" there. Without config rules
    the destinations whose verdict flipped, exactly; with rules the destinations of every packet whose outcome
    changed (an over-approximation by destination: see the module docstring)."""
    if has_rules(before) or has_rules(after):
        return _stale_with_rules(before, after)
    out = []
    for family in Family:
        prefixes = tuple(p for flip in flipped_ranges(before, after, family) for p in flip.prefixes())
        if prefixes:
            out.append(StaleDestinations(family, prefixes))
    return tuple(out)


def _stale_with_rules(before: Policy, after: Policy) -> tuple[StaleDestinations, ...]:
    node = after.node_name if after.node_name is not None else before.node_name
    # on this node only: a rule scoped to other nodes changes nothing here (the agent's node is known when a rule
    # has nodes; the config is refused otherwise)
    regions = diff_rule_policies(before, after, node_names=(node,) if node is not None else ()).regions
    spans: dict[Family, list[Span]] = {}
    for region in regions:
        spans.setdefault(region.family, []).extend(region.destinations)
    out = []
    for family in Family:
        merged = union(spans.get(family, []))
        prefixes = tuple(p for first, last in merged for p in to_prefixes(family, first, last))
        if prefixes:
            out.append(StaleDestinations(family, prefixes))
    return tuple(out)


def delete_argv(prefix: Prefix) -> list[str]:
    """conntrack-tools >= 1.4.6 takes CIDR notation for --orig-dst (it implies --mask-dst)."""
    return ["conntrack", "-D", "-f", "ipv4" if prefix.family is Family.V4 else "ipv6", "--orig-dst", str(prefix)]


@dataclass(frozen=True, slots=True)
class FlushResult:
    prefixes: tuple[Prefix, ...]  # the destinations whose entries were deleted
    deleted: int  # entries deleted in all


def delete_by_orig_dst(run: Runner, prefixes: Iterable[Prefix]) -> FlushResult:
    done: list[Prefix] = []
    deleted = 0
    for prefix in prefixes:
        argv = delete_argv(prefix)
        result = run(argv, None)
        match = _DELETED.search(result.stderr)
        # conntrack -D exits 1 when nothing matched; its count line tells that apart from a real failure
        if match is None or (result.returncode != 0 and match.group(1) != "0"):
            raise BackendError("deleting conntrack entries failed", argv=tuple(argv), stderr=result.stderr,
                               returncode=result.returncode)
        deleted += int(match.group(1))
        done.append(prefix)
    return FlushResult(tuple(done), deleted)


def flush_stale_conntrack(run: Runner, before: Policy, after: Policy) -> FlushResult:
    """Delete the entries (both families) whose original destination's verdict differs between the policies."""
    prefixes = [p for stale in stale_destinations(before, after) for p in stale.prefixes]
    return delete_by_orig_dst(run, prefixes)


def conntrack_flusher(run: Runner, log: logging.Logger) -> Callable[[Policy, Policy], None]:
    """The agent's `--flush-conntrack`: a Reconciler's on_policy_change that flushes the stale entries once the new
    rules are verified, and logs what it did. A failure is logged, never raised: the rules are in place."""

    def flush(before: Policy, after: Policy) -> None:
        try:
            result = flush_stale_conntrack(run, before, after)
        except IpmasqError as exc:
            log.error("conntrack: %s (the new rules are in place; old connections keep their NAT decision)", exc)
            return
        if result.prefixes:
            log.info("conntrack: deleted %d entries to the %d ranges whose verdict changed", result.deleted,
                     len(result.prefixes))

    return flush
