"""`ipmasq diff`: which destinations flip between two configs or named default sets (gate a change on probes).

Without `rules`, it prints the fewest CIDRs whose verdict (masquerade or keep the pod IP) differs between OLD and
NEW. With rules in either config, a packet's outcome also depends on its source, protocol, port and node, so it
prints every region of destinations x sources x protocol x ports x nodes whose outcome changes (masquerade to the
node IP, preserve the pod IP, or snat to an address), each with the rule (name, file:line) that decided before and
after: exact, a rule added, removed, reordered or edited shows the traffic it moves and nothing else. Node names
cannot be listed in advance: by default a region names the rules' node globs its nodes match and do not match
("nodes matching gke-egress-* ..."); --node-name NAME (repeatable) evaluates for those nodes only and names them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import Any

from ipmasq import documents
from ipmasq.commands import common, policy_source
from ipmasq.diff.baselines import BASELINES, BUILTIN_PREFIX, baseline_policy, builtin_set
from ipmasq.diff.diff import (
    DiffResult,
    ProbedDestination,
    Region,
    RuleDiffResult,
    diff_policies,
    diff_rule_policies,
    has_rules,
    parse_probe,
)
from ipmasq.errors import UsageError
from ipmasq.options import PolicyOptions
from ipmasq.policy.packet_space import Decision
from ipmasq.policy.policy import Policy
from ipmasq.policy.ranges import to_prefixes

__all__ = ["register", "run"]


def register(subparsers: Any) -> None:
    sets = ", ".join(f"{b.name} ({b.summary})" for b in BASELINES.values())
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "diff", help="which destinations flip between two configs or default sets",
        description="Print the fewest CIDRs whose verdict (masquerade or preserve the pod IP) differs between OLD "
        f"and NEW, and whether each probe flips. Exit 1 when a probe flips. Built-in sets: {sets}. "
        f"{BUILTIN_PREFIX}NAME always means the set and a path with a / always the file; a bare NAME that is both "
        "a file here and a set is a usage error. With rules in either config: every region of destinations x "
        "sources x protocol x ports x nodes whose outcome (masquerade to the node IP, preserve the pod IP, snat "
        "to an address) changes, with the rule that decided before and after; a region's nodes are named by "
        "the rules' node globs they match and do not match, or, with --node-name, are the given nodes.",
    )
    what = (f"config file or directory, ConfigMap manifest, - for standard input (one of OLD and NEW), or a "
            f"built-in set (NAME, or {BUILTIN_PREFIX}NAME)")
    parser.add_argument("old", metavar="OLD", help=what)
    parser.add_argument("new", metavar="NEW", help=what)
    parser.add_argument("--probe", action="append", default=[], metavar="DEST",
                        help="a destination address or CIDR that must not flip; repeatable")
    parser.add_argument("--node-name", dest="node_names", action="append", default=[], metavar="NAME",
                        help="evaluate node-scoped rules (their nodes globs) for this node; repeatable (default: "
                        "every combination of the rules' node globs)")
    common.add_policy_flags(parser, config_help=None)
    common.add_output_flag(parser)
    parser.set_defaults(func=run)


def _builtin_set(spec: str) -> str | None:
    """The set OLD or NEW names, or None for a file; a name that could be either is a usage error."""
    try:
        return builtin_set(spec, path_exists=spec != common.STDIN and os.path.lexists(spec))
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _policy(spec: str, name: str | None, options: PolicyOptions) -> Policy:
    if name is not None:
        return baseline_policy(name, options)
    # diff evaluates node-scoped rules itself, per node class or per --node-name: the loader's refusal of such a
    # rule on an unknown node is for the tools that answer for one node
    anywhere = dataclasses.replace(options, node_name=options.node_name or "*")
    config = policy_source.load_config_or_manifest(spec, anywhere)
    policy_source.print_config_warnings("diff", config)
    return Policy(config, options)


def run(args: argparse.Namespace) -> int:
    common.at_most_one_stdin(("OLD", args.old), ("NEW", args.new))
    old_set, new_set = _builtin_set(args.old), _builtin_set(args.new)  # both usage errors before any reading
    for probe in args.probe:
        try:
            parse_probe(probe)
        except ValueError:
            raise UsageError(f"--probe: {probe!r} is not an IP address or CIDR") from None
    options = common.options_from_args(args)
    for name in args.node_names:
        if not name or any(c.isspace() for c in name):
            raise UsageError(f"--node-name: {name!r} is not a node name")
    before, after = _policy(args.old, old_set, options), _policy(args.new, new_set, options)
    if has_rules(before) or has_rules(after):
        try:
            ruled = diff_rule_policies(before, after, tuple(args.probe), tuple(args.node_names))
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        if args.output != "text":
            _write(args.output, _rules_as_json(ruled))
        else:
            sys.stdout.write(_rules_as_text(ruled, common.shown_input(args.old), common.shown_input(args.new)))
        return 1 if ruled.probe_flipped else 0
    result = diff_policies(before, after, tuple(args.probe))
    if args.output != "text":
        _write(args.output, _as_json(result))
    else:
        sys.stdout.write(_as_text(result, common.shown_input(args.old), common.shown_input(args.new)))
    return 1 if result.probe_flipped else 0


def _write(output: str, text: str) -> None:
    """The JSON document as written (one object per line), or the same document as YAML."""
    if output == "yaml":
        documents.print_yaml(json.loads(text))
    else:
        sys.stdout.write(text)


# written by hand, one object per line, so the envelope is too: the same apiVersion and kind as documents.document
_HEAD = f'{{\n  "apiVersion": "{documents.API_VERSION}",\n  "kind": "DiffReport",\n'


def _as_json(result: DiffResult) -> str:
    """One object per line: readable, and json.dumps without indent stays in C (indent=2 is not)."""
    flips = [json.dumps({"range": str(f.prefix), "before": f.before.value, "after": f.after.value})
             for f in result.flips]
    probes = [json.dumps({"destination": p.destination, "before": p.before.value, "after": p.after.value,
                          "flips": p.flips}) for p in result.probes]

    def array(items: list[str]) -> str:
        return "[\n    " + ",\n    ".join(items) + "\n  ]" if items else "[]"

    return f'{_HEAD}  "flips": {array(flips)},\n  "probes": {array(probes)}\n}}\n'



def _as_text(result: DiffResult, old: str, new: str) -> str:
    lines = []
    if result.flips:
        lines.append(f"{old} -> {new}: {len(result.flips)} range(s) flip")
        width = max(len(str(f.prefix)) for f in result.flips)
        lines += [f"  {f.prefix!s:<{width}}  {f.before.value} -> {f.after.value}" for f in result.flips]
    else:
        lines.append(f"{old} -> {new}: no destination changes verdict")
    lines += [_probe_text(p) for p in result.probes]
    return "\n".join(lines) + "\n"


def _probe_text(probe: ProbedDestination) -> str:
    return (f"probe {probe.destination}: {probe.before.value} ({probe.decided_before}) -> {probe.after.value} "
            f"({probe.decided_after}): {'FLIPS' if probe.flips else 'unchanged'}")


def _decision_json(decision: Decision) -> dict[str, str | None]:
    return {"action": decision.outcome.value, "snatTo": decision.snat_to, "rule": decision.rule,
            "where": decision.where}


def _region_json(region: Region) -> str:
    ports = None if region.ports is None else [str(a) if a == b else f"{a}-{b}" for a, b in region.ports]
    return json.dumps({
        "destinations": [str(p) for p in region.destination_prefixes()],
        "sources": None if region.sources is None else [str(p) for a, b in region.sources
                                                        for p in to_prefixes(region.family, a, b)],
        "protocols": None if region.protocols is None else list(region.protocols),
        "ports": ports,
        "nodes": None if region.nodes is None else _node_list(region),
        "before": _decision_json(region.before), "after": _decision_json(region.after),
    })


def _node_list(region: Region) -> list[str]:
    """Named nodes as their names; a node class as its description."""
    assert region.nodes is not None
    return [name for c in region.nodes for name in c.names] if all(c.names for c in region.nodes) \
        else [c.shown() for c in region.nodes]


def _rules_as_json(result: RuleDiffResult) -> str:
    regions = [_region_json(r) for r in result.regions]
    probes = [json.dumps({"destination": p.destination, "before": p.before.value, "after": p.after.value,
                          "flips": p.flips}) for p in result.probes]

    def array(items: list[str]) -> str:
        return "[\n    " + ",\n    ".join(items) + "\n  ]" if items else "[]"

    return f'{_HEAD}  "regions": {array(regions)},\n  "probes": {array(probes)}\n}}\n'


def _region_text(region: Region) -> str:
    words = [", ".join(str(p) for p in region.destination_prefixes())]
    sources = region.sources_shown()
    if sources is not None:
        words.append(f"from {sources}")
    protocols = region.protocols_shown()
    if protocols is not None:
        words.append(protocols)
    ports = region.ports_shown()
    if ports is not None:
        words.append(f"port {ports}")
    nodes = region.nodes_shown()
    if nodes is not None:
        words.append(f"on {nodes}")
    return (f"  {' '.join(words)}: {region.before.sees()} ({region.before.decided()}) -> {region.after.sees()} "
            f"({region.after.decided()})")


def _rules_as_text(result: RuleDiffResult, old: str, new: str) -> str:
    lines = []
    if result.regions:
        lines.append(f"{old} -> {new}: {len(result.regions)} region(s) change outcome")
        lines += [_region_text(r) for r in result.regions]
    else:
        lines.append(f"{old} -> {new}: no packet changes outcome")
    lines += [_probe_text(p) for p in result.probes]
    return "\n".join(lines) + "\n"
