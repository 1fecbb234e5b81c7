"""Benchmark `ipmasq diff` (and `lint`) on two 100,000-CIDR configs, measured side by side in one run.

    .venv/bin/python bench/bench_diff.py [--n 100000]

Target: diffing two 100,000-CIDR configs takes under 1 s. Printed: the pure diff (policies built from
loaded configs: interval tables, flipped ranges, minimal CIDRs), loading each format, and the whole command
in-process (read, load both, diff, write JSON), with the ratio to the 1 s target. The two configs share half
their CIDRs, so the diff is large (about 100,000 flipped CIDRs), the worst case for output.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import random
import tempfile
from collections.abc import Callable
from pathlib import Path

from bench_core import best_of, cidrs  # type: ignore[import-not-found]
from ipmasq.cli import main
from ipmasq.config import ConfigInput, config_from_bytes
from ipmasq.config.source import MAX_CONFIG_BYTES
from ipmasq.diff.diff import diff_policies
from ipmasq.lint import lint_source
from ipmasq.options import PolicyOptions
from ipmasq.policy.policy import Policy

TARGET_S = 1.0


def two_configs(n: int) -> tuple[list[str], list[str]]:
    pool = cidrs(n + n // 2, variant=7)
    rng = random.Random(3)
    rng.shuffle(pool)
    return pool[:n], pool[n // 2: n + n // 2]


def config_directory(directory: Path, entries: list[str], limit: int, fmt: str, files: int = 4) -> Path:
    """The same config as `files` ip-masq-agent-N files, which the commands merge (the kubelet/ConfigMap layout)."""
    directory.mkdir()
    share = -(-len(entries) // files)
    for i in range(files):
        part = entries[i * share:(i + 1) * share]
        body = (json.dumps({"nonMasqueradeCIDRs": part, "cidrLimit": limit}) if fmt == "json" else
                f"cidrLimit: {limit}\nnonMasqueradeCIDRs:\n" + "".join(f"  - {c}\n" for c in part))
        Path(directory, f"ip-masq-agent-{i}").write_text(body)
    return directory


def main_bench() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=100_000)
    args = parser.parse_args()
    n = args.n
    old, new = two_configs(n)
    options = PolicyOptions()
    with tempfile.TemporaryDirectory() as tmp:
        files = {}
        for name, items in (("old", old), ("new", new)):
            body = {"nonMasqueradeCIDRs": items, "cidrLimit": n}
            files[name, "json"] = Path(tmp, f"{name}.json")
            files[name, "json"].write_text(json.dumps(body))
            files[name, "yaml"] = Path(tmp, f"{name}.yaml")
            files[name, "yaml"].write_text(f"cidrLimit: {n}\nnonMasqueradeCIDRs:\n" + "".join(f"  - {c}\n"
                                                                                         for c in items))

        def load(name: str, fmt: str) -> Policy:
            data = files[name, fmt].read_bytes()
            return Policy(config_from_bytes(ConfigInput(((str(files[name, fmt]), data),)), options), options)

        before, after = load("old", "json"), load("new", "json")
        flips = len(diff_policies(before, after).flips)

        def pure() -> object:
            # fresh policies: building their interval tables is part of the diff
            return diff_policies(Policy(before.config, options), Policy(after.config, options), ("10.1.2.3",))

        # a config file holds at most 1 MiB, as a ConfigMap does: larger ones come as a directory of files
        specs = {(name, fmt): path if path.stat().st_size <= MAX_CONFIG_BYTES else
                 config_directory(Path(tmp, f"{name}-{fmt}"), items, n, fmt)
                 for (name, fmt), path in files.items() for items in [old if name == "old" else new]}

        def command(fmt: str) -> Callable[[], object]:
            def run() -> object:
                with contextlib.redirect_stdout(io.StringIO()):
                    return main(["diff", str(specs["old", fmt]), str(specs["new", fmt]), "--probe", "10.1.2.3",
                                 "-o", "json"])
            return run

        yaml_bytes = files["old", "yaml"].read_bytes()
        rows = [
            ("diff, pure (2 policies built + flips + CIDRs)", best_of(3, pure)),
            ("load one config, JSON", best_of(3, lambda: load("old", "json"))),
            ("load one config, YAML", best_of(3, lambda: load("old", "yaml"))),
            ("ipmasq diff OLD NEW -o json (JSON files)", best_of(3, command("json"))),
            ("ipmasq diff OLD NEW -o json (YAML files)", best_of(1, command("yaml"))),
            ("lint one config, YAML", best_of(1, lambda: lint_source("old.yaml", yaml_bytes))),
        ]
    print(f"two configs of {n:,} CIDRs sharing half of them: {flips:,} flipped CIDRs")
    print(f"{'step':<48} {'seconds':>8} {'x 1 s target':>12}")
    for label, seconds in rows:
        print(f"{label:<48} {seconds:>8.3f} {seconds / TARGET_S:>12.2f}")


if __name__ == "__main__":
    main_bench()
