"""`ipmasq check`: compare the config with the node's real nat rules.

Compare the intent (config and flags) with the node's nat rules, read live (iptables-save or nft -j list ruleset;
read-only) or from a file holding either output (or two files, one of each, of one node). Pod traffic is traced
through every nat chain the kernel runs at postrouting: on iptables, the nftables nat chains beside it too
(kube-proxy's nftables mode). Findings: chain-missing, jump-missing, config-not-applied,
rules-differ, rule-missing, rule-extra, rule-edited, rule-order (the config's rules, by name, with file:line),
foreign-masquerade, jump-shadowed (by destination, and where a rule tests them by source, protocol and port),
stale-chain, unsupported, and live only other-variant-rules. Exit 0
when no finding is an error, 1 otherwise.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from typing import Any

from ipmasq.backends.runner import SubprocessRunner
from ipmasq.commands import common, policy_source
from ipmasq.diagnose.check import CheckReport, NodeRules, check_node
from ipmasq.diagnose.leftovers import leftover_findings, read_leftovers
from ipmasq.diagnose.sources import (
    read_dump_file,
    read_iptables_nft_beside,
    read_live_rules,
    read_nft_ruleset,
    rules_from_dump,
)
from ipmasq.errors import IpmasqError, UsageError

__all__ = ["register", "run"]


def _live_ruleset(*, required: bool) -> str | None:
    """`nft -j list ruleset`; beside iptables (not `required`) None where nft is missing or cannot list."""
    if required:
        return read_nft_ruleset(SubprocessRunner())
    try:
        return read_nft_ruleset(SubprocessRunner())
    except (IpmasqError, OSError):
        return None


def register(subparsers: Any) -> None:
    parser = common.command_parser(subparsers, __doc__)
    common.add_policy_flags(parser, config_help="config file or directory, ConfigMap manifest, or - for standard input "
                                         "(default: none, the built-in defaults)")
    parser.add_argument("--backend", choices=["iptables", "nftables", "auto"], default="auto",
                        help="live mode: which rules to read (default auto: as the agent chooses)")
    parser.add_argument("--from-dump", metavar="FILE", action="append", default=[],
                        help="iptables-save (or ip6tables-save) output, or nft -j list ruleset output; - for "
                        "standard input (then --config cannot be -); both of one node (given twice) compare "
                        "iptables' rules with the nftables nat chains beside them walked too")
    parser.add_argument("--pod-range", action="append", default=[], metavar="CIDR",
                        help="the pods' address range, so that rules testing -s can be evaluated (repeatable)")
    parser.add_argument("--local-address", action="append", default=[], metavar="IP",
                        help="an address of the node (node-local destinations are never masqueraded; repeatable)")
    common.add_agent_flag(parser)
    common.add_output_flag(parser)
    parser.set_defaults(func=run)


def _rules_from_dumps(paths: list[str]) -> NodeRules:
    """One dump, or an iptables-save dump and an nft -j listing of the same node (iptables compared, the listing's
    nat chains walked beside it)."""
    if len(paths) > 2:
        raise UsageError("--from-dump: at most two files, one iptables-save dump and one nft -j listing of one node")
    read = [rules_from_dump(text, path) for path, text in (read_dump_file(p) for p in paths)]
    texts = {rules.backend: rules for rules in read}
    if len(texts) != len(read):
        raise UsageError("--from-dump: two dumps of one kind: give one iptables-save dump and one nft -j listing")
    if len(read) == 1:
        return read[0]
    return replace(texts["iptables"], nft_ruleset=texts["nftables"].nft_ruleset)


def run(args: argparse.Namespace) -> int:
    common.at_most_one_stdin(("--config", args.config), *(("--from-dump", d) for d in args.from_dump))
    if not args.from_dump:
        agent = common.adopt_agent_settings(args, "check")
        # the backend the agent chose, as /metrics names it ("iptables (nft)", "nftables"): read the same rules
        chosen = str(agent.get("backend", "")).split(" ")[0] if agent is not None else ""
        if args.backend == "auto" and chosen in ("iptables", "nftables"):
            args.backend = chosen
    policy = policy_source.load_policy(args, "check")
    pods = common.cidr_flag("--pod-range", args.pod_range)
    local = tuple(common.address_flag("--local-address", t) for t in args.local_address)
    if args.from_dump:
        rules = _rules_from_dumps(args.from_dump)
    else:
        rules = read_live_rules(SubprocessRunner(), policy.families, chain=policy.options.masq_chain,
                                backend=args.backend)
        # the whole ruleset: other tables' nat chains decide pod traffic too (beside iptables: kube-proxy's
        # nftables mode); a node without nft has none
        rules = replace(rules, nft_ruleset=_live_ruleset(required=rules.backend == "nftables"))
        if rules.backend == "nftables" and rules.nft_ruleset is not None:
            # iptables-nft's nat tables in that ruleset (kube-proxy's iptables mode) as iptables-nft-save reads them
            rules = replace(rules, tables=read_iptables_nft_beside(SubprocessRunner(), rules.nft_ruleset,
                                                                   policy.families))
    report = check_node(policy, rules, pod_ranges=pods, local_addresses=local)
    if not args.from_dump:  # our objects in a variant or backend the compared rules are not in
        places = read_leftovers(SubprocessRunner(), policy.options, rules.backend)
        report = CheckReport(report.findings + leftover_findings(places, rules.backend))
    if args.output != "text":
        common.print_document(args.output, "CheckReport",
                              {"ok": report.ok, "findings": [f.as_dict() for f in report.findings]})
    else:
        for f in report.findings:
            print(f.as_text())
        print("ok: the node's rules match the config" if report.ok and not report.findings
              else ("ok (warnings only)" if report.ok else "NOT OK"))
    return 0 if report.ok else 1
