"""Benchmark a config with 1,000 `rules` against one without, both backends side by side in one run.

Rules are random but shaped like real ones: destinations are endpoints (/32), subnets (/24-/16) of VPN and VPC
ranges in 10/8, 172.16/12 and 192.168/16, and partners' public addresses; most test the pod range or a slice of it,
half a protocol, most of those ports (HTTPS, databases, a range); actions are masquerade, preserve or snat to a
spare node address, and a tenth apply only to nodes whose name matches a glob (this node's pool).

- apply: rendering the policy (Policy built from the YAML, `nft -f` script or iptables-restore payload) and the
  kernel tool applying it in the node namespace (`nft -f -`, `iptables-restore --noflush`), and the whole real
  `ipmasq agent --once` (process start, YAML load, transaction, verification), with 1,000 rules and with none.
- verdict: Policy.verdict_for in Python for random packets (destination, pod source, protocol, port), with
  1,000 rules and with none; each packet's first-match walk over the rules that exist on the node.
- new-connection rate: real TCP connects from the pod namespace through the node namespace to a peer, with the
  rules in the kernel and without: each connection is a SYN that creates a conntrack entry and walks the node's nat
  POSTROUTING; the destination matches no rule, then MASQUERADE. iptables tests every rule on the way (the worst
  case); the agent's nftables table holds the rules in a chain of their own, entered only for destinations in an
  interval set of every rule destination, so this one costs a set lookup. The peer answers RST (no listener), so
  the kernel sets the pace. Ratios are paired: samples with 1,000 rules and with none taken back to back in ABBA
  order, one ratio per pair, the median of those.

Everything runs in throwaway namespaces pod -> node -> peer; nothing touches this machine's own netfilter.

    sudo .venv/bin/python bench/bench_rules.py [--rules 1000] [--repeats 5] [--pairs 10] [--seconds 0.5]

Target: the nftables new-connection rate with 1,000 rules is >= 0.8x its rate with none.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from ipmasq.config import ConfigInput, config_from_bytes
from ipmasq.lab.netns import Namespace, Network, network
from ipmasq.netfilter.iptables import render_restore
from ipmasq.netfilter.nft import render_script
from ipmasq.options import PolicyOptions
from ipmasq.policy.policy import Policy
from ipmasq.prefix import Family

POD, NODE, PEER = "10.44.14.15", "10.142.15.203", "10.142.0.1"
POD_RANGE = "10.44.0.0/14"
SPARES = ("10.142.15.204", "10.142.15.205")
NODE_NAME = "gke-prod-egress-pool-7f3k"
DESTINATION = "34.120.0.10"  # in no rule's destinations and no CIDR list: every rule is walked, then MASQUERADE
PORT = 443  # a port many rules test: their port match is evaluated too; nothing listens, the peer answers RST
BACKENDS = ("iptables", "nftables")
CONNECT_PROGRAM = """
import socket, sys, time
host, port, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
n = 0
deadline = time.perf_counter() + seconds
start = time.perf_counter()
while time.perf_counter() < deadline:
    s = socket.socket()
    try:
        s.connect((host, port))
    except ConnectionRefusedError:
        pass
    s.close()
    n += 1
print(n / (time.perf_counter() - start))
"""
PORT_CHOICES = ("443", "80", "5432", "3306", "6379", "9092", "8443", '"8000-8099"', '"30000-32767"', "53", "22")


def rule_address(rng: random.Random) -> int:
    """A destination a pod reaches through a rule: VPN/VPC space or a partner's public address (never 34/8)."""
    kind = rng.random()
    if kind < 0.5:
        base, bits = 10 << 24, 24
    elif kind < 0.7:
        base, bits = (172 << 24) | (16 << 16), 20
    elif kind < 0.8:
        base, bits = (192 << 24) | (168 << 16), 16
    else:
        base, bits = rng.choice([52, 54, 104, 151, 185, 203]) << 24, 24
    return base | rng.getrandbits(bits)


def _prefix(address: int, length: int) -> str:
    network = address & ~((1 << (32 - length)) - 1) & 0xFFFFFFFF
    return f"{ipaddress.IPv4Address(network)}/{length}"


def rules_yaml(n: int, variant: int = 1) -> str:
    """A config with n rules (and GKE's usual nonMasqueradeCIDRs behind them)."""
    rng = random.Random(variant)
    pod_base = int(ipaddress.IPv4Address("10.44.0.0"))
    lines = ["nonMasqueradeCIDRs: [10.0.0.0/8, 172.16.0.0/12, 192.168.0.0/16]"]
    if n:
        lines.append("rules:")
    for i in range(n):
        lines.append(f"  - name: rule-{i:04d}")
        destinations = [_prefix(rule_address(rng), rng.choice([32, 32, 32, 28, 24, 24, 20, 16]))
                        for _ in range(rng.choice([1, 1, 1, 2, 3]))]
        lines.append(f"    destinations: [{', '.join(destinations)}]")
        if rng.random() < 0.7:
            sources = [POD_RANGE] if rng.random() < 0.5 else [
                _prefix(pod_base | rng.getrandbits(18), rng.choice([24, 24, 20, 28]))
                for _ in range(rng.choice([1, 2]))]
            lines.append(f"    sources: [{', '.join(sources)}]")
        if rng.random() < 0.5:
            lines.append(f"    protocol: {rng.choice(['tcp', 'tcp', 'tcp', 'udp'])}")
            if rng.random() < 0.8:
                lines.append(f"    ports: [{', '.join(rng.sample(PORT_CHOICES, rng.choice([1, 1, 2, 3])))}]")
        if rng.random() < 0.1:
            lines.append(f"    nodes: [{json.dumps(rng.choice(['gke-prod-egress-*', '*-egress-pool-*']))}]")
        action = rng.choice(["masquerade", "masquerade", "preserve", "snat"])
        lines.append(f"    action: {action}")
        if action == "snat":
            lines.append(f"    snatTo: {rng.choice(SPARES)}")
    return "\n".join(lines) + "\n"


def policy_of(text: str, options: PolicyOptions) -> Policy:
    return Policy(config_from_bytes(ConfigInput((("/bench/ip-masq-agent", text.encode()),)), options), options)


def build(net: Network) -> tuple[Namespace, Namespace]:
    pod, node, peer = net.add("pod"), net.add("node"), net.add("peer")
    node.sysctl("net.ipv4.ip_forward", "1")
    net.link(pod, [f"{POD}/24"], node, ["10.44.14.1/24"])
    net.link(node, [f"{NODE}/20", *(f"{s}/20" for s in SPARES)], peer, [f"{PEER}/20"])
    pod.run(["ip", "route", "add", "default", "via", "10.44.14.1"])
    node.run(["ip", "route", "add", "default", "via", PEER])
    peer.run(["ip", "route", "add", "local", f"{DESTINATION}/32", "dev", "lo"])
    peer.run(["ip", "route", "add", "10.44.14.0/24", "via", NODE])
    return pod, node


def clean(node: Namespace) -> None:
    node.run(["nft", "flush", "ruleset"])


def timed(action: Callable[[], object]) -> float:
    start = time.perf_counter()
    action()
    return time.perf_counter() - start


def rate(pod: Namespace, node: Namespace, seconds: float) -> float:
    node.run(["conntrack", "-F"], check=False)
    # pinned to one CPU: where the scheduler puts the client otherwise swings the rate by a third between samples
    pin = ["taskset", "-c", str((os.cpu_count() or 1) - 1)] if shutil.which("taskset") else []
    result = pod.run([*pin, sys.executable, "-c", CONNECT_PROGRAM, DESTINATION, str(PORT), str(seconds)],
                     timeout=seconds + 30)
    return float(result.stdout.strip())


def verdict_rate(policy: Policy, count: int, variant: int = 2) -> float:
    """Verdicts per second for `count` random packets: a pod source, tcp/udp, a port, a destination some rule or
    list holds or none does."""
    rng = random.Random(variant)
    pod_base = int(ipaddress.IPv4Address("10.44.0.0"))
    packets = [(rule_address(rng) if rng.random() < 0.7 else rng.getrandbits(32), pod_base | rng.getrandbits(18),
                rng.choice(["tcp", "udp"]), rng.choice([443, 80, 5432, 8080, 53, 30080])) for _ in range(count)]
    verdict_for = policy.verdict_for
    policy.verdict_for(Family.V4, packets[0][0])  # builds the lookup tables outside the timing
    start = time.perf_counter()
    for destination, source, protocol, port in packets:
        verdict_for(Family.V4, destination, source=source, protocol=protocol, port=port)
    return count / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rules", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=5, help="apply measurements per backend and config")
    parser.add_argument("--pairs", type=int, default=10, help="paired new-connection rate samples per backend")
    parser.add_argument("--seconds", type=float, default=0.5, help="per connection-rate sample")
    parser.add_argument("--verdicts", type=int, default=20_000)
    parser.add_argument("--out", default="bench/out")
    args = parser.parse_args()
    options = PolicyOptions(node_name=NODE_NAME)
    texts = {0: rules_yaml(0), args.rules: rules_yaml(args.rules)}
    sizes = (0, args.rules)
    workdir = tempfile.mkdtemp(prefix="ipmasq-bench-rules-")
    results: dict[str, object] = {"rules": args.rules, "node_name": NODE_NAME}
    try:
        configs = {}
        for n, text in texts.items():
            configs[n] = os.path.join(workdir, f"ip-masq-agent-{n}")
            Path(configs[n]).write_text(text)
        policies = {n: policy_of(texts[n], options) for n in sizes}
        on_node = len(policies[args.rules].rules(Family.V4))
        results["rules_on_node"] = on_node
        renderers: dict[str, Callable[[Policy], str]] = {
            "nftables": render_script, "iptables": lambda p: render_restore(p, Family.V4)}
        tools = {"nftables": ["nft", "-f", "-"], "iptables": ["iptables-restore", "--noflush", "-w"]}
        apply: dict[str, dict[int, dict[str, float]]] = {b: {} for b in BACKENDS}
        rates: dict[str, list[float]] = {}
        raw_rates: dict[str, dict[int, list[float]]] = {b: {0: [], args.rules: []} for b in BACKENDS}
        with network() as net:
            pod, node = build(net)
            for backend in BACKENDS:
                for n in sizes:
                    render_s, tool_s, once_s = [], [], []
                    payload = ""
                    for _ in range(args.repeats):
                        start = time.perf_counter()
                        policy = policy_of(texts[n], options)
                        payload = renderers[backend](policy)
                        render_s.append(time.perf_counter() - start)
                        clean(node)
                        tool_s.append(timed(lambda: node.run(tools[backend], stdin=payload, timeout=600)))  # noqa: B023
                        clean(node)
                        once = [sys.executable, "-m", "ipmasq", "agent", "--once", f"--backend={backend}",
                                f"--config={configs[n]}", f"--node-name={NODE_NAME}"]
                        once_s.append(timed(lambda: node.run(once, timeout=600)))  # noqa: B023
                    apply[backend][n] = {"render": statistics.median(render_s), "tool": statistics.median(tool_s),
                                         "once": statistics.median(once_s), "payload_lines": payload.count("\n")}
                payloads = {n: renderers[backend](policies[n]) for n in sizes}
                ratios = []
                for i in range(args.pairs):
                    measured = {}
                    for n in (sizes if i % 2 == 0 else sizes[::-1]):  # ABBA
                        clean(node)
                        node.run(tools[backend], stdin=payloads[n], timeout=600)
                        measured[n] = rate(pod, node, args.seconds)
                        raw_rates[backend][n].append(measured[n])
                    ratios.append(measured[args.rules] / measured[0])
                rates[backend] = ratios
                print(f"{backend} done", file=sys.stderr, flush=True)
            clean(node)
        verdicts = {n: verdict_rate(policies[n], args.verdicts) for n in sizes}
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    print(f"{args.rules:,} rules ({on_node} on node {NODE_NAME}) vs none; medians\n")
    print(f"{'backend':>9} {'rules':>6} {'lines':>7} {'render s':>9} {'tool s':>8} {'once s':>8} {'conn/s':>9}")
    for backend in BACKENDS:
        for n in sizes:
            a = apply[backend][n]
            print(f"{backend:>9} {n:>6} {a['payload_lines']:>7.0f} {a['render']:>9.4f} {a['tool']:>8.4f} "
                  f"{a['once']:>8.3f} {statistics.median(raw_rates[backend][n]):>9.0f}")
    print()
    for backend in BACKENDS:
        r = rates[backend]
        print(f"new-connection rate {backend}, {args.rules:,} rules / none, paired: median {statistics.median(r):.3f} "
              f"over {len(r)} pairs (min {min(r):.3f}, max {max(r):.3f})")
    print(f"policy verdicts/s in Python: none {verdicts[0]:,.0f}, {args.rules:,} rules {verdicts[args.rules]:,.0f} "
          f"({1e6 / verdicts[args.rules]:.1f} us per packet)")
    ratio = statistics.median(rates["nftables"])
    print(f"\ntarget: nftables rate with {args.rules:,} rules >= 0.8x none: {ratio:.3f} "
          f"{'met' if ratio >= 0.8 else 'MISSED'}")
    results.update({"apply": apply, "paired_rate_ratios": rates, "rates": raw_rates,
                    "verdicts_per_second": verdicts})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "rules.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
