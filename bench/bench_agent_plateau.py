"""Does the agent's resident memory level off? RSS sampled over minutes of back-to-back reconciles.

    sudo .venv/bin/python bench/bench_agent_plateau.py [--samples 18] [--every 10] [--scrape] [--backend nftables]

A real `ipmasq agent` (iptables backend by default, metrics on; its bytecode compiled first, as `pip install` does
for the image) in a throwaway namespace with resyncInterval 10ms, so it
reconciles (reads the kernel, compares) continuously; VmRSS is read from /proc every --every seconds. With
--scrape a client inside the namespace also fetches /metrics 50 times a second, as bench_agent_memory.py does to
count syncs. bench_agent_memory.py compares reconcile 100 with 1,000, which is inside the first ~30 s of warm-up;
this shows whether the growth it sees goes on or stops.
"""

from __future__ import annotations

import argparse
import compileall
import subprocess
import sys
import time
from pathlib import Path

import ipmasq
from bench_core import scratch_dir  # type: ignore[import-not-found]
from ipmasq.lab.kubelet import publish
from ipmasq.lab.netns import network

ADDRESS = "127.0.0.1:9847"
SCRAPER = (
    "import time, urllib.request\n"
    "while True:\n"
    f"    urllib.request.urlopen('http://{ADDRESS}/metrics').read()\n"
    "    time.sleep(0.02)\n"
)


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=18)
    parser.add_argument("--every", type=float, default=10.0)
    parser.add_argument("--scrape", action="store_true")
    parser.add_argument("--backend", choices=("iptables", "nftables"), default="iptables")
    args = parser.parse_args()
    compileall.compile_dir(str(Path(ipmasq.__file__).parent), quiet=1)
    config_dir = str(scratch_dir("ipmasq-plateau-"))
    publish(config_dir, "nonMasqueradeCIDRs: [10.0.0.0/8]\nresyncInterval: 10ms\n")
    with network() as net:
        node = net.add("node")
        agent = node.popen([sys.executable, "-m", "ipmasq", "agent", f"--backend={args.backend}",
                            f"--metrics-address={ADDRESS}", "--config", f"{config_dir}/ip-masq-agent"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        scraper = None
        try:
            time.sleep(1.0)
            if args.scrape:
                scraper = node.popen([sys.executable, "-c", SCRAPER], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
            samples = []
            for _ in range(args.samples):
                time.sleep(args.every)
                samples.append(rss_mib(agent.pid))  # `ip netns exec` execs, so this is the agent itself
        finally:
            if scraper is not None:
                scraper.kill()
                scraper.wait()
            agent.terminate()
            agent.wait()
    print(f"{args.backend}: RSS (MiB) every {args.every:g} s{' with /metrics scraped 50/s' if args.scrape else ''}:")
    print(" ".join(f"{s:.2f}" for s in samples))
    half = len(samples) // 2
    print(f"growth over the second half ({half * args.every:g} s): {samples[-1] - samples[half]:+.2f} MiB")


if __name__ == "__main__":
    main()
