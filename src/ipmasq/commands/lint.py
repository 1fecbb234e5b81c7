"""`ipmasq lint`: find the mistakes that make a config or ConfigMap silently not apply.

Lint ip-masq-agent config files (YAML/JSON) and Kubernetes manifests holding the ip-masq-agent ConfigMap
(multi-document YAML, kind: List, JSON): every pitfall with its file, line and a fix. A directory holding ip-masq*
files is read as the agent reads its config directory: those files; any other directory as a tree of manifests:
every *.yaml, *.yml and *.json file under it (recursively, hidden directories and symbolic links to directories
skipped) that holds an ip-masq-agent ConfigMap. No FILE: standard input when it is not a terminal (`ipmasq lint <
FILE`); --config FILE is FILE. Exit 1 when any error is found, 3 when an input could not be read (nothing is said
about a file not read).

--writer NAME (reference, gke, aks, cilium): also say each key that provider's agent ignores (ignored-by-writer:
ipmasq's masqueradeCIDRs, rules and enableIPv6; AKS's merger and Cilium also drop cidrLimit and resyncInterval) and
what happens to that traffic, as `check --writer` says it on the node.

Config rules: an invalid rule (mixed address families, ports without tcp/udp/sctp, ...) is the agent's own error;
a rule no packet reaches because earlier rules match all it matches (shadowed-rule, naming them), a rule that
changes nothing (rule-no-effect, info), a snatTo inside --pod-range or a rule's sources (snat-to-pod-address) or
inside its own destinations (snat-to-destination), and with --node-name, a rule whose nodes globs match none of the
given nodes (rule-nodes-match-none).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from ipmasq import documents
from ipmasq.commands import common
from ipmasq.config.source import CONFIG_PREFIX, read_config_file, read_config_input
from ipmasq.errors import ConfigError, InputUnreadable, UsageError
from ipmasq.findings import Finding, Severity, bounded, count
from ipmasq.lint import Expectations, lint_source, nothing_to_lint
from ipmasq.lint.manifest import holds_agent_configmap
from ipmasq.lint.writer import writer_findings
from ipmasq.writers import WRITERS

__all__ = ["register", "run"]

# the providers whose agent reads an ip-masq-agent config (the VPC CNI reads aws-node's env)
_LINT_WRITERS = sorted(name for name, w in WRITERS.items() if w.keys)
# a directory of manifests: at most this many files looked at (a whole repository given by mistake ends in one line)
MANIFEST_FILES_MAX = 10_000
_MANIFEST_SUFFIXES = (".yaml", ".yml", ".json")


def register(subparsers: Any) -> None:
    parser = common.command_parser(subparsers, __doc__)
    parser.add_argument("files", nargs="*", metavar="FILE",
                        help=f"config file, manifest, config directory (its {CONFIG_PREFIX}* files), directory of "
                        "manifests (recursively: each file holding the ip-masq-agent ConfigMap), or - for standard "
                        "input (once; the default when standard input is not a terminal)")
    parser.add_argument("--config", dest="config_files", action="append", default=[], metavar="FILE",
                        help="the same as giving FILE (as render, explain and check take it); repeatable")
    parser.add_argument("--writer", choices=_LINT_WRITERS, metavar="NAME",
                        help="also report the keys this provider's agent ignores, and what that does to traffic: "
                        f"{', '.join(_LINT_WRITERS)} (eks reads no config: `check --writer eks`)")
    parser.add_argument("--must-masquerade", action="append", default=[], metavar="CIDR",
                        help="a range that must see the node IP (a VPN peer, a firewalled endpoint); repeatable")
    parser.add_argument("--must-preserve", action="append", default=[], metavar="CIDR",
                        help="a range that must see the pod IP; repeatable")
    parser.add_argument("--pod-range", action="append", default=[], metavar="CIDR",
                        help="a range pods take their IPs from (a rule's snatTo there is an error); repeatable")
    parser.add_argument("--node-name", dest="node_names", action="append", default=[], metavar="NAME",
                        help="a node of the cluster: report rules whose nodes globs match none of those given, and "
                        "decide shadowed rules on these nodes only; repeatable")
    common.add_policy_flags(parser, config_help=None)
    common.add_output_flag(parser)
    parser.set_defaults(func=run)


def _inputs(paths: list[str]) -> list[tuple[str, bytes | OSError | ConfigError | Finding]]:
    """(name, bytes, the error reading it, or the finding that a directory holds nothing to lint).

    Read as the agent reads its config: a directory's regular `ip-masq*` files (what `--config DIR` means to the
    agent and the other tools), each at most 1 MiB, and never a FIFO or a device (which would block or never end).
    A directory without them: its manifests holding the ip-masq-agent ConfigMap (_manifests).
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
                manifests = _manifests(path)
                if not manifests:
                    out.append((path, nothing_to_lint(path, others=len(listed))))
                out.extend(manifests)
                continue
        for name in names:
            try:
                out.append((name, read_config_file(name)))
            except (OSError, ConfigError) as exc:
                out.append((name, exc))
    return out


def _manifests(directory: str) -> list[tuple[str, bytes | OSError | ConfigError | Finding]]:
    """The manifest files under `directory` (recursively, in name order; hidden directories and links to
    directories skipped) that hold an ip-masq-agent ConfigMap, or that do not parse but name it: a broken one is
    linted too, never skipped. Files that cannot be read are said, as any input."""
    found: list[tuple[str, bytes | OSError | ConfigError | Finding]] = []
    seen = 0
    for root, dirs, files in os.walk(directory, onerror=lambda exc: found.append((exc.filename or directory, exc))):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(files):
            if not name.endswith(_MANIFEST_SUFFIXES):
                continue
            seen += 1
            if seen > MANIFEST_FILES_MAX:
                found.append((directory, ConfigError(f"more than {MANIFEST_FILES_MAX} manifest files: lint a "
                                                     "smaller directory", source=directory)))
                return found
            full = os.path.join(root, name)
            try:
                data = read_config_file(full)
            except (OSError, ConfigError) as exc:
                found.append((full, exc))
                continue
            if holds_agent_configmap(data):
                found.append((full, data))
    return found


def run(args: argparse.Namespace) -> int:
    args.files = [*args.files, *args.config_files]
    if not args.files:
        if sys.stdin is None or sys.stdin.isatty():
            raise UsageError("give the config or manifest to lint: ipmasq lint FILE (or DIR), or from a pipe "
                             "`ipmasq lint - < FILE`")
        args.files = [common.STDIN]
    common.at_most_one_stdin(*(("FILE", path) for path in args.files))
    writer = WRITERS[args.writer] if args.writer is not None else None
    if writer is not None:
        common.refuse_policy_flags(args, f"--writer {writer.name}")
    options = common.options_from_args(args) if writer is None else writer.options
    for name in args.node_names:
        if not name or any(c.isspace() for c in name):
            raise UsageError(f"--node-name: {name!r} is not a node name")
    expect = Expectations(common.cidr_flag("--must-masquerade", args.must_masquerade),
                          common.cidr_flag("--must-preserve", args.must_preserve),
                          common.cidr_flag("--pod-range", args.pod_range), tuple(args.node_names))
    findings: list[Finding] = []
    unreadable: list[str] = []  # why each input that could not be read was not: nothing is said of its content
    inputs = _inputs(args.files)
    for name, data in inputs:
        if isinstance(data, ConfigError):
            unreadable.append(str(data))
            continue
        if isinstance(data, OSError):
            unreadable.append(f"{name}: cannot read: {data.strerror}")
            continue
        if isinstance(data, Finding):
            findings.append(data)
            continue
        findings += lint_source(name, data, options=options, expect=expect)
        if writer is not None:
            findings += writer_findings(name, data, writer)
    errors = count(findings, Severity.ERROR)
    linted = len(inputs) - len(unreadable)
    if args.output != "text":
        documents.print_document(args.output, "LintReport", {"findings": [f.as_dict() for f in bounded(findings)],
                                                          "unreadable": unreadable}, ensure_ascii=False)
    else:
        for f in bounded(findings):
            print(f.as_text())
        if linted:
            infos = count(findings, Severity.INFO)
            print(f"{errors} error(s), {count(findings, Severity.WARNING)} warning(s)"
                  + (f", {infos} info" if infos else "")
                  + (f" in the {linted} input(s) read" if unreadable else ""), file=sys.stderr)
    if unreadable:  # never "0 errors" about a file not read: could not run (exit 3), each one named
        raise InputUnreadable("; ".join(unreadable) + ("" if len(unreadable) == 1 else
                                                       f" ({len(unreadable)} inputs not linted)"))
    return 1 if errors else 0
