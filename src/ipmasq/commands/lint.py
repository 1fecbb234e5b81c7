"""`ipmasq lint`: config files and ConfigMap manifests, every pitfall with its file, line and a fix."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from ipmasq.commands.common import add_output_flag, add_policy_flags, cidr_flag, options_from_args, print_json
from ipmasq.config.source import read_config_file, read_config_input
from ipmasq.errors import ConfigError
from ipmasq.findings import Finding, Severity, count
from ipmasq.lint import Expectations, lint_source

__all__ = ["register", "run"]


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "lint", help="find the mistakes that make a config or ConfigMap silently not apply",
        description="Lint ip-masq-agent config files (YAML/JSON) and Kubernetes manifests holding the "
        "ip-masq-agent ConfigMap (multi-document YAML, kind: List, JSON). Exit 1 when any error is found.",
    )
    parser.add_argument("files", nargs="+", metavar="FILE",
                        help="config file, manifest, directory of them, or - for standard input")
    parser.add_argument("--must-masquerade", action="append", default=[], metavar="CIDR",
                        help="a range that must see the node IP (a VPN peer, a firewalled endpoint); repeatable")
    parser.add_argument("--must-preserve", action="append", default=[], metavar="CIDR",
                        help="a range that must see the pod IP; repeatable")
    add_policy_flags(parser, config_help=None)
    add_output_flag(parser)
    parser.set_defaults(func=run)


def _inputs(paths: list[str]) -> list[tuple[str, bytes | OSError | ConfigError]]:
    """(name, bytes or the error reading it); a directory contributes its regular, non-hidden files.

    Read as the agent reads its config: at most 1 MiB, and never a FIFO or a device (which would block or never end).
    """
    out: list[tuple[str, bytes | OSError | ConfigError]] = []
    for path in paths:
        if path == "-":
            try:
                out.append(("<stdin>", read_config_input("-", missing_ok=False).files[0][1]))
            except ConfigError as exc:
                out.append(("<stdin>", exc))
            continue
        names = [path]
        if os.path.isdir(path):
            names = [os.path.join(path, n) for n in sorted(os.listdir(path))
                     if not n.startswith(".") and os.path.isfile(os.path.join(path, n))]
        for name in names:
            try:
                out.append((name, read_config_file(name)))
            except (OSError, ConfigError) as exc:
                out.append((name, exc))
    return out


def run(args: argparse.Namespace) -> int:
    options = options_from_args(args)
    expect = Expectations(cidr_flag("--must-masquerade", args.must_masquerade),
                          cidr_flag("--must-preserve", args.must_preserve))
    findings: list[Finding] = []
    unreadable = False
    for name, data in _inputs(args.files):
        if isinstance(data, ConfigError):
            print(f"ipmasq lint: {data}", file=sys.stderr)
            unreadable = True
            continue
        if isinstance(data, OSError):
            print(f"ipmasq lint: {name}: cannot read: {data.strerror}", file=sys.stderr)
            unreadable = True
            continue
        findings += lint_source(name, data, options=options, expect=expect)
    errors = count(findings, Severity.ERROR)
    if args.output == "json":
        print_json([f.as_dict() for f in findings], ensure_ascii=False)
    else:
        for f in findings:
            print(f.as_text())
        print(f"{errors} error(s), {count(findings, Severity.WARNING)} warning(s)", file=sys.stderr)
    return 1 if errors or unreadable else 0
