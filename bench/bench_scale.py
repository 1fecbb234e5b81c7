"""The agent at scale: 100,000 CIDRs on a node holding 40,000 kube-proxy NAT rules, per backend, side by side.

    sudo .venv/bin/python bench/bench_scale.py [--cidrs 100000] [--foreign 40000] [--idle 40]
                                               [--variants nftables,iptables-nft,iptables-legacy] [--out bench/out]
    sudo .venv/bin/python bench/bench_scale.py --legacy-profile [--cidrs 100000] [--foreign 40000]

Each variant runs the real `ipmasq agent` (metrics on, as the DaemonSet runs it) in a throwaway network namespace of
its own. First the namespace gets the foreign rules, written the way kube-proxy's iptables mode writes them (one
iptables-restore: per service a KUBE-SERVICES match, a KUBE-SVC chain, a KUBE-SEP chain with its masquerade mark
and DNAT; kube-proxy's hint chain says which variant the node uses): with iptables-nft for the nftables backend and
the iptables-nft variant, with iptables-legacy for the legacy variant. The config is a directory of two files (a
ConfigMap holds at most 1 MiB) with `--cidrs` non-adjacent /24s, so neither backend can merge them.

Figures:
1. Peak RSS (VmHWM) of the agent once it has applied the config and verified it, and after the idle resyncs.
   Then a config change (one CIDR fewer): the old policy is alive while the new one is parsed and applied, and
   the peak after it. The largest tool (the read and the write of our 100,000 objects, run on their own) is
   added to that: the pod's memory while the agent waits for that tool, what its limit must hold.
2. CPU per idle resync: utime+stime of the agent and its waited-for children (iptables-save, nft) over `--idle`
   resyncs at resyncInterval 100ms, divided by the delta of its ipmasq_syncs_total (scraped only at both ends).
3. SIGTERM mid-parse: a second agent is started on the same config; once it logs "agent started" (the loop's first
   act is reading the config) plus a short delay, and before it logs "config loaded", it gets SIGTERM; the figure is
   the wall time until it has exited.

--legacy-profile: where an idle resync's iptables-legacy fingerprint goes, without the agent: the same foreign rules
and our `--cidrs` rules written with iptables-legacy-restore in a namespace, then user and system CPU per read of
the nat table (the kernel's copy into a new buffer, into a reused one, the buffer alone), per walk of every entry
zeroing counters, per hash of the whole table (sha256, blake2b, crc32, adler32) and chunk by chunk, and per read of
ipmasq.backends.generation's reader with nothing remembered, remembered (an idle pass that copies), with the xtables
lock quiet (no copy), and the mean with the backstop's full read one read in LEGACY_FULL_READ_EVERY.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

from bench_core import scratch_dir, wait_for  # type: ignore[import-not-found]
from ipmasq.lab.netns import network

ADDRESS = "127.0.0.1:9848"
CLK_TCK = os.sysconf("SC_CLK_TCK")
CPU_PER_RESYNC_TARGET_MS = 50.0
SIGTERM_TARGET_S = 0.2
VARIANTS = {  # name: (agent flags, the iptables-restore that writes the foreign rules)
    "nftables": (["--backend=nftables"], "iptables-nft-restore"),
    "iptables-nft": (["--backend=iptables", "--iptables-variant=nft"], "iptables-nft-restore"),
    "iptables-legacy": (["--backend=iptables", "--iptables-variant=legacy"], "iptables-legacy-restore"),
}


def cidrs(count: int) -> list[str]:
    """`count` /24s with a gap after each, so no two merge into a larger prefix or an nftables interval."""
    return [f"{20 + (2 * i >> 16)}.{(2 * i >> 8) & 255}.{2 * i & 255}.0/24" for i in range(count)]


def write_config(directory: Path, count: int, resync: str, *, limit: int | None = None) -> None:
    """Two files of the config directory the agent merges, each well under a ConfigMap's 1 MiB; cidrLimit `limit`
    (default `count`: kept when a change shrinks the list, or the agent may read the new first file with the old
    second one, over the limit, between the two renames)."""
    directory.mkdir(parents=True, exist_ok=True)
    all_cidrs = cidrs(count)
    half = (count + 1) // 2
    for part, chunk in enumerate((all_cidrs[:half], all_cidrs[half:])):
        head = f"cidrLimit: {limit or count}\nresyncInterval: {resync}\n" if part == 0 else ""
        body = "nonMasqueradeCIDRs:\n" + "".join(f"- {c}\n" for c in chunk)
        tmp = directory / f".tmp-{part}"
        tmp.write_text(head + body)
        tmp.rename(directory / f"ip-masq-agent-{part}")


def kube_proxy_rules(count: int) -> str:
    """An iptables-restore payload of `count` nat rules shaped like kube-proxy's (4 rules per service)."""
    services = count // 4
    lines = ["*nat", ":KUBE-SERVICES - [0:0]", ":KUBE-POSTROUTING - [0:0]", ":KUBE-MARK-MASQ - [0:0]",
             ":KUBE-IPTABLES-HINT - [0:0]"]
    lines += [f":KUBE-SVC-{i:012X} - [0:0]" for i in range(services)]
    lines += [f":KUBE-SEP-{i:012X} - [0:0]" for i in range(services)]
    for i in range(services):
        cluster_ip = f"10.96.{i >> 8 & 255}.{i & 255}"
        pod_ip = f"10.244.{i >> 8 & 255}.{i & 255}"
        lines += [
            f'-A KUBE-SERVICES -d {cluster_ip}/32 -p tcp -m comment --comment "ns/svc-{i}:http cluster IP" '
            f"-m tcp --dport 80 -j KUBE-SVC-{i:012X}",
            f'-A KUBE-SVC-{i:012X} -m comment --comment "ns/svc-{i}:http -> {pod_ip}:8080" -j KUBE-SEP-{i:012X}',
            f'-A KUBE-SEP-{i:012X} -s {pod_ip}/32 -m comment --comment "ns/svc-{i}:http" -j KUBE-MARK-MASQ',
            f'-A KUBE-SEP-{i:012X} -p tcp -m comment --comment "ns/svc-{i}:http" -m tcp '
            f"-j DNAT --to-destination {pod_ip}:8080",
        ]
    lines += ["-A KUBE-MARK-MASQ -j MARK --set-xmark 0x4000/0x4000",
              "-A KUBE-POSTROUTING -m mark --mark 0x4000/0x4000 -j MASQUERADE --random-fully",
              "-A POSTROUTING -m comment --comment \"kubernetes postrouting rules\" -j KUBE-POSTROUTING",
              "-A PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES", "COMMIT"]
    return "\n".join(lines) + "\n"


def _syncs() -> int:
    text = urllib.request.urlopen(f"http://{ADDRESS}/metrics", timeout=5).read().decode()
    return int(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("ipmasq_syncs_total{")))


def _counter(name: str) -> float:
    text = urllib.request.urlopen(f"http://{ADDRESS}/metrics", timeout=5).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.split("{")[0].split(" ")[0] == name)


def _ready() -> bool:
    text = urllib.request.urlopen(f"http://{ADDRESS}/metrics", timeout=5).read().decode()
    return any(line.startswith("ipmasq_ready ") and line.endswith(" 1") for line in text.splitlines())


def _hwm_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise SystemExit("no VmHWM")


def _cpu(pid: int) -> float:
    """utime+stime of the agent and of its waited-for children, in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(f) for f in fields[11:15]) / CLK_TCK


_MAXRSS = ("import resource, subprocess, sys\n"
           "stdin = open(sys.argv[1]) if sys.argv[1] else None\n"
           "subprocess.run(sys.argv[2:], stdin=stdin, stdout=subprocess.DEVNULL, check=True)\n"
           "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n")


def _tools_peak_mib(variant: str, config_dir: Path, workdir: Path) -> float:
    """The larger peak RSS of the two programs the agent waits for with the config's 100,000 objects: the read of
    our objects and the one transaction writing them (run here on their own, with what the agent gives them)."""
    backend = "nftables" if variant == "nftables" else "iptables"
    payload = workdir / "payload"
    payload.write_text(subprocess.run([sys.executable, "-m", "ipmasq", "render", f"--config={config_dir}",
                                       f"--backend={backend}"], capture_output=True, text=True, check=True).stdout)
    if variant == "nftables":
        runs = [("", ["nft", "-j", "list", "set", "inet", "ip-masq-agent", "nomasq_v4"]),
                ("", ["nft", "-f", str(payload)])]
    else:
        flavour = variant.split("-", 1)[1]
        runs = [("", [f"iptables-{flavour}-save", "-t", "nat"]),
                (str(payload), [f"iptables-{flavour}-restore", "--noflush"])]
    peaks = []
    for stdin, argv in runs:
        out = subprocess.run([sys.executable, "-c", _MAXRSS, stdin, *argv], capture_output=True, text=True,
                             check=True)
        peaks.append(int(out.stdout) / 1024)
    return max(peaks)


def inner(variant: str, count: int, foreign: int, idle: int) -> dict[str, object]:
    """Runs inside the namespace (so the scrapes go to its loopback)."""
    flags, restore = VARIANTS[variant]
    subprocess.run([restore, "--noflush"], input=kube_proxy_rules(foreign), text=True, check=True)
    workdir = scratch_dir("ipmasq-bench-scale-")
    config_dir = workdir / "config"
    write_config(config_dir, count, "100ms")
    argv = [sys.executable, "-m", "ipmasq", "agent", f"--config={config_dir}", *flags,
            f"--metrics-address={ADDRESS}", f"--lock-file={workdir}/lock"]
    log_path = workdir / "agent.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    started = time.monotonic()
    try:
        wait_for(_ready, 300, "the agent to apply the config")
        first_apply_s = time.monotonic() - started
        # past the passes that follow the first write (the foreign rules' first count, the pass that reads
        # everything back and finds it matching): from here on every pass is an idle resync
        settled = _syncs() + 3
        wait_for(lambda: _syncs() >= settled, 300, "the passes after the first write")
        syncs0, cpu0 = _syncs(), _cpu(proc.pid)
        wait_for(lambda: _syncs() >= syncs0 + idle, 600, f"{idle} idle resyncs")
        cpu1 = _cpu(proc.pid)
        syncs1 = _syncs()  # counted after the CPU read: the division slightly understates the cost
        peak = _hwm_mib(proc.pid)
        ready_at_end = _ready()
        # a config change at this size: the old policy stays alive while the new config is parsed and applied
        reloads = _counter("ipmasq_config_reloads_total")
        write_config(config_dir, count - 1, "100ms", limit=count)
        wait_for(lambda: _counter("ipmasq_config_reloads_total") > reloads and _ready(), 300, "the changed config")
        settled = _syncs() + 3
        wait_for(lambda: _syncs() >= settled, 300, "the passes after the change")
        peak_after_change = _hwm_mib(proc.pid)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    tools_peak = _tools_peak_mib(variant, config_dir, workdir)
    # SIGTERM while the config is being read: a second agent on the same node, the same config
    log_path2 = workdir / "agent2.log"
    with log_path2.open("w") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: "agent started" in log_path2.read_text(), 120, "the second agent's loop")
        time.sleep(0.3)
        mid_parse = "config loaded" not in log_path2.read_text()
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
        exit_s = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return {
        "variant": variant, "cidrs": count, "foreign_rules": foreign,
        "first_apply_s": first_apply_s, "peak_rss_mib": peak, "tool_peak_rss_mib": tools_peak,
        "peak_rss_after_change_mib": peak_after_change, "agent_plus_tool_mib": peak_after_change + tools_peak,
        "cpu_per_idle_resync_ms": (cpu1 - cpu0) / (syncs1 - syncs0) * 1000, "idle_resyncs": syncs1 - syncs0,
        "ready_after_idle": ready_at_end,
        "sigterm_mid_parse_exit_s": exit_s, "sigterm_was_mid_parse": mid_parse, "sigterm_exit_code": proc.returncode,
    }


def legacy_profile(count: int, foreign: int, repeat: int = 5) -> list[tuple[str, float, float]]:
    """Runs inside the namespace: (what, user ms, system ms) per operation, averaged over `repeat`."""
    import ctypes
    import hashlib
    import socket
    import zlib

    from ipmasq.backends import generation as g
    from ipmasq.prefix import Family

    subprocess.run(["iptables-legacy-restore", "--noflush"], input=kube_proxy_rules(foreign), text=True, check=True)
    workdir = scratch_dir("ipmasq-bench-legacy-")
    write_config(workdir / "config", count, "100ms")
    payload = subprocess.run([sys.executable, "-m", "ipmasq", "render", f"--config={workdir / 'config'}",
                              "--backend=iptables"], capture_output=True, text=True, check=True).stdout
    subprocess.run(["iptables-legacy-restore", "--noflush"], input=payload, text=True, check=True)
    rows: list[tuple[str, float, float]] = []

    def measure(what: str, operation: Callable[[], object]) -> None:
        operation()
        before = os.times()
        for _ in range(repeat):
            operation()
        after = os.times()
        rows.append((what, (after.user - before.user) * 1000 / repeat,
                     (after.system - before.system) * 1000 / repeat))

    sock = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW)
    name = g._NAT_NAME
    info = g._getsockopt(sock, socket.IPPROTO_IP, g._SO_GET_INFO, name + bytes(g._GETINFO.size - 32))
    entries_count, size = g._GETINFO.unpack(info)[-2:]
    rows.append((f"the nat table: {entries_count:,} entries, {size / 2**20:.1f} MiB", 0.0, 0.0))
    request = g._GET_ENTRIES_HEADER.pack(name, size) + bytes(g._ENTRIES_AT - g._GET_ENTRIES_HEADER.size)
    total = g._ENTRIES_AT + size
    measure("GET_ENTRIES into a new buffer (each read)",
            lambda: g._getsockopt_buffer(sock, socket.IPPROTO_IP, g._SO_GET_ENTRIES, request, total))
    measure("  the new buffer alone (allocated, zeroed)", lambda: ctypes.create_string_buffer(total))
    kept = ctypes.create_string_buffer(total)
    libc = ctypes.CDLL(None, use_errno=True)

    def copy_into_kept() -> None:
        ctypes.memmove(kept, request, len(request))
        length = ctypes.c_uint32(total)
        if libc.getsockopt(sock.fileno(), socket.IPPROTO_IP, g._SO_GET_ENTRIES, kept, ctypes.byref(length)):
            raise OSError(ctypes.get_errno(), "GET_ENTRIES")

    measure("GET_ENTRIES into a kept buffer (the kernel's copy)", copy_into_kept)
    entries = memoryview(kept).cast("B")[g._ENTRIES_AT:total]

    def walk_and_zero() -> None:
        walked = g._walk(entries, Family.V4, 0, size, size)
        assert walked is not None
        g._zero(entries, walked[0][2])

    measure("walk every entry, zero its counters (Python)", walk_and_zero)
    measure("sha256 of the whole table", lambda: hashlib.sha256(entries).digest())
    chunk = g.LEGACY_CHUNK_BYTES
    measure(f"sha256 per {chunk // 1024} KiB chunk",
            lambda: [hashlib.sha256(entries[at:at + chunk]).digest() for at in range(0, size, chunk)])
    measure("blake2b of the whole table", lambda: hashlib.blake2b(entries).digest())
    measure("crc32 of the whole table (not strong enough)", lambda: zlib.crc32(entries))
    measure("adler32 of the whole table (not strong enough)", lambda: zlib.adler32(entries))
    measure("reader, nothing remembered (a full walk)", lambda: g.LegacyNatDigests().read(Family.V4))
    reader = g.LegacyNatDigests()
    measure("reader, remembered (an idle pass)", lambda: reader.read(Family.V4))
    # a lock file of its own that no program opens: the xtables lock stays quiet between these reads
    lock = workdir / "xtables.lock"
    lock.touch()
    quiet = g.LegacyNatDigests(xtables_lock=str(lock), full_read_every=sys.maxsize)
    measure("reader, xtables lock quiet (GET_INFO only)", lambda: quiet.read(Family.V4))
    every = g.LEGACY_FULL_READ_EVERY
    backstop = g.LegacyNatDigests(xtables_lock=str(lock))
    measure(f"reader, lock quiet, full read 1 in {every} (mean)",
            lambda: [backstop.read(Family.V4) for _ in range(every)])
    rows[-1] = (rows[-1][0], rows[-1][1] / every, rows[-1][2] / every)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cidrs", type=int, default=100_000)
    parser.add_argument("--foreign", type=int, default=40_000)
    parser.add_argument("--idle", type=int, default=40, help="idle resyncs measured for CPU per resync")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--out", default=str(Path(__file__).parent / "out"))
    parser.add_argument("--legacy-profile", action="store_true",
                        help="where the iptables-legacy fingerprint's CPU goes (no agent)")
    parser.add_argument("--inner", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.inner == "legacy-profile":
        print(json.dumps(legacy_profile(args.cidrs, args.foreign)))
        return 0
    if args.inner:
        print(json.dumps(inner(args.inner, args.cidrs, args.foreign, args.idle)))
        return 0
    if os.geteuid() != 0:
        print("bench_scale: needs root (network namespaces)", file=sys.stderr)
        return 2
    if args.legacy_profile:
        with network() as net:
            out = net.add("node").run([sys.executable, __file__, "--inner", "legacy-profile", "--cidrs",
                                       str(args.cidrs), "--foreign", str(args.foreign)], timeout=1200)
        print(f"{args.cidrs:,} CIDRs, {args.foreign:,} kube-proxy nat rules, iptables-legacy, IPv4 nat table")
        print(f"{'':<52}{'user ms':>10}{'system ms':>11}")
        for what, user, system in json.loads(out.stdout):
            print(f"{what:<52}{user:>10.1f}{system:>11.1f}")
        return 0
    results = []
    for variant in args.variants.split(","):
        with network() as net:
            node = net.add("node")  # a namespace of its own per variant: nothing left from the other
            out = node.run([sys.executable, __file__, "--inner", variant, "--cidrs", str(args.cidrs),
                            "--foreign", str(args.foreign), "--idle", str(args.idle)], timeout=1200)
            results.append(json.loads(out.stdout))
    _print(results)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "scale.json").write_text(json.dumps(results, indent=2) + "\n")
    return 0


def _print(results: list[dict[str, object]]) -> None:
    def row(label: str, key: str, fmt: str, target: str = "") -> None:
        cells = "".join(f"{format(r[key], fmt):>17}" for r in results)
        print(f"{label:<44}{cells}   {target}")

    first = results[0]
    print(f"{first['cidrs']:,} CIDRs, {first['foreign_rules']:,} kube-proxy nat rules on the node")
    print(f"{'':<44}" + "".join(f"{r['variant']!s:>17}" for r in results) + "   target")
    row("first apply, start to ready (s)", "first_apply_s", ".1f")
    row("peak RSS, VmHWM (MiB)", "peak_rss_mib", ".1f")
    row("peak RSS after a config change (MiB)", "peak_rss_after_change_mib", ".1f")
    row("largest tool's peak RSS (nft / iptables-*) (MiB)", "tool_peak_rss_mib", ".1f")
    # no target: more CIDRs than one ConfigMap carries (the DaemonSet is sized by bench_pod_memory.py at 1 MiB)
    row("agent + largest tool, both at peak (MiB)", "agent_plus_tool_mib", ".1f")
    row("CPU per idle resync, agent + tools (ms)", "cpu_per_idle_resync_ms", ".2f",
        f"<= {CPU_PER_RESYNC_TARGET_MS:.0f}")
    row("idle resyncs measured", "idle_resyncs", "d")
    row("ready after the idle resyncs", "ready_after_idle", "")
    row("SIGTERM mid-parse to exit (s)", "sigterm_mid_parse_exit_s", ".3f", f"<= {SIGTERM_TARGET_S}")
    row("  SIGTERM landed before 'config loaded'", "sigterm_was_mid_parse", "")
    row("  exit code after SIGTERM", "sigterm_exit_code", "d", "0")


if __name__ == "__main__":
    raise SystemExit(main())
