"""Deleting stale conntrack entries through the runner (`conntrack -D -f FAMILY --orig-dst CIDR`).

For the agent: after applying a change from policy `before` to `after`, call
``flush_stale_conntrack(runner, before, after)``; see ipmasq.conntrack for why.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from ipmasq.backends.base import Runner
from ipmasq.conntrack import delete_argv, stale_destinations
from ipmasq.errors import BackendError
from ipmasq.policy import Policy
from ipmasq.prefix import Prefix

__all__ = ["FlushResult", "delete_by_orig_dst", "flush_stale_conntrack"]

_DELETED = re.compile(r"(\d+) flow entries have been deleted")


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
