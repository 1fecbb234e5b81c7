"""`ipmasq lab`: real outages and their fixes, reproduced with real namespaces, TCP and the real agent."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from typing import Any

from ipmasq import documents
from ipmasq.commands import common
from ipmasq.errors import UsageError, clip, one_line

BACKENDS = ("iptables", "nftables")
FLEET_SCENARIO = "fleet-rollout"


def register(subparsers: Any) -> None:
    from ipmasq.lab.routed_scenarios import ROUTED_SCENARIOS
    from ipmasq.lab.scenarios import SCENARIOS

    parser: argparse.ArgumentParser = subparsers.add_parser(
        "lab", help="reproduce real outages and their fixes in throwaway network namespaces (root)",
        description="Build pod -> node -> VPC -> VPN peers / partner / Cloud NAT -> internet in throwaway namespaces, "
        "run the real agent on the node, and show for every probe what explain predicts, what the peer really saw "
        "and what decided on the node (the config rule and its file:line, the CIDR entry, or the catch-all). "
        f"Scenarios: {', '.join(SCENARIOS)}. {FLEET_SCENARIO} (not part of all) builds four nodes in two pools "
        "with the agent on each and a real Prometheus scraping them (needs prometheus installed): a config rollout "
        "read from ipmasq_enforced_config_info, a node whose rules keep being deleted, a node given an invalid "
        "config, with the seconds each node took and the alerts each one raised. Nodes whose routing decides the "
        f"source (not part of all, each in namespaces of its own): {', '.join(ROUTED_SCENARIOS)}; each probe shows "
        "the source the scenario expects, the one the peer saw, and which route, rule or mark decided.",
    )
    parser.add_argument("--scenario", default="all", metavar="NAME", help="a scenario name, or all (default)")
    parser.add_argument("--backend", choices=BACKENDS, default=None,
                        help="the agent's backend (default iptables; with --kubernetes the scenarios alternate "
                        "between iptables and nftables, so one run covers both beside either kube-proxy mode)")
    common.add_output_flag(parser)
    parser.add_argument("--keep", action="store_true",
                        help="leave the namespaces (and the last agent) for exploring; prints how to enter them")
    parser.add_argument("--kubernetes", action="store_true",
                        help="run the scenarios on a real Kubernetes 1.37 cluster in the namespaces (etcd, "
                        "kube-apiserver, controller-manager, scheduler; two nodes in two pools, each with containerd, "
                        "kubelet and kube-proxy, one in iptables mode and one in nftables mode), the agent installed "
                        "with kubectl apply -k deploy/ from an image built from the Dockerfile; binaries (from Go "
                        "modules, with Go 1.26+) and images are built once and cached in /var/cache/ipmasq/kube-lab")
    parser.add_argument("--down", action="store_true",
                        help="with --kubernetes: remove a cluster left by --keep (processes, namespaces, state)")
    parser.add_argument("--prepare", action="store_true",
                        help="with --kubernetes: build what is not cached yet (binaries, pause image, base, the "
                        "agent's image, the Prometheus the lab scrapes the agents with), say what and how long, and "
                        "stop there")
    parser.add_argument("--dump-facts", metavar="DIR",
                        help=f"with a routed scenario ({', '.join(ROUTED_SCENARIOS)}): write each phase's node facts "
                        "to DIR/SCENARIO/phase-N (routing.json: ip -j rule, route and addr; iptables.save, "
                        "ip6tables.save; ruleset.json: nft -j list ruleset) and its probes (probes.json), to run the "
                        "path model on them offline")
    parser.add_argument("--source", metavar="DIR",
                        help="with --kubernetes: the ipmasq checkout whose Dockerfile and deploy/ are used "
                        "(default: the one this ipmasq runs from, else the current directory)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ipmasq.lab.netns import Network, cleanup_stale, new_prefix
    from ipmasq.lab.routed_scenarios import ROUTED_SCENARIOS
    from ipmasq.lab.run import ScenarioResult, run_scenario
    from ipmasq.lab.scenarios import SCENARIOS
    from ipmasq.lab.topology import build_lab

    known = (*SCENARIOS, FLEET_SCENARIO, *ROUTED_SCENARIOS)
    if args.scenario != "all" and args.scenario not in known:
        raise UsageError(f"unknown scenario {one_line(clip(repr(args.scenario)))} (known: {', '.join(known)}, all)")
    if args.dump_facts is not None and args.scenario not in ROUTED_SCENARIOS:
        raise UsageError(f"--dump-facts is for a routed scenario: {', '.join(ROUTED_SCENARIOS)}")
    if os.geteuid() != 0:
        raise UsageError("the lab creates network namespaces: run it as root")
    if (args.down or args.prepare) and not args.kubernetes:
        flag = "--down" if args.down else "--prepare"
        raise UsageError(f"{flag} is for the Kubernetes lab: use it with --kubernetes")
    if args.kubernetes:
        if args.scenario == FLEET_SCENARIO:
            raise UsageError(f"{FLEET_SCENARIO} runs in the namespace lab only (its nodes are agents, not kubelets)")
        from ipmasq.lab.kubernetes.command import run_kubernetes_lab

        return run_kubernetes_lab(args, print_scenario=_print_scenario)
    if args.scenario == FLEET_SCENARIO:
        return _run_fleet(args)
    if args.scenario in ROUTED_SCENARIOS:
        if args.kubernetes or args.keep:
            raise UsageError(f"{args.scenario} runs in the namespace lab, and takes its namespaces down after it")
        return _run_routed(args)
    chosen = list(SCENARIOS.values()) if args.scenario == "all" else [SCENARIOS[args.scenario]]
    # Ctrl-C raises KeyboardInterrupt; make SIGTERM (a killed job, a CI timeout) unwind the same way, so the
    # finally below always deletes the namespaces and stops the agent and the probe servers
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    cleanup_stale()
    net = Network(new_prefix())
    results: list[ScenarioResult] = []
    lab = None
    try:
        lab = build_lab(net)
        for scenario in chosen:
            results.append(run_scenario(lab, scenario, backend=args.backend or "iptables"))
            if args.output == "text":
                _print_scenario(results[-1])
    finally:
        if args.keep:
            names = " ".join(ns.name for ns in net.namespaces.values())
            print(f"kept namespaces: {names}\n  enter one:  ip netns exec {net.prefix}-node bash\n"
                  f"  remove all: for n in {names}; do ip netns del $n; done", file=sys.stderr)
        else:
            if lab is not None:
                lab.close()
            net.delete()
    ok = all(r.ok for r in results)
    if args.output != "text":
        documents.print_document(args.output, "LabReport", {"ok": ok, "scenarios": [
            {"name": r.name, "summary": r.summary, "ok": r.ok, "error": r.error,
             "phases": [{"name": p.name, "ok": p.ok, "probes": [o.as_dict() for o in p.probes]} for p in r.phases]}
            for r in results]})
    else:
        print(f"\n{'all scenarios behaved as explain predicts' if ok else 'SOME PROBES DIFFER FROM THE PREDICTION'}")
    return 0 if ok else 1


def _show(value: str | None) -> str:
    return "-" if value is None else value


def _print_scenario(result: Any) -> None:
    print(f"== {result.name}\n   {result.summary}")
    for phase in result.phases:
        print(f"-- {phase.name}")
        from_node = any(probe.node for probe in phase.probes)  # the Kubernetes lab probes from a pod on each node
        head = f"{'FROM NODE':<27} " if from_node else ""
        print(f"   {head}{'DESTINATION':<21} {'PREDICTED SOURCE':<17} {'PEER SAW':<15} {'CONNECTED':<9} {'OK':<8} "
              "DECIDED BY")
        for probe in phase.probes:
            node = f"{_show(probe.node):<27} " if from_node else ""
            print(f"   {node}{probe.target:<21} {_show(probe.predicted_source):<17} {_show(probe.seen_source):<15} "
                  f"{'yes' if probe.connected else 'no':<9} {'ok' if probe.ok else 'MISMATCH':<8} "
                  f"{probe.decided_by.text}")
    if result.error:
        print(f"!! {result.error}")
    print()


def _run_routed(args: argparse.Namespace) -> int:
    from pathlib import Path

    from ipmasq.lab.netns import cleanup_stale
    from ipmasq.lab.routed import run_routed
    from ipmasq.lab.routed_scenarios import ROUTED_SCENARIOS

    signal.signal(signal.SIGTERM, signal.default_int_handler)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    cleanup_stale()
    facts = Path(args.dump_facts) if args.dump_facts is not None else None
    result = run_routed(ROUTED_SCENARIOS[args.scenario], backend=args.backend or "iptables", facts=facts)
    if args.output != "text":
        documents.print_document(args.output, "LabReport", {"ok": result.ok, "scenarios": [
            {"name": result.name, "summary": result.summary, "ok": result.ok, "error": result.error,
             "phases": [{"name": p.name, "ok": p.ok, "probes": [o.as_dict() for o in p.probes]}
                        for p in result.phases]}]})
        return 0 if result.ok else 1
    print(f"== {result.name}\n   {result.summary}")
    for phase in result.phases:
        print(f"-- {phase.name}")
        print(f"   {'FROM POD':<15} {'DESTINATION':<19} {'EXPECTED SOURCE':<16} {'PEER SAW':<15} {'TRACE SAYS':<15} "
              f"{'OK':<8} WHY")
        for probe in phase.probes:
            expected = "|".join(source for _, source in probe.hops) if probe.hops else _show(probe.expected_source)
            print(f"   {probe.pod_ip:<15} {probe.target:<19} {expected:<16} {_show(probe.seen_source):<15} "
                  f"{_traced(probe):<15} {'ok' if probe.ok else 'MISMATCH':<8} {probe.why}")
            if not probe.trace_ok:
                print(f"   {'':<15} trace: {one_line(str(probe.traced.reason or probe.traced.interface))}")
    if result.error:
        print(f"!! {one_line(result.error)}")
    if facts is not None:
        print(f"\nnode facts and probes: {facts / result.name}/phase-N")
    print(f"\n{'every peer saw the expected source, as trace predicted' if result.ok else 'SOME PROBES DIFFER'}")
    return 0 if result.ok else 1


def _traced(probe: Any) -> str:
    """trace's prediction in a word: the source, "one of" a multipath route's, dropped, or that it cannot say."""
    traced = probe.traced
    if traced.source is not None:
        return str(traced.source)
    if traced.hops:
        return "one of " + "|".join(_show(source) for _, source in traced.hops)
    return "dropped" if (traced.reason or "").startswith("dropped") else "CANNOT DECIDE"


def _run_fleet(args: argparse.Namespace) -> int:
    from ipmasq.lab.fleet import FleetLab, FleetResult, build_fleet, run_fleet_rollout
    from ipmasq.lab.netns import Network, cleanup_stale, new_prefix

    signal.signal(signal.SIGTERM, signal.default_int_handler)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    cleanup_stale()
    net = Network(new_prefix())
    lab: FleetLab | None = None
    result: FleetResult | None = None
    progress = (lambda line: print(f"-- {line}", flush=True)) if args.output == "text" else (lambda _line: None)
    try:
        lab = build_fleet(net, args.backend or "iptables")
        result = run_fleet_rollout(lab, progress=progress)
    finally:
        if args.keep:
            names = " ".join(ns.name for ns in net.namespaces.values())
            print(f"kept namespaces: {names}\n  remove all: for n in {names}; do ip netns del $n; done",
                  file=sys.stderr)
        else:
            if lab is not None:
                lab.close()
            net.delete()
    if args.output != "text":
        documents.print_document(args.output, "FleetLabReport", result.as_dict())
    else:
        _print_fleet(result)
    return 0 if result.ok else 1


def _print_fleet(result: Any) -> None:
    print(f"== fleet-rollout ({result.backend}): initial config {result.initial_hash}, rollout {result.rollout_hash}")
    print(f"   {'NODE':<34} {'POOL':<13} {'CONFIG HASH':<17} {'CONVERGED':>9}  {'PROBES':<6} ALERTS SEEN")
    for node in result.nodes:
        seconds = "-" if node.seconds_to_converge is None else f"{node.seconds_to_converge:.1f}s"
        print(f"   {node.name:<34} {node.pool:<13} {_show(node.config_hash):<17} {seconds:>9}  "
              f"{'ok' if node.probes_ok else 'DIFFER':<6} {', '.join(node.alert_list()) or '-'}")
    for check in result.checks:
        print(f"   {'ok' if check.ok else 'FAILED':<6} {check.name}{': ' + check.detail if check.detail else ''}")
    if result.error:
        print(f"!! {result.error}")
    print(f"\n{result.verdict}")
