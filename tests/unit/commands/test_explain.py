"""A packet has one family: an IPv4-mapped IPv6 address is its IPv4 address, and mixing families is an error.

`ipmasq explain` with config rules: which rule decided (name, file:line), what the destination sees, and what
the answer depends on when the packet's source, protocol or port are not given.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ipmasq.cli import main
from ipmasq.prefix import Family, parse_address
from tests.configs import PARTNER_ENDPOINT_RULE


def test_v4_mapped_address_is_the_ipv4_address() -> None:
    assert parse_address("::ffff:8.8.8.8") == parse_address("8.8.8.8") == (Family.V4, 0x08080808)
    assert parse_address("::ffff:10.1.2.3")[0] is Family.V4
    assert parse_address("fd00::1")[0] is Family.V6


def test_explain_answers_a_v4_mapped_destination_as_ipv4(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["explain", "::ffff:10.1.2.3", "10.1.2.3", "-o", "json"]) == 0
    mapped, plain = json.loads(capsys.readouterr().out)["results"]
    assert mapped["masquerade"] is plain["masquerade"] is False
    assert mapped["matched"] == plain["matched"] == "10.0.0.0/8"


def test_v4_mapped_destination_goes_through_cloud_nat_like_ipv4(capsys: pytest.CaptureFixture[str]) -> None:
    common = ["--cloud-nat", "ALL_IP_RANGES", "--nat-ip", "203.0.113.9", "--source", "10.44.14.15", "--node-ip",
              "10.142.15.203", "--pod-range", "10.44.0.0/14", "--node-range", "10.142.0.0/20", "-o", "json"]
    assert main(["explain", "::ffff:8.8.8.8", "8.8.8.8", *common]) == 0
    mapped, plain = json.loads(capsys.readouterr().out)["results"]
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


CONFIG = """\
nonMasqueradeCIDRs: [10.0.0.0/8]
rules:
""" + PARTNER_ENDPOINT_RULE + """\
  - name: vpn-masq
    destinations: [10.1.0.0/16]
    action: masquerade
"""
NODE_IP = "10.142.15.203"


@pytest.fixture
def config(tmp_path: Path) -> str:
    path = tmp_path / "ip-masq-agent"
    path.write_text(CONFIG)
    return str(path)


def explain(capsys: pytest.CaptureFixture[str], *args: str) -> list[dict[str, object]]:
    assert main(["explain", *args, "--node-ip", NODE_IP, "-o", "json"]) == 0
    answers: list[dict[str, object]] = json.loads(capsys.readouterr().out)["results"]
    return answers


def test_the_deciding_rule_and_the_address_the_destination_sees(capsys: pytest.CaptureFixture[str],
                                                                config: str) -> None:
    packet = ["--config", config, "--node-name", "gke-prod-egress-2", "--source", "100.64.7.1", "--protocol", "tcp"]
    (snat,) = explain(capsys, "10.1.2.100", *packet, "--port", "8080")
    assert (snat["rule_name"], snat["defined_at"], snat["action"]) == ("partner-endpoint", f"{config}:3", "snat")
    assert snat["source_seen"] == snat["snat_to"] == "10.142.0.50" and snat["matched"] == "10.1.2.100/32"
    assert snat["reason"] == "rule" and snat["depends_on"] == [] and snat["if_matched_first"] == []
    (masq,) = explain(capsys, "10.1.2.100", *packet, "--port", "22")
    assert (masq["rule_name"], masq["defined_at"], masq["source_seen"]) == ("vpn-masq", f"{config}:11", NODE_IP)
    (kept,) = explain(capsys, "10.9.0.1", *packet, "--port", "22")
    assert kept["rule_name"] is None and kept["source_seen"] == "100.64.7.1" and kept["matched"] == "10.0.0.0/8"


def test_another_node_has_no_such_rule(capsys: pytest.CaptureFixture[str], config: str) -> None:
    (answer,) = explain(capsys, "10.1.2.100", "--config", config, "--node-name", "gke-prod-batch-1",
                        "--source", "100.64.7.1", "--protocol", "tcp", "--port", "443")
    assert answer["rule_name"] == "vpn-masq"


def test_what_the_answer_depends_on_when_fields_are_not_given(capsys: pytest.CaptureFixture[str],
                                                              config: str) -> None:
    (answer,) = explain(capsys, "10.1.2.100", "--config", config, "--node-name", "gke-prod-egress-2")
    assert answer["rule_name"] == "vpn-masq" and answer["depends_on"] == ["source", "protocol", "port"]
    assert answer["if_matched_first"] == [{"rule_name": "partner-endpoint", "defined_at": f"{config}:3",
                                           "action": "snat", "snat_to": "10.142.0.50"}]
    assert main(["explain", "10.1.2.100", "--config", config, "--node-name", "gke-prod-egress-2", "--source",
                 "100.64.7.1", "--protocol", "tcp"]) == 0
    text = capsys.readouterr().out
    assert "MASQUERADED to the node IP" in text and "Depends on port (not given)" in text
    assert f"rule partner-endpoint ({config}:3): snat to 10.142.0.50" in text


def test_node_name_comes_from_the_environment(capsys: pytest.CaptureFixture[str], config: str,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NODE_NAME", raising=False)
    assert main(["explain", "10.1.2.100", "--config", config]) == 1
    assert "node name is unknown" in capsys.readouterr().err
    monkeypatch.setenv("NODE_NAME", "gke-prod-egress-9")
    assert main(["explain", "10.1.2.100", "--config", config, "--source", "100.64.0.9", "--protocol", "tcp",
                 "--port", "443"]) == 0
    assert "SNAT to 10.142.0.50; the destination sees 10.142.0.50" in capsys.readouterr().out


@pytest.mark.parametrize(("args", "message"), [
    (["--port", "443"], "--port needs --protocol tcp, udp or sctp"),
    (["--protocol", "icmp", "--port", "1"], "--port needs --protocol"),
    (["--protocol", "tcp", "--port", "70000"], "is not a port"),
    (["--protocol", "gre"], "invalid choice"),
])
def test_bad_packet_flags_are_usage_errors(capsys: pytest.CaptureFixture[str], args: list[str], message: str) -> None:
    assert main(["explain", "10.1.2.100", *args]) == 2
    assert message in capsys.readouterr().err


def test_without_the_addresses_the_answer_is_still_a_sentence(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["explain", "10.1.2.3", "8.8.8.8"]) == 0
    kept, masqueraded = capsys.readouterr().out.splitlines()
    assert kept == ("10.1.2.3: NOT masqueraded (keeps the pod IP); the destination sees the pod's IP. Matched "
                    "10.0.0.0/8 (built-in). Why: in the agent's default non-masquerade list.")
    assert masqueraded.startswith("8.8.8.8: MASQUERADED to the node IP; the destination sees the node's IP. Why:")
    assert main(["explain", "10.1.2.3", "-o", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["results"][0]["source_seen"] == "pod"  # the JSON keeps its word
