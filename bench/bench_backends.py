"""Benchmark both backends side by side in one run, at 0, 1,000, 10,000 and 100,000 CIDRs.

For each backend and CIDR count, in throwaway namespaces pod -> node -> peer (nothing touches this machine's own
netfilter): the time to apply the payload (render + the kernel tool), and the new-connection rate from the pod to
a masqueraded destination through the node. Each connection is a real TCP SYN that creates a conntrack entry and
walks the node's nat POSTROUTING; the peer answers with a RST (no listener), so the client, not a server, is the
only userspace in the path. Also `nft -f` alone on the same script, and a whole `ipmasq`-style once-run (process
start, YAML load, Policy, read, one transaction, verify) as a multiple of `nft -f` alone.

    sudo .venv/bin/python bench/bench_backends.py [--sizes 0,1000,10000,100000] [--seconds 1.5] [--out bench/out]

Targets (issue 4): with 10,000 CIDRs the nftables rate is >= 0.9x its rate with none; a once-run applies 10,000
CIDRs in < 0.5 s and 100,000 from YAML in < 2.5 s.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ipmasq.config import ConfigInput, config_from_bytes
from ipmasq.lab.netns import Namespace, Network, network
from ipmasq.options import PolicyOptions
from ipmasq.policy import Policy
from ipmasq.prefix import Family
from ipmasq.rules.iptables import render_restore
from ipmasq.rules.nft import render_script

POD, NODE, PEER = "10.44.14.15", "10.142.15.203", "10.142.0.1"
DESTINATION = "34.120.0.10"  # in no set: every rule of the iptables chain is walked, then MASQUERADE
PORT = 9  # nothing listens: the peer's kernel answers RST, so the rate is the kernel's
ONCE_PROGRAM = """
import sys, time
from ipmasq.backends.nftables import NftablesBackend
from ipmasq.backends.runner import SubprocessRunner
from ipmasq.config import load_config
from ipmasq.options import PolicyOptions
from ipmasq.policy import Policy
options = PolicyOptions()
policy = Policy(load_config(sys.argv[1], options), options)
backend = NftablesBackend(SubprocessRunner())
for family in policy.families:
    want = backend.desired(policy, family)
    current = backend.read(family)
    if current != want:
        backend.apply(policy, family, current)
        assert backend.read(family) == want
"""
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


def cidrs(n: int, seed: int = 1) -> list[str]:
    """n disjoint, non-adjacent /28s in 10.0.0.0/8: n set elements, n iptables rules."""
    out = []
    for b in random.Random(seed).sample(range(1 << 19), n):
        a = (10 << 24) + b * 32
        out.append(f"{a >> 24}.{(a >> 16) & 255}.{(a >> 8) & 255}.{a & 255}/28")
    return out


def yaml_config(n: int) -> bytes:
    return (f"cidrLimit: {max(n, 1)}\nnonMasqueradeCIDRs:\n" + "".join(f"  - {c}\n" for c in cidrs(n))).encode()


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


def timed(fn: object) -> float:
    start = time.perf_counter()
    fn()  # type: ignore[operator]
    return time.perf_counter() - start


def rate(pod: Namespace, node: Namespace, seconds: float) -> float:
    node.run(["conntrack", "-F"], check=False)
    result = pod.run([sys.executable, "-c", CONNECT_PROGRAM, DESTINATION, str(PORT), str(seconds)],
                     timeout=seconds + 30)
    return float(result.stdout.strip())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="0,1000,10000,100000")
    parser.add_argument("--seconds", type=float, default=1.5)
    parser.add_argument("--out", default="bench/out")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    options = PolicyOptions()
    rows = []
    workdir = tempfile.mkdtemp(prefix="ipmasq-bench-")
    print(f"{'CIDRs':>7} {'backend':>9} {'render s':>9} {'apply s':>8} {'conn/s':>9} {'x rate@0':>8} "
          f"{'nft -f s':>9} {'once-run s':>10} {'x nft -f':>8}")
    base_rate: dict[str, float] = {}
    with network() as net:
        pod, node = build(net)
        for n in sizes:
            data = yaml_config(n)
            policy = Policy(config_from_bytes(ConfigInput((("/bench/ip-masq-agent", data),)), options), options)
            config_path = os.path.join(workdir, f"ip-masq-agent-{n}")
            Path(config_path).write_bytes(data)
            for backend in ("iptables", "nftables"):
                # start each measurement from a node without our objects
                node.run(["nft", "flush", "ruleset"])
                row: dict[str, object] = {"cidrs": n, "backend": backend}
                if backend == "iptables":
                    start = time.perf_counter()
                    payload = render_restore(policy, Family.V4)
                    row["render"] = time.perf_counter() - start
                    row["apply"] = timed(lambda p=payload: node.run(["iptables-restore", "--noflush", "-w"],
                                                                    stdin=p, timeout=600))
                else:
                    start = time.perf_counter()
                    script = render_script(policy)
                    row["render"] = time.perf_counter() - start
                    row["apply"] = timed(lambda s=script: node.run(["nft", "-f", "-"], stdin=s, timeout=600))
                    # the same script by nft alone (the floor), then a whole once-run from a clean node
                    node.run(["nft", "flush", "ruleset"])
                    row["nft_f"] = timed(lambda s=script: node.run(["nft", "-f", "-"], stdin=s, timeout=600))
                    node.run(["nft", "flush", "ruleset"])
                    row["once"] = timed(lambda c=config_path: node.run([sys.executable, "-c", ONCE_PROGRAM, c],
                                                         timeout=600))
                r = rate(pod, node, args.seconds)
                row["rate"] = r
                base_rate.setdefault(backend, r)
                row["rate_ratio"] = r / base_rate[backend]
                rows.append(row)
                nft_f = row.get("nft_f")
                once = row.get("once")
                print(f"{n:>7} {backend:>9} {row['render']:>9.3f} {row['apply']:>8.3f} {r:>9.0f} "
                      f"{row['rate_ratio']:>8.2f} "
                      + (f"{nft_f:>9.3f} {once:>10.3f} {once / nft_f:>8.2f}"  # type: ignore[operator]
                         if nft_f is not None else ""), flush=True)
            node.run(["nft", "flush", "ruleset"])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "backends.json").write_text(json.dumps(rows, indent=1))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
        for backend in ("iptables", "nftables"):
            mine = [r for r in rows if r["backend"] == backend]
            xs = [max(int(r["cidrs"]), 1) for r in mine]  # type: ignore[call-overload]
            ax1.plot(xs, [r["rate"] for r in mine], marker="o", label=backend)
            ax2.plot(xs, [r["apply"] for r in mine], marker="o", label=backend)
        for ax, title in ((ax1, "new connections/s through the node"), (ax2, "apply time (s)")):
            ax.set_xscale("log")
            ax.set_xlabel("CIDRs (0 plotted at 1)")
            ax.set_title(title)
            ax.legend()
        fig.tight_layout()
        fig.savefig(out / "backends.png")
    except ImportError:
        pass
    subprocess.run(["rm", "-rf", workdir], check=False)


if __name__ == "__main__":
    main()
