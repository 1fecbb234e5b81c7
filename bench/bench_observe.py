"""What observe mode costs a node, and how soon it sees a change of the node's rules, side by side in one run.

    sudo .venv/bin/python bench/bench_observe.py [--window 60] [--filler 0,2000] [--flips 20] [-o json]

A real `ipmasq agent --observe gke` (GKE's flags, metrics on, no API) in a throwaway network namespace beside a
stand-in writer (a loop of `iptables-restore --noflush` of GKE's default IP-MASQ chain, as hand-made fix-nat
DaemonSets and, from the node's side, GKE's agent do), with --filler other nat rules in a chain of their own
(kube-proxy's, sized as a node's Services make them). For each filler size, measured:

1. CPU per minute of the observer (utime+stime, its own and its waited-for children's: iptables-save and nft are
   the bulk), over --window seconds: (a) idle, the writer stopped (the kernel's fingerprint does not move: no read);
   (b) the writer re-applying the same rules every second (the nf_tables generation moves: one full read per look,
   every 2 s, never a comparison: the rules read are equal to the last ones);
2. a change of the rules -> the observer's verdict: the writer flips between GKE's rules (in sync with the config)
   and only the MASQUERADE rule (out of sync), --flips times; the seconds from the write until the observer's
   /metrics counts a pass with the new verdict (p50, p99, max). `ipmasq status` shows it after the status write
   that follows (in the lab: tests/kernel/lab/kubernetes/test_observe.py prints those times);
3. the observer's resident memory (VmRSS at the end, VmHWM).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

from bench_agent_memory import ADDRESS, _cpu, _rss  # type: ignore[import-not-found]
from bench_core import scratch_dir  # type: ignore[import-not-found]
from ipmasq.lab.kubelet import publish
from ipmasq.lab.kubernetes.standin import GKE_DEFAULT_RULES, JUMP
from ipmasq.lab.netns import Namespace, network

GKE = ("--masq-chain=IP-MASQ", "--nomasq-all-reserved-ranges", "--random-fully=false")
ONLY_MASQUERADE = "\n".join(line for line in GKE_DEFAULT_RULES.splitlines() if "RETURN" not in line) + "\n"


def _filler(count: int) -> str:
    """`count` kube-proxy-like rules (DNAT of Service IPs) in a chain of their own, jumped to from PREROUTING."""
    lines = ["*nat", ":KUBE-BENCH-SERVICES - [0:0]", "-A PREROUTING -j KUBE-BENCH-SERVICES"]
    for i in range(count):
        lines.append(f"-A KUBE-BENCH-SERVICES -d 10.96.{i // 250}.{i % 250 + 1}/32 -p tcp -m tcp --dport 80 "
                     f'-m comment --comment "bench/svc-{i}:http cluster IP" -j DNAT --to-destination '
                     f"10.44.{i // 250}.{i % 250 + 1}:8080")
    return "\n".join([*lines, "COMMIT"]) + "\n"


def _wait(condition: object, timeout: float, what: str) -> float:
    started = time.monotonic()
    while not condition():  # type: ignore[operator]
        if time.monotonic() - started > timeout:
            raise SystemExit(f"bench_observe: not within {timeout:.0f} s: {what}")
        time.sleep(0.02)
    return time.monotonic() - started


class Writer:
    """The stand-in: restores its chain every second while running (a thread of the bench, bounded by stop)."""

    def __init__(self, node: Namespace) -> None:
        self.node, self.rules = node, GKE_DEFAULT_RULES
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None

    def write(self, rules: str) -> None:
        self.rules = rules
        self.node.run(["iptables-restore", "--noflush"], stdin=rules)

    def start(self) -> None:
        self.stop.clear()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while not self.stop.wait(1.0):
            self.node.run(["iptables-restore", "--noflush"], stdin=self.rules)

    def halt(self) -> None:
        self.stop.set()
        if self.thread is not None:
            self.thread.join()


def _cpu_per_minute(pid: int, window: float) -> float:
    before = sum(_cpu(pid))
    time.sleep(window)
    return (sum(_cpu(pid)) - before) / window * 60.0


def _run(filler: int, window: float, flips: int, work: Path) -> dict[str, object]:
    with network() as net:
        node = net.add("node")
        node.run(["iptables-restore", "--noflush"], stdin=f"*nat\n:IP-MASQ - [0:0]\n-A POSTROUTING {JUMP}\nCOMMIT\n")
        if filler:
            node.run(["iptables-restore", "--noflush"], stdin=_filler(filler))
        writer = Writer(node)
        writer.write(GKE_DEFAULT_RULES)
        config = work / f"config-{filler}"
        publish(str(config), "")
        log = (work / f"observer-{filler}.log").open("w")
        proc = node.popen([sys.executable, "-m", "ipmasq", "agent", "--observe=gke", *GKE, "--api=off",
                           f"--config={config}/ip-masq-agent", f"--metrics-address={ADDRESS}"], stdout=log,
                          stderr=log)
        try:
            _wait(lambda: _in_ns(node, "in-sync") >= 1 or proc.poll() is not None, 60, "the observer's first pass")
            if proc.poll() is not None:
                raise SystemExit(f"bench_observe: the observer exited: {(work / f'observer-{filler}.log').read_text()}")
            idle = _cpu_per_minute(proc.pid, window)
            writer.start()
            churn = _cpu_per_minute(proc.pid, window)
            seconds = []
            for flip in range(flips):
                target, verdict = (ONLY_MASQUERADE, "out-of-sync") if flip % 2 == 0 else (GKE_DEFAULT_RULES,
                                                                                           "in-sync")
                before = _in_ns(node, verdict)
                written = time.monotonic()
                writer.write(target)
                _wait(lambda v=verdict, b=before: _in_ns(node, v) > b, 60, f"flip {flip}: {verdict}")
                seconds.append(time.monotonic() - written)
            writer.halt()
            rss, hwm = _rss(proc.pid)
        finally:
            writer.halt()
            proc.terminate()
            proc.wait(timeout=30)
            log.close()
    ordered = sorted(seconds)
    return {"filler_rules": filler, "cpu_seconds_per_minute_idle": round(idle, 3),
            "cpu_seconds_per_minute_writer_every_1s": round(churn, 3),
            "rules_change_to_verdict_p50": round(ordered[len(ordered) // 2], 2),
            "rules_change_to_verdict_p99": round(ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))], 2),
            "rules_change_to_verdict_max": round(ordered[-1], 2), "rss_mib": round(rss, 1),
            "hwm_mib": round(hwm, 1)}


def _in_ns(node: Namespace, result: str) -> float:
    """The observer's counter of passes with `result`, scraped from inside its namespace (its loopback)."""
    out = node.run([sys.executable, "-c", _SCRAPE, result], check=False).stdout.strip()
    return float(out) if out else -1.0


_SCRAPE = """import sys, urllib.request
try:
    body = urllib.request.urlopen("http://127.0.0.1:9847/metrics", timeout=5).read().decode()
except OSError:
    sys.exit(0)
for line in body.splitlines():
    if line.startswith("ipmasq_syncs_total{") and 'result="%s"' % sys.argv[1] in line:
        print(line.rsplit(" ", 1)[1])
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--window", type=float, default=60.0, help="seconds per CPU window (default %(default)s)")
    parser.add_argument("--filler", default="0,2000", help="other nat rules on the node, comma-separated sizes")
    parser.add_argument("--flips", type=int, default=20)
    parser.add_argument("-o", "--output", choices=("text", "json"), default="text")
    args = parser.parse_args()
    work = scratch_dir("bench-observe-")
    rows = [_run(int(size), args.window, args.flips, work) for size in args.filler.split(",") if size]
    if args.output == "json":
        print(json.dumps(rows, indent=2))
    else:
        for row in rows:
            print(f"{row['filler_rules']:>6} other nat rules: CPU {row['cpu_seconds_per_minute_idle']:.3f} s/min "
                  f"idle, {row['cpu_seconds_per_minute_writer_every_1s']:.3f} s/min with the writer re-applying "
                  f"every 1 s; rules change -> verdict p50 {row['rules_change_to_verdict_p50']:.2f} s, p99 "
                  f"{row['rules_change_to_verdict_p99']:.2f} s, max {row['rules_change_to_verdict_max']:.2f} s; "
                  f"RSS {row['rss_mib']:.1f} MiB (peak {row['hwm_mib']:.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
