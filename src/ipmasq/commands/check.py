"""`ipmasq check`: compare the config with the node's real nat rules.

Compare the intent (config and flags) with the node's nat rules, read live (iptables-save or nft -j list ruleset;
read-only) or from a file holding either output (or two files, one of each, of one node). Pod traffic is traced
through every nat chain the kernel runs at postrouting: on iptables, the nftables nat chains beside it too
(kube-proxy's nftables mode). Findings: chain-missing, jump-missing, config-not-applied,
rules-differ, rule-missing, rule-extra, rule-edited, rule-order (the config's rules, by name, with file:line),
foreign-masquerade, jump-shadowed (by destination, and where a rule tests them by source, protocol and port),
stale-chain, unsupported, and live only other-variant-rules. Exit 0
when no finding is an error, 1 otherwise; 3 live on a machine with no nat rule at all (no node: nothing to compare).

--writer NAME compares with what a provider's agent intends instead (gke, aks, eks, reference, cilium: the chain
and flags that agent runs with, its inputs read its way from --config and --manifest: only the keys it reads). A
key it ignores (ipmasq's masqueradeCIDRs, rules, enableIPv6; AKS's merger and Cilium also drop cidrLimit and
resyncInterval) is ignored-by-writer, with what happens to that traffic. eks reads the VPC CNI's
AWS-SNAT-CHAIN-0; cilium reads `cilium-dbg bpf ipmasq list` output given to --from-dump.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from typing import Any

from ipmasq import documents
from ipmasq.backends.runner import SubprocessRunner
from ipmasq.commands import common, policy_source
from ipmasq.config.model import MasqConfig
from ipmasq.config.source import read_config_file
from ipmasq.diagnose.check import CheckReport, NodeRules, check_node, ignored_findings
from ipmasq.diagnose.cilium import check_cilium_map, is_ipmasq_list, parse_ipmasq_list
from ipmasq.diagnose.eks import DEFAULT_OUT_INTERFACE, check_eks, node_chain
from ipmasq.diagnose.leftovers import leftover_findings, read_leftovers
from ipmasq.diagnose.sources import holds_no_nat_rules, read_dump_file, read_node_rules, rules_from_dump
from ipmasq.diagnose.writer_sources import sources_from_manifests
from ipmasq.errors import ConfigError, NotANode, UsageError, one_line
from ipmasq.findings import Finding, bounded
from ipmasq.lint.manifest import configmap_config
from ipmasq.policy.policy import Policy
from ipmasq.prefix import Family
from ipmasq.writers import (
    CILIUM_MAP,
    REFERENCE_CONFIGMAP,
    REFERENCE_KEY,
    WRITERS,
    Sources,
    Writer,
    cilium_map_intent,
    config_files,
    ignored,
    intended,
)

__all__ = ["register", "run"]


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
    group = parser.add_argument_group("a provider's agent (see docs/how-to/observe-a-provider-agent.md)")
    group.add_argument("--writer", choices=sorted(WRITERS), metavar="NAME",
                       help="compare with what this agent intends, under its own chain and flags (which replace the "
                       f"policy flags): {', '.join(sorted(WRITERS))}")
    group.add_argument("--manifest", action="append", default=[], metavar="FILE",
                       help="Kubernetes objects the writer reads, as `kubectl -n kube-system get -o yaml` prints "
                       "them: ConfigMaps (AKS: its ip-masq fragments), the aws-node DaemonSet (repeatable)")
    group.add_argument("--vpc-cidr", action="append", default=[], metavar="CIDR",
                       help="eks: a CIDR of the VPC (repeatable; default: the ones the node's AWS-SNAT-CHAIN-0 "
                       "returns for, as the CNI learnt them from the instance metadata)")
    group.add_argument("--out-interface", metavar="IFACE",
                       help=f"eks: the interface pod traffic leaves by (default {DEFAULT_OUT_INTERFACE}, the "
                       "primary ENI)")
    common.add_agent_flag(parser)
    common.add_output_flag(parser)
    parser.set_defaults(func=run)


def _rules_from_dumps(dumps: list[tuple[str, str]]) -> NodeRules:
    """One dump, or an iptables-save dump and an nft -j listing of the same node (iptables compared, the listing's
    nat chains walked beside it)."""
    if len(dumps) > 2:
        raise UsageError("--from-dump: at most two files, one iptables-save dump and one nft -j listing of one node")
    read = [rules_from_dump(text, path) for path, text in dumps]
    texts = {rules.backend: rules for rules in read}
    if len(texts) != len(read):
        raise UsageError("--from-dump: two dumps of one kind: give one iptables-save dump and one nft -j listing")
    if len(read) == 1:
        return read[0]
    return replace(texts["iptables"], nft_ruleset=texts["nftables"].nft_ruleset)


def shown(finding: Finding) -> Finding:
    """The finding as a terminal may show it: what it quotes of the node's rules (a rule comment, a chain or table
    name: anything a writer of rules chose) with every control character, C1 control and bidi override escaped
    (ipmasq.errors.one_line), so that no rule can move the cursor, retitle the window or reorder a line."""
    return replace(finding, message=one_line(finding.message), hint=one_line(finding.hint),
                   file=None if finding.file is None else one_line(finding.file))


def run(args: argparse.Namespace) -> int:
    common.at_most_one_stdin(("--config", args.config), *(("--from-dump", d) for d in args.from_dump),
                             *(("--manifest", m) for m in args.manifest))
    dumps = [read_dump_file(p) for p in args.from_dump]
    if args.writer is not None or any(is_ipmasq_list(text) for _, text in dumps):
        return _report(args, _check_writer(args, WRITERS[args.writer or "cilium"], dumps))
    if args.manifest or args.vpc_cidr or args.out_interface:
        raise UsageError("--manifest, --vpc-cidr and --out-interface go with --writer")
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
        rules = _rules_from_dumps(dumps)
    else:
        rules = _live_node(read_node_rules(SubprocessRunner(), policy.families, chain=policy.options.masq_chain,
                                           backend=args.backend))
    report = check_node(policy, rules, pod_ranges=pods, local_addresses=local)
    if not args.from_dump:  # our objects in a variant or backend the compared rules are not in
        places = read_leftovers(SubprocessRunner(), policy.options, rules.backend)
        report = CheckReport(report.findings + leftover_findings(places, rules.backend))
    return _report(args, report)


def _live_node(rules: NodeRules) -> NodeRules:
    """The live read, unless it found no nat rule at all: then this is no node to check (one line, exit 3)."""
    if holds_no_nat_rules(rules):
        raise NotANode("this machine holds no nat rule at all (none of ip-masq-agent, kube-proxy or a CNI, in "
                       "iptables or nftables): not a Kubernetes node whose pod SNAT is nat rules; run it on a node "
                       "(kubectl ipmasq check NODE), or check a dump (--from-dump); Cilium's BPF masquerade: "
                       "--writer cilium")
    return rules


def _report(args: argparse.Namespace, report: CheckReport) -> int:
    if args.output != "text":
        documents.print_document(args.output, "CheckReport",
                              {"ok": report.ok, "findings": [f.as_dict() for f in bounded(report.findings)]})
    else:
        for f in bounded(report.findings):
            print(shown(f).as_text())
        print("ok: the node's rules match the config" if report.ok and not report.findings
              else ("ok (warnings only)" if report.ok else "NOT OK"))
    return 0 if report.ok else 1


def _writer_sources(args: argparse.Namespace) -> Sources:
    """--manifest's objects, and --config: the ip-masq-agent ConfigMap's config (a raw file or its manifest)."""
    manifests = [read_dump_file(p) for p in args.manifest]
    sources = sources_from_manifests(manifests, vpc_cidrs=tuple(args.vpc_cidr))
    if args.config is None:
        return sources
    try:
        data = read_config_file(args.config) if args.config != "-" else read_dump_file("-")[1].encode()
    except FileNotFoundError:
        raise ConfigError("no such file", source=args.config) from None
    try:
        embedded = configmap_config(data.decode("utf-8", "surrogateescape"))
    except ValueError as exc:
        raise ConfigError(f"{exc} (for other ConfigMaps use --manifest)", source=args.config) from None
    config = data if embedded is None else embedded.encode("utf-8", "surrogatepass")
    return Sources({**sources.configmaps, REFERENCE_CONFIGMAP: {REFERENCE_KEY: config}}, sources.env,
                   sources.vpc_cidrs)


def _check_writer(args: argparse.Namespace, writer: Writer, dumps: list[tuple[str, str]]) -> CheckReport:
    """The node's rules (or Cilium's map) against what `writer` intends."""
    common.refuse_policy_flags(args, f"--writer {writer.name}")
    sources = _writer_sources(args)
    pods = common.cidr_flag("--pod-range", args.pod_range)
    local = tuple(common.address_flag("--local-address", t) for t in args.local_address)
    if writer.name == "cilium":
        listings = [(path, text) for path, text in dumps if is_ipmasq_list(text)]
        if len(listings) != 1 or len(dumps) != 1:
            raise UsageError("--writer cilium: give one --from-dump with `cilium-dbg bpf ipmasq list` output, e.g. "
                             "kubectl -n kube-system exec ds/cilium -- cilium-dbg bpf ipmasq list > map.txt")
        config, said = _writes(writer, sources)
        if config is None:
            return CheckReport(tuple(said))
        policy_source.print_config_warnings("check", config)
        report = check_cilium_map(cilium_map_intent(config), parse_ipmasq_list(listings[0][1], listings[0][0]),
                                  map_name=CILIUM_MAP)
        return CheckReport(tuple(said) + report.findings)
    if any(is_ipmasq_list(text) for _, text in dumps):
        raise UsageError(f"--writer {writer.name}: a `cilium-dbg bpf ipmasq list` listing is Cilium's map: use "
                         "--writer cilium")
    if dumps:
        rules = _rules_from_dumps(dumps)
    else:
        rules = _live_node(read_node_rules(SubprocessRunner(),
                                           (Family.V4, Family.V6) if writer.name != "eks" else (Family.V4,),
                                           chain=writer.options.masq_chain, backend="iptables"))
    if rules.backend != "iptables":
        raise UsageError(f"--writer {writer.name}: that agent writes iptables rules: give iptables-save output")
    if writer.name == "eks":
        if not sources.vpc_cidrs:
            chain = node_chain(rules)
            sources = Sources(sources.configmaps, sources.env, tuple(str(p) for p in chain.vpc_cidrs) if chain else ())
        config, said = _writes(writer, sources)  # its warnings (skipped exclusions) are findings of check_eks
        if config is None:
            return CheckReport(tuple(said))
        local4 = tuple(address for family, address in local if family is Family.V4)
        report = check_eks(Policy(config, writer.options), rules, sources.env, pod_ranges=pods,
                           local_addresses=local4, out_interface=args.out_interface or DEFAULT_OUT_INTERFACE)
        return CheckReport(tuple(said) + report.findings)
    config, said = _writes(writer, sources)
    if config is None:
        return CheckReport(tuple(said))
    policy_source.print_config_warnings("check", config)
    policy = Policy(config, writer.options)
    tables = {family: table for family, table in rules.tables.items() if family in policy.families}
    report = check_node(policy, replace(rules, tables=tables), pod_ranges=pods, local_addresses=local,
                        writer=writer.called or writer.name)
    return CheckReport(tuple(said) + report.findings)


def _writes(writer: Writer, sources: Sources) -> tuple[MasqConfig | None, list[Finding]]:
    """What `writer` enforces from its inputs (its own reading: the keys it ignores left out, so that the node is
    compared with what it really writes), and one ignored-by-writer finding per key it ignores. A refusal caused by
    such a key (enableIPv6 with IPv6 CIDRs, for an agent without --enable-ipv6) is said by those findings alone
    (config None: nothing to compare the node with)."""
    files = config_files(writer, sources)
    try:
        config = intended(writer, sources)
    except ConfigError as exc:
        said = ignored_findings(ignored(writer, files, exc))
        if any(f.destinations for f in said):
            return None, said
        raise
    return config, ignored_findings(ignored(writer, files, config))
