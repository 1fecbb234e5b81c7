"""The rules page cannot rot (docs/concepts/rules.md): every `rules` example in it loads and renders for both
backends, and the rule it declares does what the hand-written iptables command shown above it did. (The README's
own facts are tests/unit/test_docs.py's and test_deploy.py's.)"""

from __future__ import annotations

import contextlib
import io
import ipaddress
import re
from pathlib import Path

import pytest
import yaml

from ipmasq import cli
from tests.conftest import ROOT

PAGE = ROOT / "docs" / "concepts" / "rules.md"
SECTION = "# Rules: what you used to write by hand"


def _section() -> str:
    text = PAGE.read_text()
    start = text.index(SECTION)
    end = text.index("\n## ", start + len(SECTION))
    return text[start:end]


def _examples() -> list[tuple[str, str]]:
    """(the hand-written command shown before it, the YAML block) for each rules example of the section."""
    out = []
    for match in re.finditer(r"((?:.*\n)*?)```yaml\n((?:.*\n)*?)```", _section()):
        before, block = match.group(1), match.group(2)
        commands = [line.strip() for line in before.splitlines() if line.startswith("    iptables -t nat ")]
        if "rules:" in block:
            out.append((commands[-1] if commands else "", block))
    return out


EXAMPLES = _examples()


def _run(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(list(argv))
    return code, out.getvalue(), err.getvalue()


def _matching_node(globs: list[str]) -> str:
    """A node name the first glob matches (its wildcards filled in)."""
    return re.sub(r"\[[^]]*\]", "0", globs[0]).replace("*", "7f3k").replace("?", "x")


def _cidr(text: str) -> str:
    return str(ipaddress.ip_network(text, strict=True))


def _hand_written(command: str) -> dict[str, str]:
    """The matches and target of `iptables -t nat -I|-A POSTROUTING ...`, in the form iptables-save prints them."""
    tokens = command.split()
    spec = {}
    for option, key in (("-s", "-s"), ("-d", "-d"), ("-p", "-p"), ("--dport", "ports"), ("-j", "-j"),
                        ("--to-source", "--to-source")):
        if option in tokens:
            spec[key] = tokens[tokens.index(option) + 1]
    for key in ("-s", "-d"):
        if key in spec:
            spec[key] = _cidr(spec[key])
    return spec


def test_the_section_has_an_example_for_each_use() -> None:
    assert len(EXAMPLES) >= 5
    commands = [c for c, _ in EXAMPLES]
    assert all(c.startswith("iptables -t nat ") for c in commands), commands
    actions = {rule["action"] for _, block in EXAMPLES for rule in yaml.safe_load(block)["rules"]}
    assert actions == {"masquerade", "preserve", "snat"}
    assert any("nodes" in rule for _, block in EXAMPLES for rule in yaml.safe_load(block)["rules"])


@pytest.mark.parametrize(("command", "block"), EXAMPLES, ids=[f"example-{i}" for i in range(len(EXAMPLES))])
def test_each_example_renders_the_rule_it_replaces(tmp_path: Path, command: str, block: str) -> None:
    config = tmp_path / "ip-masq-agent"
    config.write_text(block)
    (rule,) = yaml.safe_load(block)["rules"]
    node_flags = [f"--node-name={_matching_node(rule['nodes'])}"] if "nodes" in rule else []
    comment = f"ip-masq-agent: rule {rule['name']}"
    code, nft, err = _run("render", f"--config={config}", "--backend=nftables", *node_flags)
    assert code == 0, err
    assert comment in nft
    code, restore, err = _run("render", f"--config={config}", "--backend=iptables", *node_flags)
    assert code == 0, err
    (line,) = [line for line in restore.splitlines() if comment in line]
    rendered = line.split()
    # what the hand-written command matched and did, the rendered rule matches and does
    for key, value in _hand_written(command).items():
        if key == "ports":
            assert "--dports" in rendered and rendered[rendered.index("--dports") + 1] == value, line
        else:
            assert key in rendered and rendered[rendered.index(key) + 1] == value, (key, value, line)
    if "nodes" in rule:  # on another pool's node the rule is absent
        code, other, err = _run("render", f"--config={config}", "--backend=iptables", "--node-name=db-pool-1")
        assert code == 0, err
        assert comment not in other


def test_explain_in_the_section_answers_as_printed(tmp_path: Path) -> None:
    """The `ipmasq explain` transcripts of the section, run on the example they name (FILE)."""
    section = _section()
    block = next(b for _, b in EXAMPLES if "onprem-https-sees-node-ip" in b)
    config = tmp_path / "ip-masq-agent"
    config.write_text(block)
    transcripts = re.findall(r"    \$ (ipmasq explain .*)\n((?:    (?!\$).*\n)+)", section)
    assert len(transcripts) == 2
    for command, printed in transcripts:
        argv = command.replace("FILE", str(config)).split()[1:]
        code, out, err = _run(*argv)
        assert code == 0, err
        expected = " ".join(line.strip() for line in printed.splitlines()).replace("FILE", str(config))
        assert " ".join(out.split()) == expected
