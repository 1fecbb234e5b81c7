"""Policy verdicts, longest-prefix exceptions, and their agreement with a brute-force model (hypothesis)."""

from __future__ import annotations

import ipaddress
import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from ipmasq.config import ConfigInput, config_from_bytes, load_config
from ipmasq.diff.diff import flipped_ranges
from ipmasq.options import PolicyOptions
from ipmasq.policy.policy import Policy, Reason
from ipmasq.policy.prefix import Family, Prefix
from ipmasq.policy.ranges import to_prefixes

V4 = PolicyOptions()


def policy(text: str, options: PolicyOptions = V4) -> Policy:
    return Policy(config_from_bytes(ConfigInput((("/c", text.encode()),)), options), options)


def test_gke_1_14_defaults_preserve_the_aws_vpc_and_the_fix_masquerades_it() -> None:
    gke = PolicyOptions(masq_chain="IP-MASQ", nomasq_all_reserved_ranges=True)
    before = Policy(load_config(None, gke), gke).verdict("172.30.12.110")
    assert (before.masquerade, str(before.matched), before.reason) == (False, "172.16.0.0/12", Reason.DEFAULT)
    after = policy("nonMasqueradeCIDRs: [10.0.0.0/8]\n", gke).verdict("172.30.12.110")
    assert (after.masquerade, after.matched, after.reason) == (True, None, Reason.CATCH_ALL)


def test_link_local() -> None:
    assert policy("nonMasqueradeCIDRs: []\n").verdict("169.254.169.254").reason is Reason.LINK_LOCAL
    assert policy("masqLinkLocal: true\nnonMasqueradeCIDRs: []\n").verdict("169.254.169.254").masquerade


def test_vpn_inside_10_8_with_an_exception() -> None:
    p = policy("nonMasqueradeCIDRs: [10.0.0.0/8]\nmasqueradeCIDRs: [10.11.0.0/24]\n")
    vpn = p.verdict("10.11.0.7")
    assert (vpn.masquerade, str(vpn.matched), vpn.reason) == (True, "10.11.0.0/24", Reason.EXCEPTION)
    assert not p.verdict("10.12.0.7").masquerade


def test_nested_exceptions_longest_prefix_wins() -> None:
    p = policy("nonMasqueradeCIDRs: [10.0.0.0/8, 10.11.5.0/24]\nmasqueradeCIDRs: [10.11.0.0/16, 10.11.5.128/25]\n")
    assert not p.verdict("10.1.1.1").masquerade
    assert p.verdict("10.11.1.1").masquerade
    assert not p.verdict("10.11.5.1").masquerade
    assert p.verdict("10.11.5.200").masquerade
    assert p.verdict("11.0.0.1").reason is Reason.CATCH_ALL


def test_without_exceptions_the_first_rule_in_config_order_decides() -> None:
    # the kernel walks the chain in order: 10.0.0.0/8 comes first, so it is the rule that matched
    p = policy("nonMasqueradeCIDRs: [10.0.0.0/8, 10.1.0.0/16]\n")
    assert str(p.verdict("10.1.2.3").matched) == "10.0.0.0/8"


def test_ipv6() -> None:
    v6 = PolicyOptions(enable_ipv6=True)
    p = policy("nonMasqueradeCIDRs: [10.0.0.0/8, 'fd00::/8']\n", v6)
    assert not p.verdict("fd00::1").masquerade
    assert p.verdict("2001:db8::1").masquerade
    assert p.verdict("fe80::1").reason is Reason.LINK_LOCAL
    assert policy("").verdict("2001:db8::1").reason is Reason.IPV6_DISABLED


def test_non_masquerade_ranges_are_disjoint_and_merged() -> None:
    p = policy("nonMasqueradeCIDRs: [10.0.0.0/9, 10.128.0.0/9, 10.64.0.0/10]\nmasqueradeCIDRs: [10.1.0.0/16]\n")
    ranges = p.non_masquerade_ranges(Family.V4)
    ten = int(ipaddress.IPv4Address("10.0.0.0"))
    assert ranges == [
        (ten, ten + 0x00FFFF),  # 10.0.0.0 - 10.0.255.255
        (ten + 0x020000, ten + 0xFFFFFF),  # 10.2.0.0 - 10.255.255.255
        (int(ipaddress.IPv4Address("169.254.0.0")), int(ipaddress.IPv4Address("169.254.255.255"))),
    ]


def test_range_to_prefixes_is_minimal() -> None:
    first = int(ipaddress.IPv4Address("10.0.0.1"))
    last = int(ipaddress.IPv4Address("10.0.0.6"))
    assert [str(p) for p in to_prefixes(Family.V4, first, last)] == [
        "10.0.0.1/32", "10.0.0.2/31", "10.0.0.4/31", "10.0.0.6/32"]
    assert [str(p) for p in to_prefixes(Family.V4, 0, 2**32 - 1)] == ["0.0.0.0/0"]


# --- properties ---------------------------------------------------------------------------------------------

# Small address space (10.0.0.0/24 and friends) so random prefixes nest and collide often.
prefix_lengths = st.integers(min_value=20, max_value=32)


@st.composite
def prefixes(draw: st.DrawFn) -> Prefix:
    length = draw(prefix_lengths)
    base = int(ipaddress.IPv4Address("10.0.0.0"))
    offset = draw(st.integers(min_value=0, max_value=(1 << 12) - 1))
    network = (base + offset) & ~((1 << (32 - length)) - 1) & 0xFFFFFFFF
    return Prefix(Family.V4, network, length)


@st.composite
def configs(draw: st.DrawFn) -> tuple[list[Prefix], list[Prefix], bool]:
    preserve = draw(st.lists(prefixes(), max_size=8))
    masquerade = [p for p in draw(st.lists(prefixes(), max_size=5)) if p not in preserve]
    return preserve, masquerade, draw(st.booleans())


def render_config(preserve: list[Prefix], masquerade: list[Prefix], masq_link_local: bool) -> str:
    lines = ["nonMasqueradeCIDRs:"] + [f"  - {p}" for p in preserve] or ["nonMasqueradeCIDRs: []"]
    if not preserve:
        lines = ["nonMasqueradeCIDRs: []"]
    if masquerade:
        lines += ["masqueradeCIDRs:"] + [f"  - {p}" for p in masquerade]
    lines.append(f"masqLinkLocal: {str(masq_link_local).lower()}")
    return "\n".join(lines) + "\n"


def brute_force_masquerade(address: int, preserve: list[Prefix], masquerade: list[Prefix], masq_ll: bool) -> bool:
    """Longest prefix wins; no match: masquerade. Link-local 169.254/16 preserves unless masqLinkLocal."""
    candidates = [(p.length, False) for p in preserve if p.contains(address)]
    candidates += [(p.length, True) for p in masquerade if p.contains(address)]
    if not masq_ll and (address >> 16) == (169 << 8 | 254):
        candidates.append((16, False))
    if not candidates:
        return True
    best = max(length for length, _ in candidates)
    decisions = {m for length, m in candidates if length == best}
    assert len(decisions) == 1
    return decisions.pop()


addresses = st.one_of(
    st.integers(min_value=int(ipaddress.IPv4Address("10.0.0.0")), max_value=int(ipaddress.IPv4Address("10.0.31.255"))),
    st.integers(min_value=0, max_value=2**32 - 1),
)


@settings(max_examples=300, deadline=None)
@given(configs(), st.lists(addresses, min_size=1, max_size=20))
def test_verdicts_agree_with_brute_force(config: tuple[list[Prefix], list[Prefix], bool], probe: list[int]) -> None:
    preserve, masquerade, masq_ll = config
    p = policy(render_config(preserve, masquerade, masq_ll))
    for address in probe:
        verdict = p.verdict(str(ipaddress.IPv4Address(address)))
        assert verdict.masquerade == brute_force_masquerade(address, preserve, masquerade, masq_ll)
        if verdict.matched is not None:
            assert verdict.matched.contains(address)


@settings(max_examples=200, deadline=None)
@given(configs())
def test_non_masquerade_ranges_match_verdicts(config: tuple[list[Prefix], list[Prefix], bool]) -> None:
    preserve, masquerade, masq_ll = config
    p = policy(render_config(preserve, masquerade, masq_ll))
    ranges = p.non_masquerade_ranges(Family.V4)
    for (_, last), (first, _) in itertools.pairwise(ranges):
        assert last + 1 < first  # disjoint and not adjacent
    # every boundary of every range, and its neighbours, gets the verdict the ranges say
    for first, last in ranges:
        for address in (first, last):
            assert not p.verdict_for(Family.V4, address).masquerade
        for outside in (first - 1, last + 1):
            if 0 <= outside < 2**32 and not any(a <= outside <= b for a, b in ranges):
                assert p.verdict_for(Family.V4, outside).masquerade


@settings(max_examples=150, deadline=None)
@given(configs(), configs(), st.lists(addresses, min_size=1, max_size=20))
def test_flips_agree_with_brute_force(a: tuple[list[Prefix], list[Prefix], bool],
                                      b: tuple[list[Prefix], list[Prefix], bool], probe: list[int]) -> None:
    before, after = policy(render_config(*a)), policy(render_config(*b))
    flips = flipped_ranges(before, after, Family.V4)
    for address in probe:
        changed = before.verdict_for(Family.V4, address).masquerade != after.verdict_for(Family.V4, address).masquerade
        inside = [f for f in flips if f.first <= address <= f.last]
        assert bool(inside) == changed
        if inside:
            assert inside[0].masquerade_before == before.verdict_for(Family.V4, address).masquerade
