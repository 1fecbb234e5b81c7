"""Benchmark the Python verdict with config rules: the destination-indexed first match against the walk over every
rule, side by side in one run, with 0, 1,000 and 10,000 rules; and `audit` over a flow log with 1,000 rules.

The rules are bench_rules.py's (endpoints and subnets of VPN/VPC ranges and partners' public addresses, sources in
the pod range, protocols, ports, a tenth for this node's pool only); packets are a pod source, tcp or udp, a port,
and a destination some rule or list holds or none does. "walk" is the evaluation verdict_for did before the index:
rule_match over every rule of the node in order, then the CIDR lists; both give the same verdict for every packet
measured (checked here, not assumed).

- verdicts/s: Policy.verdict_for with source, protocol and port known (explain, lab probes), and with only the
  source known (audit: flow logs give no protocol and port to the policy, so rules on them stay conditional).
- index: the time and memory (tracemalloc) to build the rules index of a policy, once, on its first verdict; and
  for the index's worst shape, half the rules to 0.0.0.0/0 and half endpoints inside it.
- audit: `audit` over an AWS flow log of --flows lines (2,000 pods, 5,000 destinations), parsing included.

No namespaces, no kernel:

    .venv/bin/python bench/bench_verdict.py [--sizes 0,1000,10000] [--packets 20000] [--walk-packets 2000]
        [--flows 100000] [--out bench/out]
"""

from __future__ import annotations

import argparse
import gc
import ipaddress
import json
import random
import tempfile
import time
import tracemalloc
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

from bench_audit import aws_lines  # type: ignore[import-not-found]
from bench_core import best_of  # type: ignore[import-not-found]
from bench_rules import NODE_NAME, rule_address, rules_yaml  # type: ignore[import-not-found]
from ipmasq.audit import AuditReport, audit, count_flows
from ipmasq.config import ConfigInput, config_from_bytes
from ipmasq.config.model import Rule, RuleAction
from ipmasq.options import PolicyOptions
from ipmasq.policy.packet import Packet
from ipmasq.policy.policy import Policy, PolicyVerdict, Reason
from ipmasq.policy.rule_index import RuleIndex
from ipmasq.prefix import Family, Prefix, format_address, parse_cidr
from ipmasq.testing.first_match import first_match_walk

POD_RANGE = parse_cidr("10.44.0.0/14")
PacketFields = tuple[int, int, str, int]


class WalkPolicy(Policy):
    """The verdict as it was computed before the rules index: every rule of the node in order, then the lists."""

    def __init__(self, policy: Policy) -> None:
        super().__init__(policy.config, policy.options)
        self._lists = Policy(replace(policy.config, rules=()), policy.options)

    def verdict_for(self, family: Family, address: int, *, text: str | None = None, source: int | None = None,
                    protocol: str | None = None, port: int | None = None) -> PolicyVerdict:
        shown = text if text is not None else format_address(family, address)
        rule, conditional, depends_on = first_match_walk(self.rules(family),
                                                         Packet.exact(family, address, source, protocol, port))
        if rule is not None:
            return PolicyVerdict(shown, family, rule.action is not RuleAction.PRESERVE, Reason.RULE, None, rule,
                                 rule.snat_to, conditional, depends_on)
        listed = self._lists.verdict_for(family, address, text=shown)
        if not conditional:
            return listed
        return replace(listed, conditional=conditional, depends_on=depends_on)


def policy_of(n: int) -> Policy:
    options = PolicyOptions(node_name=NODE_NAME)
    text = rules_yaml(n).encode()
    return Policy(config_from_bytes(ConfigInput((("/bench/ip-masq-agent", text),)), options), options)


def _destination(rng: random.Random) -> int:
    """Where bench_rules.py's rules point (VPN/VPC space, partners' addresses) 70% of the time, else anywhere."""
    return rng.getrandbits(32) if rng.random() >= 0.7 else rule_address(rng)


def packets(count: int, variant: int = 2) -> list[PacketFields]:
    rng = random.Random(variant)
    pod_base = int(ipaddress.IPv4Address("10.44.0.0"))
    return [(_destination(rng), pod_base | rng.getrandbits(18), rng.choice(["tcp", "udp"]),
             rng.choice([443, 80, 5432, 8080, 53, 30080])) for _ in range(count)]


def rate(policy: Policy, sample: Sequence[PacketFields], *, full: bool) -> tuple[float, list[PolicyVerdict]]:
    """Verdicts per second over `sample` (full: source, protocol and port known; else the source only)."""
    verdict_for = policy.verdict_for
    verdict_for(Family.V4, sample[0][0])  # builds the lookup tables outside the timing
    v4 = Family.V4
    gc.collect()
    start = time.perf_counter()
    if full:
        out = [verdict_for(v4, d, source=s, protocol=proto, port=port) for d, s, proto, port in sample]
    else:
        out = [verdict_for(v4, d, source=s) for d, s, _, _ in sample]
    return len(sample) / (time.perf_counter() - start), out


def same(a: PolicyVerdict, b: PolicyVerdict) -> bool:
    return (a.masquerade, a.reason, a.entry, a.rule, a.snat_to, a.conditional, a.depends_on) == (
        b.masquerade, b.reason, b.entry, b.rule, b.snat_to, b.conditional, b.depends_on)


def index_cost(n: int) -> dict[str, float]:
    """Seconds and bytes to build the rules index of a fresh policy with n rules (the CIDR table built first)."""
    policy = policy_of(n)
    policy.non_masquerade_ranges(Family.V4)  # the CIDR lists' table, which is not the index's cost
    gc.collect()
    start = time.perf_counter()
    index = policy.rule_index(Family.V4)
    seconds = time.perf_counter() - start
    del index
    policy = policy_of(n)
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    index = policy.rule_index(Family.V4)
    current, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return {"seconds": seconds, "bytes": current - before, "peak_bytes": peak - before,
            "intervals": 0 if index is None else index.intervals, "rules_on_node": len(policy.rules(Family.V4))}


def overlapping_cost(n: int) -> dict[str, float]:
    """The index's worst shape: half the rules to 0.0.0.0/0 (one port each), half endpoints inside it; a packet to
    an endpoint on another port tests every wide rule, as the walk does, but the index stores them once."""
    everywhere = Prefix(Family.V4, 0, 0)
    rules: list[Rule] = []
    for i in range(n // 2):
        rules.append(Rule(f"wide-{i}", Family.V4, (everywhere,), RuleAction.PRESERVE, protocol="tcp",
                          ports=((1024 + i, 1024 + i),)))
        rules.append(Rule(f"endpoint-{i}", Family.V4, (Prefix(Family.V4, (10 << 24) + 7 * i, 32),),
                          RuleAction.MASQUERADE))
    gc.collect()
    tracemalloc.start()
    start = time.perf_counter()
    index = RuleIndex(rules)
    seconds = time.perf_counter() - start
    current, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    lookups = 1000
    start = time.perf_counter()
    for i in range(lookups):
        index.first_match((10 << 24) + 7 * (i % (n // 2)), 1, "tcp", 443)
    return {"seconds": seconds, "bytes": current, "peak_bytes": peak, "intervals": index.intervals,
            "lookup_seconds": (time.perf_counter() - start) / lookups}


def report_key(report: AuditReport) -> object:
    return [(g.destination, g.flows, g.masquerade, g.matched, g.reasons) for g in report.groups]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="0,1000,10000", help="rule counts, comma-separated")
    parser.add_argument("--packets", type=int, default=20_000, help="packets timed with the index")
    parser.add_argument("--walk-packets", type=int, default=2_000, help="of those, timed with the walk too (slow)")
    parser.add_argument("--flows", type=int, default=100_000, help="flow log lines for audit (0: skip)")
    parser.add_argument("--audit-rules", type=int, default=1000)
    parser.add_argument("--out", default="bench/out")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    sample = packets(args.packets)
    results: dict[str, object] = {"node_name": NODE_NAME, "packets": args.packets, "walk_packets": args.walk_packets}
    rows = []
    print(f"verdicts/s, {args.packets:,} packets with the index, the first {args.walk_packets:,} with the walk")
    print(f"{'rules':>6} {'on node':>8} {'known':>15} {'walk/s':>10} {'index/s':>10} {'speed-up':>9}")
    for n in sizes:
        policy = policy_of(n)
        for full in (True, False):
            walk_rate, walk_verdicts = rate(WalkPolicy(policy), sample[:args.walk_packets], full=full)
            index_rate, verdicts = rate(policy, sample, full=full)
            differ = sum(not same(a, b) for a, b in zip(walk_verdicts, verdicts, strict=False))
            if differ:
                raise SystemExit(f"{n} rules: {differ} of {len(walk_verdicts)} verdicts differ from the walk's")
            known = "src,proto,port" if full else "source only"
            rows.append({"rules": n, "rules_on_node": len(policy.rules(Family.V4)), "known": known,
                         "walk_per_second": walk_rate, "index_per_second": index_rate})
            print(f"{n:>6,} {len(policy.rules(Family.V4)):>8,} {known:>15} {walk_rate:>10,.0f} {index_rate:>10,.0f} "
                  f"{index_rate / walk_rate:>8.1f}x", flush=True)
    results["verdicts"] = rows
    if args.flows:
        policy = policy_of(args.audit_rules)
        with tempfile.TemporaryDirectory() as tmp:
            log = Path(tmp, "aws.log")
            log.write_text("\n".join(aws_lines(args.flows)) + "\n")
            reports: dict[str, AuditReport] = {}

            def run(name: str, fresh: Callable[[], Policy]) -> Callable[[], object]:
                # a fresh policy each run: it builds its lookup tables (and the index) as a real `audit` does
                def once() -> None:
                    reports[name] = audit(count_flows([str(log)], (POD_RANGE,)), fresh())
                return once

            walk_s = best_of(1, run("walk", lambda: WalkPolicy(policy)))
            index_s = best_of(3, run("index", lambda: Policy(policy.config, policy.options)))
            if report_key(reports["walk"]) != report_key(reports["index"]):
                raise SystemExit("audit: the index's report differs from the walk's")
        results["audit"] = {"flows": args.flows, "rules": args.audit_rules, "walk_seconds": walk_s,
                            "index_seconds": index_s}
        print(f"\naudit, {args.flows:,}-line AWS flow log, {args.audit_rules:,} rules (parsing and the policy's "
              f"lookup tables included): walk {walk_s:.2f} s, index {index_s:.2f} s ({walk_s / index_s:.1f}x)")
    costs = {n: index_cost(n) for n in sizes if n}
    results["index"] = costs
    print("\nrules index: build time and memory (tracemalloc), once per policy")
    for n, c in costs.items():
        print(f"{n:>6,} rules ({c['rules_on_node']:,} on node): {c['intervals']:,} intervals, "
              f"{c['seconds'] * 1000:.1f} ms, {c['bytes'] / 2**20:.2f} MiB (peak {c['peak_bytes'] / 2**20:.2f} MiB)")
    overlapping = {n: overlapping_cost(n) for n in sizes if n}
    results["overlapping"] = overlapping
    for n, c in overlapping.items():
        print(f"{n:>6,} rules, half to 0.0.0.0/0: {c['intervals']:,} intervals, {c['seconds'] * 1000:.1f} ms, "
              f"{c['bytes'] / 2**20:.2f} MiB (peak {c['peak_bytes'] / 2**20:.2f} MiB), "
              f"{c['lookup_seconds'] * 1e6:.0f} us per packet to an endpoint (every wide rule tested)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "verdict.json").write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
