"""Flags accepted the way the reference agent (Go's flag package) accepts them: `-flag=v` as `--flag=v`, a bare
boolean flag as `--flag=true`, a boolean's value only after "=". Used by every command line of ipmasq's (the CLI, the
kubectl plugin), so it lives below them all."""

from __future__ import annotations

import argparse

from ipmasq.errors import UsageError
from ipmasq.options import quoted

__all__ = ["BOOL_FLAGS", "VALUE_FLAGS", "go_bool", "normalise_go_flags"]

# Go boolean flags: `--flag`, `--flag=false`, `-flag`; never `--flag false` (that would eat a positional).
BOOL_FLAGS = (
    "nomasq-all-reserved-ranges", "enable-ipv6", "random-fully", "logtostderr", "alsologtostderr", "flush-conntrack",
)
VALUE_FLAGS = (
    "masq-chain", "to-ports", "config", "backend", "v", "log_dir", "stderrthreshold", "vmodule", "metrics-address",
    "log-format", "iptables-variant",
)
_TRUE = {"1", "t", "T", "true", "TRUE", "True"}
_FALSE = {"0", "f", "F", "false", "FALSE", "False"}


def normalise_go_flags(argv: list[str]) -> list[str]:
    """Rewrite Go-style flags into argparse's: `-flag=v` -> `--flag=v`; a bare bool flag -> `--flag=true`.

    A boolean flag's value only ever follows "=": `--flag false` would set the flag and leave "false" behind as an
    argument (what Go's flag package does, silently), so it is a UsageError here, as is a value that is no boolean.
    """
    out: list[str] = []
    for index, arg in enumerate(argv):
        if arg == "--":
            out.extend(argv[index:])
            break
        if arg.startswith("-") and not arg.startswith("--") and len(arg) > 2:
            name = arg[1:].split("=", 1)[0]
            if name in BOOL_FLAGS or name in VALUE_FLAGS:
                arg = "-" + arg
        if arg.startswith("--"):
            name, eq, value = arg[2:].partition("=")
            if name in BOOL_FLAGS:
                if not eq:
                    following = argv[index + 1] if index + 1 < len(argv) else None
                    if following in _TRUE | _FALSE:
                        raise UsageError(f"--{name} {following}: a boolean flag takes its value after \"=\" "
                                         f"(--{name}={following}); alone, --{name} means true")
                    arg = f"--{name}=true"
                elif value not in _TRUE | _FALSE:
                    raise UsageError(f"--{name}: invalid boolean value {quoted(value)} (use --{name}, "
                                     f"--{name}=true or --{name}=false)")
        out.append(arg)
    return out


def go_bool(text: str) -> bool:
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise argparse.ArgumentTypeError(f"invalid boolean {text!r}")
