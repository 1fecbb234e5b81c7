"""`ipmasq completion`: generated from the parsers, so it completes every subcommand and every flag of this version.

bash's own completion machinery runs the bash script (`complete -p`, then the function as bash calls it on TAB);
zsh and fish are not on every machine, so their scripts are checked for each command's and flag's line."""

from __future__ import annotations

import contextlib
import io
import shutil
import subprocess

import pytest

from ipmasq.cli import COMMANDS, EXAMPLES, build_parser, main, subcommands

PARSERS = subcommands(build_parser())


def _script(shell: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["completion", shell]) == 0
    return out.getvalue()


def _bash_complete(script: str, words: list[str]) -> list[str]:
    """What bash offers on TAB after `words` (the last one being completed), with the script loaded."""
    array = " ".join(f"'{w}'" for w in words)
    program = (f"{script}\ncomplete -p ipmasq >/dev/null || exit 9\nCOMP_WORDS=({array}); "
               f"COMP_CWORD={len(words) - 1}; _ipmasq; printf '%s\\n' \"${{COMPREPLY[@]}}\"")
    done = subprocess.run(["bash", "--norc", "--noprofile", "-c", program], capture_output=True, text=True,
                          timeout=30, check=True)
    return done.stdout.split()


def _long_flags(command: str) -> set[str]:
    return {o for a in PARSERS[command]._actions for o in a.option_strings if o.startswith("--")}


def test_bash_completes_every_subcommand() -> None:
    assert set(COMMANDS) <= set(_bash_complete(_script("bash"), ["ipmasq", ""]))
    assert _bash_complete(_script("bash"), ["ipmasq", "ch"]) == ["check"]


@pytest.mark.parametrize("command", COMMANDS)
def test_bash_completes_every_flag_of_every_subcommand(command: str) -> None:
    offered = set(_bash_complete(_script("bash"), ["ipmasq", command, "--"]))
    assert _long_flags(command) <= offered, _long_flags(command) - offered


def test_bash_completes_a_flags_choices_and_the_shells() -> None:
    script = _script("bash")
    assert _bash_complete(script, ["ipmasq", "render", "--backend", ""]) == ["iptables", "nftables"]
    assert _bash_complete(script, ["ipmasq", "lint", "-o", ""]) == ["text", "json", "yaml"]
    assert _bash_complete(script, ["ipmasq", "completion", ""]) == ["bash", "zsh", "fish"]


@pytest.mark.parametrize("shell", ["zsh", "fish"])
def test_zsh_and_fish_name_every_subcommand_and_flag(shell: str) -> None:
    script = _script(shell)
    for command in COMMANDS:
        if shell == "zsh":
            assert f"\n    '{command}:" in script and f"\n    {command}) _arguments" in script, command
            assert all(f"'{flag}[" in script for flag in _long_flags(command)), command
        else:
            assert f"-a {command} -d '" in script, command
            for flag in _long_flags(command):
                assert f"__fish_seen_subcommand_from {command}' -l {flag[2:]} " in script, (command, flag)
    if shutil.which(shell):  # where the shell is installed, it parses the script
        subprocess.run([shell, "-n", "-c", script] if shell == "zsh" else [shell, "--no-execute", "-c", script],
                       check=True, timeout=30)


def test_every_command_has_examples_in_its_help() -> None:
    for command, parser in PARSERS.items():
        text = parser.format_help()
        assert EXAMPLES[command], command
        assert all(f"\n  {example}\n" in text for example in EXAMPLES[command]), command
        assert "exit status: 0 ok, 1 findings" in text, command
