"""The path model against the kernel on many generated nodes: the differential test's generator
(tests/kernel/route/differential.py) for a long run, both families.

    sudo .venv/bin/python bench/bench_path_differential.py [--topologies 300] [--family 4,6] [--start 0]

Each topology is built in fresh namespaces (a node with 1-3 uplinks, a pod, a peer per uplink; random ip rules,
routes, nat POSTROUTING and mangle MARK rules), every probe asked of the model (reading the node live, as `trace`
does) and of the kernel twice: `ip route get` (the route check) and a real TCP connection from the pod, the peer
that accepts it and the source it saw (the source check). Printed per family: topologies, probes checked each way,
probes the model left undecided (its reason given), commands the kernel refused (left out of that node: the model
reads what the kernel holds), mismatches; each mismatch with the topology as the commands that build it. Exits 1 on
a mismatch. Needs root. Figures: docs/measurements.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import Counter
from pathlib import Path

import hypothesis
from hypothesis import HealthCheck, Phase, given, settings

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.kernel.route.differential import Topology, topologies
from tests.kernel.route.differential_kernel import run_case

from ipmasq.prefix import Family


def run_family(family: Family, count: int, start: int, verbose: bool) -> Counter[str]:
    totals: Counter[str] = Counter()

    @hypothesis.seed(start)  # a fixed run: the same topologies every time for one --start
    @settings(max_examples=count, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(topologies(family))
    def one(topology: Topology) -> None:
        result = run_case(topology)
        totals["topologies"] += 1
        totals["uplinks"] += len(topology.uplinks)
        totals["rules"] += len(topology.rules)
        totals["routes"] += len(topology.routes)
        totals["route checks"] += result.routes_checked
        totals["source checks"] += result.sources_checked
        totals["undecided"] += len(result.skipped)
        totals["refused commands"] += len(result.rejected)
        totals["mismatches"] += len(result.mismatches)
        if verbose:
            for line in result.rejected:
                print(f"  refused: {line}")
            for line in result.skipped:
                print(f"  undecided: {line}")
        if result.mismatches:
            print(f"--- IPv{family.value} mismatch\n{topology.script()}")
            for line in result.mismatches:
                print(f"  {line}")
            sys.stdout.flush()

    one()
    return totals


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--topologies", type=int, default=300, help="per family")
    parser.add_argument("--family", default="4,6")
    parser.add_argument("--start", type=int, default=0, help="which fixed run of topologies (each is repeatable)")
    parser.add_argument("--verbose", action="store_true", help="print each refused command and undecided probe")
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("bench_path_differential: needs root (it builds namespaces)", file=sys.stderr)
        return 2
    columns = ("topologies", "route checks", "source checks", "undecided", "refused commands", "mismatches")
    rows = []
    for text in args.family.split(","):
        family = Family.V6 if text.strip() == "6" else Family.V4
        start = time.monotonic()
        totals = run_family(family, args.topologies, args.start, args.verbose)
        rows.append((family, totals, time.monotonic() - start))
    print(f"{'family':>6} " + " ".join(f"{c:>16}" for c in columns) + f" {'s/topology':>11}")
    for family, totals, seconds in rows:
        print(f"{'IPv' + str(family.value):>6} " + " ".join(f"{totals[c]:>16}" for c in columns)
              + f" {seconds / max(1, totals['topologies']):>11.2f}")
    return 1 if any(totals["mismatches"] for _, totals, _ in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
