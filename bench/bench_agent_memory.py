"""The agent's resident memory over 1,000 reconciles and 10 minutes of scraping, and its CPU time over 10 idle
minutes, per backend, side by side.

    sudo .venv/bin/python bench/bench_agent_memory.py [--reconciles 1000] [--scrape-seconds 600] [--scrape-every 0.25]
        [--idle 500] [--window 15] [--sequential] [--out bench/out]

A real `ipmasq agent` (metrics on, as the DaemonSet runs it) in a throwaway namespace per backend; the backends run
at the same time, each in its own namespace (--sequential: one after the other; the figures are per process either
way, CPU as utime+stime, so running side by side changes wall time, not what is measured). The package's bytecode
is compiled first, as `pip install` does for the image: compiling sources at start-up would leave the compiler's
working memory in the figures (about 0.5 MiB):

1. Memory: resyncInterval 10ms, so 1,000 reconciles take seconds; every 100th the bench publishes the other of two
   configs the way kubelet does, so the passes mix config changes (writes) with idle resyncs (reads only). VmRSS
   from /proc/PID/status each time the agent's own syncs counter (scraped from /metrics) passes a multiple of 100.
   Budget: at most 22 MiB (BUDGET_RSS_MIB: the agent's modules imported plainly, with room), no growth between
   reconcile 100 and 1,000.
1b. Memory under scraping: resyncInterval 1s (a pass every second goes on), a scraper fetches /metrics every
   --scrape-every seconds (and /healthz, /readyz once a second, as probes would) for --scrape-seconds (default 600:
   10 minutes); every /metrics answer is parsed with prometheus_client's parser (the format Prometheus reads) and
   must hold ipmasq_syncs_total. VmRSS sampled every 10 s; reported at the end, its maximum and its growth over the
   second half. Budget: at most 22 MiB at the end, no growth.
2. CPU over 10 idle minutes, simulated. An idle agent at the default 60 s resync does two things in 10 minutes:
   10 idle resyncs, and sleeping in select between them. So it is measured in two parts and composed:
   a. CPU per idle resync: utime+stime of the agent *and its waited-for children* (iptables-save / nft are the
      bulk of the cost; /proc/PID/stat fields 14-17) over N idle resyncs at 10ms, divided by the syncs counter's
      delta (scraped only at both ends, so scraping is not in the figure);
   b. CPU while asleep: the same counters over a window of wall time at resyncInterval 60s (no resync inside it).
   10 idle minutes at 60 s = 10 x (a) + 600 s x (b)/s. The same model at a 1 s resync (600 x (a) + 600 s x (b)) is
   checked against a direct measurement: a window of wall time at resyncInterval 1s, scaled to 10 minutes.

    .venv/bin/python bench/bench_agent_memory.py --imports

prints only what `ipmasq agent` imports (the full run prints it too, after its figures, and exits 1 when a figure
is over the budget), by package, in MiB of resident memory (no root needed): every module
`python -X importtime` lists for the agent's start-up is imported in that order (dependencies first) into a fresh
interpreter, and the VmRSS each one adds is counted to its top-level package (ipmasq's own by subpackage).
"""

from __future__ import annotations

import argparse
import compileall
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from bench_core import scratch_dir  # type: ignore[import-not-found]
from ipmasq.lab.kubelet import publish
from ipmasq.lab.netns import network

ADDRESS = "127.0.0.1:9847"
MIB = 1024 * 1024
BUDGET_RSS_MIB = 22.0  # the node agent's budget: resident, steady, metrics served, either backend
REFERENCE_RSS_MIB = 9.0  # what the reference Go agent holds
CLK_TCK = os.sysconf("SC_CLK_TCK")
CIDRS = [f"10.{i}.0.0/16" for i in range(20)]
CONFIGS = ("nonMasqueradeCIDRs: [{}]\nresyncInterval: {}\n".format(", ".join(CIDRS), "{}"),
           "nonMasqueradeCIDRs: [{}]\nresyncInterval: {}\n".format(", ".join(CIDRS[:10]), "{}"))


def _get(path: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"http://{ADDRESS}{path}", timeout=5) as answer:
            return int(answer.status), answer.read()
    except urllib.error.HTTPError as exc:  # 503 from /readyz is an answer
        return exc.code, exc.read()


def _syncs() -> int:
    text = urllib.request.urlopen(f"http://{ADDRESS}/metrics", timeout=5).read().decode()
    return int(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("ipmasq_syncs_total{")))


def _parsed_syncs(body: bytes) -> float:
    """ipmasq_syncs_total summed over results, read by prometheus_client's parser (the test oracle)."""
    from prometheus_client.parser import text_string_to_metric_families

    families = {f.name: f for f in text_string_to_metric_families(body.decode())}
    return sum(s.value for s in families["ipmasq_syncs"].samples if s.name == "ipmasq_syncs_total")


def scrape_for(pid: int, seconds: float, every: float) -> dict[str, object]:
    """Scrape /metrics every `every` s (and /healthz, /readyz once a second) for `seconds`; VmRSS every 10 s."""
    samples: list[tuple[float, float]] = []
    scrapes = probes = 0
    last_syncs = 0.0
    start = time.monotonic()
    next_sample = next_probe = start
    while (now := time.monotonic()) - start < seconds:
        if now >= next_sample:
            samples.append((now - start, _rss(pid)[0]))
            next_sample += 10.0
        if now >= next_probe:
            for path in ("/healthz", "/readyz"):
                code, _ = _get(path)
                assert code in (200, 503), f"{path} answered {code}"
                probes += 1
            next_probe += 1.0
        code, body = _get("/metrics")
        assert code == 200, f"/metrics answered {code}"
        syncs = _parsed_syncs(body)
        assert syncs >= last_syncs, "ipmasq_syncs_total went down"
        last_syncs = syncs
        scrapes += 1
        time.sleep(max(0.0, every - (time.monotonic() - now)))
    samples.append((time.monotonic() - start, _rss(pid)[0]))
    half = [rss for at, rss in samples if at >= seconds / 2]
    return {"scrape_seconds": seconds, "scrapes": scrapes, "probes": probes,
            "rss_after_scrape_mib": samples[-1][1], "max_rss_scrape_mib": max(rss for _, rss in samples),
            "growth_scrape_second_half_mib": half[-1] - half[0], "rss_scrape_samples": samples}


def _rss(pid: int) -> tuple[float, float]:
    """(VmRSS, VmHWM) in MiB."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024


def _cpu(pid: int) -> tuple[float, float]:
    """(the agent's own utime+stime, its waited-for children's) in seconds."""
    # the command name (field 2) may hold spaces: split after its closing parenthesis
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    own = (int(fields[11]) + int(fields[12])) / CLK_TCK
    children = (int(fields[13]) + int(fields[14])) / CLK_TCK
    return own, children


def _asleep_window(pid: int, window: float) -> tuple[tuple[float, float], tuple[float, float]]:
    """The agent's CPU counters at both ends of `window` s in which no pass ran. The passes the config change to a
    60 s resync starts (it is a change: applied, then read back) can finish late on a busy machine: wait until the
    syncs counter holds still for a second, and measure again if a pass still fell inside the window."""
    for _ in range(5):
        syncs = -1
        while (count := _syncs()) != syncs:
            syncs = count
            time.sleep(1.0)
        before, syncs_before = _cpu(pid), _syncs()
        time.sleep(window)
        after, syncs_after = _cpu(pid), _syncs()
        if syncs_after == syncs_before:
            return before, after
    raise SystemExit("bench_agent_memory: a resync fell inside every idle window (resyncInterval 60s)")


def _wait_for(condition: object, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if callable(condition) and condition():
                return
        except OSError:
            pass
        time.sleep(0.05)
    raise SystemExit("timed out waiting for the agent")


def inner(backend: str, reconciles: int, idle: int, window: float, scrape_seconds: float,
          scrape_every: float) -> dict[str, object]:
    """Runs inside the namespace (so the scrapes go to its loopback)."""
    workdir = scratch_dir("ipmasq-bench-mem-")
    config_dir = str(workdir / "config")
    publish(config_dir, CONFIGS[0].format("10ms"))
    log = (workdir / "agent.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "ipmasq", "agent", f"--config={config_dir}/ip-masq-agent",
                             f"--backend={backend}", f"--metrics-address={ADDRESS}"], stdout=log,
                            stderr=subprocess.STDOUT)
    try:
        pid = proc.pid
        _wait_for(lambda: _syncs() >= 1, 15)
        # 1. memory over `reconciles` passes
        rss: dict[int, float] = {}
        mark, version = 100, 0
        while mark <= reconciles:
            count = _syncs()
            if count >= mark:
                rss[mark] = _rss(pid)[0]
                version = 1 - version  # a config change between marks: writes, not only idle reads
                publish(config_dir, CONFIGS[version].format("10ms"))
                mark += 100
            time.sleep(0.02)
        rss_after_reconciles = _rss(pid)[0]
        # 1b. scraped for minutes while it goes on reconciling every second
        publish(config_dir, CONFIGS[0].format("1s"))
        scraping = scrape_for(pid, scrape_seconds, scrape_every)
        peak = _rss(pid)[1]
        # 2a. CPU per idle resync: no config change from here on; scrape only at both ends
        publish(config_dir, CONFIGS[0].format("10ms"))
        time.sleep(0.5)
        start_syncs, start_cpu = _syncs(), _cpu(pid)
        while _syncs() < start_syncs + idle:
            time.sleep(max(0.5, idle * 0.01))
        end_cpu = _cpu(pid)
        end_syncs = _syncs()  # ... counted after the CPU read, so the division slightly understates the cost
        per_resync_own = (end_cpu[0] - start_cpu[0]) / (end_syncs - start_syncs)
        per_resync_children = (end_cpu[1] - start_cpu[1]) / (end_syncs - start_syncs)
        # 2b. asleep: resync 60 s, so no pass happens inside the window
        publish(config_dir, CONFIGS[0].format("60s"))
        before, after = _asleep_window(pid, window)
        asleep_per_s = sum(after) - sum(before)
        asleep_per_s /= window
        # 2c. direct check of the model: resync 1 s over the same window
        publish(config_dir, CONFIGS[0].format("1s"))
        time.sleep(0.5)
        before, syncs_before = _cpu(pid), _syncs()
        time.sleep(window)
        after, syncs_after = _cpu(pid), _syncs()
        direct_1s_per_s = (sum(after) - sum(before)) / window
        rss_end = _rss(pid)[0]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(10)
        log.close()
    per_resync = per_resync_own + per_resync_children
    return {
        "backend": backend,
        "rss_mib": rss, "peak_rss_mib": peak, "rss_end_mib": rss_end, "rss_after_reconciles_mib": rss_after_reconciles,
        **scraping,
        "growth_100_to_last_mib": rss[max(rss)] - rss[100],
        "cpu_per_idle_resync_ms": per_resync * 1000, "cpu_per_idle_resync_own_ms": per_resync_own * 1000,
        "cpu_per_idle_resync_children_ms": per_resync_children * 1000,
        "cpu_asleep_ms_per_min": asleep_per_s * 60 * 1000,
        "cpu_10min_idle_60s_s": 10 * per_resync + 600 * asleep_per_s,
        "cpu_10min_idle_1s_model_s": 600 * per_resync + 600 * asleep_per_s,
        "cpu_10min_idle_1s_direct_s": 600 * direct_1s_per_s,
        "resyncs_in_1s_window": syncs_after - syncs_before,
    }


IMPORTS_PROBE = r"""
import sys
def rss():
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("VmRSS:"))
bare = rss()
import importlib
added = []
for name in sys.argv[1:]:
    if name in sys.modules:
        continue
    before = rss()
    try:
        importlib.import_module(name)
    except Exception:
        continue
    added.append((name, rss() - before))
from ipmasq.cli import build_parser
build_parser("agent")  # what `ipmasq agent` does before it runs: argparse's formatting, gettext
added.append(("(building the agent's parser)", rss() - sum(kib for _, kib in added) - bare))
import json
print(json.dumps({"bare_kib": bare, "total_kib": rss(), "modules": added}))
"""


def import_breakdown() -> dict[str, object]:
    """Resident memory added per imported package when `ipmasq agent` starts (see the module docstring)."""
    entry = "import ipmasq.cli as c; c.build_parser('agent')"
    timing = subprocess.run([sys.executable, "-X", "importtime", "-c", entry], capture_output=True, text=True,
                            check=True).stderr
    order = [line.split("|")[2].strip() for line in timing.splitlines() if line.startswith("import time:")
             and not line.rstrip().endswith("package")]
    out = subprocess.run([sys.executable, "-c", IMPORTS_PROBE, *order], capture_output=True, text=True, check=True)
    probe = json.loads(out.stdout)
    packages: dict[str, float] = {}
    for name, kib in probe["modules"]:
        parts = name.split(".")
        key = ".".join(parts[:2]) if parts[0] == "ipmasq" and len(parts) > 1 else parts[0]
        packages[key] = packages.get(key, 0.0) + kib / 1024
    return {"bare_mib": probe["bare_kib"] / 1024, "after_import_mib": probe["total_kib"] / 1024,
            "modules": len(probe["modules"]), "packages_mib": dict(sorted(packages.items(), key=lambda kv: -kv[1]))}


def _print_imports(result: dict[str, object]) -> None:
    print(f"{'bare interpreter':<40}{result['bare_mib']:>8.2f} MiB")
    packages: dict[str, float] = result["packages_mib"]  # type: ignore[assignment]
    for name, mib in packages.items():
        if mib >= 0.05:
            print(f"  {name:<38}{mib:>8.2f}")
    rest = sum(mib for mib in packages.values() if mib < 0.05)
    print(f"  {'everything else (< 0.05 each)':<38}{rest:>8.2f}")
    print(f"{'after the agent imports':<40}{result['after_import_mib']:>8.2f} MiB ({result['modules']} modules)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reconciles", type=int, default=1000)
    parser.add_argument("--scrape-seconds", type=float, default=600.0,
                        help="how long /metrics is scraped after the reconciles (default 600: 10 minutes)")
    parser.add_argument("--scrape-every", type=float, default=0.25, help="seconds between two /metrics scrapes")
    parser.add_argument("--idle", type=int, default=500, help="idle resyncs measured for CPU per resync")
    parser.add_argument("--window", type=float, default=15.0, help="seconds of wall time per idle window")
    parser.add_argument("--backends", default="iptables,nftables")
    parser.add_argument("--sequential", action="store_true", help="one backend after the other, not side by side")
    parser.add_argument("--out", default=str(Path(__file__).parent / "out"))
    parser.add_argument("--imports", action="store_true",
                        help="print what the agent's imports cost, by package, and exit (no root needed)")
    parser.add_argument("--inner", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.imports:
        import ipmasq

        compileall.compile_dir(str(Path(ipmasq.__file__).parent), quiet=1)
        breakdown = import_breakdown()
        _print_imports(breakdown)
        out_dir = Path(args.out)
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "agent_imports.json").write_text(json.dumps(breakdown, indent=2) + "\n")
        return 0
    if args.inner:
        print(json.dumps(inner(args.inner, args.reconciles, args.idle, args.window, args.scrape_seconds,
                               args.scrape_every)))
        return 0
    if os.geteuid() != 0:
        print("bench_agent_memory: needs root (network namespaces)", file=sys.stderr)
        return 2
    backends = args.backends.split(",")
    import ipmasq

    compileall.compile_dir(str(Path(ipmasq.__file__).parent), quiet=1)
    # the reconciles, the scrape, the CPU phases and starting up, with room to spare
    timeout = args.reconciles * 0.1 + args.scrape_seconds + args.idle * 0.05 + 3 * args.window + 120
    argv = ["--reconciles", str(args.reconciles), "--idle", str(args.idle), "--window", str(args.window),
            "--scrape-seconds", str(args.scrape_seconds), "--scrape-every", str(args.scrape_every)]
    results = []
    groups = [[b] for b in backends] if args.sequential else [backends]
    for group in groups:
        with contextlib.ExitStack() as stack:
            running = []
            for backend in group:
                node = stack.enter_context(network()).add("node")  # a namespace per backend: nothing shared
                running.append(node.popen([sys.executable, __file__, "--inner", backend, *argv],
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE))
            for proc in running:
                out, err = proc.communicate(timeout=timeout)
                if proc.returncode != 0:
                    raise SystemExit(f"bench_agent_memory: a run failed:\n{err}")
                result = json.loads(out)
                result["rss_mib"] = {int(k): v for k, v in result["rss_mib"].items()}  # JSON made the keys strings
                results.append(result)
    _print(results, args.reconciles, args.scrape_seconds)
    print("\nwhere it goes: what `ipmasq agent` imports, by package (resident MiB)")
    breakdown = import_breakdown()
    _print_imports(breakdown)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "agent_memory.json").write_text(json.dumps(results, indent=2) + "\n")
    (out_dir / "agent_imports.json").write_text(json.dumps(breakdown, indent=2) + "\n")
    _plot(results, out_dir / "agent_memory.png")
    over = [(r["backend"], key, r[key]) for r in results
            for key in ("rss_at_100", "rss_at_last", "rss_after_scrape_mib", "max_rss_scrape_mib")
            if float(r[key]) > BUDGET_RSS_MIB]
    for backend, key, value in over:
        print(f"OVER BUDGET: {backend} {key} {value:.2f} MiB > {BUDGET_RSS_MIB:.0f} MiB", file=sys.stderr)
    return 1 if over else 0


def _print(results: list[dict[str, object]], reconciles: int, scrape_seconds: float) -> None:
    def row(label: str, key: str, fmt: str, target: str = "") -> None:
        cells = "".join(f"{format(r[key], fmt):>14}" for r in results)
        print(f"{label:<52}{cells}   {target}")

    print(f"{'':<52}" + "".join(f"{r['backend']:>14}" for r in results) + "   target")
    for r in results:
        r["rss_at_100"] = r["rss_mib"][100]  # type: ignore[index]
        r["rss_at_last"] = r["rss_mib"][reconciles]  # type: ignore[index]
    row("RSS at reconcile 100 (MiB)", "rss_at_100", ".1f", f"<= {BUDGET_RSS_MIB:.0f} (reference Go agent ~"
        f"{REFERENCE_RSS_MIB:.0f})")
    row(f"RSS at reconcile {reconciles} (MiB)", "rss_at_last", ".1f", f"<= {BUDGET_RSS_MIB:.0f}")
    row(f"RSS growth, reconcile 100 -> {reconciles} (MiB)", "growth_100_to_last_mib", "+.2f", "0")
    row(f"RSS after {scrape_seconds:g} s of /metrics scrapes (MiB)", "rss_after_scrape_mib", ".1f",
        f"<= {BUDGET_RSS_MIB:.0f}")
    row("  highest RSS while scraped (MiB)", "max_rss_scrape_mib", ".1f")
    row("  RSS growth over the scrape's second half (MiB)", "growth_scrape_second_half_mib", "+.2f", "0")
    row("  /metrics scrapes (each parsed by prometheus_client)", "scrapes", "d")
    row("peak RSS, VmHWM (MiB)", "peak_rss_mib", ".1f")
    row("CPU per idle resync, agent + tools (ms)", "cpu_per_idle_resync_ms", ".2f")
    row("  of which the tools (iptables-save / nft) (ms)", "cpu_per_idle_resync_children_ms", ".2f")
    row("CPU while asleep between resyncs (ms per minute)", "cpu_asleep_ms_per_min", ".2f")
    row("CPU over 10 idle minutes at resync 60s (s)", "cpu_10min_idle_60s_s", ".3f")
    row("CPU over 10 idle minutes at resync 1s, model (s)", "cpu_10min_idle_1s_model_s", ".2f")
    row("CPU over 10 idle minutes at resync 1s, measured (s)", "cpu_10min_idle_1s_direct_s", ".2f")


def _plot(results: list[dict[str, object]], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for r in results:
        rss: dict[int, float] = r["rss_mib"]  # type: ignore[assignment]
        ax.plot(list(rss), list(rss.values()), marker="o", label=str(r["backend"]))
    ax.axhline(BUDGET_RSS_MIB, color="red", linestyle="--", label=f"budget {BUDGET_RSS_MIB:.0f} MiB")
    ax.axhline(REFERENCE_RSS_MIB, color="grey", linestyle=":", label="reference Go agent ~9 MiB")
    ax.set_xlabel("reconciles")
    ax.set_ylabel("VmRSS (MiB)")
    ax.set_ylim(0, max([BUDGET_RSS_MIB * 1.2, *(v + 2 for r in results for v in r["rss_mib"].values())]))  # type: ignore[attr-defined]
    ax.set_title("ipmasq agent resident memory (metrics on)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


if __name__ == "__main__":
    raise SystemExit(main())
