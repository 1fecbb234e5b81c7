"""conntrack cleanup: the stale destinations between two policies, and their deletion through a runner.

conntrack cleanup with config rules: every connection whose outcome changed (masquerade, preserve, snat to which
address) has its destination flushed; destinations where no packet's outcome changed are never flushed.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from ipmasq.backends.base import Result
from ipmasq.conntrack import delete_argv, delete_by_orig_dst, flush_stale_conntrack, stale_destinations
from ipmasq.errors import BackendError
from ipmasq.options import PolicyOptions
from ipmasq.policy.policy import Policy
from ipmasq.prefix import Family, Prefix, format_address, parse_address, parse_cidr
from tests.configs import policy_of


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
    stale = stale_destinations(policy_of(""), policy_of("nonMasqueradeCIDRs: [10.0.0.0/8]\n"))
    assert [(s.family, [str(p) for p in s.prefixes]) for s in stale] == \
        [(Family.V4, ["172.16.0.0/12", "192.168.0.0/16"])]


def test_same_policy_spelled_differently_has_nothing_stale() -> None:
    a = policy_of("nonMasqueradeCIDRs: [10.0.0.0/9, 10.128.0.0/9]\n")
    b = policy_of("nonMasqueradeCIDRs: [10.0.0.0/8]\n")
    assert stale_destinations(a, b) == ()


def test_ipv6_enabled_flips_the_whole_v6_space_but_the_preserved() -> None:
    before = policy_of("nonMasqueradeCIDRs: [10.0.0.0/8]\n")
    on = PolicyOptions(enable_ipv6=True)
    after = policy_of("nonMasqueradeCIDRs: [10.0.0.0/8, 'fd00::/8']\n", on)
    v6 = next(s for s in stale_destinations(before, after) if s.family is Family.V6)
    covered = sum(1 << (128 - p.length) for p in v6.prefixes)
    # everything but fd00::/8 and fe80::/10 was unmanaged (pod IP kept) and is now masqueraded
    assert covered == (1 << 128) - (1 << 120) - (1 << 118)


def test_argv() -> None:
    assert delete_argv(parse_cidr("fd00::/8")) == ["conntrack", "-D", "-f", "ipv6", "--orig-dst", "fd00::/8"]


def test_flush_deletes_only_flipped_destinations() -> None:
    table = FakeConntrack(["172.30.12.110", "172.16.0.1", "10.2.1.100", "8.8.8.8", "192.168.1.1"])
    result = flush_stale_conntrack(table, policy_of(""), policy_of("nonMasqueradeCIDRs: [10.0.0.0/8]\n"))
    assert result.deleted == 3
    assert table.entries == ["10.2.1.100", "8.8.8.8"]
    assert [c[-1] for c in table.calls] == ["172.16.0.0/12", "192.168.0.0/16"]


def test_a_real_failure_is_a_backend_error() -> None:
    def broken(argv: Sequence[str], stdin: str | None = None) -> Result:
        return Result(1, "", "conntrack v1.4.7 (conntrack-tools): Operation failed: Operation not permitted\n")

    with pytest.raises(BackendError, match="Operation not permitted"):
        delete_by_orig_dst(broken, [parse_cidr("10.0.0.0/8")])


NODE = "egress-1"


def _node_policy(text: str, options: PolicyOptions | None = None) -> Policy:
    options = options or PolicyOptions(node_name=NODE)
    return policy_of(text, options)


def flushed(before: Policy, after: Policy) -> list[str]:
    return [str(p) for stale in stale_destinations(before, after) for p in stale.prefixes]


def covered(prefixes: list[str], address: str) -> bool:
    family, value = parse_address(address)
    return any(p.family is family and p.network <= value <= p.last for p in map(parse_cidr, prefixes))


BASE = "nonMasqueradeCIDRs: [10.0.0.0/8]\n"


def test_a_source_scoped_rule_flushes_its_destinations_not_the_rest() -> None:
    before = _node_policy(BASE)
    after = _node_policy(BASE + "rules:\n  - name: vpn-pod-keeps-ip\n    destinations: [172.30.0.0/16]\n"
                           "    sources: [10.44.1.0/24]\n    action: preserve\n")
    # the lists did not change: only traffic to the rule's destinations (from 10.44.1.0/24) changes outcome;
    # conntrack selects by destination, so every entry to 172.30.0.0/16 goes (an over-approximation by source)
    assert flushed(before, after) == ["172.30.0.0/16"]


def test_a_changed_snat_address_is_a_changed_outcome() -> None:
    rule = "rules:\n  - name: partner\n    destinations: [203.0.113.0/24]\n    protocol: tcp\n    ports: [443]\n" \
           "    action: snat\n    snatTo: {}\n"
    before, after = _node_policy(BASE + rule.format("10.142.0.50")), _node_policy(BASE + rule.format("10.142.0.51"))
    assert flushed(before, after) == ["203.0.113.0/24"]
    assert flushed(before, before) == []
    # the same rule under another name: no packet's outcome changes, nothing is flushed
    assert flushed(before, _node_policy(BASE + rule.format("10.142.0.50").replace("partner", "renamed"))) == []


def test_a_rule_for_other_nodes_flushes_nothing_here() -> None:
    before = _node_policy(BASE)
    after = _node_policy(BASE + "rules:\n  - name: other-pool\n    destinations: [172.30.0.0/16]\n"
                           "    nodes: ['general-*']\n    action: preserve\n")
    assert flushed(before, after) == []
    on_general = PolicyOptions(node_name="general-3")
    assert flushed(_node_policy(BASE, on_general), Policy(after.config, on_general)) == ["172.30.0.0/16"]


def test_list_flips_and_rule_changes_together() -> None:
    before = _node_policy(BASE + "rules:\n  - name: r\n    destinations: [192.168.0.0/16]\n    action: preserve\n")
    after = _node_policy("nonMasqueradeCIDRs: [10.0.0.0/9]\n")
    assert flushed(before, after) == ["10.128.0.0/9", "192.168.0.0/16"]


def test_enable_ipv6_switched_on_flushes_what_ipv6_now_masquerades() -> None:
    before = _node_policy(BASE)
    after = _node_policy(BASE + "enableIPv6: true\nrules:\n  - name: v6\n    destinations: ['2001:db8::/32']\n"
                           "    action: preserve\n")
    # IPv6 was unmanaged (pod IP everywhere); now everything but 2001:db8::/32 and link-local is masqueraded
    stale = {s.family: s.prefixes for s in stale_destinations(before, after)}
    assert set(stale) == {Family.V6}
    assert not covered([str(p) for p in stale[Family.V6]], "2001:db8::5")
    assert covered([str(p) for p in stale[Family.V6]], "2600::1")


RANDOM_CIDRS = ["10.0.0.0/8", "10.1.0.0/16", "172.16.0.0/12", "172.30.0.0/16", "192.168.0.0/16", "192.168.4.0/24",
                "203.0.113.0/24", "203.0.113.128/25"]
SOURCES = ["10.44.0.0/16", "10.44.1.0/24", "10.45.0.0/16"]


def _random_config(rng: random.Random) -> str:
    lines = ["nonMasqueradeCIDRs: [" + ", ".join(rng.sample(RANDOM_CIDRS[:6], rng.randint(0, 3))) + "]"]
    rules = []
    for i in range(rng.randint(0, 4)):
        rule = [f"  - name: r{i}", f"    destinations: [{rng.choice(RANDOM_CIDRS)}]"]
        if rng.random() < 0.5:
            rule.append(f"    sources: [{rng.choice(SOURCES)}]")
        if rng.random() < 0.5:
            rule += [f"    protocol: {rng.choice(['tcp', 'udp'])}",
                     f"    ports: [{rng.choice([443, 53, '8000-8080'])}]"]
        if rng.random() < 0.3:
            rule.append(f"    nodes: [{rng.choice(['egress-*', 'general-*'])}]")
        action = rng.choice(["masquerade", "preserve", "snat"])
        rule.append(f"    action: {action}")
        if action == "snat":
            rule.append(f"    snatTo: 10.142.0.{rng.choice([50, 51])}")
        rules += rule
    return "\n".join(lines) + "\n" + ("rules:\n" + "\n".join(rules) + "\n" if rules else "")


def _outcome(policy: Policy, destination: int, source: int, protocol: str,
             port: int | None) -> tuple[bool, str | None]:
    verdict = policy.verdict_for(Family.V4, destination, source=source, protocol=protocol, port=port)
    assert verdict.decided
    return verdict.masquerade, verdict.snat_to


def _interesting(rng: random.Random) -> int:
    prefix = parse_cidr(rng.choice([*RANDOM_CIDRS, "8.8.8.0/24"]))
    return rng.choice([prefix.network, prefix.last, rng.randint(prefix.network, prefix.last),
                       prefix.network - 1, prefix.last + 1])


@pytest.mark.parametrize("case", range(60))
def test_never_under_every_changed_packet_is_flushed(case: int) -> None:
    rng = random.Random(case)
    before, after = _node_policy(_random_config(rng)), _node_policy(_random_config(rng))
    prefixes: list[Prefix] = [p for s in stale_destinations(before, after) for p in s.prefixes]
    for _ in range(400):
        destination = _interesting(rng)
        source = parse_address(format_address(Family.V4, rng.randint(parse_cidr("10.43.255.0/24").network,
                                                                      parse_cidr("10.46.0.0/24").last)))[1]
        protocol = rng.choice(["tcp", "udp", "icmp"])
        port = None if protocol == "icmp" else rng.choice([53, 443, 8000, 8080, 8081, 22])
        if _outcome(before, destination, source, protocol, port) != _outcome(after, destination, source, protocol,
                                                                              port):
            assert any(p.network <= destination <= p.last for p in prefixes), (format_address(
                Family.V4, destination), before.config, after.config)
