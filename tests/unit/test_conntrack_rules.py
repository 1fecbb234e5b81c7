"""conntrack cleanup with config rules: every connection whose outcome changed (masquerade, preserve, snat to which
address) has its destination flushed; destinations where no packet's outcome changed are never flushed."""

from __future__ import annotations

import random

import pytest

from ipmasq.config import ConfigInput, config_from_bytes
from ipmasq.conntrack import stale_destinations
from ipmasq.options import PolicyOptions
from ipmasq.policy.policy import Policy
from ipmasq.policy.prefix import Family, Prefix, format_address, parse_address, parse_cidr

NODE = "egress-1"


def _policy(text: str, options: PolicyOptions | None = None) -> Policy:
    options = options or PolicyOptions(node_name=NODE)
    return Policy(config_from_bytes(ConfigInput((("/c", text.encode()),)), options), options)


def flushed(before: Policy, after: Policy) -> list[str]:
    return [str(p) for stale in stale_destinations(before, after) for p in stale.prefixes]


def covered(prefixes: list[str], address: str) -> bool:
    family, value = parse_address(address)
    return any(p.family is family and p.network <= value <= p.last for p in map(parse_cidr, prefixes))


BASE = "nonMasqueradeCIDRs: [10.0.0.0/8]\n"


def test_a_source_scoped_rule_flushes_its_destinations_not_the_rest() -> None:
    before = _policy(BASE)
    after = _policy(BASE + "rules:\n  - name: vpn-pod-keeps-ip\n    destinations: [172.30.0.0/16]\n"
                           "    sources: [10.44.1.0/24]\n    action: preserve\n")
    # the lists did not change: only traffic to the rule's destinations (from 10.44.1.0/24) changes outcome;
    # conntrack selects by destination, so every entry to 172.30.0.0/16 goes (an over-approximation by source)
    assert flushed(before, after) == ["172.30.0.0/16"]


def test_a_changed_snat_address_is_a_changed_outcome() -> None:
    rule = "rules:\n  - name: partner\n    destinations: [203.0.113.0/24]\n    protocol: tcp\n    ports: [443]\n" \
           "    action: snat\n    snatTo: {}\n"
    before, after = _policy(BASE + rule.format("10.142.0.50")), _policy(BASE + rule.format("10.142.0.51"))
    assert flushed(before, after) == ["203.0.113.0/24"]
    assert flushed(before, before) == []
    # the same rule under another name: no packet's outcome changes, nothing is flushed
    assert flushed(before, _policy(BASE + rule.format("10.142.0.50").replace("partner", "renamed"))) == []


def test_a_rule_for_other_nodes_flushes_nothing_here() -> None:
    before = _policy(BASE)
    after = _policy(BASE + "rules:\n  - name: other-pool\n    destinations: [172.30.0.0/16]\n"
                           "    nodes: ['general-*']\n    action: preserve\n")
    assert flushed(before, after) == []
    on_general = PolicyOptions(node_name="general-3")
    assert flushed(_policy(BASE, on_general), Policy(after.config, on_general)) == ["172.30.0.0/16"]


def test_list_flips_and_rule_changes_together() -> None:
    before = _policy(BASE + "rules:\n  - name: r\n    destinations: [192.168.0.0/16]\n    action: preserve\n")
    after = _policy("nonMasqueradeCIDRs: [10.0.0.0/9]\n")
    assert flushed(before, after) == ["10.128.0.0/9", "192.168.0.0/16"]


def test_enable_ipv6_switched_on_flushes_what_ipv6_now_masquerades() -> None:
    before = _policy(BASE)
    after = _policy(BASE + "enableIPv6: true\nrules:\n  - name: v6\n    destinations: ['2001:db8::/32']\n"
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
    before, after = _policy(_random_config(rng)), _policy(_random_config(rng))
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
