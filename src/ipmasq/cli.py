"""The `ipmasq` command: argparse subcommands, each in ipmasq.commands.<name>; errors become one line and an exit code.

This module is the one place exit codes are decided (`Exit`): a command returns Exit.OK or Exit.FINDINGS from what it
found, and everything it could not do is an exception translated here. Every usage error, argparse's own (unknown
flag, invalid choice, missing argument) or a flag value a command checks (ipmasq.options, commands.common), is one
line on stderr, `ipmasq COMMAND: message`, never argparse's usage block: a DaemonSet's log or a CI step shows one line.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from enum import IntEnum
from importlib import import_module
from typing import Any, NoReturn

from ipmasq.errors import ConfigError, InputUnreadable, IpmasqError, UsageError, one_line
from ipmasq.version import VersionAction

__all__ = ["COMMANDS", "EXAMPLES", "ArgumentParser", "Exit", "build_parser", "main", "report"]

# Each module has `register(subparsers)`, which sets `func=run(args) -> int` on its parser.
COMMANDS = ("render", "explain", "agent", "uninstall", "lab", "lint", "diff", "trace", "check", "audit", "health",
            "status", "webhook", "completion")


class Exit(IntEnum):
    """Every command's exit status, the same for all: a CI step gates on 1 and alerts on 2 and 3."""

    OK = 0  # done, nothing to report: the config is clean, the node matches, every node is current
    FINDINGS = 1  # done, and found something: an error finding, an invalid config, a flip, a node not current
    USAGE = 2  # the command line is wrong; nothing was run
    COULD_NOT_RUN = 3  # an input could not be read, the API server or a kernel tool could not be asked
    INTERRUPTED = 130  # Ctrl-C, as a shell reports SIGINT


# Shown under each subcommand's --help (and in docs/reference/cli.md): what people type most.
EXAMPLES: dict[str, tuple[str, ...]] = {
    "render": ("ipmasq render --config ip-masq-agent.yaml",
               "ipmasq render --config ip-masq-agent.yaml --backend nftables",
               "ipmasq render --config configmap.yaml --print-hash"),
    "explain": ("ipmasq explain 172.30.12.110 --config ip-masq-agent.yaml",
                "ipmasq explain 10.2.1.100 --config FILE --source 10.44.14.15 --protocol tcp --port 443",
                "ipmasq explain 8.8.8.8 -o yaml"),
    "agent": ("ipmasq agent --config /etc/config/ip-masq-agent --backend auto",
              "ipmasq agent --once --config ip-masq-agent.yaml"),
    "uninstall": ("ipmasq uninstall", "ipmasq uninstall --masq-chain IP-MASQ", "ipmasq uninstall --remove-unmarked"),
    "lab": ("sudo ipmasq lab", "sudo ipmasq lab --scenario incident-gke-1.14",
            "sudo ipmasq lab --kubernetes --keep"),
    "lint": ("kubectl get configmap ip-masq-agent -n kube-system -o yaml | ipmasq lint -",
             "ipmasq lint ip-masq-agent.yaml --must-masquerade 172.30.0.0/16",
             "ipmasq lint deploy/examples/*.yaml -o json"),
    "diff": ("ipmasq diff kubenet gke --probe 172.30.12.110",
             "ipmasq diff old.yaml new.yaml --probe 10.2.1.100 -o yaml"),
    "trace": ("ipmasq trace 172.30.12.110 --source 10.44.14.15 --protocol tcp --port 443",
              "ipmasq trace 10.244.1.5 --source 192.168.0.1 --dump nat.save --dump ruleset.json",
              "ipmasq trace 172.30.12.110 --source 10.44.14.15 --protocol tcp --port 5432 --routes routing.json "
              "--dump node.save"),
    "check": ("ipmasq check", "ipmasq check --from-dump nat.save --config ip-masq-agent.yaml",
              "kubectl exec -n kube-system ds/ip-masq-agent -- ipmasq check -o json"),
    "audit": ("ipmasq audit flows.log.gz --pod-range 10.44.0.0/14 --config ip-masq-agent.yaml",),
    "health": ("ipmasq health", "ipmasq health --live"),
    "status": ("ipmasq status", "ipmasq status --context prod -n kube-system -o yaml"),
    "webhook": ("ipmasq webhook --listen 0.0.0.0:8443 --nomasq-all-reserved-ranges",),
    "completion": ("source <(ipmasq completion bash)",
                   "ipmasq completion zsh > \"${fpath[1]}/_ipmasq\"",
                   "ipmasq completion fish > ~/.config/fish/completions/ipmasq.fish"),
}

EXIT_CODES_HELP = ("exit status: 0 ok, 1 findings (an error, an invalid config, a flip), 2 usage, "
                   "3 could not run (an unreadable input, no API server, a failed kernel tool)")


class HelpFormatter(argparse.HelpFormatter):
    """argparse's formatter, but an epilog of examples keeps its lines (descriptions are still wrapped)."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if text.startswith("examples:\n"):
            return "".join(indent + line + "\n" for line in text.splitlines()).rstrip("\n")
        return super()._fill_text(text, width, indent)


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser, but a mistake raises UsageError (main prints it as one line, exit 2) instead of printing
    the usage block and exiting. Subparsers are made of the parser's own class, so every command gets it.

    No abbreviated long flags: Go's flag package (the reference agent's) has none, and `--enable` silently standing
    for `--enable-ipv6` would take the next word as its value, a form boolean flags do not have.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        # argparse's "invalid choice: 'iptabels' (choose from 'iptables', ...)" names the nearest choice too
        import re

        choice = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)$", message)
        if choice is not None:
            message += did_you_mean(choice.group(1), re.findall(r"'([^']*)'", choice.group(2)))
        raise UsageError(message)


def build_parser(only: str | None = None, *, prog: str = "ipmasq") -> argparse.ArgumentParser:
    """The whole parser, or with `only` just that subcommand: each command module imports what it needs, so a
    node agent's start (`agent --once` runs on every pod start and in benchmarks) does not pay for the toolkit."""
    parser = ArgumentParser(
        prog=prog,
        description="Pod SNAT for Kubernetes nodes: a drop-in ip-masq-agent and the tools to see, check and prove it.",
        epilog=EXIT_CODES_HELP,
    )
    parser.add_argument("--version", action=VersionAction)
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMANDS if only is None else (only,):
        import_module(f"ipmasq.commands.{name}").register(subparsers)
    for name, sub in subcommands(parser).items():
        sub.epilog = "examples:\n" + "".join(f"  {line}\n" for line in EXAMPLES.get(name, ())) + "\n" + EXIT_CODES_HELP
    return parser


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """The subcommands' own parsers, by name (what completion, the reference test and "did you mean" read)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def short_usage() -> str:
    """What bare `ipmasq` prints: the commands and a line each."""
    parser = build_parser()
    helps = {a.dest: a.help or "" for a in _subparsers_action(parser)._choices_actions}
    width = max(map(len, helps))
    lines = ["usage: ipmasq COMMAND [FLAGS]   (ipmasq COMMAND --help: its flags and examples)", "", "commands:"]
    lines += [f"  {name:<{width}}  {helps.get(name, '')}" for name in COMMANDS]
    return "\n".join(lines)


def _subparsers_action(parser: argparse.ArgumentParser) -> Any:
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))


def main(argv: Sequence[str] | None = None, *, prog: str = "ipmasq") -> int:
    """`prog`: how help and errors name the program (`kubectl ipmasq` when the kubectl plugin runs a command)."""
    raw = list(sys.argv[1:] if argv is None else argv)
    command = raw[0] if raw and raw[0] in COMMANDS else None
    who = f"{prog} {command}" if command is not None else prog
    if not raw:
        print(short_usage(), file=sys.stderr)
        return Exit.USAGE
    try:
        if command is None and raw[0] not in ("-h", "--help", "--version"):
            what = "flag" if raw[0].startswith("-") else "command"
            raise UsageError(f"unknown {what} {_quoted(raw[0])}{did_you_mean(raw[0], COMMANDS)} "
                             f"(commands: {', '.join(COMMANDS)})")
        parser = build_parser(command, prog=prog)
        args, extra = parser.parse_known_args(_go_flags_normalised(command, raw))
        if extra:
            raise UsageError(_unrecognized(extra, subcommands(parser).get(command or "")))
        code: int = args.func(args)  # Exit.OK or Exit.FINDINGS: what the command found
        return code
    except IpmasqError as exc:
        return report(who, exc)
    except KeyboardInterrupt:
        return Exit.INTERRUPTED
    except BrokenPipeError:
        return Exit.OK


def did_you_mean(word: str, known: Sequence[str]) -> str:
    """` (did you mean X?)` when a known word is close to `word` (a typo), else nothing."""
    import difflib  # only on a mistake: the agent's start imports nothing it does not use

    close = difflib.get_close_matches(word, known, n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


def _unrecognized(extra: list[str], sub: argparse.ArgumentParser | None) -> str:
    flags = [o for a in (sub._actions if sub is not None else ()) for o in a.option_strings if o.startswith("--")]
    hints = [f"{word.split('=', 1)[0]}{did_you_mean(word.split('=', 1)[0], flags)}" if word.startswith("--") else word
             for word in extra]
    return "unrecognized arguments: " + " ".join(hints)


def _quoted(word: str) -> str:
    from ipmasq.errors import clip, one_line

    return repr(one_line(clip(word)))


# Commands that take none of the reference agent's flags: their arguments need no Go-style rewriting, so they do not
# import ipmasq.commands.common (the flag tables and, through them, the config and policy machinery). `health` runs as
# an exec probe every few seconds inside the agent's container: it imports only a socket client.
NO_GO_FLAGS = frozenset({"health", "completion"})


def _go_flags_normalised(command: str | None, raw: list[str]) -> list[str]:
    if command in NO_GO_FLAGS:
        return raw
    from ipmasq.goflags import normalise_go_flags

    return normalise_go_flags(raw)


def report(who: str, exc: IpmasqError) -> Exit:
    """The error as one line on stderr, `WHO: message`, and the exit status it means: the one translation for
    `ipmasq` and `kubectl ipmasq` (a value typed on the command line or read from outside may hold a newline or an
    escape: the line is escaped)."""
    if isinstance(exc, UsageError):
        code, prefix = Exit.USAGE, ""
    elif isinstance(exc, InputUnreadable):  # a ConfigError that says nothing of the content: could not run
        code, prefix = Exit.COULD_NOT_RUN, ""
    elif isinstance(exc, ConfigError):
        code, prefix = Exit.FINDINGS, "config error: "
    else:
        code, prefix = Exit.COULD_NOT_RUN, ""
    print(f"{who}: {prefix}{one_line(str(exc))}", file=sys.stderr)
    return code
