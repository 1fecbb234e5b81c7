"""`ipmasq lab`: real outages and their fixes, reproduced with real namespaces, TCP and the real agent."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from typing import Any

from ipmasq.errors import UsageError

BACKENDS = ("iptables", "nftables")


def register(subparsers: Any) -> None:
    from ipmasq.lab.scenarios import SCENARIOS

    parser: argparse.ArgumentParser = subparsers.add_parser(
        "lab", help="reproduce real outages and their fixes in throwaway network namespaces (root)",
        description="Build pod -> node -> VPC -> VPN peers / Cloud NAT -> internet in throwaway namespaces, run the "
        "real agent on the node, and show for every probe what explain predicts and what the peer really saw. "
        f"Scenarios: {', '.join(SCENARIOS)}.",
    )
    parser.add_argument("--scenario", default="all", metavar="NAME", help="a scenario name, or all (default)")
    parser.add_argument("--backend", choices=BACKENDS, default="iptables", help="the agent's backend")
    parser.add_argument("-o", "--output", choices=["text", "json"], default="text")
    parser.add_argument("--keep", action="store_true",
                        help="leave the namespaces (and the last agent) for exploring; prints how to enter them")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ipmasq.lab.netns import Network, cleanup_stale, new_prefix
    from ipmasq.lab.run import ScenarioResult, run_scenario
    from ipmasq.lab.scenarios import SCENARIOS
    from ipmasq.lab.topology import build_lab

    if args.scenario != "all" and args.scenario not in SCENARIOS:
        raise UsageError(f"unknown scenario {args.scenario!r} (known: {', '.join(SCENARIOS)}, all)")
    if os.geteuid() != 0:
        raise UsageError("the lab creates network namespaces: run it as root")
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
            results.append(run_scenario(lab, scenario, backend=args.backend))
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
    if args.output == "json":
        json.dump({"ok": ok, "scenarios": [
            {"name": r.name, "summary": r.summary, "ok": r.ok, "error": r.error,
             "phases": [{"name": p.name, "ok": p.ok, "probes": [o.as_dict() for o in p.probes]} for p in r.phases]}
            for r in results]}, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(f"\n{'all scenarios behaved as explain predicts' if ok else 'SOME PROBES DIFFER FROM THE PREDICTION'}")
    return 0 if ok else 1


def _show(value: str | None) -> str:
    return "-" if value is None else value


def _print_scenario(result: Any) -> None:
    print(f"== {result.name}\n   {result.summary}")
    for phase in result.phases:
        print(f"-- {phase.name}")
        print(f"   {'DESTINATION':<16} {'PREDICTED SOURCE':<17} {'PEER SAW':<15} {'CONNECTED':<9} OK")
        for probe in phase.probes:
            print(f"   {probe.destination:<16} {_show(probe.predicted_source):<17} {_show(probe.seen_source):<15} "
                  f"{'yes' if probe.connected else 'no':<9} {'ok' if probe.ok else 'MISMATCH'}")
    if result.error:
        print(f"!! {result.error}")
    print()
