"""Which chains of a nat table ipmasq wrote: the ownership markers' names and how a table is read by them."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ipmasq.errors import UsageError
from ipmasq.netfilter.iptables import (
    CHAIN_NAME_MAX,
    canonical,
    chain_digest,
    chain_ownership,
    is_marker,
    is_marker_rule,
    jump_rule,
    marker_chain,
    marker_rule,
    parse_save,
    recorded_digest,
)
from ipmasq.options import check_chain_name

COMMENT = '-m comment --comment "ip-masq-agent: local traffic is not subject to MASQUERADE"'
CHAIN_NAMES = st.text(alphabet="ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.-", min_size=1,
                      max_size=28).filter(lambda name: not is_marker(name))


def table(*chains: str, rules: tuple[str, ...] = (), jumps: tuple[str, ...] = ()) -> str:
    lines = ["*nat", ":POSTROUTING ACCEPT [0:0]", *(f":{c} - [0:0]" for c in chains)]
    lines += [jump_rule(c) for c in jumps]
    lines += [*rules, "COMMIT"]
    return "\n".join(lines) + "\n"


def test_a_short_chain_name_is_kept_whole_in_its_marker() -> None:
    assert marker_chain("IP-MASQ-AGENT") == "IPMASQ-OWNS-IP-MASQ-AGENT"
    assert marker_chain("IP-MASQ") == "IPMASQ-OWNS-IP-MASQ"
    assert marker_chain("A" * 15) == "IPMASQ-OWNS-" + "A" * 15  # 27 characters: the longest whole form


def test_a_long_chain_name_is_abbreviated_and_hashed_into_exactly_28_characters() -> None:
    long = "IP-MASQ-AGENT-FOR-TENANT-B"
    marker = marker_chain(long)
    assert len(marker) == CHAIN_NAME_MAX and marker.startswith("IPMASQ-OWNS-IP-MASQ-")
    assert marker == marker_chain(long)  # deterministic: the uninstall of another process finds it
    assert marker != marker_chain("IP-MASQ-AGENT-FOR-TENANT-C")
    assert marker_chain("A" * 16) != "IPMASQ-OWNS-" + "A" * 16


@given(CHAIN_NAMES, CHAIN_NAMES)
def test_markers_fit_iptables_and_two_chains_never_share_one(a: str, b: str) -> None:
    assert len(marker_chain(a)) <= CHAIN_NAME_MAX and is_marker(marker_chain(a))
    # whole names are at most 27 characters and hashed ones exactly 28: the two forms never meet
    assert (len(marker_chain(a)) == CHAIN_NAME_MAX) == (len(a) > 15)
    if a != b and len(a) <= 15:
        assert marker_chain(a) != marker_chain(b)


def test_a_masq_chain_may_not_be_named_like_a_marker() -> None:
    with pytest.raises(UsageError, match="IPMASQ-OWNS-, the names of ipmasq's ownership markers"):
        check_chain_name("IPMASQ-OWNS-X")
    assert check_chain_name("IPMASQ-OWN") == "IPMASQ-OWN"


def test_a_chain_with_the_reference_agents_comments_but_no_marker_is_not_ours() -> None:
    text = table("IP-MASQ", jumps=("IP-MASQ",), rules=(f"-A IP-MASQ {COMMENT} -d 10.0.0.0/8 -j RETURN",))
    ownership = chain_ownership(parse_save(text), "IP-MASQ")
    assert (ownership.owned, ownership.unmarked, ownership.markers, ownership.orphans) == ((), ("IP-MASQ",), (), ())


def marked(chain: str, rules: tuple[str, ...], *, jumped: bool = True) -> tuple[str, ...]:
    """`chain`'s rules and its marker's record, as ipmasq writes them (the jump, when `jumped`, goes in `table`)."""
    canonical_rules = [canonical(r) for r in rules]
    jumps = [canonical(jump_rule(chain))] if jumped else []
    return (*rules, marker_rule(chain, chain_digest(chain, jumps, canonical_rules)))


def test_a_marked_chain_is_ours_while_it_holds_what_its_marker_records_and_a_marker_alone_is_an_orphan() -> None:
    ours = (f"-A IP-MASQ-AGENT {COMMENT} -d 10.0.0.0/8 -j RETURN",)
    text = table("IP-MASQ-AGENT", "IPMASQ-OWNS-IP-MASQ-AGENT", "EMPTIED", "IPMASQ-OWNS-EMPTIED", "IPMASQ-OWNS-GONE",
                 "OLD", "IPMASQ-OWNS-OLD", "IP-MASQ", "KUBE-POSTROUTING", jumps=("IP-MASQ-AGENT", "IP-MASQ"),
                 rules=(*marked("IP-MASQ-AGENT", ours),
                        # flushed by hand since ipmasq wrote it: its marker records the rule it held
                        *marked("EMPTIED", (f"-A EMPTIED {COMMENT} -d 10.0.0.0/8 -j RETURN",), jumped=False)[1:],
                        f"-A OLD {COMMENT} -d 10.0.0.0/8 -j RETURN",  # an empty marker records nothing
                        f"-A IP-MASQ {COMMENT} -d 10.0.0.0/8 -j RETURN", "-A KUBE-POSTROUTING -j RETURN"))
    ownership = chain_ownership(parse_save(text), "IP-MASQ-AGENT")
    assert ownership.owned == ("IP-MASQ-AGENT",)
    assert ownership.changed == ("EMPTIED", "OLD")  # marked once, another program's now
    assert ownership.unmarked == ("IP-MASQ",)  # GKE's, beside ours: not ours
    assert ownership.markers == ("IPMASQ-OWNS-EMPTIED", "IPMASQ-OWNS-GONE", "IPMASQ-OWNS-IP-MASQ-AGENT",
                                 "IPMASQ-OWNS-OLD")
    assert ownership.orphans == ("IPMASQ-OWNS-GONE",)
    assert "KUBE-POSTROUTING" not in ownership.owned + ownership.unmarked + ownership.changed


def test_the_digest_covers_the_jump_and_every_rule_in_order() -> None:
    rules = (f"-A IP-MASQ-AGENT {COMMENT} -d 10.0.0.0/8 -j RETURN",
             f"-A IP-MASQ-AGENT {COMMENT} -d 172.16.0.0/12 -j RETURN")
    text = table("IP-MASQ-AGENT", "IPMASQ-OWNS-IP-MASQ-AGENT", jumps=("IP-MASQ-AGENT",),
                 rules=marked("IP-MASQ-AGENT", rules))
    assert chain_ownership(parse_save(text), "IP-MASQ-AGENT").owned == ("IP-MASQ-AGENT",)
    swapped = text.replace("10.0.0.0/8", "SWAP").replace("172.16.0.0/12", "10.0.0.0/8").replace("SWAP",
                                                                                                 "172.16.0.0/12")
    without_jump = "\n".join(line for line in text.splitlines() if not line.startswith("-A POSTROUTING"))
    doubled_jump = text.replace("COMMIT", jump_rule("IP-MASQ-AGENT") + "\nCOMMIT")
    counted = text.replace("-A IP-MASQ-AGENT -m", "[5:300] -A IP-MASQ-AGENT -m")  # counters are not content
    for changed in (swapped, without_jump + "\n", doubled_jump):
        assert chain_ownership(parse_save(changed), "IP-MASQ-AGENT").changed == ("IP-MASQ-AGENT",), changed
        # the chain an agent enforces is taken whatever it holds: not hashed
        assert chain_ownership(parse_save(changed), "IP-MASQ-AGENT", taken="IP-MASQ-AGENT").owned == (
            "IP-MASQ-AGENT",)
    assert chain_ownership(parse_save(counted), "IP-MASQ-AGENT").owned == ("IP-MASQ-AGENT",)


def test_a_marker_records_only_its_one_rule_of_the_exact_form() -> None:
    digest = "0" * 64
    rule = marker_rule("IP-MASQ-AGENT", digest)
    assert rule == ('-A IPMASQ-OWNS-IP-MASQ-AGENT -m comment --comment "ipmasq wrote sha256:' + digest
                    + '" -j RETURN')
    marker = "IPMASQ-OWNS-IP-MASQ-AGENT"
    assert recorded_digest(marker, [canonical(rule)]) == digest
    assert recorded_digest(marker, []) is None  # an empty marker: an earlier development build's
    assert recorded_digest(marker, [rule, rule]) is None
    assert recorded_digest("IPMASQ-OWNS-OTHER", [rule]) is None  # another marker's record
    assert recorded_digest(marker, [rule.replace("-j RETURN", "-j ACCEPT")]) is None
    assert recorded_digest(marker, [rule.replace(digest, digest[:-1])]) is None
    assert not is_marker_rule(f"-A IP-MASQ-AGENT {COMMENT} -j RETURN") and is_marker_rule(rule)


def test_a_builtin_chain_is_never_owned_even_beside_a_marker_of_its_name() -> None:
    ownership = chain_ownership(parse_save(table("IPMASQ-OWNS-POSTROUTING")), "IP-MASQ-AGENT")
    assert ownership.owned == () and ownership.orphans == ("IPMASQ-OWNS-POSTROUTING",)
