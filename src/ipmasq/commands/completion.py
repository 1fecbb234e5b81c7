"""`ipmasq completion`: print a shell completion script (bash, zsh or fish).

The script is generated from the command's own parsers, so it completes every subcommand, every flag and every
flag's fixed choices of this version: load it with `source <(ipmasq completion bash)`, or write it where the shell
looks for completions.
"""

from __future__ import annotations

import argparse
import re
import sys
from typing import Any

__all__ = ["Completion", "register", "run", "script", "spec"]

SHELLS = ("bash", "zsh", "fish")


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "completion", help="print a shell completion script (bash, zsh or fish)",
        description=" ".join((__doc__ or "").strip().partition("\n")[2].split()))
    parser.add_argument("shell", choices=SHELLS, help="the shell to complete in")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    sys.stdout.write(script(args.shell))
    return 0


class Completion:
    """What one subcommand offers: its flags (each with its fixed choices, if any, and whether it takes a value)
    and its one-line help."""

    def __init__(self, name: str, summary: str, parser: argparse.ArgumentParser) -> None:
        self.name = name
        self.summary = summary
        self.flags: list[tuple[str, tuple[str, ...], bool, str]] = []  # (flag, choices, takes a value, help)
        self.positional_choices: tuple[str, ...] = ()
        for action in parser._actions:
            choices = tuple(str(c) for c in action.choices) if action.choices else ()
            if not action.option_strings:
                self.positional_choices += choices
                continue
            # a Go boolean flag (metavar BOOL) stands alone: `--flag` or `--flag=false`, never `--flag VALUE`
            takes_value = action.nargs != 0 and action.metavar != "BOOL"
            help_ = (action.help or "").replace("%(default)s", str(action.default))
            for flag in action.option_strings:
                self.flags.append((flag, choices, takes_value, _plain(help_)))


def spec() -> list[Completion]:
    """Every subcommand's completion, read from the parsers `ipmasq` itself parses with."""
    from ipmasq.cli import COMMANDS, build_parser, subcommands

    parser = build_parser()
    subs = subcommands(parser)
    helps = {a.dest: a.help or "" for a in next(a for a in parser._actions
                                                 if isinstance(a, argparse._SubParsersAction))._choices_actions}
    return [Completion(name, _plain(helps.get(name, "")), subs[name]) for name in COMMANDS]


def _plain(text: str) -> str:
    """A help line any shell takes inside single quotes or brackets: no quotes, brackets, colons or `%` forms."""
    text = text.split(". ")[0]
    return re.sub(r"[^A-Za-z0-9 ,./+()=_-]", " ", text).strip()[:80]


def script(shell: str) -> str:
    commands = spec()
    if shell == "bash":
        return _bash(commands)
    if shell == "zsh":
        return _zsh(commands)
    return _fish(commands)


def _bash(commands: list[Completion]) -> str:
    names = " ".join(c.name for c in commands)
    flag_cases = "".join(f"    {c.name}) flags='{' '.join(f for f, *_ in c.flags)}'; "
                         f"positional='{' '.join(c.positional_choices)}' ;;\n" for c in commands)
    choice_cases = "".join(f"    '{c.name} {flag}') COMPREPLY=($(compgen -W '{' '.join(choices)}' -- \"$cur\")); "
                           "return ;;\n" for c in commands for flag, choices, _, _ in c.flags if choices)
    value_flags = " ".join(sorted({f"{c.name}:{flag}" for c in commands for flag, choices, takes, _ in c.flags
                                   if takes and not choices}))
    return f"""# bash completion for ipmasq (ipmasq completion bash); generated from its own parsers
_ipmasq() {{
  local cur="${{COMP_WORDS[COMP_CWORD]}}" prev="${{COMP_WORDS[COMP_CWORD-1]}}" flags='' positional=''
  if [ "$COMP_CWORD" -eq 1 ]; then
    COMPREPLY=($(compgen -W '{names} --help --version' -- "$cur"))
    return
  fi
  local command="${{COMP_WORDS[1]}}"
  case "$command $prev" in
{choice_cases}  esac
  case " {value_flags} " in
    *" $command:$prev "*) COMPREPLY=($(compgen -f -- "$cur")); return ;;
  esac
  case "$command" in
{flag_cases}  esac
  if [[ "$cur" == -* ]]; then
    COMPREPLY=($(compgen -W "$flags" -- "$cur"))
  elif [ -n "$positional" ]; then
    COMPREPLY=($(compgen -W "$positional" -- "$cur"))
  else
    COMPREPLY=($(compgen -f -- "$cur"))
  fi
}}
complete -o filenames -F _ipmasq ipmasq
"""


def _zsh(commands: list[Completion]) -> str:
    described = "".join(f"    '{c.name}:{c.summary}'\n" for c in commands)
    cases = []
    for c in commands:
        specs = []
        for flag, choices, takes, help_ in c.flags:
            value = f":{flag.lstrip('-')}:({' '.join(choices)})" if choices else (":value:_files" if takes else "")
            specs.append(f"'{flag}[{help_}]{value}'")
        if c.positional_choices:
            specs.append(f"'1:{c.name}:({' '.join(c.positional_choices)})'")
        else:
            specs.append("'*:file:_files'")
        cases.append(f"    {c.name}) _arguments \\\n      " + " \\\n      ".join(specs) + " ;;\n")
    return f"""#compdef ipmasq
# zsh completion for ipmasq (ipmasq completion zsh); generated from its own parsers
_ipmasq() {{
  local -a commands
  commands=(
{described}  )
  if (( CURRENT == 2 )); then
    _describe 'command' commands
    return
  fi
  words=("${{words[@]:1}}")
  (( CURRENT-- ))
  case $words[1] in
{''.join(cases)}  esac
}}
compdef _ipmasq ipmasq
"""


def _fish(commands: list[Completion]) -> str:
    lines = ["# fish completion for ipmasq (ipmasq completion fish); generated from its own parsers",
             "complete -c ipmasq -f"]
    for c in commands:
        lines.append(f"complete -c ipmasq -n __fish_use_subcommand -a {c.name} -d '{c.summary}'")
        if c.positional_choices:
            lines.append(f"complete -c ipmasq -n '__fish_seen_subcommand_from {c.name}' "
                         f"-a '{' '.join(c.positional_choices)}'")
        for flag, choices, takes, help_ in c.flags:
            option = f"-l {flag[2:]}" if flag.startswith("--") else f"-s {flag[1:]}"
            value = f" -x -a '{' '.join(choices)}'" if choices else (" -r -F" if takes else "")
            lines.append(f"complete -c ipmasq -n '__fish_seen_subcommand_from {c.name}' {option}{value} "
                         f"-d '{help_}'")
    return "\n".join(lines) + "\n"
