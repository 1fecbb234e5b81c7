"""Our RETURN rules skip the tokenizer (the bulk of a 100,000-CIDR chain): the fast paths must agree exactly with
the general path, for every address and comment they accept."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ipmasq.netfilter import iptables

addresses = st.one_of(
    st.ip_addresses(v=4).map(str),
    st.builds(lambda a, n: f"{a}/{n}", st.ip_addresses(v=4), st.integers(0, 32)),
    st.builds(lambda a, n: f"{a}/{n}", st.ip_addresses(v=6), st.integers(0, 128)),
)
comments = st.text(st.characters(blacklist_characters='"\\\n\r', min_codepoint=32, max_codepoint=126), max_size=40)
chains = st.from_regex(r"[A-Z][A-Z0-9_-]{0,20}", fullmatch=True)


def _general(line: str) -> iptables.IptablesRule:
    saved = iptables._OUR_RETURN_SAVE
    iptables._OUR_RETURN_SAVE = re.compile("(?!)")  # never matches: the general path
    try:
        return iptables.parse_rule(iptables._canonical(line))
    finally:
        iptables._OUR_RETURN_SAVE = saved


@given(chains, comments, addresses, st.booleans())
def test_fast_paths_equal_the_general_path(chain: str, comment: str, address: str, save_order: bool) -> None:
    if save_order:
        line = f'-A {chain} -d {address} -m comment --comment "{comment}" -j RETURN'
    else:
        line = f'-A {chain} -m comment --comment "{comment}" -d {address} -j RETURN'
    assert iptables.canonical(line) == iptables._canonical(line)
    text = iptables.canonical(line)
    assert iptables.parse_rule(text, already_canonical=True) == _general(line)


@pytest.mark.parametrize("line", [
    '-A X -m comment --comment "a" -d 10.0.0.0/8 -j MASQUERADE',
    '-A X -m comment --comment "a" ! -d 10.0.0.0/8 -j RETURN',
    '-A X -m comment --comment "a\\"b" -d 10.0.0.0/8 -j RETURN',
    '-A X -m comment --comment "-o" -d 0.0.0.0 -j RETURN',
    '-A X -m comment --comment "-m" -d 0.0.0.0 -j RETURN',
])
def test_other_rules_take_the_general_path(line: str) -> None:
    assert iptables.canonical(line) == iptables._canonical(line)


@pytest.mark.parametrize("comment", ["-o", "-m", "-j", "-d", "--comment", "--protocol", "--destination", "--jump"])
def test_a_comment_that_reads_like_an_option_stays_a_comment(comment: str) -> None:
    rule = iptables.parse_rule(f'-A X -s 10.0.0.0/8 -m comment --comment "{comment}" -j MASQUERADE')
    assert rule.matches == (iptables.Match("comment", ("--comment", comment)),)
    assert rule.target == "MASQUERADE"
    assert [c.option for c in rule.conditions] == ["-s"]
