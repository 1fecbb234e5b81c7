"""The reference agent's config semantics and our extensions (masqueradeCIDRs, config directories, limits).

The `rules` section: every field's errors name the file, the line and the value, in one line.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ipmasq.config import ConfigInput, config_from_bytes, load_config, parse_go_duration
from ipmasq.config.model import Origin, RuleAction
from ipmasq.errors import ConfigError, PrefixError
from ipmasq.options import PolicyOptions, PortRange
from ipmasq.prefix import Family, parse_cidr
from tests.configs import PARTNER_ENDPOINT_RULE

V4 = PolicyOptions()
V6 = PolicyOptions(enable_ipv6=True)


def load(text: str, options: PolicyOptions = V4, name: str = "/etc/config/ip-masq-agent"):
    return config_from_bytes(ConfigInput(((name, text.encode()),)), options)


def error_of(text: str, options: PolicyOptions = V4) -> str:
    with pytest.raises(ConfigError) as raised:
        load(text, options)
    message = str(raised.value)
    assert "\n" not in message
    return message


def cidrs(config) -> list[str]:
    return [str(e.prefix) for e in config.non_masquerade]


def test_missing_and_empty_mean_defaults() -> None:
    assert cidrs(load_config(None, V4)) == ["10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16"]
    assert cidrs(load("")) == ["10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16"]
    assert cidrs(load("# only a comment\n")) == ["10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16"]
    assert all(e.origin is Origin.DEFAULT for e in load("").non_masquerade)


def test_all_reserved_defaults() -> None:
    options = PolicyOptions(nomasq_all_reserved_ranges=True)
    assert cidrs(load_config(None, options))[-1] == "240.0.0.0/4"
    assert len(load_config(None, options).non_masquerade) == 11


def test_absent_key_keeps_default_list_null_or_empty_clears_it() -> None:
    assert cidrs(load("masqLinkLocal: true\n")) == ["10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16"]
    assert cidrs(load("nonMasqueradeCIDRs: null\n")) == []
    assert cidrs(load("nonMasqueradeCIDRs: []\n")) == []
    assert cidrs(load("nonMasqueradeCIDRs:\n")) == []


def test_keys_match_case_insensitively() -> None:
    config = load("nonMasqueradeCIDRS:\n  - 10.1.1.0/24\nMASQLINKLOCAL: true\n")
    assert cidrs(config) == ["10.1.1.0/24"]
    assert config.masq_link_local is True


def test_unknown_keys_are_accepted_with_a_warning() -> None:
    config = load("nonMasqueradeCIDRs: [10.0.0.0/8]\nfoo: bar\n")
    assert cidrs(config) == ["10.0.0.0/8"]
    assert any("unknown key 'foo'" in w and ":2:" in w for w in config.warnings)


@pytest.mark.parametrize("word,value", [("yes", True), ("on", True), ("no", False), ("off", False),
                                        ("true", True), ("False", False), ("y", True), ("n", False)])
def test_yaml_11_booleans(word: str, value: bool) -> None:
    assert load(f"masqLinkLocal: {word}\n").masq_link_local is value


def test_quoted_true_is_an_error() -> None:
    message = error_of('masqLinkLocal: "true"\n')
    assert message.startswith("/etc/config/ip-masq-agent:1:")
    assert 'the string "true"' in message


def test_number_interval_is_the_reference_error() -> None:
    message = error_of("resyncInterval: 60\n")
    assert 'expected string value for unmarshal to field of type Duration, got "60"' in message
    assert ":1:" in message


@pytest.mark.parametrize("text,seconds", [("60s", 60), ("1m30s", 90), ("500ms", 0.5), ("2h", 7200),
                                          ("1.5h", 5400), ("1h2m3s4ms", 3723.004), ("+5s", 5)])
def test_go_durations(text: str, seconds: float) -> None:
    assert parse_go_duration(text) == pytest.approx(seconds)
    assert load(f'resyncInterval: "{text}"\n').resync_interval == pytest.approx(seconds)


def test_json_escapes_in_duration() -> None:
    config = load('{"resyncInterval": "\\u0036\\u0030s"}', name="/c.json")
    assert config.resync_interval == 60


@pytest.mark.parametrize("text,fragment", [("60", "missing unit"), ("5x", 'unknown unit "x"'), ("abc", "invalid"),
                                           ("", "invalid")])
def test_bad_durations(text: str, fragment: str) -> None:
    assert fragment in error_of(f'resyncInterval: "{text}"\n')


@pytest.mark.parametrize("text", ["0s", "-1s", "0"])
def test_zero_or_negative_interval_is_an_error(text: str) -> None:
    assert "above zero" in error_of(f'resyncInterval: "{text}"\n')


def test_scalar_where_list_expected() -> None:
    message = error_of("nonMasqueradeCIDRs: 10.0.0.0/8\n")
    assert "must be a list" in message and '"10.0.0.0/8"' in message


def test_folded_list_item_is_reported_with_its_line() -> None:
    # an item indented deeper than its sibling folds into it: "10.0.0.0/8 - 172.16.0.0/12"
    message = error_of("nonMasqueradeCIDRs:\n  - 10.0.0.0/8\n    - 172.16.0.0/12\n")
    assert message.startswith("/etc/config/ip-masq-agent:2:")
    assert '"10.0.0.0/8 - 172.16.0.0/12"' in message


def test_invalid_and_misaligned_cidrs_name_line_and_value() -> None:
    message = error_of("nonMasqueradeCIDRs:\n  - 10.0.0.0/8\n  - 10.0.0.1/8\n")
    assert message == ('/etc/config/ip-masq-agent:3: CIDR "10.0.0.1/8" is not aligned to a CIDR block, '
                       'ip: "10.0.0.1" network: "10.0.0.0/8"')
    assert "could not be parsed, invalid CIDR address: 010.0.0.0/8" in error_of("nonMasqueradeCIDRs: [010.0.0.0/8]\n")
    assert "could not be parsed" in error_of("nonMasqueradeCIDRs: [10.0.0.0/33]\n")
    assert "could not be parsed" in error_of("nonMasqueradeCIDRs: [256.0.0.0/8]\n")
    assert "could not be parsed" in error_of("nonMasqueradeCIDRs: [10.0.0.0]\n")


def test_cidr_limit() -> None:
    many = "nonMasqueradeCIDRs:\n" + "".join(f"  - 10.{i}.0.0/16\n" for i in range(65))
    assert "can only accept up to 64 CIDRs (excluding link-local), but got 65 CIDRs" in error_of(many)
    assert len(load("cidrLimit: 65\n" + many).non_masquerade) == 65
    assert "whole number" in error_of('cidrLimit: "65"\n')


def test_ipv6_needs_the_flag() -> None:
    text = "nonMasqueradeCIDRs:\n  - 10.0.0.0/8\n  - fc00::/7\n"
    assert error_of(text).endswith(
        "ipv6 is not enabled, but ipv6 cidr fc00::/7 provided. Enable ipv6 using --enable-ipv6 agent flag")
    assert cidrs(load(text, V6)) == ["10.0.0.0/8", "fc00::/7"]
    assert "not aligned" in error_of("nonMasqueradeCIDRs: ['fc00::1/7']\n", V6)


def test_duplicates_are_kept_with_a_warning() -> None:
    config = load("nonMasqueradeCIDRs: [10.0.0.0/8, 10.0.0.0/8]\n")
    assert cidrs(config) == ["10.0.0.0/8", "10.0.0.0/8"]  # the reference writes both rules
    assert any("duplicate CIDR 10.0.0.0/8" in w for w in config.warnings)


def test_json_file() -> None:
    config = load('{"nonMasqueradeCIDRs": ["10.0.0.0/8", "192.168.0.0/16"], "masqLinkLocal": false, '
                  '"resyncInterval": "1m"}', name="/c.json")
    assert cidrs(config) == ["10.0.0.0/8", "192.168.0.0/16"]
    assert config.resync_interval == 60


def test_json_errors_point_at_the_line() -> None:
    text = '{\n  "nonMasqueradeCIDRs": [\n    "10.0.0.0/8",\n    "bad"\n  ]\n}\n'
    with pytest.raises(ConfigError) as raised:
        load(text, name="/c.json")
    assert str(raised.value).startswith("/c.json:4:")
    with pytest.raises(ConfigError) as raised:
        load('{\n  "a": 1,\n}\n', name="/c.json")
    assert str(raised.value).startswith("/c.json:3: JSON syntax error")


def test_yaml_syntax_error_points_at_the_line() -> None:
    message = error_of("nonMasqueradeCIDRs:\n  - 10.0.0.0/8\n bad: [\n")
    assert message.startswith("/etc/config/ip-masq-agent:")
    assert "YAML syntax error" in message


def test_top_level_must_be_a_mapping() -> None:
    assert "must be a mapping" in error_of("- 10.0.0.0/8\n")
    assert "must be a mapping" in error_of("hello\n")


def test_masquerade_cidrs_extension() -> None:
    config = load("nonMasqueradeCIDRs: [10.0.0.0/8]\nmasqueradeCIDRs: [10.11.0.0/24]\n")
    assert [str(e.prefix) for e in config.masquerade] == ["10.11.0.0/24"]
    assert config.masquerade[0].origin is Origin.EXCEPTION
    message = error_of("nonMasqueradeCIDRs: [10.0.0.0/8]\nmasqueradeCIDRs: [10.0.0.0/8]\n")
    assert "listed both in masqueradeCIDRs" in message and ":2" in message


def test_directory_merges_ip_masq_files(tmp_path: Path) -> None:
    (tmp_path / "ip-masq-agent").write_text("nonMasqueradeCIDRs: [10.0.0.0/8]\n")
    (tmp_path / "ip-masq-user").write_text("nonMasqueradeCIDRs: [192.168.0.0/16]\nmasqueradeCIDRs: [10.11.0.0/24]\n")
    (tmp_path / "other").write_text("this is ignored: [\n")
    (tmp_path / "..data").mkdir()
    config = load_config(str(tmp_path), V4)
    assert cidrs(config) == ["10.0.0.0/8", "192.168.0.0/16"]
    assert [str(e.prefix) for e in config.masquerade] == ["10.11.0.0/24"]
    assert len(config.sources) == 2


def test_directory_conflict_names_both_files(tmp_path: Path) -> None:
    (tmp_path / "ip-masq-a").write_text("nonMasqueradeCIDRs:\n  - 10.11.0.0/24\n")
    (tmp_path / "ip-masq-b").write_text("masqueradeCIDRs:\n  - 10.11.0.0/24\n")
    with pytest.raises(ConfigError) as raised:
        load_config(str(tmp_path), V4)
    message = str(raised.value)
    assert f"{tmp_path}/ip-masq-a:2" in message and f"{tmp_path}/ip-masq-b:2" in message


def test_directory_scalar_conflict(tmp_path: Path) -> None:
    (tmp_path / "ip-masq-a").write_text("resyncInterval: 10s\n")
    (tmp_path / "ip-masq-b").write_text("resyncInterval: 20s\n")
    with pytest.raises(ConfigError, match="resyncInterval conflicts"):
        load_config(str(tmp_path), V4)


def test_missing_path_is_an_error_for_offline_tools_but_defaults_for_the_agent(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such file"):
        load_config(str(tmp_path / "typo"), V4)
    assert cidrs(load_config(str(tmp_path / "typo"), V4, missing_ok=True))[0] == "10.0.0.0/8"


def test_binary_garbage_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="not UTF-8"):
        config_from_bytes(ConfigInput((("/x", b"\xff\xfe\x00bad"),)), V4)


# --- hostile input: one place for YAML errors, clipped values, Go's duration range -------------------------------


def test_yaml_errors_are_translated_in_one_place_for_the_loader_and_for_lint() -> None:
    import yaml

    from ipmasq.config.document import yaml_error

    def both(text: str) -> tuple[ConfigError, ConfigError]:
        with pytest.raises(yaml.YAMLError) as raised:
            list(yaml.compose_all(text, Loader=yaml.CSafeLoader))
        return yaml_error(raised.value, text, "f.yaml"), yaml_error(raised.value, text, "f.yaml", lint=True)

    loader, lint = both("metadata:\n  name: x\ndata\n  config: |\n")
    assert (str(loader), loader.line, loader.column) == (
        "f.yaml:4: YAML syntax error: could not find expected ':' (column 9)", 4, 9)
    assert (lint.message, lint.line, lint.column) == ("YAML syntax error: could not find expected ':'", 3, 1)
    loader, lint = both("a: b\x07\n")
    assert (str(loader), loader.column) == (
        "f.yaml:1: YAML syntax error: unacceptable character #x0007 (control characters are not allowed)", 5)
    assert (lint.message, lint.line, lint.column) == (
        "YAML error: unacceptable character #x0007: control characters are not allowed", 1, None)
    assert loader.code == lint.code == "yaml-syntax"


def test_values_in_messages_are_clipped() -> None:
    from ipmasq.config.document import clip, show_value

    assert show_value("10.0.0.0/8") == '"10.0.0.0/8"'
    assert show_value("x" * 61) == '"' + "x" * 60 + '\u2026"'
    assert show_value("\u00e9" * 100) == '"' + "\\u00e9" * 60 + '\u2026"'  # an escape is never cut in half
    assert clip("y" * 1000) == "y" * 60 + "\u2026"
    long_cidr = "10.0.0.0/8" + "0" * 100
    message = error_of(f"nonMasqueradeCIDRs: [{long_cidr}]\n")
    assert message == (f'/etc/config/ip-masq-agent:1: CIDR "{clip(long_cidr)}" could not be parsed, invalid CIDR '
                       f"address: {clip(long_cidr)}")


def test_resync_interval_within_go_duration_range() -> None:
    assert parse_go_duration("2562047h") == 2562047 * 3600.0  # the longest whole-hour Go duration
    for text in ("2562048h", "1000000000h", "-2562048h", "1" * 400 + "s"):
        with pytest.raises(ValueError, match=r"^time: invalid duration \""):
            parse_go_duration(text)
    assert error_of("resyncInterval: 1000000000h\n") == (
        '/etc/config/ip-masq-agent:1: resyncInterval: time: invalid duration "1000000000h"')


def test_a_cidr_limit_below_the_default_list_names_the_file_that_set_it() -> None:
    assert error_of("masqLinkLocal: true\ncidrLimit: 0\n").startswith(
        "/etc/config/ip-masq-agent:2: the daemon can only accept up to 0 CIDRs")


def test_a_json_number_too_long_for_python_is_a_config_error() -> None:
    assert error_of('{\n"cidrLimit": ' + "9" * 5000 + "}") == (
        "/etc/config/ip-masq-agent:2: JSON error: a number of more than 4,300 digits")


NAME = "/etc/config/ip-masq-agent"
V4_ON_NODE = PolicyOptions(node_name="gke-prod-egress-1")
V6_ON_NODE = PolicyOptions(enable_ipv6=True, node_name="gke-prod-egress-1")
NO_V6 = PolicyOptions(enable_ipv6=False, node_name="gke-prod-egress-1")  # --enable-ipv6=false given

FULL = """\
nonMasqueradeCIDRs: [10.0.0.0/8]
rules:
""" + PARTNER_ENDPOINT_RULE + """\
  - name: keep-vpn
    destinations: [192.168.0.0/16, 172.16.0.0/12]
    action: preserve
"""


def load_on_node(text: str, options: PolicyOptions = V4_ON_NODE, name: str = NAME):
    return config_from_bytes(ConfigInput(((name, text.encode()),)), options)


def rule_error_of(text: str, options: PolicyOptions = V4_ON_NODE) -> ConfigError:
    with pytest.raises(ConfigError) as raised:
        load_on_node(text, options)
    assert "\n" not in str(raised.value)
    return raised.value


def one_rule(body: str) -> str:
    """A config with one rule; `body` is its lines after `- name: r`, indented by four spaces."""
    return "rules:\n  - name: r\n" + "".join(f"    {line}\n" for line in body.splitlines())


def test_every_field_is_read() -> None:
    config = load_on_node(FULL)
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
    (rule,) = load_on_node(text).rules
    assert rule.ports == ((53, 53),) and rule.action is RuleAction.MASQUERADE


def test_a_config_without_rules_has_none() -> None:
    assert load_on_node("nonMasqueradeCIDRs: [10.0.0.0/8]\n").rules == ()
    assert load_on_node("rules: null\n").rules == ()


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
    error = rule_error_of(one_rule(body), V6_ON_NODE if "one family" in " ".join(words) else NO_V6)
    message = str(error)
    assert message.startswith(f"{NAME}:{line}: rules[0] (r): "), message
    assert error.line == line
    for word in words:
        assert word in message, (word, message)


@pytest.mark.parametrize("name", ["", "Upper", "-lead", "trail-", "a_b", "x" * 41, "1" * 200])
def test_bad_names(name: str) -> None:
    error = rule_error_of(f"rules:\n  - name: '{name}'\n    destinations: [10.1.0.0/16]\n    action: preserve\n")
    assert error.line == 2 and "rules[0]: name" in str(error)
    assert len(str(error)) < 300  # a long value is clipped


def test_rules_must_be_a_list_of_mappings() -> None:
    assert "rules must be a list" in str(rule_error_of("rules: {name: a}\n"))
    error = rule_error_of("rules:\n  - just-a-name\n")
    assert error.line == 2 and "each rule must be a mapping" in str(error)
    assert "name is required" in str(rule_error_of("rules:\n  - destinations: [10.1.0.0/16]\n    action: preserve\n"))


def test_a_long_value_is_clipped() -> None:
    message = str(rule_error_of(one_rule("destinations: [10.1.0.0/16]\naction: " + "x" * 10_000)))
    assert len(message) < 300 and "\u2026" in message


def test_a_name_used_twice_in_one_file() -> None:
    text = ("rules:\n  - name: a\n    destinations: [10.1.0.0/16]\n    action: preserve\n"
            "  - name: a\n    destinations: [10.2.0.0/16]\n    action: preserve\n")
    error = rule_error_of(text)
    assert error.line == 5 and f"used twice (first at {NAME}:2)" in str(error)


def test_directory_rules_are_concatenated_in_file_order_and_names_unique() -> None:
    a = ("/cfg/ip-masq-a", b"rules:\n  - name: first\n    destinations: [10.1.0.0/16]\n    action: preserve\n")
    b = ("/cfg/ip-masq-b", b"rules:\n  - name: second\n    destinations: [10.2.0.0/16]\n    action: masquerade\n")
    config = config_from_bytes(ConfigInput((a, b)), V4_ON_NODE)
    assert [r.name for r in config.rules] == ["first", "second"]
    assert config.rules[1].where() == "/cfg/ip-masq-b:2"
    twice = ("/cfg/ip-masq-c", b"\nrules:\n  - name: first\n    destinations: [10.3.0.0/16]\n    action: preserve\n")
    with pytest.raises(ConfigError) as raised:
        config_from_bytes(ConfigInput((a, b, twice)), V4_ON_NODE)
    assert str(raised.value) == ('/cfg/ip-masq-c:3: rule name "first" is used in /cfg/ip-masq-a:2 and in '
                                 "/cfg/ip-masq-c:3; names are unique across all config files")


def test_ipv6_rules_with_the_flag() -> None:
    text = one_rule("destinations: ['fd00:1::/64']\nprotocol: icmpv6\naction: snat\nsnatTo: 'fd00::0:5'")
    (rule,) = load_on_node(text, V6_ON_NODE).rules
    assert rule.family is Family.V6 and rule.snat_to == "fd00::5"


def test_a_node_rule_without_a_node_name_is_an_error() -> None:
    text = one_rule("destinations: [10.1.0.0/16]\nnodes: [pool-a-*]\naction: preserve")
    assert load_on_node(text, V4_ON_NODE).rules[0].nodes == ("pool-a-*",)
    error = rule_error_of(text, PolicyOptions())
    assert error.line == 2 and '"pool-a-*"' in str(error) and "node name is unknown" in str(error)


def test_to_ports_with_a_rewriting_rule_is_an_error_not_ignored() -> None:
    with_ports = PolicyOptions(to_ports=(PortRange(32768, 65535),))
    assert load_on_node(one_rule("destinations: [10.1.0.0/16]\naction: preserve"), with_ports).rules
    error = rule_error_of(one_rule("destinations: [10.1.0.0/16]\naction: masquerade"), with_ports)
    assert "--to-ports is not supported yet" in str(error) and error.line == 2


def test_enable_ipv6_in_the_config() -> None:
    assert load_on_node("enableIPv6: true\n", V6_ON_NODE).rules == ()
    assert load_on_node("enableIPv6: false\n", V4_ON_NODE).warnings == ()  # a known key: no "unknown key" warning
    assert 'got the string "yes"' in str(rule_error_of('enableIPv6: "yes"\n', V6_ON_NODE))


def test_enable_ipv6_from_the_config_decides_without_the_flag() -> None:
    from ipmasq.policy.policy import Policy

    text = "nonMasqueradeCIDRs: [10.0.0.0/8, 'fd00::/8']\nenableIPv6: true\n" + FULL.split("\n", 1)[1] + \
        "  - name: v6-snat\n    destinations: ['2001:db8::/32']\n    action: snat\n    snatTo: 'fd00::50'\n"
    config = load_on_node(text, V4_ON_NODE)
    assert config.enable_ipv6 is True
    policy = Policy(config, V4_ON_NODE)
    assert policy.families == (Family.V4, Family.V6)
    assert [r.name for r in policy.rules(Family.V6)] == ["v6-snat"]
    assert policy.verdict("fd00::1").masquerade is False
    # the flag, when given, wins: false means no IPv6 rules at all (the CIDRs are refused as without enableIPv6)
    error = rule_error_of(text, NO_V6)
    assert error.line == 1 and "fd00::/8" in str(error) and "--enable-ipv6" in str(error)
    assert Policy(load_on_node("enableIPv6: true\n", NO_V6), NO_V6).families == (Family.V4,)
    assert "overridden by --enable-ipv6=false" in " ".join(load_on_node("enableIPv6: true\n", NO_V6).warnings)
    # false or absent: no IPv6, and an IPv6 CIDR or rule is refused, naming file and line
    for switch in ("enableIPv6: false\n", ""):
        assert Policy(load_on_node(switch, V4_ON_NODE), V4_ON_NODE).families == (Family.V4,)
        error = rule_error_of("nonMasqueradeCIDRs: [10.0.0.0/8, 'fd00::/8']\n" + switch, V4_ON_NODE)
        assert error.line == 1 and "ipv6 is not enabled, but ipv6 cidr fd00::/8 provided" in str(error)
        error = rule_error_of(one_rule("destinations: ['fd00::/8']\naction: preserve") + switch, V4_ON_NODE)
        assert error.line == 2 and "rule r: ipv6 cidr fd00::/8 needs IPv6 enabled" in str(error)
        assert "enableIPv6: true" in str(error)


def test_enable_ipv6_across_a_config_directory() -> None:
    files = ((f"{NAME}/ip-masq-a", b"nonMasqueradeCIDRs: ['fd00::/8']\n"), (f"{NAME}/ip-masq-b", b"enableIPv6: true\n"))
    config = config_from_bytes(ConfigInput(files), V4_ON_NODE)
    assert config.enable_ipv6 is True and [str(e.prefix) for e in config.non_masquerade] == ["fd00::/8"]
    clash = ((f"{NAME}/ip-masq-a", b"enableIPv6: false\n"), (f"{NAME}/ip-masq-b", b"enableIPv6: true\n"))
    with pytest.raises(ConfigError, match="enableIPv6 conflicts"):
        config_from_bytes(ConfigInput(clash), V4_ON_NODE)


@pytest.mark.parametrize("text", ["\x00/", "10.0.0.0\x00/8", "10.0.0.0/\x008"])
def test_a_nul_in_a_cidr_is_a_cidr_that_cannot_be_parsed(text: str) -> None:
    """inet_pton takes a C string: a NUL raised ValueError past the parser, a traceback in the agent and lint."""
    with pytest.raises(PrefixError, match="could not be parsed"):
        parse_cidr(text)
