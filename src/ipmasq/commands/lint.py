"""`ipmasq lint`: find the mistakes that make a config or ConfigMap silently not apply.

Lint ip-masq-agent config files (YAML/JSON) and Kubernetes manifests holding the ip-masq-agent ConfigMap
(multi-document YAML, kind: List, JSON): every pitfall with its file, line and a fix. A directory is read as the agent
reads its config directory: its ip-masq* files. Exit 1 when any error is found.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from ipmasq.commands import common
from ipmasq.config.source import CONFIG_PREFIX, read_config_file, read_config_input
from ipmasq.errors import ConfigError
from ipmasq.findings import Finding, Severity, count
from ipmasq.lint import Expectations, lint_source, nothing_to_lint

__all__ = ["register", "run"]


def register(subparsers: Any) -> None:
    parser = common.command_parser(subparsers, __doc__)
    parser.add_argument("files", nargs="+", metavar="FILE",
                        help=f"config file, manifest, config directory (its {CONFIG_PREFIX}* files), or - for "
                        "standard input (once)")
    parser.add_argument("--must-masquerade", action="append", default=[], metavar="CIDR",
                        help="a range that must see the node IP (a VPN peer, a firewalled endpoint); repeatable")
    parser.add_argument("--must-preserve", action="append", default=[], metavar="CIDR",
                        help="a range that must see the pod IP; repeatable")
    common.add_policy_flags(parser, config_help=None)
    common.add_output_flag(parser)
    parser.set_defaults(func=run)


def _inputs(paths: list[str]) -> list[tuple[str, bytes | OSError | ConfigError | Finding]]:
    """(name, bytes, the error reading it, or the finding that a directory holds nothing to lint).

    Read as the agent reads its config: a directory's regular `ip-masq*` files (what `--config DIR` means to the
    agent and the other tools), each at most 1 MiB, and never a FIFO or a device (which would block or never end).
    """
    out: list[tuple[str, bytes | OSError | ConfigError | Finding]] = []
    for path in paths:
        if path == common.STDIN:
            try:
                out.append((common.STDIN_NAME, read_config_input(common.STDIN, missing_ok=False).files[0][1]))
            except ConfigError as exc:
                out.append((common.STDIN_NAME, exc))
            continue
        names = [path]
        if os.path.isdir(path):
            try:
                listed = sorted(os.listdir(path))
            except OSError as exc:
                out.append((path, exc))
                continue
            names = [os.path.join(path, n) for n in listed
                     if n.startswith(CONFIG_PREFIX) and os.path.isfile(os.path.join(path, n))]
            if not names:
                out.append((path, nothing_to_lint(path, others=len(listed))))
        for name in names:
            try:
                out.append((name, read_config_file(name)))
            except (OSError, ConfigError) as exc:
                out.append((name, exc))
    return out


def run(args: argparse.Namespace) -> int:
    common.at_most_one_stdin(*(("FILE", path) for path in args.files))
    options = common.options_from_args(args)
    expect = Expectations(common.cidr_flag("--must-masquerade", args.must_masquerade),
                          common.cidr_flag("--must-preserve", args.must_preserve))
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
        if isinstance(data, Finding):
            findings.append(data)
            continue
        findings += lint_source(name, data, options=options, expect=expect)
    errors = count(findings, Severity.ERROR)
    if args.output == "json":
        common.print_json([f.as_dict() for f in findings], ensure_ascii=False)
    else:
        for f in findings:
            print(f.as_text())
        print(f"{errors} error(s), {count(findings, Severity.WARNING)} warning(s)", file=sys.stderr)
    return 1 if errors or unreadable else 0
