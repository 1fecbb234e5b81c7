"""Benchmark the pure core: load, render and verdict at 10 .. 100,000 CIDRs, YAML and JSON.

Figures are measured side by side in one run and reported as ratios against the floor each step cannot beat
(PyYAML's C loader, json.loads), because absolute times on a shared machine are noise.

    .venv/bin/python bench/bench_core.py [--out bench/out]

Targets: 100,000 CIDRs load+render under 1 s from JSON and under 2 s from YAML; explain answers at
least 200,000 destinations per second against 10,000 CIDRs.
"""

from __future__ import annotations

import argparse
import atexit
import json
import random
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import yaml

from ipmasq.config import ConfigInput, config_from_bytes
from ipmasq.netfilter.iptables import render_restore
from ipmasq.options import PolicyOptions
from ipmasq.policy.policy import Policy
from ipmasq.prefix import Family

SIZES = (10, 1_000, 10_000, 100_000)


def cidrs(n: int, variant: int = 1) -> list[str]:
    """n distinct /24s (and /28s past 65,536) spread over 10.0.0.0/8 and 100.64.0.0/10."""
    rng = random.Random(variant)
    blocks = rng.sample(range(1 << 16), min(n, 1 << 16))
    out = [f"10.{b >> 8}.{b & 255}.0/24" for b in blocks]
    extra = n - len(out)
    for b in rng.sample(range(1 << 18), extra):
        out.append(f"100.{64 + (b >> 12)}.{(b >> 4) & 255}.{(b & 15) << 4}/28")
    return out


def wait_for(condition: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll `condition` (an OSError counts as not yet) until it holds; exit naming `what` after `timeout` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if condition():
                return
        except OSError:
            pass
        time.sleep(0.05)
    raise SystemExit(f"timed out waiting for {what}")


def scratch_dir(prefix: str) -> Path:
    """A work directory for one run (configs, the agent's log, certificates, etcd's data), removed when the process
    exits, after the run's own clean-up has stopped what wrote there."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, path, True)
    return path


def best_of(repeats: int, fn: Callable[[], object]) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="bench/out")
    args = parser.parse_args()
    options = PolicyOptions()
    rows = []
    print(f"{'CIDRs':>8} {'fmt':>4} {'parse floor':>11} {'load':>8} {'render':>8} {'load+render':>11} "
          f"{'x floor':>7} {'verdicts/s':>11}")
    for n in SIZES:
        entries = cidrs(n)
        docs = {
            "yaml": (f"cidrLimit: {n}\nnonMasqueradeCIDRs:\n" + "".join(f"  - {c}\n" for c in entries)).encode(),
            "json": json.dumps({"cidrLimit": n, "nonMasqueradeCIDRs": entries}).encode(),
        }
        floors: dict[str, Callable[[bytes], object]] = {
            "yaml": lambda d: yaml.load(d, Loader=yaml.CSafeLoader),
            "json": json.loads,
        }
        repeats = 3 if n >= 100_000 else 5
        for fmt, data in docs.items():
            floor = best_of(repeats, lambda data=data, parse=floors[fmt]: parse(data))  # type: ignore[misc]
            config_input = ConfigInput((("/bench/ip-masq-agent", data),))
            load = best_of(repeats, lambda ci=config_input: config_from_bytes(ci, options))  # type: ignore[misc]
            config = config_from_bytes(config_input, options)
            render = best_of(repeats, lambda c=config: render_restore(Policy(c, options), Family.V4))  # type: ignore[misc]
            verdict_rate = 0.0
            if fmt == "yaml":
                policy = Policy(config, options)
                policy.verdict("10.0.0.1")  # build the interval table outside the timing
                rng = random.Random(7)
                probes = [f"10.{rng.randrange(256)}.{rng.randrange(256)}.{rng.randrange(256)}" for _ in range(200_000)]
                elapsed = best_of(3, lambda p=policy, pr=probes: [p.verdict(x) for x in pr])  # type: ignore[misc]
                verdict_rate = len(probes) / elapsed
            total = load + render
            rows.append({"cidrs": n, "format": fmt, "floor_s": floor, "load_s": load, "render_s": render,
                         "total_s": total, "verdicts_per_s": verdict_rate})
            rate = f"{verdict_rate:11,.0f}" if verdict_rate else f"{'':>11}"
            print(f"{n:>8,} {fmt:>4} {floor:>10.3f}s {load:>7.3f}s {render:>7.3f}s {total:>10.3f}s "
                  f"{total / floor if floor else 0:>6.1f}x {rate}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "core.json").write_text(json.dumps(rows, indent=2))
    big = {r["format"]: r for r in rows if r["cidrs"] == 100_000}
    ten_k = next(r for r in rows if r["cidrs"] == 10_000 and r["format"] == "yaml")
    print()
    print(f"target 100k JSON load+render < 1 s: {big['json']['total_s']:.3f} s "
          f"({'ok' if big['json']['total_s'] < 1 else 'MISSED'})")
    print(f"target 100k YAML load+render < 2 s: {big['yaml']['total_s']:.3f} s "
          f"({'ok' if big['yaml']['total_s'] < 2 else 'MISSED'}; C loader alone {big['yaml']['floor_s']:.3f} s)")
    print(f"target >= 200,000 verdicts/s at 10k CIDRs: {ten_k['verdicts_per_s']:,.0f} "
          f"({'ok' if ten_k['verdicts_per_s'] >= 200_000 else 'MISSED'})")
    plot(rows, out / "core.png")


def plot(rows: list[dict[str, float]], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib not installed: no plot)")
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for fmt in ("yaml", "json"):
        sel = [r for r in rows if r["format"] == fmt]
        ax.plot([r["cidrs"] for r in sel], [r["total_s"] for r in sel], marker="o", label=f"ipmasq load+render ({fmt})")
        ax.plot([r["cidrs"] for r in sel], [r["floor_s"] for r in sel], linestyle="--", label=f"parser alone ({fmt})")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("CIDRs")
    ax.set_ylabel("seconds")
    ax.legend()
    ax.set_title("ipmasq core: load + render vs. the parser floor")
    fig.tight_layout()
    fig.savefig(path)
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
