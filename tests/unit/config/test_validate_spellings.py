"""Kubernetes' spellings and every mistake of a rule: `protocol: TCP` is `tcp` (the same rules rendered, byte for
byte), a rule's every mistake is reported (lint), the agent still names the first, and a tab is called a tab."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest

from ipmasq import cli
from ipmasq.config.source import ConfigInput, config_from_bytes
from ipmasq.errors import ConfigError
from ipmasq.lint import lint_source
from ipmasq.options import PolicyOptions

RULE = """rules:
  - name: onprem-https-sees-node-ip
    destinations: [10.2.1.100/32]
    protocol: {protocol}
    ports: [443]
    action: masquerade
"""


def _run(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(list(argv))
    return code, out.getvalue(), err.getvalue()


@pytest.mark.parametrize(("kubernetes", "iptables"), [("TCP", "tcp"), ("UDP", "udp"), ("SCTP", "sctp")])
@pytest.mark.parametrize("backend", ["iptables", "nftables"])
def test_kubernetes_protocol_renders_byte_identical_rules(tmp_path: Path, kubernetes: str, iptables: str,
                                                          backend: str) -> None:
    rendered = []
    for spelling in (kubernetes, iptables):
        config = tmp_path / f"ip-masq-agent-{spelling}"
        config.write_text(RULE.format(protocol=spelling))
        code, out, err = _run("render", f"--config={config}", f"--backend={backend}")
        assert code == 0, err
        rendered.append(out)
    assert rendered[0] == rendered[1] and f"{iptables}" in rendered[0]
    code, out, err = _run("lint", str(tmp_path / f"ip-masq-agent-{kubernetes}"))
    assert (code, out) == (0, ""), err


def test_the_flags_take_kubernetes_protocol_too(tmp_path: Path) -> None:
    config = tmp_path / "ip-masq-agent"
    config.write_text(RULE.format(protocol="tcp"))
    upper = _run("explain", "10.2.1.100", f"--config={config}", "--protocol", "TCP", "--port", "443")
    lower = _run("explain", "10.2.1.100", f"--config={config}", "--protocol", "tcp", "--port", "443")
    assert upper == lower and upper[0] == 0 and "onprem-https-sees-node-ip" in upper[1]
    assert _run("explain", "10.2.1.100", "--protocol", "TCPX")[0] == 2


BROKEN = """rules:
  - name: Bad_Name
    destinations: [10.0.0.0/33, 10.1.0.0/16]
    sources: [10.44.0.0/14, nope]
    protocol: TCPP
    ports: [99999, 443]
    nodes: ["a b"]
    action: snat
    snatTo: 10.0.0.1/32
    port: 80
  - name: fine
    destinations: [10.3.0.0/16]
    action: nothing
"""


def test_lint_reports_every_mistake_of_a_rule_and_the_agent_the_first() -> None:
    findings = lint_source("f", BROKEN.encode(), options=PolicyOptions())
    shown = [(f.line, f.message.split(": ", 1)[1]) for f in findings if f.id == "invalid-rule"]
    assert [line for line, _ in shown] == [2, 3, 4, 5, 6, 7, 9, 10, 13], shown  # in line order
    words = " | ".join(message for _, message in shown)
    for expected in ('unknown key "port"', 'name "Bad_Name"', '"10.0.0.0/33" could not be parsed',
                     '"nope" could not be parsed', "protocol must be one of", '"99999" must be ports',
                     'nodes: "a b" is not a node-name glob', 'snatTo: "10.0.0.1/32" is not an IP address',
                     'action must be masquerade, preserve or snat, got the string "nothing"'):
        assert expected in words, (expected, words)
    # the agent refuses the config with the first of them, as before
    with pytest.raises(ConfigError) as raised:
        config_from_bytes(ConfigInput((("f", BROKEN.encode()),)), PolicyOptions())
    assert raised.value.line == 10 and 'unknown key "port"' in str(raised.value)


def test_ports_need_a_protocol_is_said_beside_a_bad_port_and_not_for_a_bad_protocol() -> None:
    no_protocol = "rules:\n  - name: a\n    destinations: [10.0.0.0/8]\n    ports: [0]\n    action: masquerade\n"
    messages = [f.message for f in lint_source("f", no_protocol.encode(), options=PolicyOptions())]
    assert any("ports need protocol tcp, udp or sctp, got no protocol" in m for m in messages), messages
    assert any('"0" must be ports between 1 and 65535' in m for m in messages), messages
    bad_protocol = no_protocol.replace("    ports: [0]\n", "    protocol: tpc\n    ports: [443]\n")
    messages = [f.message for f in lint_source("f", bad_protocol.encode(), options=PolicyOptions())]
    assert len(messages) == 1 and "protocol must be one of" in messages[0], messages


@pytest.mark.parametrize("text", ["nonMasqueradeCIDRs:\n\t- 10.0.0.0/8\n",
                                  "nonMasqueradeCIDRs:\n  - 10.0.0.0/8\n\t- 172.16.0.0/12\n"])
def test_a_tab_in_the_indentation_is_called_a_tab(tmp_path: Path, text: str) -> None:
    config = tmp_path / "ip-masq-agent"
    config.write_text(text)
    code, out, err = _run("lint", str(config))
    assert code == 1 and "tab" in out and out.count("\n") == 1, out
    code, _, err = _run("render", f"--config={config}")
    assert code == 1 and "tab" in err and err.count("\n") == 1, err
