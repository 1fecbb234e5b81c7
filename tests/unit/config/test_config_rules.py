"""The `rules` section: every field's errors name the file, the line and the value, in one line."""

from __future__ import annotations

import pytest

from ipmasq.config import ConfigInput, config_from_bytes
from ipmasq.config.model import RuleAction
from ipmasq.errors import ConfigError
from ipmasq.options import PolicyOptions, PortRange
from ipmasq.policy.prefix import Family, parse_cidr

NAME = "/etc/config/ip-masq-agent"
V4 = PolicyOptions(node_name="gke-prod-egress-1")
V6 = PolicyOptions(enable_ipv6=True, node_name="gke-prod-egress-1")
NO_V6 = PolicyOptions(enable_ipv6=False, node_name="gke-prod-egress-1")  # --enable-ipv6=false given

FULL = """\
nonMasqueradeCIDRs: [10.0.0.0/8]
rules:
  - name: partner-endpoint
    destinations: [10.1.2.100/32]
    sources: [100.64.0.0/16]
    protocol: tcp
    ports: [443, "8000-8080"]
    nodes: ["gke-prod-egress-*"]
    action: snat
    snatTo: 10.142.0.50
  - name: keep-vpn
    destinations: [192.168.0.0/16, 172.16.0.0/12]
    action: preserve
"""


def load(text: str, options: PolicyOptions = V4, name: str = NAME):
    return config_from_bytes(ConfigInput(((name, text.encode()),)), options)


def error_of(text: str, options: PolicyOptions = V4) -> ConfigError:
    with pytest.raises(ConfigError) as raised:
        load(text, options)
    assert "\n" not in str(raised.value)
    return raised.value


def one_rule(body: str) -> str:
    """A config with one rule; `body` is its lines after `- name: r`, indented by four spaces."""
    return "rules:\n  - name: r\n" + "".join(f"    {line}\n" for line in body.splitlines())


def test_every_field_is_read() -> None:
    config = load(FULL)
    first, second = config.rules
    assert first.name == "partner-endpoint" and first.where() == f"{NAME}:3"
    assert first.destinations == (parse_cidr("10.1.2.100/32"),)
    assert first.sources == (parse_cidr("100.64.0.0/16"),)
    assert (first.protocol, first.ports, first.nodes) == ("tcp", ((443, 443), (8000, 8080)), ("gke-prod-egress-*",))
    assert (first.action, first.snat_to, first.family) == (RuleAction.SNAT, "10.142.0.50", Family.V4)
    assert second.action is RuleAction.PRESERVE and second.sources == () and second.protocol is None
    assert second.where() == f"{NAME}:11"
    assert [str(e.prefix) for e in config.non_masquerade] == ["10.0.0.0/8"]


def test_json_config_rules() -> None:
    text = ('{"rules": [{"name": "a", "destinations": ["10.1.0.0/16"], "protocol": "udp", "ports": [53],\n'
            ' "action": "masquerade"}]}')
    (rule,) = load(text).rules
    assert rule.ports == ((53, 53),) and rule.action is RuleAction.MASQUERADE


def test_a_config_without_rules_has_none() -> None:
    assert load("nonMasqueradeCIDRs: [10.0.0.0/8]\n").rules == ()
    assert load("rules: null\n").rules == ()


@pytest.mark.parametrize(("body", "line", "words"), [
    ("destinations: [10.1.0.0/16]\naction: preserve\ncolour: blue", 5, ['unknown key "colour"']),
    ("destinations: [10.1.0.0/16]\naction: preserve\naction: snat", 5, ["action is given twice", "line 4"]),
    ("action: preserve", 2, ["destinations is required"]),
    ("destinations: 10.1.0.0/16\naction: preserve", 3, ["destinations must be a list", '"10.1.0.0/16"']),
    ("destinations: []\naction: preserve", 3, ["destinations is an empty list"]),
    ("destinations: [10.1.0.1/16]\naction: preserve", 3, ["not aligned", "10.1.0.1/16"]),
    ("destinations: [10.1.0.0/16, 'fd00::/8']\naction: preserve", 3, ["one family per rule", "fd00::/8"]),
    ("destinations: ['fd00::/8']\naction: preserve", 3, ["needs IPv6 enabled", "fd00::/8"]),
    ("destinations: [10.1.0.0/16]\nsources: [nope]\naction: preserve", 4, ["sources", "nope"]),
    ("destinations: [10.1.0.0/16]\nsources: ['fd00::/8']\naction: preserve", 4, ["IPv6", "one family"]),
    ("destinations: [10.1.0.0/16]\nprotocol: tcpp\naction: preserve", 4, ['"tcpp"', "tcp, udp, sctp, icmp"]),
    ("destinations: [10.1.0.0/16]\nprotocol: 6\naction: preserve", 4, ["the number 6"]),
    ("destinations: [10.1.0.0/16]\nprotocol: icmpv6\naction: preserve", 4, ["icmpv6 is not an IPv4 protocol"]),
    ("destinations: [10.1.0.0/16]\nports: [443]\naction: preserve", 4, ["ports need protocol tcp, udp or sctp"]),
    ("destinations: [10.1.0.0/16]\nprotocol: icmp\nports: [1]\naction: preserve", 5, ["protocol icmp"]),
    ("destinations: [10.1.0.0/16]\nprotocol: tcp\nports: [70000]\naction: preserve", 5, ['"70000"', "65535"]),
    ("destinations: [10.1.0.0/16]\nprotocol: tcp\nports: ['9-1']\naction: preserve", 5, ['"9-1"', "low before"]),
    ("destinations: [10.1.0.0/16]\nprotocol: tcp\nports: ['http']\naction: preserve", 5, ['"http"', "a port"]),
    ("destinations: [10.1.0.0/16]\nprotocol: tcp\nports: [true]\naction: preserve", 5, ["the boolean true"]),
    ("destinations: [10.1.0.0/16]\nnodes: ['a b']\naction: preserve", 4, ['"a b"', "not a node-name glob"]),
    ("destinations: [10.1.0.0/16]\nnodes: node-1\naction: preserve", 4, ["nodes must be a list"]),
    ("destinations: [10.1.0.0/16]", 2, ["action is required"]),
    ("destinations: [10.1.0.0/16]\naction: drop", 4, ['"drop"', "masquerade, preserve or snat"]),
    ("destinations: [10.1.0.0/16]\naction: snat", 4, ["action snat needs snatTo"]),
    ("destinations: [10.1.0.0/16]\naction: masquerade\nsnatTo: 10.0.0.1", 5, ["snatTo is only for action snat"]),
    ("destinations: [10.1.0.0/16]\naction: snat\nsnatTo: 10.0.0.0/24", 5, ['"10.0.0.0/24"', "not an IP address"]),
    ("destinations: [10.1.0.0/16]\naction: snat\nsnatTo: 'fd00::1'", 5, ["IPv6", "destinations are IPv4"]),
])
def test_field_errors_name_file_line_and_value(body: str, line: int, words: list[str]) -> None:
    # --enable-ipv6=false refuses an IPv6 CIDR where it is written; without the flag the config's enableIPv6 decides
    error = error_of(one_rule(body), V6 if "one family" in " ".join(words) else NO_V6)
    message = str(error)
    assert message.startswith(f"{NAME}:{line}: rules[0] (r): "), message
    assert error.line == line
    for word in words:
        assert word in message, (word, message)


@pytest.mark.parametrize("name", ["", "Upper", "-lead", "trail-", "a_b", "x" * 41, "1" * 200])
def test_bad_names(name: str) -> None:
    error = error_of(f"rules:\n  - name: '{name}'\n    destinations: [10.1.0.0/16]\n    action: preserve\n")
    assert error.line == 2 and "rules[0]: name" in str(error)
    assert len(str(error)) < 300  # a long value is clipped


def test_rules_must_be_a_list_of_mappings() -> None:
    assert "rules must be a list" in str(error_of("rules: {name: a}\n"))
    error = error_of("rules:\n  - just-a-name\n")
    assert error.line == 2 and "each rule must be a mapping" in str(error)
    assert "name is required" in str(error_of("rules:\n  - destinations: [10.1.0.0/16]\n    action: preserve\n"))


def test_a_long_value_is_clipped() -> None:
    message = str(error_of(one_rule("destinations: [10.1.0.0/16]\naction: " + "x" * 10_000)))
    assert len(message) < 300 and "\u2026" in message


def test_a_name_used_twice_in_one_file() -> None:
    text = ("rules:\n  - name: a\n    destinations: [10.1.0.0/16]\n    action: preserve\n"
            "  - name: a\n    destinations: [10.2.0.0/16]\n    action: preserve\n")
    error = error_of(text)
    assert error.line == 5 and f"used twice (first at {NAME}:2)" in str(error)


def test_directory_rules_are_concatenated_in_file_order_and_names_unique() -> None:
    a = ("/cfg/ip-masq-a", b"rules:\n  - name: first\n    destinations: [10.1.0.0/16]\n    action: preserve\n")
    b = ("/cfg/ip-masq-b", b"rules:\n  - name: second\n    destinations: [10.2.0.0/16]\n    action: masquerade\n")
    config = config_from_bytes(ConfigInput((a, b)), V4)
    assert [r.name for r in config.rules] == ["first", "second"]
    assert config.rules[1].where() == "/cfg/ip-masq-b:2"
    twice = ("/cfg/ip-masq-c", b"\nrules:\n  - name: first\n    destinations: [10.3.0.0/16]\n    action: preserve\n")
    with pytest.raises(ConfigError) as raised:
        config_from_bytes(ConfigInput((a, b, twice)), V4)
    assert str(raised.value) == ('/cfg/ip-masq-c:3: rule name "first" is used in /cfg/ip-masq-a:2 and in '
                                 "/cfg/ip-masq-c:3; names are unique across all config files")


def test_ipv6_rules_with_the_flag() -> None:
    text = one_rule("destinations: ['fd00:1::/64']\nprotocol: icmpv6\naction: snat\nsnatTo: 'fd00::0:5'")
    (rule,) = load(text, V6).rules
    assert rule.family is Family.V6 and rule.snat_to == "fd00::5"


def test_a_node_rule_without_a_node_name_is_an_error() -> None:
    text = one_rule("destinations: [10.1.0.0/16]\nnodes: [pool-a-*]\naction: preserve")
    assert load(text, V4).rules[0].nodes == ("pool-a-*",)
    error = error_of(text, PolicyOptions())
    assert error.line == 2 and '"pool-a-*"' in str(error) and "node name is unknown" in str(error)


def test_to_ports_with_a_rewriting_rule_is_an_error_not_ignored() -> None:
    with_ports = PolicyOptions(to_ports=(PortRange(32768, 65535),))
    assert load(one_rule("destinations: [10.1.0.0/16]\naction: preserve"), with_ports).rules
    error = error_of(one_rule("destinations: [10.1.0.0/16]\naction: masquerade"), with_ports)
    assert "--to-ports is not supported yet" in str(error) and error.line == 2


def test_enable_ipv6_in_the_config() -> None:
    assert load("enableIPv6: true\n", V6).rules == ()
    assert load("enableIPv6: false\n", V4).warnings == ()  # a known key: no "unknown key" warning
    assert 'got the string "yes"' in str(error_of('enableIPv6: "yes"\n', V6))


def test_enable_ipv6_from_the_config_decides_without_the_flag() -> None:
    from ipmasq.policy.policy import Policy

    text = "nonMasqueradeCIDRs: [10.0.0.0/8, 'fd00::/8']\nenableIPv6: true\n" + FULL.split("\n", 1)[1] + \
        "  - name: v6-snat\n    destinations: ['2001:db8::/32']\n    action: snat\n    snatTo: 'fd00::50'\n"
    config = load(text, V4)
    assert config.enable_ipv6 is True
    policy = Policy(config, V4)
    assert policy.families == (Family.V4, Family.V6)
    assert [r.name for r in policy.rules(Family.V6)] == ["v6-snat"]
    assert policy.verdict("fd00::1").masquerade is False
    # the flag, when given, wins: false means no IPv6 rules at all (the CIDRs are refused as without enableIPv6)
    error = error_of(text, NO_V6)
    assert error.line == 1 and "fd00::/8" in str(error) and "--enable-ipv6" in str(error)
    assert Policy(load("enableIPv6: true\n", NO_V6), NO_V6).families == (Family.V4,)
    assert "overridden by --enable-ipv6=false" in " ".join(load("enableIPv6: true\n", NO_V6).warnings)
    # false or absent: no IPv6, and an IPv6 CIDR or rule is refused, naming file and line
    for switch in ("enableIPv6: false\n", ""):
        assert Policy(load(switch, V4), V4).families == (Family.V4,)
        error = error_of("nonMasqueradeCIDRs: [10.0.0.0/8, 'fd00::/8']\n" + switch, V4)
        assert error.line == 1 and "ipv6 is not enabled, but ipv6 cidr fd00::/8 provided" in str(error)
        error = error_of(one_rule("destinations: ['fd00::/8']\naction: preserve") + switch, V4)
        assert error.line == 2 and "rule r: ipv6 cidr fd00::/8 needs IPv6 enabled" in str(error)
        assert "enableIPv6: true" in str(error)


def test_enable_ipv6_across_a_config_directory() -> None:
    files = ((f"{NAME}/ip-masq-a", b"nonMasqueradeCIDRs: ['fd00::/8']\n"), (f"{NAME}/ip-masq-b", b"enableIPv6: true\n"))
    config = config_from_bytes(ConfigInput(files), V4)
    assert config.enable_ipv6 is True and [str(e.prefix) for e in config.non_masquerade] == ["fd00::/8"]
    clash = ((f"{NAME}/ip-masq-a", b"enableIPv6: false\n"), (f"{NAME}/ip-masq-b", b"enableIPv6: true\n"))
    with pytest.raises(ConfigError, match="enableIPv6 conflicts"):
        config_from_bytes(ConfigInput(clash), V4)
