"""The agent's pod memory as its memory cgroup sees it, at the largest config one ConfigMap can carry, per backend.

    sudo .venv/bin/python bench/bench_pod_memory.py [--variants nftables,iptables-nft,iptables-legacy]
        [--foreign 40000] [--bytes 1048576] [--margin 0.25] [--out bench/out]

A ConfigMap holds at most 1 MiB, so no node receives a larger config. This bench writes the config of that size
with the most CIDRs a plain YAML list fits in it (`- a.b.c.0/24` lines, /24s with a gap after each, so no two merge),
and runs the real `ipmasq agent` (metrics on, as the DaemonSet runs it) in a throwaway network namespace per
variant, already holding `--foreign` kube-proxy-shaped NAT rules (bench_scale's), inside a cgroup v1 memory cgroup
of its own made for the run, a child of this process's: the agent and every tool it runs (nft, iptables-save,
iptables-restore) are charged there, as in the pod's container. Each phase resets the cgroup's peak
(memory.max_usage_in_bytes) and the agent's own (VmHWM, through /proc/PID/clear_refs) first:

1. start: the agent applies a small config (20 CIDRs) and settles;
2. small -> full: the 1 MiB config is published the way kubelet does (an atomic `..data` swap);
3. full -> full: another 1 MiB config with none of the same CIDRs: the old policy is alive while the new one is
   parsed, rendered, applied and verified, the agent's largest moment;
4. idle resync at full size (SIGHUP): the agent reads the kernel back;
5. an exec probe (`ipmasq health`) on top of the settled agent.

Printed per variant: the cgroup's peak and resident usage after each phase (usage counts the page cache the cgroup
was charged, as a memory limit does), the agent's own peak and RSS. Then the largest peak over every variant and
phase, and the DaemonSet resources derived from it: the limit is that peak plus --margin, rounded up to 8 MiB; the
request is the largest settled usage at full size (what the pod holds between changes), rounded up to 4 MiB.
Also printed, without root: what release_free_memory (a full collection, then malloc_trim) hands back after a
1 MiB config was parsed into a policy and dropped, in a fresh interpreter.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from bench_core import scratch_dir, wait_for  # type: ignore[import-not-found]
from bench_scale import VARIANTS, kube_proxy_rules  # type: ignore[import-not-found]
from ipmasq.config.source import MAX_CONFIG_BYTES
from ipmasq.lab.kubelet import publish
from ipmasq.lab.netns import network

ADDRESS = "127.0.0.1:9849"
MIB = 1024 * 1024
CGROUP_V1 = Path("/sys/fs/cgroup/memory")


def cidrs(count: int, offset: int = 0) -> list[str]:
    """`count` /24s with a gap after each (no two merge), starting `offset` /24s in (so two lists can be disjoint)."""
    out = []
    for i in range(offset, offset + count):
        n = (20 << 16) + 2 * i
        out.append(f"{n >> 16}.{(n >> 8) & 255}.{n & 255}.0/24")
    return out


def full_config(size: int, offset: int, resync: str) -> tuple[str, int]:
    """The largest config of the list's shape that fits in `size` bytes: (text, CIDR count)."""
    head = "cidrLimit: {}\nresyncInterval: " + resync + "\nnonMasqueradeCIDRs:\n"
    lines, used = [], len(head.format(999_999))
    for cidr in cidrs(size // 8, offset):  # more than can fit
        line = f"- {cidr}\n"
        if used + len(line) > size:
            break
        lines.append(line)
        used += len(line)
    return head.format(len(lines)) + "".join(lines), len(lines)


def small_config(resync: str) -> str:
    return "nonMasqueradeCIDRs: [{}]\nresyncInterval: {}\n".format(", ".join(cidrs(20, 1 << 20)), resync)


class MemoryCgroup:
    """A cgroup v1 memory cgroup, a child of this process's own, made before entering the namespace (`ip netns exec`
    mounts a sysfs of its own, without /sys/fs/cgroup) and reached from inside through an open directory fd."""

    def __init__(self, name: str) -> None:
        own = next(line.split(":", 2)[2] for line in Path("/proc/self/cgroup").read_text().splitlines()
                   if line.split(":", 2)[1] == "memory")
        self.path = CGROUP_V1 / own.lstrip("/") / name
        self.path.mkdir()
        self.fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY)

    def remove(self) -> None:
        os.close(self.fd)
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)  # its last process is still exiting


class CgroupFiles:
    """The cgroup's files through the directory fd handed to the inner process."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def _write(self, name: str, text: str) -> None:
        fd = os.open(name, os.O_WRONLY, dir_fd=self.fd)
        try:
            os.write(fd, text.encode())
        finally:
            os.close(fd)

    def join(self) -> None:
        """Called in a child between fork and exec (preexec_fn): the child and all it starts are charged here."""
        self._write("cgroup.procs", str(os.getpid()))

    def read(self, name: str) -> int:
        fd = os.open(name, os.O_RDONLY, dir_fd=self.fd)
        try:
            return int(os.read(fd, 64))
        finally:
            os.close(fd)

    def reset_peak(self) -> None:
        self._write("memory.max_usage_in_bytes", "0")


def _metric(name: str) -> float:
    text = urllib.request.urlopen(f"http://{ADDRESS}/metrics", timeout=5).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.split("{")[0].split(" ")[0] == name)


def _status(pid: int) -> dict[str, float]:
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return {key: int(fields[key].split()[0]) / 1024 for key in ("VmRSS", "VmHWM")}


def inner(variant: str, foreign: int, size: int, cgroup: CgroupFiles) -> dict[str, object]:
    """Runs inside the variant's namespace (so the scrapes reach its loopback)."""
    flags, restore = VARIANTS[variant]
    if foreign:
        subprocess.run([restore, "--noflush"], input=kube_proxy_rules(foreign), text=True, check=True)
    workdir = scratch_dir("ipmasq-bench-pod-")
    config_dir = str(workdir / "config")
    publish(config_dir, small_config("60s"))
    first, count = full_config(size, 0, "60s")
    second, second_count = full_config(size, count, "60s")
    phases: dict[str, dict[str, float]] = {}
    log = (workdir / "agent.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "ipmasq", "agent", f"--config={config_dir}/ip-masq-agent",
                             *flags, f"--metrics-address={ADDRESS}", f"--lock-file={workdir}/lock"],
                            stdout=log, stderr=subprocess.STDOUT, preexec_fn=cgroup.join)

    def record(phase: str) -> None:
        time.sleep(1.0)  # settled: the pass's tools have exited, its memory handed back
        agent = _status(proc.pid)
        phases[phase] = {"cgroup_peak_mib": cgroup.read("memory.max_usage_in_bytes") / MIB,
                         "cgroup_usage_mib": cgroup.read("memory.usage_in_bytes") / MIB,
                         "agent_peak_mib": agent["VmHWM"], "agent_rss_mib": agent["VmRSS"]}

    def reset() -> None:
        cgroup.reset_peak()
        Path(f"/proc/{proc.pid}/clear_refs").write_text("5")  # VmHWM := VmRSS

    def change(text: str) -> None:
        reloads, syncs = _metric("ipmasq_config_reloads_total"), _metric("ipmasq_syncs_total")
        publish(config_dir, text)
        wait_for(lambda: _metric("ipmasq_config_reloads_total") > reloads
                  and _metric("ipmasq_syncs_total") > syncs and _metric("ipmasq_ready") == 1, 300,
                  "the changed config to be applied")

    try:
        wait_for(lambda: _metric("ipmasq_ready") == 1, 120, "the agent to apply its first config")
        record("start (20 CIDRs)")
        reset()
        change(first)
        record(f"small -> full ({count:,} CIDRs)")
        reset()
        change(second)
        record("full -> full (none in common)")
        reset()
        syncs = _metric("ipmasq_syncs_total")
        proc.send_signal(signal.SIGHUP)
        wait_for(lambda: _metric("ipmasq_syncs_total") > syncs, 300, "the idle resync")
        record("idle resync at full size")
        reset()
        subprocess.run([sys.executable, "-m", "ipmasq", "health", f"--address={ADDRESS}"], check=True,
                       stdout=subprocess.DEVNULL, preexec_fn=cgroup.join)
        record("exec probe (ipmasq health)")
        assert "Traceback" not in (workdir / "agent.log").read_text()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        log.close()
    return {"variant": variant, "foreign_rules": foreign, "config_bytes": len(first), "cidrs": count,
            "second_cidrs": second_count, "phases": phases}


RELEASE_PROBE = r"""
import ctypes, gc, sys
from ipmasq.config.source import ConfigInput, config_from_bytes
from ipmasq.options import PolicyOptions
from ipmasq.policy.policy import Policy
from ipmasq.netfilter.nft import render_script
def rss():
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("VmRSS:")) / 1024
data = sys.stdin.buffer.read()
before = rss()
policy = Policy(config_from_bytes(ConfigInput((("ip-masq-agent", data),)), PolicyOptions()), PolicyOptions())
script = render_script(policy)
holding = rss()
del policy, script
dropped = rss()
gc.collect()
collected = rss()
ctypes.CDLL(None).malloc_trim(0)
print(before, holding, dropped, collected, rss())
"""


def release_figures(size: int) -> dict[str, float]:
    """VmRSS of a fresh interpreter around one 1 MiB config parsed into a policy and rendered, then dropped."""
    text, _ = full_config(size, 0, "60s")
    out = subprocess.run([sys.executable, "-c", RELEASE_PROBE], input=text.encode(), capture_output=True,
                         check=True).stdout.split()
    keys = ("before", "holding the policy", "dropped", "after gc.collect", "after malloc_trim")
    return dict(zip(keys, map(float, out), strict=True))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--foreign", type=int, default=40_000, help="kube-proxy-shaped NAT rules on the node")
    parser.add_argument("--bytes", type=int, default=MAX_CONFIG_BYTES, help="config size (default: 1 MiB)")
    parser.add_argument("--margin", type=float, default=0.25, help="the limit's margin over the largest peak")
    parser.add_argument("--out", default=str(Path(__file__).parent / "out"))
    parser.add_argument("--inner", help=argparse.SUPPRESS)
    parser.add_argument("--cgroup-fd", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.inner:
        print(json.dumps(inner(args.inner, args.foreign, args.bytes, CgroupFiles(args.cgroup_fd))))
        return 0
    if os.geteuid() != 0:
        print("bench_pod_memory: needs root (network namespaces, a memory cgroup)", file=sys.stderr)
        return 2
    if not CGROUP_V1.is_dir():
        print(f"bench_pod_memory: needs the cgroup v1 memory controller at {CGROUP_V1}", file=sys.stderr)
        return 2
    results = []
    for variant in args.variants.split(","):
        cgroup = MemoryCgroup(f"ipmasq-bench-pod-{variant}-{os.getpid()}")
        try:
            with network() as net:
                node = net.add("node")
                out = subprocess.run(node.argv([sys.executable, __file__, "--inner", variant, "--cgroup-fd",
                                                str(cgroup.fd), "--foreign", str(args.foreign), "--bytes",
                                                str(args.bytes)]), pass_fds=(cgroup.fd,), capture_output=True,
                                     text=True, timeout=1800)
        finally:
            cgroup.remove()
        if out.returncode != 0:
            raise SystemExit(f"bench_pod_memory: {variant} failed:\n{out.stderr}")
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    release = release_figures(args.bytes)
    summary = _print(results, release, args.margin)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "pod_memory.json").write_text(json.dumps({"results": results, "release_mib": release, **summary},
                                                        indent=2) + "\n")
    return 0


def _print(results: list[dict[str, object]], release: dict[str, float], margin: float) -> dict[str, object]:
    first = results[0]
    print(f"config: {first['config_bytes']:,} bytes, {first['cidrs']:,} CIDRs (then {first['second_cidrs']:,} "
          f"others); {first['foreign_rules']:,} kube-proxy rules on the node")
    print(f"{'phase':<34}{'variant':>16}{'cgroup peak':>13}{'cgroup now':>12}{'agent peak':>12}{'agent RSS':>11}"
          "   (MiB)")
    peak, settled = 0.0, 0.0
    for r in results:
        phases: dict[str, dict[str, float]] = r["phases"]  # type: ignore[assignment]
        for phase, f in phases.items():
            print(f"{phase:<34}{r['variant']:>16}{f['cgroup_peak_mib']:>13.1f}{f['cgroup_usage_mib']:>12.1f}"
                  f"{f['agent_peak_mib']:>12.1f}{f['agent_rss_mib']:>11.1f}")
            peak = max(peak, f["cgroup_peak_mib"])
            if phase.startswith(("full", "idle")):
                settled = max(settled, f["cgroup_usage_mib"])
    limit = math.ceil(peak * (1 + margin) / 8) * 8
    request = math.ceil(settled / 4) * 4
    print(f"largest cgroup peak: {peak:.1f} MiB; largest settled usage at full size: {settled:.1f} MiB")
    print(f"DaemonSet: requests.memory {request}Mi (settled, rounded up to 4 MiB), limits.memory {limit}Mi "
          f"(peak + {margin:.0%}, rounded up to 8 MiB)")
    print("release_free_memory after a 1 MiB config became a policy and was dropped (VmRSS, MiB): "
          + ", ".join(f"{k} {v:.1f}" for k, v in release.items()))
    return {"largest_peak_mib": peak, "largest_settled_mib": settled, "request_mib": request, "limit_mib": limit}


if __name__ == "__main__":
    raise SystemExit(main())
