"""The `ipmasq` command: argparse subcommands, each in ipmasq.commands.<name>; errors become one line and an exit code.

Exit codes: 0 ok, 1 the input is wrong or a finding, 2 usage. Every usage error, argparse's own (unknown flag,
invalid choice, missing argument) or a flag value a command checks (ipmasq.options, commands.common), is one line
on stderr, `ipmasq COMMAND: message`, never argparse's usage block: a DaemonSet's log or a CI step shows one line.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from importlib import import_module
from typing import Any, NoReturn

from ipmasq.errors import ConfigError, IpmasqError, UsageError
from ipmasq.version import VersionAction

__all__ = ["ArgumentParser", "main"]

# Each module has `register(subparsers)`, which sets `func=run(args) -> int` on its parser.
COMMANDS = ("render", "explain", "agent", "uninstall", "lab", "lint", "diff", "trace", "check", "audit", "health",
            "status", "webhook")


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser, but a mistake raises UsageError (main prints it as one line, exit 2) instead of printing
    the usage block and exiting. Subparsers are made of the parser's own class, so every command gets it.

    No abbreviated long flags: Go's flag package (the reference agent's) has none, and `--enable` silently standing
    for `--enable-ipv6` would take the next word as its value, a form boolean flags do not have.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The whole parser, or with `only` just that subcommand: each command module imports what it needs, so a
    node agent's start (`agent --once` runs on every pod start and in benchmarks) does not pay for the toolkit."""
    parser = ArgumentParser(
        prog="ipmasq",
        description="Pod SNAT for Kubernetes nodes: a drop-in ip-masq-agent and the tools to see, check and prove it.",
    )
    parser.add_argument("--version", action=VersionAction)
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMANDS if only is None else (only,):
        import_module(f"ipmasq.commands.{name}").register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    raw = list(sys.argv[1:] if argv is None else argv)
    command = raw[0] if raw and raw[0] in COMMANDS else None
    who = f"ipmasq {command}" if command is not None else "ipmasq"
    try:
        args = build_parser(command).parse_args(_go_flags_normalised(command, raw))
        code: int = args.func(args)
        return code
    except UsageError as exc:
        print(f"{who}: {_one_line(str(exc))}", file=sys.stderr)
        return 2
    except ConfigError as exc:
        print(f"{who}: config error: {exc}", file=sys.stderr)
        return 1
    except IpmasqError as exc:
        print(f"{who}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0


# Commands that take none of the reference agent's flags: their arguments need no Go-style rewriting, so they do not
# import ipmasq.commands.common (the flag tables and, through them, the config and policy machinery). `health` runs as
# an exec probe every few seconds inside the agent's container: it imports only a socket client.
NO_GO_FLAGS = frozenset({"health"})


def _go_flags_normalised(command: str | None, raw: list[str]) -> list[str]:
    if command in NO_GO_FLAGS:
        return raw
    from ipmasq.commands.common import normalise_go_flags

    return normalise_go_flags(raw)


def _one_line(message: str) -> str:
    # a value typed on the command line may hold a newline; the message stays one line
    return message.replace("\r", "\\r").replace("\n", "\\n")
