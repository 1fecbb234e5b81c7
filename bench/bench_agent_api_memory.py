"""The agent's resident memory with the API features on, per backend, side by side: the 32 MiB budget.

    sudo .venv/bin/python bench/bench_agent_api_memory.py [--reconciles 1000] [--scrape-seconds 120] [--out bench/out]

Each backend gets a throwaway network namespace holding a real etcd and kube-apiserver (the Kubernetes lab's
binaries: `ipmasq lab --kubernetes --prepare` builds them once) on its loopback, the CRD of deploy/base, a Node and
the ip-masq-agent ConfigMap; a real `ipmasq agent --kubeconfig` follows that ConfigMap through a watch, writes its
Events and its IPMasqAgentStatus, and serves /metrics. resyncInterval 10ms, so 1,000 reconciles take seconds; every
100th, the other of two configs is applied through the API (a watch event, a config change, Events and a status
write). `--backends ...,observe` adds observe mode (`--observe=gke`, looking every 10 ms at GKE's default rules,
written beforehand by iptables-restore as a provider's agent would): each look a pass, each config change a status
write saying the rules do not enforce it. VmRSS from /proc/PID/status at every 100th reconcile, then while /metrics
is scraped every 0.25 s for --scrape-seconds. Exit 1 when any figure is over BUDGET_RSS_MIB or the memory grows from
reconcile 100 on.
"""

from __future__ import annotations

import argparse
import compileall
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from bench_agent_memory import ADDRESS, CONFIGS, _rss, _syncs, _wait_for, scrape_for
from bench_core import scratch_dir  # type: ignore[import-not-found]
from ipmasq.kube.client import KubeClient
from ipmasq.kube.credentials import Credentials
from ipmasq.lab.kubernetes.artifacts import kubernetes_toolchain
from ipmasq.lab.kubernetes.standin import GKE_DEFAULT_RULES, JUMP
from ipmasq.lab.netns import network

BUDGET_RSS_MIB = 32.0  # the agent with the API features on (without them: 22 MiB, bench_agent_memory.py)
NODE = "bench-node"
TOKEN = "bench-admin-token"
ROOT = Path(__file__).resolve().parents[1]


def _api_server(workdir: Path, etcd: str, apiserver: str) -> tuple[list[subprocess.Popen[bytes]], Credentials]:
    """etcd and kube-apiserver on this namespace's loopback (self-signed serving certificate, a static token)."""
    (workdir / "tokens.csv").write_text(f'{TOKEN},admin,admin,"system:masters"\n')
    subprocess.run(["openssl", "genrsa", "-out", str(workdir / "sa.key"), "2048"], check=True, capture_output=True)
    log = (workdir / "control-plane.log").open("w")
    procs = [subprocess.Popen([etcd, f"--data-dir={workdir / 'etcd'}", "--listen-client-urls=http://127.0.0.1:2379",
                               "--advertise-client-urls=http://127.0.0.1:2379",
                               "--listen-peer-urls=http://127.0.0.1:2380"], stdout=log, stderr=log)]
    procs.append(subprocess.Popen([
        apiserver, "--etcd-servers=http://127.0.0.1:2379", "--bind-address=127.0.0.1", "--secure-port=6443",
        # 1.37 refuses a loopback advertise address to its endpoint reconciler: no kubernetes Service is needed here
        "--advertise-address=127.0.0.1", "--endpoint-reconciler-type=none",
        f"--token-auth-file={workdir / 'tokens.csv'}",
        "--authorization-mode=RBAC", f"--service-account-key-file={workdir / 'sa.key'}",
        f"--service-account-signing-key-file={workdir / 'sa.key'}",
        "--service-account-issuer=https://kubernetes.default.svc", f"--cert-dir={workdir / 'certs'}",
        "--service-cluster-ip-range=10.96.0.0/16"], stdout=log, stderr=log))
    return procs, Credentials(host="127.0.0.1", port=6443, token=TOKEN, insecure=True)


def _kubeconfig(path: Path) -> None:
    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "bench",
        "clusters": [{"name": "bench", "cluster": {"server": "https://127.0.0.1:6443",
                                                   "insecure-skip-tls-verify": True}}],
        "users": [{"name": "admin", "user": {"token": TOKEN}}],
        "contexts": [{"name": "bench", "context": {"cluster": "bench", "user": "admin"}}]}))


def _ready(client: KubeClient) -> bool:
    try:
        client.get("/api/v1/namespaces/kube-system")
        return True
    except Exception:
        return False


def inner(backend: str, reconciles: int, scrape_seconds: float, etcd: str, apiserver: str) -> dict[str, object]:
    """Runs inside the namespace: the API server and the agent on its loopback."""
    workdir = scratch_dir("ipmasq-bench-api-")
    procs, credentials = _api_server(workdir, etcd, apiserver)
    agent = None
    try:
        client = KubeClient(credentials)
        _wait_for(lambda: _ready(client), 60)
        kubeconfig = workdir / "kubeconfig"
        _kubeconfig(kubeconfig)
        subprocess.run(["kubectl", f"--kubeconfig={kubeconfig}", "apply", "-f", str(ROOT / "deploy/base/crd.yaml")],
                       check=True, capture_output=True)
        client.create("/api/v1/nodes", {"metadata": {"name": NODE}})
        path = "/api/v1/namespaces/kube-system/configmaps"
        client.create(path, {"metadata": {"name": "ip-masq-agent"}, "data": {"config": CONFIGS[0].format("10ms")}})
        log = (workdir / "agent.log").open("w")
        mode = [f"--backend={backend}"]
        if backend == "observe":
            jump = f"-A POSTROUTING {JUMP}\n"
            subprocess.run(["iptables-restore", "--noflush"], input=GKE_DEFAULT_RULES.replace("COMMIT\n", jump
                                                                                            + "COMMIT\n"),
                           text=True, check=True)
            mode = ["--observe=gke", "--backend=iptables", "--masq-chain=IP-MASQ", "--nomasq-all-reserved-ranges",
                    "--random-fully=false", "--observe-interval=0.01"]
        agent = subprocess.Popen([sys.executable, "-m", "ipmasq", "agent", *mode,
                                  f"--config={workdir / 'no-volume' / 'ip-masq-agent'}", f"--kubeconfig={kubeconfig}",
                                  f"--node-name={NODE}", f"--metrics-address={ADDRESS}"], stdout=log,
                                 stderr=subprocess.STDOUT)
        _wait_for(lambda: _syncs() >= 1, 30)
        rss: dict[int, float] = {}
        mark, version = 100, 0
        while mark <= reconciles:
            if _syncs() >= mark:
                rss[mark] = _rss(agent.pid)[0]
                version = 1 - version  # through the API only: the agent has no volume
                client.patch(f"{path}/ip-masq-agent", {"data": {"config": CONFIGS[version].format("10ms")}})
                mark += 100
            time.sleep(0.02)
        client.patch(f"{path}/ip-masq-agent", {"data": {"config": CONFIGS[0].format("1s")}})
        scraping = scrape_for(agent.pid, scrape_seconds, 0.25)
        status = client.get(f"/apis/ipmasq.dev/v1alpha1/ipmasqagentstatuses/{NODE}")
        events = client.get("/api/v1/namespaces/kube-system/events")["items"]
        return {"backend": backend, "rss_mib": rss, "growth_100_to_last_mib": rss[max(rss)] - rss[100],
                "peak_rss_mib": _rss(agent.pid)[1], "status_ready": status.get("ready"),
                "events": len(events), **scraping}
    finally:
        for proc in ([agent] if agent else []) + procs[::-1]:
            proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(15)
            if proc.poll() is None:
                proc.kill()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reconciles", type=int, default=1000)
    parser.add_argument("--scrape-seconds", type=float, default=120.0)
    parser.add_argument("--backends", default="iptables,nftables")
    parser.add_argument("--out", default=str(Path(__file__).parent / "out"))
    parser.add_argument("--inner", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.inner:
        backend, etcd, apiserver = args.inner
        print(json.dumps(inner(backend, args.reconciles, args.scrape_seconds, etcd, apiserver)))
        return 0
    if os.geteuid() != 0:
        print("bench_agent_api_memory: needs root (network namespaces)", file=sys.stderr)
        return 2
    import ipmasq

    # bytecode compiled first, as `pip install` does for the image: compiling at start-up would count the compiler
    compileall.compile_dir(str(Path(ipmasq.__file__).parent), quiet=1)
    tools = kubernetes_toolchain(lambda line: print(line, file=sys.stderr))
    results = []
    with contextlib.ExitStack() as stack:
        running = []
        for backend in args.backends.split(","):
            node = stack.enter_context(network()).add("node")
            running.append(node.popen([sys.executable, __file__, "--inner", backend, tools.etcd,
                                       tools.binaries["kube-apiserver"], "--reconciles", str(args.reconciles),
                                       "--scrape-seconds", str(args.scrape_seconds)],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
        for proc in running:
            out, err = proc.communicate(timeout=args.reconciles * 0.2 + args.scrape_seconds + 300)
            if proc.returncode != 0:
                raise SystemExit(f"bench_agent_api_memory: a run failed:\n{err[-3000:]}")
            results.append(json.loads(out))
    over = []
    print(f"{'':<48}" + "".join(f"{r['backend']:>14}" for r in results) + "   target")
    for label, key, target in (("RSS at reconcile 100 (MiB)", "at_100", f"<= {BUDGET_RSS_MIB:.0f}"),
                               (f"RSS at reconcile {args.reconciles} (MiB)", "at_last", f"<= {BUDGET_RSS_MIB:.0f}"),
                               ("RSS growth from reconcile 100 (MiB)", "growth_100_to_last_mib", "0"),
                               (f"RSS after {args.scrape_seconds:g} s of scrapes (MiB)", "rss_after_scrape_mib",
                                f"<= {BUDGET_RSS_MIB:.0f}"),
                               ("highest RSS while scraped (MiB)", "max_rss_scrape_mib", f"<= {BUDGET_RSS_MIB:.0f}"),
                               ("peak RSS, VmHWM (MiB)", "peak_rss_mib", "")):
        for r in results:
            rss = {int(k): v for k, v in r["rss_mib"].items()}
            r["at_100"], r["at_last"] = rss[100], rss[max(rss)]
        print(f"{label:<48}" + "".join(f"{float(r[key]):>14.2f}" for r in results) + f"   {target}")
        if target.startswith("<="):
            over += [(r["backend"], label, r[key]) for r in results if float(r[key]) > BUDGET_RSS_MIB]
    print("status objects ready: " + ", ".join(f"{r['backend']} {r['status_ready']}" for r in results)
          + "; Events written: " + ", ".join(f"{r['backend']} {r['events']}" for r in results))
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "agent_api_memory.json").write_text(json.dumps(results, indent=2) + "\n")
    for backend, label, value in over:
        print(f"OVER BUDGET: {backend} {label} {value:.2f} MiB > {BUDGET_RSS_MIB:.0f} MiB", file=sys.stderr)
    growth = [r for r in results if float(r["growth_100_to_last_mib"]) > 0.5]
    return 1 if over or growth else 0


if __name__ == "__main__":
    raise SystemExit(main())
