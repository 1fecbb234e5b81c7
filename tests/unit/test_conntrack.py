"""conntrack cleanup: the stale destinations between two policies, and their deletion through a runner."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from ipmasq.backends.base import Result
from ipmasq.config import ConfigInput, config_from_bytes
from ipmasq.conntrack import delete_argv, delete_by_orig_dst, flush_stale_conntrack, stale_destinations
from ipmasq.errors import BackendError
from ipmasq.options import PolicyOptions
from ipmasq.policy.policy import Policy
from ipmasq.policy.prefix import Family, parse_address, parse_cidr


def _policy(text: str, options: PolicyOptions | None = None) -> Policy:
    options = options or PolicyOptions()
    return Policy(config_from_bytes(ConfigInput((("/c", text.encode()),)), options), options)


class FakeConntrack:
    """A conntrack table of (family, original destination) entries that `conntrack -D` really deletes from."""

    def __init__(self, entries: list[str]) -> None:
        self.entries = list(entries)
        self.calls: list[list[str]] = []

    def __call__(self, argv: Sequence[str], stdin: str | None = None) -> Result:
        self.calls.append(list(argv))
        assert argv[:3] == ["conntrack", "-D", "-f"] and argv[4] == "--orig-dst"
        prefix = parse_cidr(argv[5])
        kept, deleted = [], 0
        for entry in self.entries:
            family, address = parse_address(entry)
            if family is prefix.family and prefix.contains(address):
                deleted += 1
            else:
                kept.append(entry)
        self.entries = kept
        message = f"conntrack v1.4.7 (conntrack-tools): {deleted} flow entries have been deleted.\n"
        return Result(0 if deleted else 1, "", message)


def test_gke_upgrade_fix_makes_172_16_stale() -> None:
    stale = stale_destinations(_policy(""), _policy("nonMasqueradeCIDRs: [10.0.0.0/8]\n"))
    assert [(s.family, [str(p) for p in s.prefixes]) for s in stale] == \
        [(Family.V4, ["172.16.0.0/12", "192.168.0.0/16"])]


def test_same_policy_spelled_differently_has_nothing_stale() -> None:
    a = _policy("nonMasqueradeCIDRs: [10.0.0.0/9, 10.128.0.0/9]\n")
    b = _policy("nonMasqueradeCIDRs: [10.0.0.0/8]\n")
    assert stale_destinations(a, b) == ()


def test_ipv6_enabled_flips_the_whole_v6_space_but_the_preserved() -> None:
    before = _policy("nonMasqueradeCIDRs: [10.0.0.0/8]\n")
    on = PolicyOptions(enable_ipv6=True)
    after = _policy("nonMasqueradeCIDRs: [10.0.0.0/8, 'fd00::/8']\n", on)
    v6 = next(s for s in stale_destinations(before, after) if s.family is Family.V6)
    covered = sum(1 << (128 - p.length) for p in v6.prefixes)
    # everything but fd00::/8 and fe80::/10 was unmanaged (pod IP kept) and is now masqueraded
    assert covered == (1 << 128) - (1 << 120) - (1 << 118)


def test_argv() -> None:
    assert delete_argv(parse_cidr("fd00::/8")) == ["conntrack", "-D", "-f", "ipv6", "--orig-dst", "fd00::/8"]


def test_flush_deletes_only_flipped_destinations() -> None:
    table = FakeConntrack(["172.30.12.110", "172.16.0.1", "10.2.1.100", "8.8.8.8", "192.168.1.1"])
    result = flush_stale_conntrack(table, _policy(""), _policy("nonMasqueradeCIDRs: [10.0.0.0/8]\n"))
    assert result.deleted == 3
    assert table.entries == ["10.2.1.100", "8.8.8.8"]
    assert [c[-1] for c in table.calls] == ["172.16.0.0/12", "192.168.0.0/16"]


def test_a_real_failure_is_a_backend_error() -> None:
    def broken(argv: Sequence[str], stdin: str | None = None) -> Result:
        return Result(1, "", "conntrack v1.4.7 (conntrack-tools): Operation failed: Operation not permitted\n")

    with pytest.raises(BackendError, match="Operation not permitted"):
        delete_by_orig_dst(broken, [parse_cidr("10.0.0.0/8")])
