"""The command line: render and explain contracts, Go-style flags, one-line errors and exit codes."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from ipmasq.cli import COMMANDS, main
from ipmasq.goflags import normalise_go_flags
from tests.conftest import PYTHON


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_go_style_flags() -> None:
    assert normalise_go_flags(["-masq-chain=IP-MASQ", "-nomasq-all-reserved-ranges", "--enable-ipv6", "1.2.3.4"]) == [
        "--masq-chain=IP-MASQ", "--nomasq-all-reserved-ranges=true", "--enable-ipv6=true", "1.2.3.4"]
    assert normalise_go_flags(["--random-fully=false", "-v=2", "-logtostderr"]) == [
        "--random-fully=false", "--v=2", "--logtostderr=true"]


def test_render_gke(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "render", "-masq-chain=IP-MASQ", "--nomasq-all-reserved-ranges", "--random-fully=false")
    assert code == 0
    assert out.startswith("*nat\n:IP-MASQ - [0:0]\n")
    assert out.count("-j RETURN") == 12
    assert '(must be last in chain)" -j MASQUERADE\nCOMMIT\n' in out


def test_render_from_stdin() -> None:
    result = subprocess.run([PYTHON, "-m", "ipmasq", "render", "--config", "-"], input="nonMasqueradeCIDRs: []\n",
                            capture_output=True, text=True, check=True)
    assert result.stdout.count("-j RETURN") == 1  # link-local only


def test_render_missing_config_is_an_error(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, out, err = run(capsys, "render", "--config", str(tmp_path / "typo.yaml"))
    assert (code, out) == (3, "")  # could not run: nothing was read
    assert err == f"ipmasq render: {tmp_path}/typo.yaml: no such file or directory\n"


def test_bad_config_is_one_line_naming_file_line_and_value(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    config = tmp_path / "ip-masq-agent"
    config.write_text("nonMasqueradeCIDRs:\n  - 10.0.0.0/8\n  - 172.16.0.0/33\n")
    code, out, err = run(capsys, "render", "--config", str(config))
    assert code == 1 and out == ""
    assert err.count("\n") == 1
    assert f"{config}:3:" in err and '"172.16.0.0/33"' in err


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(capsys, "explain", "not-an-ip")[0] == 2
    assert run(capsys, "render", "--family", "6")[0] == 2
    assert run(capsys, "render", "--bogus") == (2, "", "ipmasq render: unrecognized arguments: --bogus\n")


def one_usage_line(capsys: pytest.CaptureFixture[str], command: str, *argv: str) -> str:
    """Runs `ipmasq COMMAND ARGV`, checks it is a usage error told in one line, returns the message."""
    code, out, err = run(capsys, command, *argv)
    assert (code, out) == (2, ""), err
    assert err.endswith("\n") and err.count("\n") == 1, err  # one line, no usage block
    assert err.startswith(f"ipmasq {command}: ") and "usage:" not in err
    return err[len(f"ipmasq {command}: "):-1]


@pytest.mark.parametrize("command", COMMANDS)
def test_an_unknown_flag_is_one_line_for_every_command(capsys: pytest.CaptureFixture[str], command: str) -> None:
    message = one_usage_line(capsys, command, "--no-such-flag")
    # commands with required arguments name those first, as argparse checks them before unknown flags
    assert message == "unrecognized arguments: --no-such-flag" or message.startswith(
        "the following arguments are required: ")


@pytest.mark.parametrize(("command", "argv", "message"), [
    ("render", ["--enable-ipv6=maybe"],
     '--enable-ipv6: invalid boolean value "maybe" (use --enable-ipv6, --enable-ipv6=true or --enable-ipv6=false)'),
    ("agent", ["--random-fully=maybe"],
     '--random-fully: invalid boolean value "maybe" (use --random-fully, --random-fully=true or --random-fully=false)'),
    ("agent", ["-flush-conntrack=yes"], '--flush-conntrack: invalid boolean value "yes" (use --flush-conntrack, '
                                        '--flush-conntrack=true or --flush-conntrack=false)'),
    ("render", ["--masq-chain", ""],
     '--masq-chain: "" is not a usable chain name (1-28 letters, digits, "-", "_", "."; not a built-in chain)'),
    ("agent", ["--masq-chain="],
     '--masq-chain: "" is not a usable chain name (1-28 letters, digits, "-", "_", "."; not a built-in chain)'),
    ("uninstall", ["--masq-chain=POSTROUTING"], '--masq-chain: "POSTROUTING" is not a usable chain name (1-28 '
                                                'letters, digits, "-", "_", "."; not a built-in chain)'),
    ("render", ["--to-ports", "abc"], '--to-ports: "abc" is not a port or a port range like 32768-65535'),
    ("agent", ["--once", "--to-ports=70000"],
     '--to-ports: "70000" must be ports between 1 and 65535, low before high'),
    ("explain", ["8.8.8.8", "-o", "xml"],
     "argument -o/--output: invalid choice: 'xml' (choose from 'text', 'json', 'yaml')"),
    ("lint", ["-", "--output=xml"], "argument -o/--output: invalid choice: 'xml' (choose from 'text', 'json', 'yaml')"),
    ("agent", ["--log-format", "yaml"], "argument --log-format: invalid choice: 'yaml' (choose from 'text', 'json')"),
    ("health", ["--timeout", "soon"], "argument --timeout: invalid float value: 'soon'"),
    # no abbreviations, as in Go; a near miss is named
    ("render", ["--enable"], "unrecognized arguments: --enable (did you mean --enable-ipv6?)"),
    ("render", ["--confg", "x"], "unrecognized arguments: --confg (did you mean --config?) x"),
    ("render", ["--backend", "iptabels"],
     "argument --backend: invalid choice: 'iptabels' (choose from 'iptables', 'nftables') (did you mean iptables?)"),
])
def test_bad_flag_values_are_usage_errors(capsys: pytest.CaptureFixture[str], command: str, argv: list[str],
                                          message: str) -> None:
    assert one_usage_line(capsys, command, *argv) == message


@pytest.mark.parametrize(("command", "argv", "flag", "value"), [
    ("render", ["--enable-ipv6", "false"], "enable-ipv6", "false"),
    ("explain", ["-enable-ipv6", "false", "8.8.8.8"], "enable-ipv6", "false"),  # else "false" is a destination
    ("lint", ["--nomasq-all-reserved-ranges", "true", "-"], "nomasq-all-reserved-ranges", "true"),  # ... a file
    ("agent", ["--once", "--random-fully", "0"], "random-fully", "0"),  # ... or --random-fully silently stays on
])
def test_a_boolean_flag_does_not_take_the_next_word(capsys: pytest.CaptureFixture[str], command: str,
                                                   argv: list[str], flag: str, value: str) -> None:
    assert one_usage_line(capsys, command, *argv) == (
        f'--{flag} {value}: a boolean flag takes its value after "=" (--{flag}={value}); alone, --{flag} means true')


def test_boolean_flags_take_go_forms(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["--enable-ipv6"], ["--enable-ipv6=true"], ["-enable-ipv6=1"], ["-enable-ipv6"]):
        code, out, _ = run(capsys, "render", "--family", "6", *argv)
        assert code == 0 and out.startswith("*nat\n"), argv
    assert run(capsys, "render", "--family", "6", "-enable-ipv6=false")[0] == 2  # no IPv6 rules to render
    # after "--" nothing is a flag
    assert normalise_go_flags(["--", "--enable-ipv6", "false"]) == ["--", "--enable-ipv6", "false"]


def test_without_or_with_an_unknown_command(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys)  # bare: the short usage, every command with its line
    assert (code, out) == (2, "") and err.startswith("usage: ipmasq COMMAND")
    assert all(f"\n  {name} " in err for name in COMMANDS)
    code, out, err = run(capsys, "bogus")
    assert (code, out) == (2, "") and err.startswith("ipmasq: unknown command 'bogus' (commands: render, ")
    assert err.count("\n") == 1
    assert run(capsys, "rendr")[2].startswith("ipmasq: unknown command 'rendr' (did you mean render?)")


def test_a_newline_in_a_flag_value_stays_on_the_line(capsys: pytest.CaptureFixture[str]) -> None:
    message = one_usage_line(capsys, "render", "--masq-chain", "IP\nMASQ" + "X" * 200)
    assert message.startswith('--masq-chain: "IP\\nMASQXXX') and "…" in message and len(message) < 200


def test_the_installed_entry_point_says_one_line() -> None:
    result = subprocess.run([PYTHON, "-m", "ipmasq", "check", "--backend=bogus"], capture_output=True, text=True)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr == ("ipmasq check: argument --backend: invalid choice: 'bogus' (choose from 'iptables', "
                             "'nftables', 'auto')\n")


def test_explain_json_contract(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "explain", "172.30.12.110", "8.8.8.8", "169.254.169.254", "10.0.0.5",
                       "--nomasq-all-reserved-ranges", "--source", "10.44.14.15", "--node-ip", "10.0.0.5", "-o", "json")
    assert code == 0
    document = json.loads(out)
    assert (document["apiVersion"], document["kind"]) == ("ipmasq.io/v1", "ExplainReport")
    results = document["results"]
    assert [(r["destination"], r["masquerade"], r["matched"], r["reason"], r["source_seen"]) for r in results] == [
        ("172.30.12.110", False, "172.16.0.0/12", "default", "10.44.14.15"),
        ("8.8.8.8", True, None, "catch-all", "10.0.0.5"),
        ("169.254.169.254", False, "169.254.0.0/16", "link-local", "10.44.14.15"),
        ("10.0.0.5", False, None, "local", "10.44.14.15"),
    ]


def test_explain_without_addresses_says_pod_or_node(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("nonMasqueradeCIDRs: [10.0.0.0/8]\nmasqueradeCIDRs: [10.11.0.0/24]\n")
    _code, out, _ = run(capsys, "explain", "10.11.0.9", "10.12.0.9", "--config", str(config), "-o", "json")
    results = json.loads(out)["results"]
    assert [(r["source_seen"], r["reason"], r["defined_at"]) for r in results] == [
        ("node", "exception", f"{config}:2"), ("pod", "config", f"{config}:1")]
    _code, out, _ = run(capsys, "explain", "10.11.0.9", "--config", str(config))
    assert "MASQUERADED" in out and "masqueradeCIDRs" in out


NAT = ["--source", "10.48.1.5", "--node-ip", "10.128.0.5", "--pod-range", "10.48.0.0/14", "--node-range",
       "10.128.0.0/20", "--nat-ip", "35.199.0.71", "-o", "json"]


@pytest.mark.parametrize("mode,seen", [("ALL_IP_RANGES", "35.199.0.71"), ("PRIMARY_IP_RANGE", "35.199.0.71"),
                                       ("LIST_OF_SECONDARY_IP_RANGES", None)])
def test_cloud_nat_with_the_agent_masquerading(capsys: pytest.CaptureFixture[str], mode: str, seen: str | None) -> None:
    code, out, _ = run(capsys, "explain", "34.120.0.10", "10.2.0.9", "--cloud-nat", mode, *NAT)
    internet, private = json.loads(out)["results"]
    assert code == 0
    assert (internet["source_after_node"], internet["source_seen"], internet["dropped"]) == (
        "10.128.0.5", seen, seen is None)
    assert private["source_seen"] == "10.48.1.5" and not private["dropped"]  # RFC 1918: never through Cloud NAT


@pytest.mark.parametrize("mode,seen", [("ALL_IP_RANGES", "35.199.0.71"), ("PRIMARY_IP_RANGE", None),
                                       ("LIST_OF_SECONDARY_IP_RANGES", "35.199.0.71")])
def test_cloud_nat_when_pods_leave_unmasqueraded(capsys: pytest.CaptureFixture[str], tmp_path: Path, mode: str,
                                                  seen: str | None) -> None:
    config = tmp_path / "all.yaml"
    config.write_text("nonMasqueradeCIDRs: [0.0.0.0/0]\n")  # what the node does when nothing masquerades
    _, out, _ = run(capsys, "explain", "34.120.0.10", "--config", str(config), "--cloud-nat", mode, *NAT)
    (result,) = json.loads(out)["results"]
    assert (result["source_after_node"], result["source_seen"]) == ("10.48.1.5", seen)


def test_cloud_nat_needs_its_ranges(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(capsys, "explain", "34.120.0.10", "--cloud-nat", "ALL_IP_RANGES", "--nat-ip", "35.199.0.71")[0] == 2


def test_offline_tools_read_the_config_inside_a_configmap_manifest(capsys: pytest.CaptureFixture[str]) -> None:
    # read as a raw config the manifest's keys would be ignored and the defaults would silently stand in
    manifest = "deploy/examples/vpn-range-inside-10-8.yaml"
    _, out, err = run(capsys, "explain", "10.11.0.5", "10.2.0.9", "--config", manifest, "-o", "json")
    vpn, other = json.loads(out)["results"]
    assert (vpn["reason"], vpn["defined_at"]) == ("exception", f"{manifest}:13")  # the manifest's own line
    assert (other["reason"], other["defined_at"]) == ("config", f"{manifest}:11")
    assert "unknown key" not in err
    code, out, _ = run(capsys, "render", "--config", manifest)
    assert code == 0 and "-d 10.11.0.0/24 -j MASQUERADE" in out
