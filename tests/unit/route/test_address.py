"""MASQUERADE's address as the kernel picks it: inet_select_addr for IPv4, RFC 6724 as ipv6_dev_get_saddr applies
it for IPv6 (the kernel tests in tests/kernel/diagnose/test_path.py prove the measured cases against real TCP)."""

from __future__ import annotations

from ipmasq.prefix import Family, format_address, parse_address
from ipmasq.route.address import masquerade_v4, masquerade_v6
from ipmasq.route.facts import SCOPES, Address, Link


def _address(text: str, *flags: str, scope: str = "global") -> Address:
    address, _, length = text.partition("/")
    family, number = parse_address(address)
    return Address(family, number, int(length), SCOPES[scope], frozenset(flags))


def _v4(links: tuple[Link, ...], device: str, hop: str) -> str | None:
    chosen = masquerade_v4(links, device, parse_address(hop)[1])
    return None if chosen.address is None else format_address(Family.V4, chosen.address)


def _v6(links: tuple[Link, ...], device: str, destination: str) -> tuple[str | None, str | None]:
    chosen = masquerade_v6(links, device, parse_address(destination)[1])
    return (None if chosen.address is None else format_address(Family.V6, chosen.address)), chosen.undecided


LO = Link(1, "lo", addresses=(_address("127.0.0.1/8", scope="host"), _address("::1/128", scope="host")))


def test_the_primary_address_whose_subnet_holds_the_next_hop_never_a_secondary() -> None:
    eth1 = Link(3, "eth1", addresses=(_address("192.168.20.2/24"), _address("192.168.20.99/24", "secondary"),
                                      _address("10.9.0.2/16")))
    links = (LO, eth1)
    assert _v4(links, "eth1", "192.168.20.1") == "192.168.20.2"  # the measured case: not the route's src .99
    assert _v4(links, "eth1", "10.9.3.4") == "10.9.0.2"  # the second primary, whose subnet holds the hop
    assert _v4(links, "eth1", "198.51.100.1") == "192.168.20.2"  # no subnet holds it: the first primary
    chosen = masquerade_v4(links, "eth1", parse_address("192.168.20.1")[1])
    assert "eth1" in chosen.why and "192.168.20.1" in chosen.why


def test_an_interface_without_an_address_takes_the_first_global_one_of_the_node() -> None:
    tunnel = Link(4, "tun0", addresses=(_address("169.254.1.1/32", scope="link"),))
    eth0 = Link(2, "eth0", addresses=(_address("192.168.10.2/24"),))
    assert _v4((LO, eth0, tunnel), "tun0", "198.51.100.1") == "192.168.10.2"
    none = masquerade_v4((LO, tunnel), "tun0", parse_address("198.51.100.1")[1])
    assert none.address is None and "ate my IP address" in (none.undecided or "")
    assert masquerade_v4((LO,), "eth9", 1).undecided is not None  # an interface the node does not have


def test_ipv6_prefers_the_out_interface_then_the_label_then_the_longest_prefix() -> None:
    # the kernel lists an interface's addresses of one scope newest first: fd20::99 was added after fd20::2
    eth1 = Link(3, "eth1", addresses=(_address("fd20::99/64"), _address("fd20::2/64"),
                                      _address("fe80::1/64", scope="link")))
    eth0 = Link(2, "eth0", addresses=(_address("2001:db8:10::2/64"),))
    links = (LO, eth0, eth1)
    assert _v6(links, "eth1", "2001:db8:100::10") == ("fd20::99", None)  # out interface beats label and prefix
    assert _v6(links, "eth1", "fd20::7") == ("fd20::99", None)  # equal on every rule: the first listed
    assert _v6(links, "eth0", "fd30::10") == ("2001:db8:10::2", None)
    eth1b = Link(3, "eth1", addresses=(_address("fd20::99/64"), _address("2001:db8:20::2/64")))
    assert _v6((LO, eth0, eth1b), "eth1", "2001:db8:100::10") == ("2001:db8:20::2", None)  # the label (rule 6)
    eth1c = Link(3, "eth1", addresses=(_address("2001:db8:20::2/64"), _address("2001:db8:100::2/64")))
    assert _v6((LO, eth1c), "eth1", "2001:db8:100::10") == ("2001:db8:100::2", None)  # longest prefix (rule 8)


def test_ipv6_leaves_out_tentative_avoids_deprecated_and_says_when_temporary_decides() -> None:
    eth1 = Link(3, "eth1", addresses=(_address("fd20::5/64", "tentative"), _address("fd20::6/64", "deprecated"),
                                      _address("fd20::7/64")))
    assert _v6((LO, eth1), "eth1", "2001:db8::1") == ("fd20::7", None)
    privacy = Link(3, "eth1", addresses=(_address("2001:db8:1::aaaa/64", "temporary"),
                                         _address("2001:db8:1::2/64")))
    address, undecided = _v6((LO, privacy), "eth1", "2001:db8:9::1")
    assert address is None and undecided is not None and "use_tempaddr" in undecided


def test_a_link_local_destination_takes_only_the_out_interface() -> None:
    eth1 = Link(3, "eth1", addresses=(_address("fe80::1/64", scope="link"),))
    eth0 = Link(2, "eth0", addresses=(_address("fe80::2/64", scope="link"),))
    assert _v6((LO, eth0, eth1), "eth1", "fe80::99") == ("fe80::1", None)
