"""Benchmark `audit`: flow records per second, parsing included, AWS plain and gzip and GCP JSON lines.

Each format is timed side by side with the floor it cannot beat (reading and splitting the same file's lines,
json.loads of every line), and the ratio is printed, because absolute times on a shared machine are noise.

    .venv/bin/python bench/bench_audit.py [--records 1000000] [--out bench/out]

Target: at least 300,000 flow records per second, parsing included.
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import tempfile
from collections.abc import Callable
from pathlib import Path

from bench_core import best_of  # type: ignore[import-not-found]
from ipmasq.audit import AWS_DEFAULT_FIELDS, audit, count_flows
from ipmasq.config import ConfigInput, config_from_bytes
from ipmasq.options import PolicyOptions
from ipmasq.policy.policy import Policy
from ipmasq.prefix import parse_cidr

TARGET = 300_000


def aws_lines(n: int, variant: int = 1) -> list[str]:
    """A node pool's day: 2,000 pods and 200 nodes talking to 5,000 destinations, a fifth of flows rejected."""
    rng = random.Random(variant)
    pods = [f"10.44.{rng.randrange(256)}.{rng.randrange(1, 255)}" for _ in range(2000)]
    nodes = [f"10.142.{rng.randrange(16)}.{rng.randrange(1, 255)}" for _ in range(200)]
    dests = [f"172.30.{rng.randrange(256)}.{rng.randrange(1, 255)}" for _ in range(2500)]
    dests += [f"{rng.randrange(1, 223)}.{rng.randrange(256)}.{rng.randrange(256)}.{rng.randrange(1, 255)}"
              for _ in range(2500)]
    out = [" ".join(AWS_DEFAULT_FIELDS)]
    for _ in range(n):
        src = rng.choice(pods) if rng.random() < 0.3 else rng.choice(nodes)
        action = "REJECT" if rng.random() < 0.2 else "ACCEPT"
        out.append(f"2 123456789010 eni-1235b8ca123456789 {src} {rng.choice(dests)} {rng.randrange(32768, 61000)} "
                   f"443 6 {rng.randrange(1, 50)} {rng.randrange(60, 90000)} 1587124877 1587124937 {action} OK")
    return out


def gcp_lines(aws: list[str]) -> list[str]:
    out = []
    for line in aws[1:]:
        f = line.split()
        out.append(json.dumps({"insertId": "x", "logName": "projects/p/logs/compute.googleapis.com%2Fvpc_flows",
                               "jsonPayload": {"connection": {"src_ip": f[3], "dest_ip": f[4], "src_port": int(f[5]),
                                                              "dest_port": int(f[6]), "protocol": 6},
                                               "reporter": "SRC", "bytes_sent": f[9], "packets_sent": f[8]}}))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--out", default="bench/out")
    args = parser.parse_args()
    n = args.records
    options = PolicyOptions()
    policy = Policy(config_from_bytes(ConfigInput((("/c", b"nonMasqueradeCIDRs: [10.0.0.0/8]\n"),)), options), options)
    pods = (parse_cidr("10.44.0.0/14"),)
    aws = aws_lines(n)
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        plain = Path(tmp, "aws.log")
        plain.write_text("\n".join(aws) + "\n")
        packed = Path(tmp, "aws.log.gz")
        with gzip.open(packed, "wt", compresslevel=6) as fh:
            fh.write("\n".join(aws) + "\n")
        gcp = Path(tmp, "gcp.jsonl")
        gcp.write_text("\n".join(gcp_lines(aws)) + "\n")

        def split_floor(path: Path) -> Callable[[], object]:
            def run() -> int:
                total = 0
                with open(path) as fh:
                    for line in fh:
                        total += len(line.split())
                return total
            return run

        def json_floor() -> int:
            total = 0
            with open(gcp) as fh:
                for line in fh:
                    total += len(json.loads(line))
            return total

        cases = {
            "aws": (lambda: audit(count_flows([str(plain)], pods), policy), split_floor(plain)),
            "aws.gz": (lambda: audit(count_flows([str(packed)], pods), policy), split_floor(plain)),
            "gcp-json": (lambda: audit(count_flows([str(gcp)], pods), policy), json_floor),
        }
        for name, (fn, floor) in cases.items():
            seconds = best_of(3, fn)
            floor_seconds = best_of(3, floor)
            results[name] = {"records": n, "seconds": seconds, "records_per_second": n / seconds,
                             "floor_seconds": floor_seconds, "ratio_to_floor": seconds / floor_seconds}
            verdict = "meets" if n / seconds >= TARGET else "BELOW"
            print(f"{name:9s} {n:>9,} records  {seconds:6.3f} s  {n / seconds:>10,.0f} records/s  "
                  f"({seconds / floor_seconds:4.2f}x the read+split/json floor)  {verdict} the {TARGET:,}/s target")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "audit.json").write_text(json.dumps(results, indent=2) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    names = list(results)
    ax.bar(names, [results[k]["records_per_second"] for k in names], color="tab:blue")
    ax.axhline(TARGET, color="tab:red", linestyle="--", label=f"target {TARGET:,}/s")
    ax.set_ylabel("flow records / s (parsing included)")
    ax.set_title(f"ipmasq audit, {n:,} records")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "audit.png", dpi=100)


if __name__ == "__main__":
    main()
