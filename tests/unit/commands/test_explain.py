"""A packet has one family: an IPv4-mapped IPv6 address is its IPv4 address, and mixing families is an error."""

from __future__ import annotations

import json

import pytest

from ipmasq.cli import main
from ipmasq.policy.prefix import Family, parse_address


def test_v4_mapped_address_is_the_ipv4_address() -> None:
    assert parse_address("::ffff:8.8.8.8") == parse_address("8.8.8.8") == (Family.V4, 0x08080808)
    assert parse_address("::ffff:10.1.2.3")[0] is Family.V4
    assert parse_address("fd00::1")[0] is Family.V6


def test_explain_answers_a_v4_mapped_destination_as_ipv4(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["explain", "::ffff:10.1.2.3", "10.1.2.3", "-o", "json"]) == 0
    mapped, plain = json.loads(capsys.readouterr().out)
    assert mapped["masquerade"] is plain["masquerade"] is False
    assert mapped["matched"] == plain["matched"] == "10.0.0.0/8"


def test_v4_mapped_destination_goes_through_cloud_nat_like_ipv4(capsys: pytest.CaptureFixture[str]) -> None:
    common = ["--cloud-nat", "ALL_IP_RANGES", "--nat-ip", "203.0.113.9", "--source", "10.44.14.15", "--node-ip",
              "10.142.15.203", "--pod-range", "10.44.0.0/14", "--node-range", "10.142.0.0/20", "-o", "json"]
    assert main(["explain", "::ffff:8.8.8.8", "8.8.8.8", *common]) == 0
    mapped, plain = json.loads(capsys.readouterr().out)
    assert mapped["source_seen"] == plain["source_seen"] == "203.0.113.9"


@pytest.mark.parametrize(("flag", "value", "destination"), [
    ("--node-ip", "fd00::1", "8.8.8.8"),
    ("--source", "fd00::5", "8.8.8.8"),
    ("--node-ip", "10.0.0.1", "2001:db8::1"),
])
def test_mixed_families_are_a_usage_error(flag: str, value: str, destination: str,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["explain", destination, flag, value, "--enable-ipv6"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ipmasq explain: ") and "one family" in err and err.count("\n") == 1
