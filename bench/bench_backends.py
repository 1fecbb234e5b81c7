"""Benchmark both backends side by side in one run, at 0, 1,000, 10,000 and 100,000 CIDRs.

Everything runs in throwaway namespaces pod -> node -> peer (nothing touches this machine's own netfilter). For
each backend and CIDR count, from a node without our objects:

- once-run: the real `ipmasq agent --once --backend B --config PATH` in the node namespace, process start, YAML
  load, Policy, reads, one transaction and its verification included. Up to 10,000 CIDRs PATH is one file; above,
  a config directory of several `ip-masq-agent-N` files (the kubelet/ConfigMap layout the agent merges), each
  raising cidrLimit.
- the kernel tool alone on the same payload (`nft -f -` with the script `ipmasq render --backend nftables` prints,
  or `iptables-restore --noflush`): the floor a once-run is compared with.
- the new-connection rate from the pod to a masqueraded destination through the node: each connection is a real
  TCP SYN that creates a conntrack entry and walks the node's nat POSTROUTING; the peer answers RST (no listener),
  so the kernel, not a server, sets the pace.

Noise control: every measurement is repeated (--repeats) in rounds; each round visits every (backend, size) in a
rotated order, so a slow spell of the machine hits all configurations alike; the figures are medians. The rate
ratio of the first target below is also measured paired (--pairs): short samples with N CIDRs and with none taken back
to back (ABBA order), one ratio per pair, and the median of those ratios, which cancels slow drifts in the machine's
load that a ratio of two medians still feels.

    sudo .venv/bin/python bench/bench_backends.py [--sizes 0,1000,10000,100000] [--repeats 5] [--seconds 1]
        [--baseline DIR]

--baseline DIR: a source tree of another version (e.g. `git archive main src | tar -x -C DIR`); its `agent --once`
is timed in the same rounds, right after this tree's, so a before/after comparison shares the machine's load.

Targets: with 10,000 CIDRs the nftables rate is >= 0.9x its rate with none; a once-run takes at most 5x what
`nft -f` alone takes for the same ruleset at 10,000 CIDRs, at most 3x at 100,000 from a YAML config directory.
The bench exits 1 when a target is missed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from ipmasq.config import ConfigInput, config_from_bytes, load_config
from ipmasq.lab.netns import Namespace, Network, network
from ipmasq.netfilter.iptables import render_restore
from ipmasq.netfilter.nft import render_script
from ipmasq.options import PolicyOptions
from ipmasq.policy.policy import Policy
from ipmasq.prefix import Family

POD, NODE, PEER = "10.44.14.15", "10.142.15.203", "10.142.0.1"
DESTINATION = "34.120.0.10"  # in no set: every rule of the iptables chain is walked, then MASQUERADE
PORT = 9  # nothing listens: the peer's kernel answers RST, so the rate is the kernel's
BACKENDS = ("iptables", "nftables")
DIRECTORY_ABOVE = 10_000  # larger configs come as a directory of several files
FILES = 4
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


def cidrs(n: int, variant: int = 1) -> list[str]:
    """n disjoint, non-adjacent /28s in 10.0.0.0/8: n set elements, n iptables rules."""
    out = []
    for b in random.Random(variant).sample(range(1 << 19), n):
        a = (10 << 24) + b * 32
        out.append(f"{a >> 24}.{(a >> 16) & 255}.{(a >> 8) & 255}.{a & 255}/28")
    return out


def yaml_file(items: list[str], limit: int) -> str:
    if not items:
        return "nonMasqueradeCIDRs: []\n"
    return f"cidrLimit: {limit}\nnonMasqueradeCIDRs:\n" + "".join(f"  - {c}\n" for c in items)


def write_config(workdir: str, n: int) -> str:
    """The config for n CIDRs: one file, or above DIRECTORY_ABOVE a directory of FILES files."""
    items = cidrs(n)
    if n <= DIRECTORY_ABOVE:
        path = os.path.join(workdir, f"ip-masq-agent-{n}")
        Path(path).write_text(yaml_file(items, max(n, 1)))
        return path
    directory = os.path.join(workdir, f"config-{n}")
    os.mkdir(directory)
    share = -(-n // FILES)
    for i in range(FILES):
        Path(directory, f"ip-masq-agent-{i}").write_text(yaml_file(items[i * share:(i + 1) * share], n))
    return directory


def build(net: Network) -> tuple[Namespace, Namespace]:
    pod, node, peer = net.add("pod"), net.add("node"), net.add("peer")
    node.sysctl("net.ipv4.ip_forward", "1")
    net.link(pod, [f"{POD}/24"], node, ["10.44.14.1/24"])
    net.link(node, [f"{NODE}/20"], peer, [f"{PEER}/20"])
    pod.run(["ip", "route", "add", "default", "via", "10.44.14.1"])
    node.run(["ip", "route", "add", "default", "via", PEER])
    peer.run(["ip", "route", "add", "local", f"{DESTINATION}/32", "dev", "lo"])
    peer.run(["ip", "route", "add", "10.44.14.0/24", "via", NODE])
    return pod, node


def timed_run(node: Namespace, argv: list[str], stdin: str | None = None, env: dict[str, str] | None = None) -> float:
    start = time.perf_counter()
    node.run(argv, stdin=stdin, timeout=600, env=env)
    return time.perf_counter() - start


def once_argv(backend: str, config: str) -> list[str]:
    return [sys.executable, "-m", "ipmasq", "agent", "--once", f"--backend={backend}", f"--config={config}"]


def source_env(tree: str) -> dict[str, str]:
    """The environment that makes `python -m ipmasq` import the package from `tree`/src instead of this one."""
    return {**os.environ, "PYTHONPATH": str(Path(tree, "src").resolve())}


def clean(node: Namespace) -> None:
    """A node without our objects (nor anyone's: the namespace holds only what the benchmark wrote)."""
    node.run(["nft", "flush", "ruleset"])


def rate(pod: Namespace, node: Namespace, seconds: float) -> float:
    node.run(["conntrack", "-F"], check=False)
    # pinned to one CPU: where the scheduler puts the client otherwise swings the rate by a third between samples
    pin = ["taskset", "-c", str((os.cpu_count() or 1) - 1)] if shutil.which("taskset") else []
    result = pod.run([*pin, sys.executable, "-c", CONNECT_PROGRAM, DESTINATION, str(PORT), str(seconds)],
                     timeout=seconds + 30)
    return float(result.stdout.strip())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="0,1000,10000,100000")
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=1.0, help="per connection-rate sample")
    parser.add_argument("--pairs", type=int, default=8, help="paired rate samples per backend (0: skip)")
    parser.add_argument("--pair-size", type=int, default=10_000, help="CIDRs of the paired rate comparison")
    parser.add_argument("--out", default="bench/out")
    parser.add_argument("--baseline", metavar="DIR", help="also time `agent --once` of the source tree DIR/src")
    args = parser.parse_args()
    baseline = source_env(args.baseline) if args.baseline else None
    sizes = [int(s) for s in args.sizes.split(",")]
    backends = args.backends.split(",")
    options = PolicyOptions()
    workdir = tempfile.mkdtemp(prefix="ipmasq-bench-")
    samples: dict[tuple[str, int, str], list[float]] = defaultdict(list)
    try:
        configs = {n: write_config(workdir, n) for n in sizes}
        policies = {n: Policy(load_config(configs[n], options, missing_ok=False), options) for n in sizes}
        payloads = {("nftables", n): render_script(p) for n, p in policies.items()}
        payloads.update({("iptables", n): render_restore(p, Family.V4) for n, p in policies.items()})
        floor_tool = {"nftables": ["nft", "-f", "-"], "iptables": ["iptables-restore", "--noflush", "-w"]}
        visits = [(b, n) for n in sizes for b in backends]
        with network() as net:
            pod, node = build(net)
            for round_ in range(args.repeats):
                shift = (round_ * 3) % len(visits)  # rotate: each round starts elsewhere
                for backend, n in visits[shift:] + visits[:shift]:
                    clean(node)
                    samples[(backend, n, "tool")].append(
                        timed_run(node, floor_tool[backend], payloads[(backend, n)]))
                    clean(node)
                    samples[(backend, n, "once")].append(timed_run(node, once_argv(backend, configs[n])))
                    if baseline is not None:
                        clean(node)
                        samples[(backend, n, "baseline")].append(
                            timed_run(node, once_argv(backend, configs[n]), env=baseline))
                    samples[(backend, n, "rate")].append(rate(pod, node, args.seconds))
                print(f"round {round_ + 1}/{args.repeats} done", file=sys.stderr, flush=True)
            paired = paired_ratios(pod, node, backends, args, options) if args.pairs else {}
            clean(node)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    rows = []
    kinds = ("tool", "once", "rate", "baseline") if baseline is not None else ("tool", "once", "rate")
    print(f"{'CIDRs':>7} {'backend':>9} {'tool s':>8} {'once s':>8} {'x tool':>7} {'conn/s':>9} "
          f"{'(min-max)':>15} {'x rate@0':>8}" + (f" {'baseline s':>10} {'x tool':>7}" if baseline else ""))
    for backend in backends:
        for n in sizes:
            tool = statistics.median(samples[(backend, n, "tool")])
            once = statistics.median(samples[(backend, n, "once")])
            rates = samples[(backend, n, "rate")]
            r = statistics.median(rates)
            ratio = r / statistics.median(samples[(backend, sizes[0], "rate")])
            row: dict[str, object] = {"backend": backend, "cidrs": n, "tool": tool, "once": once,
                                      "once_ratio": once / tool, "rate": r, "rate_ratio": ratio,
                                      "samples": {k: samples[(backend, n, k)] for k in kinds}}
            line = (f"{n:>7} {backend:>9} {tool:>8.3f} {once:>8.3f} {once / tool:>7.1f} {r:>9.0f} "
                    f"{f'({min(rates):.0f}-{max(rates):.0f})':>15} {ratio:>8.2f}")
            if baseline is not None:
                before = statistics.median(samples[(backend, n, "baseline")])
                row.update(baseline=before, baseline_ratio=before / tool)
                line += f" {before:>10.3f} {before / tool:>7.1f}"
            rows.append(row)
            print(line, flush=True)
    by = {(r["backend"], r["cidrs"]): r for r in rows}
    checks = [
        (("nftables", 10_000), "rate_ratio", ">=", 0.9, "nftables rate at 10,000 CIDRs / rate at 0, unpaired medians"),
        (("nftables", 10_000), "once_ratio", "<=", 5.0, "agent --once / nft -f of its ruleset, 10,000 CIDRs"),
        (("nftables", 100_000), "once_ratio", "<=", 3.0,
         "agent --once / nft -f of its ruleset, 100,000 CIDRs from a config directory"),
    ]
    for backend, ratios in paired.items():
        print(f"paired rate ratio {backend} {args.pair_size} CIDRs / none: median {statistics.median(ratios):.3f} "
              f"over {len(ratios)} pairs (min {min(ratios):.3f}, max {max(ratios):.3f})")
        rows.append({"backend": backend, "cidrs": args.pair_size, "paired_rate_ratios": ratios})
    if "nftables" in paired:
        checks.append((("nftables", -1), "paired", ">=", 0.9,
                       f"nftables rate at {args.pair_size:,} CIDRs / rate at 0, paired"))
        by[("nftables", -1)] = {"paired": statistics.median(paired["nftables"])}
    print("\ntargets (medians of", args.repeats, "rounds):")
    missed = []
    for key, field, op, bound, label in checks:
        if key in by:
            value = float(by[key][field])
            ok = value >= bound if op == ">=" else value <= bound
            print(f"  {label}: {value:.3f} (target {op} {bound}) {'met' if ok else 'MISSED'}")
            if not ok:
                missed.append(label)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "backends.json").write_text(json.dumps(rows, indent=1))
    plot(rows, backends, out / "backends.png")
    if missed:
        sys.exit(f"missed: {'; '.join(missed)}")


def paired_ratios(pod: Namespace, node: Namespace, backends: list[str], args: argparse.Namespace,
                  options: PolicyOptions) -> dict[str, list[float]]:
    """Per backend: rate with args.pair_size CIDRs / rate with none, sampled back to back, once per pair."""
    def policy(text: str) -> Policy:
        return Policy(config_from_bytes(ConfigInput((("/bench/ip-masq-agent", text.encode()),)), options), options)

    big = policy(yaml_file(cidrs(args.pair_size), max(args.pair_size, 1)))
    none = policy(yaml_file([], 1))
    seconds = max(args.seconds / 2, 0.25)
    out: dict[str, list[float]] = {}
    for backend in backends:
        install = {
            n: (["nft", "-f", "-"], render_script(p)) if backend == "nftables"
            else (["iptables-restore", "--noflush", "-w"], render_restore(p, Family.V4))
            for n, p in ((0, none), (args.pair_size, big))
        }
        ratios = []
        for i in range(args.pairs):
            measured = {}
            for n in ((0, args.pair_size) if i % 2 == 0 else (args.pair_size, 0)):  # ABBA
                clean(node)
                argv, payload = install[n]
                node.run(argv, stdin=payload, timeout=600)
                measured[n] = rate(pod, node, seconds)
            ratios.append(measured[args.pair_size] / measured[0])
        out[backend] = ratios
    return out


def plot(rows: list[dict[str, object]], backends: list[str], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for backend in backends:
        mine = [r for r in rows if r["backend"] == backend and "rate" in r]
        xs = [max(int(r["cidrs"]), 1) for r in mine]  # type: ignore[call-overload]
        ax1.plot(xs, [r["rate"] for r in mine], marker="o", label=backend)
        ax2.plot(xs, [r["once"] for r in mine], marker="o", label=f"{backend}: agent --once")
        ax2.plot(xs, [r["tool"] for r in mine], marker="x", linestyle="--", label=f"{backend}: tool alone")
    for ax, title in ((ax1, "new connections/s through the node (median)"), (ax2, "apply time (s, median)")):
        ax.set_xscale("log")
        ax.set_xlabel("CIDRs (0 plotted at 1)")
        ax.set_title(title)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)


if __name__ == "__main__":
    main()
