"""`ipmasq check`: the config against the node's real nat rules (live, or a dump file), as findings."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ipmasq.backends.choose import detect
from ipmasq.backends.iptables import our_chains
from ipmasq.backends.runner import SubprocessRunner
from ipmasq.backends.snapshot import read_nat_save, read_nft_ruleset
from ipmasq.check import CheckReport, Finding, check_iptables, check_nft, family_of_dump
from ipmasq.commands.common import add_policy_flags, address_flag, cidr_flag, load_policy_config, options_from_args
from ipmasq.commands.dumps import read_dump_file
from ipmasq.commands.trace import parse_save_located
from ipmasq.errors import IpmasqError
from ipmasq.policy import Policy
from ipmasq.prefix import Prefix
from ipmasq.rules.iptables import parse_save
from ipmasq.rules.nft import NftParseError, parse_list_json

__all__ = ["register", "run"]


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "check", help="compare the config with the node's real nat rules",
        description="Compare the intent (config and flags) with the node's nat rules, read live (iptables-save or "
        "nft -j list ruleset; read-only) or from a file holding either output. Findings: chain-missing, "
        "jump-missing, config-not-applied, rules-differ, foreign-masquerade, jump-shadowed, stale-chain, "
        "unsupported. Exit 0 when no finding is an error, 1 otherwise.",
    )
    add_policy_flags(parser, config_help="config file or directory (default: none, the built-in defaults)")
    parser.add_argument("--backend", choices=["iptables", "nftables", "auto"], default="auto",
                        help="live mode: which rules to read (default auto: as the agent chooses)")
    parser.add_argument("--from-dump", metavar="FILE",
                        help="iptables-save (or ip6tables-save) output, or nft -j list ruleset output; - for stdin")
    parser.add_argument("--pod-range", action="append", default=[], metavar="CIDR",
                        help="the pods' address range, so that rules testing -s can be evaluated (repeatable)")
    parser.add_argument("--local-address", action="append", default=[], metavar="IP",
                        help="an address of the node (node-local destinations are never masqueraded; repeatable)")
    parser.add_argument("-o", "--output", choices=["text", "json"], default="text")
    parser.set_defaults(func=run)


def _from_text(policy: Policy, text: str, path: str, pods: tuple[Prefix, ...],
               local: list[tuple[Any, int]]) -> CheckReport:
    if text.lstrip().startswith("{"):
        try:
            return check_nft(policy, parse_list_json(text))
        except NftParseError as exc:
            raise IpmasqError(f"{path}: {exc}") from None
    table = parse_save_located(text, path)
    if not table.chains and not table.rules:
        raise IpmasqError(f"{path}: no *nat table found (expected iptables-save or nft -j list ruleset output)")
    family = family_of_dump(table)
    return check_iptables(policy, table, family, pod_ranges=pods,
                          local_addresses=tuple(a for f, a in local if f is family))


def _live(policy: Policy, backend: str, pods: tuple[Prefix, ...], local: list[tuple[Any, int]]) -> CheckReport:
    runner = SubprocessRunner()
    tables = {}
    if backend in ("iptables", "auto"):
        tables = {family: parse_save(read_nat_save(runner, family)) for family in policy.families}
    if backend == "auto":
        # whichever of ours is on the node; only on a node with neither, the agent's own choice
        if any(our_chains(t, policy.options.masq_chain) for t in tables.values()):
            backend = "iptables"
        elif parse_list_json(read_nft_ruleset(runner)) is not None:
            backend = "nftables"
        else:
            backend = detect(runner).backend
    if backend == "nftables":
        return check_nft(policy, parse_list_json(read_nft_ruleset(runner)))
    findings: list[Finding] = []
    for family in policy.families:
        table = tables[family]
        report = check_iptables(policy, table, family, pod_ranges=pods,
                                local_addresses=tuple(a for f, a in local if f is family))
        findings.extend(report.findings)
    return CheckReport(tuple(findings))


def run(args: argparse.Namespace) -> int:
    options = options_from_args(args)
    config = load_policy_config(args, options)
    for warning in config.warnings:
        print(f"ipmasq check: warning: {warning}", file=sys.stderr)
    policy = Policy(config, options)
    pods = cidr_flag("--pod-range", args.pod_range)
    local = [address_flag("--local-address", t) for t in args.local_address]
    if args.from_dump is not None:
        path, text = read_dump_file(args.from_dump)
        report = _from_text(policy, text, path, pods, local)
    else:
        report = _live(policy, args.backend, pods, local)
    if args.output == "json":
        json.dump({"ok": report.ok, "findings": [f.as_dict() for f in report.findings]}, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        for f in report.findings:
            print(f"{f.severity.value.upper()} {f.id.value}: {f.message}\n    fix: {f.hint}")
        print("ok: the node's rules match the config" if report.ok and not report.findings
              else ("ok (warnings only)" if report.ok else "NOT OK"))
    return 0 if report.ok else 1
