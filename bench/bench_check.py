"""Benchmark `ipmasq check --from-dump` on nodes with 1,000 to 100,000 CIDRs, side by side with `ipmasq render`.

    .venv/bin/python bench/bench_check.py [--sizes 1000,10000,100000]

Targets: 10,000 CIDRs under 2 s, 100,000 under 15 s, the whole command (process start, loading the config,
reading the dump, both passes). Each dump is what the agent writes for the config (our chain, in iptables-save
order) plus kubenet's masquerade rule and a KUBE-POSTROUTING chain in front of it, so the traced pass has foreign
rules to decide on every destination interval. `render` of the same config runs in the same round as the yardstick
(it loads the same config and renders the same chain): the ratio check/render says what the analysis costs on top.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_core import cidrs  # type: ignore[import-not-found]
from ipmasq.config import ConfigInput, config_from_bytes
from ipmasq.config.source import MAX_CONFIG_BYTES
from ipmasq.netfilter.iptables import render_restore
from ipmasq.options import PolicyOptions
from ipmasq.policy.policy import Policy
from ipmasq.prefix import Family

TARGETS = {10_000: 2.0, 100_000: 15.0}
FOREIGN = (":KUBE-POSTROUTING - [0:0]\n"
           "-A POSTROUTING -m comment --comment \"kubernetes postrouting rules\" -j KUBE-POSTROUTING\n"
           "-A KUBE-POSTROUTING -m mark ! --mark 0x4000/0x4000 -j RETURN\n"
           "-A KUBE-POSTROUTING -j MARK --set-xmark 0x4000/0x0\n"
           "-A KUBE-POSTROUTING -j MASQUERADE --random-fully\n"
           "-A POSTROUTING ! -d 10.0.0.0/8 -m comment --comment \"kubenet: SNAT for outbound traffic from cluster\" "
           "-m addrtype ! --dst-type LOCAL -j MASQUERADE\n")


def timed(argv: list[str]) -> tuple[float, int]:
    start = time.perf_counter()
    done = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, check=False)
    return time.perf_counter() - start, done.returncode


def config_directory(directory: Path, entries: list[str], files: int = 4) -> Path:
    """The same config as `files` ip-masq-agent-N files, which the commands merge (the kubelet/ConfigMap layout)."""
    directory.mkdir()
    share = -(-len(entries) // files)
    for i in range(files):
        body = {"nonMasqueradeCIDRs": entries[i * share:(i + 1) * share], "cidrLimit": len(entries)}
        Path(directory, f"ip-masq-agent-{i}").write_text(json.dumps(body))
    return directory


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="1000,10000,100000")
    args = parser.parse_args()
    ipmasq = str(Path(sys.executable).with_name("ipmasq"))
    print(f"{'CIDRs':>8} {'check s':>9} {'render s':>9} {'check/render':>13} {'target s':>9}  verdict")
    with tempfile.TemporaryDirectory() as tmp:
        for n in (int(s) for s in args.sizes.split(",")):
            config = Path(tmp, f"config-{n}.json")
            config.write_text(json.dumps({"nonMasqueradeCIDRs": cidrs(n), "cidrLimit": n}))
            options = PolicyOptions()
            policy = Policy(config_from_bytes(ConfigInput(((str(config), config.read_bytes()),)), options), options)
            if config.stat().st_size > MAX_CONFIG_BYTES:  # a config file holds at most 1 MiB, as a ConfigMap does:
                config = config_directory(Path(tmp, f"config-{n}"), cidrs(n))  # larger ones come as a directory
            payload = render_restore(policy, Family.V4)
            dump = Path(tmp, f"dump-{n}.save")
            dump.write_text(payload.replace("*nat\n", "*nat\n:POSTROUTING ACCEPT [0:0]\n" + FOREIGN, 1))
            repeats = 3 if n <= 10_000 else 1
            check_s, render_s = [], []
            for _ in range(repeats):  # alternate the two commands, so that noise hits both alike
                seconds, code = timed([ipmasq, "check", "--from-dump", str(dump), "--config", str(config),
                                       "--pod-range", "10.4.0.0/14", "-o", "json"])
                check_s.append(seconds)
                render_s.append(timed([ipmasq, "render", "--config", str(config)])[0])
            check, render = min(check_s), min(render_s)
            target = TARGETS.get(n)
            verdict = "" if target is None else ("meets target" if check < target else "MISSES target")
            print(f"{n:>8} {check:>9.2f} {render:>9.2f} {check / render:>13.1f} "
                  f"{'' if target is None else f'{target:.0f}':>9}  {verdict} (exit {code})")


if __name__ == "__main__":
    main()
