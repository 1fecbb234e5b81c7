"""The `ipmasq` command: argparse subcommands, each in ipmasq.commands.<name>; errors become one line and an exit code.

Exit codes: 0 ok, 1 the input is wrong or a finding, 2 usage.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from importlib import import_module

from ipmasq import __version__
from ipmasq.errors import ConfigError, IpmasqError, UsageError

__all__ = ["main"]

# Each module has `register(subparsers)`, which sets `func=run(args) -> int` on its parser.
COMMANDS = ("render", "explain", "agent", "uninstall", "lab", "lint", "diff", "trace", "check", "audit", "health")


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The whole parser, or with `only` just that subcommand: each command module imports what it needs, so a
    node agent's start (`agent --once` runs on every pod start and in benchmarks) does not pay for the toolkit."""
    parser = argparse.ArgumentParser(
        prog="ipmasq",
        description="Pod SNAT for Kubernetes nodes: a drop-in ip-masq-agent and the tools to see, check and prove it.",
    )
    parser.add_argument("--version", action="version", version=f"ipmasq {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMANDS if only is None else (only,):
        import_module(f"ipmasq.commands.{name}").register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from ipmasq.commands.common import normalise_go_flags

    args_list = normalise_go_flags(list(sys.argv[1:] if argv is None else argv))
    parser = build_parser(args_list[0] if args_list and args_list[0] in COMMANDS else None)
    args = parser.parse_args(args_list)
    try:
        code: int = args.func(args)
        return code
    except UsageError as exc:
        print(f"ipmasq {args.command}: {exc}", file=sys.stderr)
        return 2
    except ConfigError as exc:
        print(f"ipmasq {args.command}: config error: {exc}", file=sys.stderr)
        return 1
    except IpmasqError as exc:
        print(f"ipmasq {args.command}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0
