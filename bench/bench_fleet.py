"""The agent's API side at fleet scale: N simulated nodes against a real kube-apiserver and etcd.

    .venv/bin/python bench/bench_fleet.py --nodes 1000 [--workers 8] [-o json] [--out bench/out] [--no-restart]

Each simulated node runs what `ipmasq agent` runs for the API, wired by the same function (ipmasq.agent.api.wiring):
its ConfigMap follower (list + watch), its reporter (Events, its IPMasqAgentStatus), its candidacy for the summary
Lease, its HTTP client; and the agent's own loop and Reconciler, on a fake kernel (ipmasq.testing's FakeIptables),
so that 1,000 nodes fit one machine. The nodes are spread over --workers processes (threads inside each). Node
objects and agent Pods (Running, Ready, a podIP, set through the status subresource) exist for every simulated node,
so `ipmasq status` sees a real fleet. The API server and etcd are the Kubernetes lab's binaries, on 127.0.0.1 with
free ports; the agents authenticate as the DaemonSet's service account and get exactly deploy/base's RBAC. Two
things an agent does on its own node are left out, because a worker holds a hundred nodes: the loop polls the
(absent) mounted file once a minute instead of watching it with inotify, and skips the full garbage collection and
malloc_trim after a config change's pass (on a heap shared by a hundred nodes they are the bench's cost, not the
API's).

Measured, in this order:
1. a change: first, the fleet's size each node had heard from the summary's Lease (it spreads its status writes by
   it; a fleet that started a few minutes ago has not heard it yet: --settle); then `kubectl apply` of a new config;
   each node's seconds until its fake kernel holds it (p50, p99); the
   agents' requests during the change, counted exactly at the API server (an audit log of the agents' user only,
   each request once, by the time the server received it); the API server's and etcd's CPU seconds and peak RSS
   over the change, and the bench's own processes' CPU;
2. a bad edit (line 3 invalid): the Events on the ConfigMap it leaves (the elected writer's summary), the Node
   Events and status objects with each node's reason, the agents' requests;
3. `ipmasq status` against the whole fleet: its seconds, and that it reports every node current;
4. an API server restart (SIGTERM, 5 s down, started again): each follower's first watch afterwards, whether it
   resumed from its last resourceVersion or listed again, how spread out the reconnections were, and then a change
   after it (every node still follows).
Exit 1 when a target is missed: p99 <= 5 s, <= 2 requests per node per change, <= 10 Events on the ConfigMap per bad
edit, `ipmasq status` <= 3 s.
"""

from __future__ import annotations

import argparse
import compileall
import concurrent.futures
import contextlib
import json
import logging
import math
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from datetime import datetime
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from apiserver import ApiServer
from ipmasq.config.source import config_digest
from ipmasq.kube import paths
from ipmasq.kube.client import KubeClient, WatchEvent

ROOT = Path(__file__).resolve().parents[1]
AGENT_USER = "system:serviceaccount:kube-system:ip-masq-agent"
AGENT_TOKEN = "bench-agent-token"
NAMESPACE, CONFIGMAP = "kube-system", "ip-masq-agent"
MARKER = re.compile(r"198\.18\.(\d+)\.0/24")
TARGETS = {"apply_to_all_p99_s": 5.0, "api_requests_per_node_per_change": 2.0, "configmap_events_per_bad_edit": 10,
           "status_seconds": 3.0}
AUDIT_POLICY = f"""apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]
rules:
  - level: Metadata
    users: ["{AGENT_USER}"]
  - level: None
"""
SELECT_FDS = 1024
NODES_PER_WORKER = 450  # two pipe descriptors each, below SELECT_FDS
BACKGROUND = {"get leases", "watch configmaps"}
BAD_LINE_3 = "nonMasqueradeCIDRs:\n  - 10.0.0.0/8\n  - 10.300.0.0/16\n"


def config(marker: int) -> str:
    return f"nonMasqueradeCIDRs:\n  - 10.0.0.0/8\n  - 198.18.{marker}.0/24\nresyncInterval: 60s\n"


def digest(text: str) -> str:
    return config_digest((text.encode(),))


def node_name(i: int) -> str:
    return f"fleet-{i:05d}"


# ---- a worker process: simulated nodes, each with the agent's real API code -----------------------------------


class _Seam:
    """The agent's ApiClient (a KubeClient), telling the bench what a node wrote: the only instrumentation."""

    def __init__(self, inner: KubeClient, node: str, emit: Callable[[dict[str, Any]], None]) -> None:
        self.inner, self.node, self.emit = inner, node, emit

    def get(self, path: str, *, query: Mapping[str, str] | None = None) -> dict[str, Any]:
        return self.inner.get(path, query=query)

    def create(self, path: str, body: Mapping[str, Any]) -> dict[str, Any]:
        answer = self.inner.create(path, body)
        self._wrote(path, body)
        return answer

    def patch(self, path: str, body: Mapping[str, Any]) -> dict[str, Any]:
        answer = self.inner.patch(path, body)
        self._wrote(path, body)
        return answer

    def watch(self, path: str, *, query: Mapping[str, str], timeout_seconds: int = 300) -> Iterator[WatchEvent]:
        return self.inner.watch(path, query=query, timeout_seconds=timeout_seconds)

    def _wrote(self, path: str, body: Mapping[str, Any]) -> None:
        now = time.time()
        if path.startswith(paths.statuses()):
            self.emit({"event": "status", "node": self.node, "digest": body.get("configDigest"),
                       "rejected": body.get("rejectedDigest"), "t": now})
        elif path.startswith(f"/api/v1/namespaces/{NAMESPACE}/events") and isinstance(body.get("message"), str):
            self.emit({"event": "summary", "node": self.node, "message": body["message"], "t": now})


def worker(first: int, count: int, port: int, workdir: Path) -> int:
    import ipmasq.agent.loop
    import ipmasq.agent.watch
    from ipmasq import __version__
    from ipmasq.agent.api.report import FleetSize
    from ipmasq.agent.api.wiring import start_api
    from ipmasq.agent.loop import Agent, LoopSettings, Wakeup
    from ipmasq.agent.reconcile import Reconciler
    from ipmasq.backends.base import Result
    from ipmasq.backends.iptables import IptablesBackend, Variant
    from ipmasq.kube.credentials import Credentials
    from ipmasq.options import PolicyOptions
    from ipmasq.prefix import Family
    from ipmasq.testing import FakeIptables

    # The mounted file does not exist here and never changes: an agent watches it with inotify, at no cost while it
    # does not change; without inotify (its instances are few per user, and shared with the machine) the loop polls
    # it every second, which is 1,000 wakeups a second for 1,000 nodes on this one machine and no part of the API's
    # cost. Polled every minute instead (the loop wakes on the API's news at once either way).
    ipmasq.agent.watch.POLL_SECONDS = 60.0
    # After a config change's pass an agent runs a full garbage collection and malloc_trim on its own heap
    # (ipmasq.agent.memory): cheap for one agent, but here one process holds a hundred nodes' objects, and a hundred
    # collections of the whole heap per change are the bench's cost, not the API's. Not done here.
    setattr(ipmasq.agent.loop, "release_free_memory", lambda: False)  # noqa: B010 - the name the loop calls
    threading.stack_size(512 << 10)
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    out_lock = threading.Lock()

    def emit(obj: dict[str, Any]) -> None:
        with out_lock:
            sys.stdout.write(json.dumps(obj) + "\n")
            sys.stdout.flush()

    class Kernel(FakeIptables):
        """The fake kernel, saying when it first holds each config (its marker CIDR)."""

        def __init__(self, node: str) -> None:
            super().__init__()
            self.node = node
            self.held: set[str] = set()

        def __call__(self, argv: Any, stdin: str | None = None) -> Result:
            result = super().__call__(argv, stdin)
            if stdin and result.returncode == 0:
                for marker in set(MARKER.findall(stdin)) - self.held:
                    self.held.add(marker)
                    emit({"event": "applied", "node": self.node, "marker": int(marker), "t": time.time()})
            return result

    log = logging.getLogger(f"fleet.worker{first}")
    handler = logging.FileHandler(workdir / f"worker-{first}.log")
    handler.setFormatter(logging.Formatter("%(asctime)s %(threadName)s %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
    credentials = Credentials(host="127.0.0.1", port=port, token=AGENT_TOKEN, insecure=True)
    options = PolicyOptions()
    # the loop waits with select(), which takes descriptors below 1,024 only: every node's wakeup pipe is made
    # first, so they get the lowest ones (an agent alone on its node has a dozen descriptors)
    wakeups = [Wakeup() for _ in range(count)]
    fleets: list[FleetSize] = []  # what each node heard of the fleet's size (its status writes' spread follows it)
    if max(w.read_fd for w in wakeups) >= SELECT_FDS:
        raise SystemExit(f"{count} nodes in one worker: their pipes pass select()'s {SELECT_FDS} descriptors")
    for i, wakeup in zip(range(first, first + count), wakeups, strict=True):
        node = node_name(i)
        client = KubeClient(credentials)
        client.user_agent = f"ipmasq/{__version__} (fleet bench {node})"  # the audit log tells the nodes apart
        kernel = Kernel(node)
        # as make_backend chooses: IPv4 only unless the options enable IPv6
        backend = IptablesBackend(kernel, chain=options.masq_chain, variant=Variant.NFT,
                                  families=(Family.V4,) if options.enable_ipv6 is False else (Family.V4, Family.V6))
        api_config, reporter = start_api(_Seam(client, node, emit), node, pod=f"ip-masq-agent-{node}",
                                         namespace=NAMESPACE, names=[CONFIGMAP], key="config",
                                         summary_lease=CONFIGMAP, log=log, poke=wakeup.request_look,
                                         stop=wakeup.stop)
        reporter.narrator.set_backend(backend.name)
        fleets.append(reporter.fleet)
        agent = Agent(Reconciler(backend, options, log=log),
                      LoopSettings(config_path=str(workdir / "no-volume" / "ip-masq-agent"), use_inotify=False),
                      log=log, listener=reporter, api_config=api_config)
        threading.Thread(target=agent.run, args=(wakeup,), name=f"loop-{node}", daemon=True).start()
        time.sleep(0.005)  # a DaemonSet's pods do not all start in the same millisecond either
    emit({"event": "started", "first": first, "count": count})
    for line in sys.stdin:
        if line.strip() == "heard":
            emit({"event": "heard", "sizes": Counter(str(f.nodes) for f in fleets)})
        elif line.strip() == "stop":
            break
    for wakeup in wakeups:
        wakeup.request_stop()
    usage = resource.getrusage(resource.RUSAGE_SELF)
    emit({"event": "usage", "cpu_seconds": usage.ru_utime + usage.ru_stime, "peak_rss_mib": usage.ru_maxrss / 1024})
    return 0


# ---- the bench ---------------------------------------------------------------------------------------------------


class Fleet:
    """What the workers said: when each node's kernel first held each config, its status writes, summaries."""

    def __init__(self) -> None:
        self.lock = threading.Condition()
        self.applied: dict[int, dict[str, float]] = {}  # marker -> node -> time
        self.status: dict[str, tuple[str | None, str | None, float]] = {}  # node -> (digest, rejected digest, time)
        self.summaries: list[tuple[str, str, float]] = []  # (writer, message, time)
        self.started = 0
        self.usage: list[dict[str, float]] = []
        self.heard: list[dict[str, int]] = []  # each worker's answer to "heard": fleet size heard -> its nodes

    def read(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            self.take(line)

    def take(self, line: bytes) -> None:
        try:
            event = json.loads(line)
        except ValueError:
            return
        with self.lock:
            kind = event.get("event")
            if kind == "applied":
                self.applied.setdefault(event["marker"], {})[event["node"]] = event["t"]
            elif kind == "status":
                self.status[event["node"]] = (event["digest"], event["rejected"], event["t"])
            elif kind == "summary":
                self.summaries.append((event["node"], event["message"], event["t"]))
            elif kind == "started":
                self.started += event["count"]
            elif kind == "usage":
                self.usage.append(event)
            elif kind == "heard":
                self.heard.append(event["sizes"])
            self.lock.notify_all()

    def wait(self, condition: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        with self.lock:
            while not condition():
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"not within {timeout:.0f} s: {what}")
                self.lock.wait(min(left, 1.0))


class Sampler:
    """CPU seconds (utime+stime) of some processes over a phase, and their peak VmRSS sampled every 0.1 s."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self.cpu0 = {name: _cpu(pid) for name, pid in pids.items()}
        self.peak = dict.fromkeys(pids, 0.0)
        self.started = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            for name, pid in self.pids.items():
                self.peak[name] = max(self.peak[name], _rss(pid))

    def done(self) -> dict[str, float]:
        self._stop.set()
        self._thread.join()
        out = {"seconds": round(time.monotonic() - self.started, 2)}
        for name, pid in self.pids.items():
            out[f"{name}_cpu_seconds"] = round(_cpu(pid) - self.cpu0[name], 2)
            out[f"{name}_peak_rss_mib"] = round(self.peak[name], 1)
        return out


def _cpu(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _rss(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(p / 100 * len(ordered)) - 1))]


def audit(api: ApiServer, offset: int, since: float, until: float) -> list[dict[str, Any]]:
    """The agents' requests the API server received in [since, until], each once (by auditID)."""
    seen: dict[str, dict[str, Any]] = {}
    with api.audit_log.open("rb") as log:
        log.seek(offset)
        for line in log:
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            received = datetime.fromisoformat(entry["requestReceivedTimestamp"]).timestamp()
            if since <= received <= until:
                first = seen.setdefault(entry["auditID"], entry)
                if entry["stage"] == "ResponseStarted":  # a watch: its status is known when it started
                    first["responseStatus"] = entry.get("responseStatus")
    return list(seen.values())


def kinds(requests: list[dict[str, Any]]) -> dict[str, int]:
    counted = Counter(f"{r['verb']} {r.get('objectRef', {}).get('resource', r.get('requestURI', '?'))}"
                      + (f"/{r['objectRef']['subresource']}" if r.get("objectRef", {}).get("subresource") else "")
                      for r in requests)
    return dict(counted.most_common())


def refused(requests: list[dict[str, Any]]) -> dict[str, int]:
    """The answers that were not 2xx, by code (429: the API server's priority and fairness shed the request)."""
    codes = Counter(str((r.get("responseStatus") or {}).get("code", "?")) for r in requests)
    return {code: count for code, count in codes.items() if not code.startswith("2")}


def _audit_size(api: ApiServer) -> int:
    return api.audit_log.stat().st_size if api.audit_log.exists() else 0


def apply_configmap(api: ApiServer, kubectl: str, text: str) -> None:
    manifest = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": CONFIGMAP, "namespace": NAMESPACE},
                "data": {"config": text}}
    api.kubectl(kubectl, "apply", "-f", "-", stdin=json.dumps(manifest))


def setup_objects(api: ApiServer, kubectl: str, nodes: int) -> None:
    # deploy/base without its admission policy: the simulated nodes share one static token, which carries no node
    # name (a pod-bound token's authentication.kubernetes.io/node-name), so the policy would refuse every write; its
    # cost on the API server (a few CEL expressions per status PATCH) is not in these figures
    built = api.kubectl(kubectl, "kustomize", str(ROOT / "deploy/base")).stdout
    kept = [doc for doc in built.split("\n---\n")
            if not re.search(r"^kind: ValidatingAdmissionPolicy(Binding)?$", doc, re.MULTILINE)]
    api.kubectl(kubectl, "apply", "-f", "-", stdin="\n---\n".join(kept))
    api.kubectl(kubectl, "wait", "--for=condition=established", "--timeout=60s",
                "crd/ipmasqagentstatuses.ipmasq.dev")
    admin = api.admin
    with contextlib.suppress(Exception):  # the ServiceAccount admission needs the pods' account to exist
        admin.create(f"/api/v1/namespaces/{NAMESPACE}/serviceaccounts", {"metadata": {"name": "default"}})

    def one(i: int) -> None:
        node = node_name(i)
        admin.create("/api/v1/nodes", {"metadata": {"name": node, "labels": {"kubernetes.io/hostname": node}}})
        pod = f"ip-masq-agent-{node}"
        admin.create(f"/api/v1/namespaces/{NAMESPACE}/pods", {
            "metadata": {"name": pod, "labels": {"k8s-app": "ip-masq-agent"}},
            "spec": {"nodeName": node, "serviceAccountName": "ip-masq-agent", "automountServiceAccountToken": False,
                     "tolerations": [{"operator": "Exists"}],
                     "containers": [{"name": "ip-masq-agent", "image": "ipmasq/ipmasq:0.1.0"}]}})
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        ip = f"10.{64 + i // 65536}.{i // 256 % 256}.{i % 256}"
        admin.patch(f"/api/v1/namespaces/{NAMESPACE}/pods/{pod}/status", {"status": {
            "phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}], "hostIP": ip, "startTime": now,
            "conditions": [{"type": t, "status": "True", "lastTransitionTime": now}
                           for t in ("PodScheduled", "Initialized", "ContainersReady", "Ready")]}})

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        list(pool.map(one, range(nodes)))


def run_status(api: ApiServer) -> dict[str, Any]:
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "ipmasq", "status", f"--kubeconfig={api.kubeconfig}", "-o", "json"],
                            capture_output=True, text=True, cwd=ROOT)
    seconds = time.monotonic() - started
    view = json.loads(result.stdout) if result.stdout.startswith("{") else {}
    return {"status_seconds": round(seconds, 2), "exit": result.returncode, "rows": len(view.get("nodes", [])),
            "current": sum(1 for row in view.get("nodes", []) if row.get("current"))}


def bench(args: argparse.Namespace) -> dict[str, Any]:
    import ipmasq
    from ipmasq.lab.kubernetes.artifacts import kubernetes_toolchain

    compileall.compile_dir(str(Path(ipmasq.__file__).parent), quiet=1)
    tools = kubernetes_toolchain(lambda line: print(line, file=sys.stderr))
    kubectl = tools.kubectl
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # the API server holds a watch per node
    workdir = Path(tempfile.mkdtemp(prefix="ipmasq-bench-fleet-"))
    n = args.nodes
    workers = args.workers or max(1, min(8, math.ceil(n / 125)), math.ceil(n / NODES_PER_WORKER))
    agents = ((AGENT_TOKEN, AGENT_USER, ("system:serviceaccounts", "system:serviceaccounts:kube-system")),)
    result: dict[str, Any] = {"nodes": n, "workers": workers}
    fleet = Fleet()
    procs: list[subprocess.Popen[bytes]] = []

    def say(text: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr)

    with ApiServer(workdir, tools.etcd, tools.binaries["kube-apiserver"], users=agents,
                   audit_policy=AUDIT_POLICY) as api:
        try:
            started = time.monotonic()
            setup_objects(api, kubectl, n)
            marker = 1
            apply_configmap(api, kubectl, config(marker))
            result["setup_objects_seconds"] = round(time.monotonic() - started, 1)
            say(f"{n} Nodes and agent Pods created in {result['setup_objects_seconds']} s; starting {workers} workers "
                f"(work directory {workdir})")
            per = math.ceil(n / workers)
            for w in range(workers):
                first, count = w * per, min(per, n - w * per)
                if count <= 0:
                    break
                proc = subprocess.Popen([sys.executable, __file__, "--worker", str(first), str(count), str(api.port),
                                         str(workdir)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=(workdir / f"worker-{first}.err").open("wb"))
                procs.append(proc)
                threading.Thread(target=fleet.read, args=(proc,), daemon=True).start()
            fleet.wait(lambda: len(fleet.applied.get(marker, {})) == n, 120 + n * 0.1, "every node holds config 1")
            fleet.wait(lambda: sum(1 for s in fleet.status.values() if s[0] == digest(config(marker))) == n,
                       60 + n * 0.05, "every node's status says config 1")
            result["start_seconds"] = round(time.monotonic() - started, 1)
            say(f"every node enforces config 1 ({result['start_seconds']} s after the start)")
            time.sleep(args.settle)  # the start-up's tallies and lease reads are over
            pids = {"apiserver": api.apiserver.pid, "etcd": api.etcd.pid}  # type: ignore[union-attr]
            bench_pids = {f"worker{i}": p.pid for i, p in enumerate(procs)}

            heard = fleet_size_heard(fleet, procs)
            say(f"the fleet's size as the nodes heard it (from the summary's Lease): {json.dumps(heard)}")
            # 1. a change
            marker = 2
            result["change"] = {"fleet_size_heard": heard, **change(api, kubectl, fleet, n, marker, pids, bench_pids)}
            say(f"change: {json.dumps(result['change'])}")
            # 2. a bad edit
            result["bad_edit"] = bad_edit(api, kubectl, fleet, n, pids)
            say(f"bad edit: {json.dumps(result['bad_edit'])}")
            marker = 3
            apply_configmap(api, kubectl, config(marker))
            fleet.wait(lambda: sum(1 for s in fleet.status.values() if s[0] == digest(config(3))) == n,
                       60 + n * 0.05, "every node's status says config 3")
            time.sleep(3.0)
            # 3. ipmasq status
            result["status"] = run_status(api)
            say(f"ipmasq status: {json.dumps(result['status'])}")
            # 4. an API server restart
            if args.restart:
                result["restart"] = restart(api, kubectl, fleet, n, pids)
                say(f"restart: {json.dumps(result['restart'])}")
        finally:
            for proc in procs:
                with contextlib.suppress(OSError):
                    assert proc.stdin is not None
                    proc.stdin.write(b"stop\n")
                    proc.stdin.flush()
            for proc in procs:
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
    if not args.keep:
        shutil.rmtree(workdir, ignore_errors=True)
    result["bench_workers_cpu_seconds_total"] = round(sum(u["cpu_seconds"] for u in fleet.usage), 1)
    result["bench_workers_peak_rss_mib"] = round(max((u["peak_rss_mib"] for u in fleet.usage), default=0.0), 1)
    return result


def fleet_size_heard(fleet: Fleet, procs: list[subprocess.Popen[bytes]]) -> dict[str, int]:
    """How many nodes had heard which fleet size ("None": none yet, they spread as for a fleet of unknown size)."""
    with fleet.lock:
        fleet.heard.clear()
    for proc in procs:
        assert proc.stdin is not None
        proc.stdin.write(b"heard\n")
        proc.stdin.flush()
    fleet.wait(lambda: len(fleet.heard) == len(procs), 30, "every worker's answer to heard")
    total: Counter[str] = Counter()
    for sizes in fleet.heard:
        total.update(sizes)
    return dict(total)


def change(api: ApiServer, kubectl: str, fleet: Fleet, n: int, marker: int, pids: dict[str, int],
           bench_pids: dict[str, int]) -> dict[str, Any]:
    offset = _audit_size(api)
    sampler = Sampler({**pids, **bench_pids})
    t0 = time.time()
    apply_configmap(api, kubectl, config(marker))
    want = digest(config(marker))
    fleet.wait(lambda: len(fleet.applied.get(marker, {})) == n, 60 + n * 0.05, f"every node holds config {marker}")
    fleet.wait(lambda: sum(1 for s in fleet.status.values() if s[0] == want) == n, 60 + n * 0.05,
               f"every node's status says config {marker}")
    fleet.wait(lambda: any(m.startswith(f"enforced on {n:,} of {n:,} nodes") and t >= t0
                           for _w, m, t in fleet.summaries), 120, "the summary on the ConfigMap")
    t1 = time.time() + 2.0
    time.sleep(2.0)
    phase = sampler.done()
    time.sleep(1.5)  # the audit log's last lines
    requests = audit(api, offset, t0, t1)
    seconds = [t - t0 for t in fleet.applied[marker].values()]
    status_written = [s[2] - t0 for s in fleet.status.values()]
    out = {"apply_to_all_p50_s": round(percentile(seconds, 50), 3),
           "apply_to_all_p99_s": round(percentile(seconds, 99), 3),
           "apply_to_all_max_s": round(max(seconds), 3),
           "status_written_p99_s": round(percentile(status_written, 99), 3),
           "api_requests": len(requests), "api_requests_per_node_per_change": round(len(requests) / n, 3),
           # what the agents do whether or not anything changes (Lease reads, watches restarted at their timeout)
           "of_which_background": len([r for r in requests if kinds([r]).keys() & BACKGROUND]),
           "api_requests_by_kind": kinds(requests), "api_answers_not_2xx": refused(requests),
           "window_seconds": round(t1 - t0, 2)}
    out.update({k: v for k, v in phase.items() if not k.startswith("worker")})
    out["bench_cpu_seconds"] = round(sum(v for k, v in phase.items() if k.startswith("worker") and "cpu" in k), 2)
    return out


def bad_edit(api: ApiServer, kubectl: str, fleet: Fleet, n: int, pids: dict[str, int]) -> dict[str, Any]:
    admin = api.admin
    uid = admin.get(f"/api/v1/namespaces/{NAMESPACE}/configmaps/{CONFIGMAP}")["metadata"]["uid"]

    def on_configmap() -> list[dict[str, Any]]:
        return admin.get(f"/api/v1/namespaces/{NAMESPACE}/events",
                         query={"fieldSelector": f"involvedObject.uid={uid}"}).get("items") or []

    before = {e["metadata"]["name"] for e in on_configmap()}
    offset = _audit_size(api)
    sampler = Sampler(pids)
    t0 = time.time()
    apply_configmap(api, kubectl, BAD_LINE_3)
    bad = digest(BAD_LINE_3)
    fleet.wait(lambda: sum(1 for s in fleet.status.values() if s[1] == bad) == n, 60 + n * 0.05,
               "every node's status says it rejected the bad edit")
    status_p99 = percentile([s[2] - t0 for s in fleet.status.values()], 99)
    fleet.wait(lambda: any(m.startswith(f"rejected on {n:,} of {n:,} nodes") and t >= t0
                           for _w, m, t in fleet.summaries), 120, "the rejection's summary on the ConfigMap")
    summary_at = min(t for _w, m, t in fleet.summaries if m.startswith(f"rejected on {n:,} of {n:,}") and t >= t0)
    t1 = time.time() + 2.0
    time.sleep(2.0)
    phase = sampler.done()
    time.sleep(1.5)
    requests = audit(api, offset, t0, t1)
    after = on_configmap()
    new = [e for e in after if e["metadata"]["name"] not in before]
    node_events = admin.get("/api/v1/namespaces/default/events", query={"fieldSelector": "reason=ConfigRejected"})
    with_reason = 0
    statuses: list[dict[str, Any]] = []
    query = {"limit": "500"}
    while True:
        page = admin.get(paths.statuses(), query=query)
        statuses += page.get("items") or []
        if not (page.get("metadata") or {}).get("continue"):
            break
        query = {"limit": "500", "continue": page["metadata"]["continue"]}
    with_reason = sum(1 for s in statuses if s.get("rejectedDigest") == bad and ":3:" in (s.get("lastRejection") or ""))
    return {"configmap_events_per_bad_edit": len(new),
            "configmap_events": [{"reason": e["reason"], "message": e["message"][:300],
                                  "writer": (e.get("source") or {}).get("host")} for e in new],
            "node_events_config_rejected": len({e["involvedObject"]["name"] for e in node_events.get("items") or []}),
            "statuses_with_the_reason": with_reason, "status_written_p99_s": round(status_p99, 3),
            "summary_seconds": round(summary_at - t0, 2), "api_requests": len(requests),
            "api_requests_per_node": round(len(requests) / n, 3), "api_requests_by_kind": kinds(requests),
            "api_answers_not_2xx": refused(requests), **phase}


def restart(api: ApiServer, kubectl: str, fleet: Fleet, n: int, pids: dict[str, int]) -> dict[str, Any]:
    offset = _audit_size(api)
    t_stop = time.time()
    api.stop_apiserver(grace=5.0)  # it stops listening at once; its open watches are cut within 5 s
    time.sleep(5.0)
    api.start_apiserver()
    t_ready = time.time()
    new_pid = api.apiserver.pid  # type: ignore[union-attr]
    cpu0 = _cpu(new_pid)
    first_watch: dict[str, float] = {}
    resumed = relisted = 0
    deadline = time.monotonic() + 180
    requests: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        time.sleep(2.0)
        requests = audit(api, offset, t_stop, time.time())
        first_watch.clear()
        for r in requests:
            agent = r.get("userAgent", "")
            if (r["verb"] == "watch" and r.get("objectRef", {}).get("resource") == "configmaps"
                    and (r.get("responseStatus") or {}).get("code") == 200):
                received = datetime.fromisoformat(r["requestReceivedTimestamp"]).timestamp()
                first_watch[agent] = min(first_watch.get(agent, received), received)
        if len(first_watch) >= n:
            break
    apiserver_cpu = _cpu(new_pid) - cpu0
    for r in requests:
        if r.get("objectRef", {}).get("resource") != "configmaps":
            continue
        if r["verb"] == "list":
            relisted += 1
        elif r["verb"] == "watch" and parse_qs(urlsplit(r["requestURI"]).query).get("resourceVersion", [""])[0]:
            resumed += 1
    after = [t - t_ready for t in first_watch.values()]
    per_second = Counter(math.floor(datetime.fromisoformat(r["requestReceivedTimestamp"]).timestamp() - t_ready)
                         for r in requests)
    not_2xx = Counter(f"{code} {kind}" for r in requests
                      if not (code := str((r.get("responseStatus") or {}).get("code", "?"))).startswith("2")
                      for kind in kinds([r]))
    out: dict[str, Any] = {
        "down_seconds": round(t_ready - t_stop, 1), "followers_back": len(first_watch),
        "followers_back_p50_s": round(percentile(after, 50), 2) if after else None,
        "followers_back_max_s": round(max(after), 2) if after else None,
        "configmap_lists": relisted, "configmap_watches_with_resource_version": resumed,
        # the herd: the most agent requests the server received in one second after it was back
        "peak_agent_requests_in_one_second": max(per_second.values(), default=0),
        "agent_requests_per_second_from_back": [per_second.get(i, 0) for i in range(-2, 31)],
        "agent_requests": len(requests), "agent_requests_per_node": round(len(requests) / n, 3),
        "agent_requests_by_kind": kinds(requests), "api_answers_not_2xx": dict(not_2xx.most_common()),
        "apiserver_cpu_seconds_until_back": round(apiserver_cpu, 2)}
    # every node still follows: a change after the restart
    pids = {**pids, "apiserver": new_pid}
    after_change = change(api, kubectl, fleet, n, 4, pids, {})
    out["change_after"] = {k: after_change[k] for k in ("apply_to_all_p50_s", "apply_to_all_p99_s",
                                                        "api_requests_per_node_per_change")}
    return out


def flatten(result: dict[str, Any]) -> dict[str, Any]:
    change_, bad, status = result.get("change", {}), result.get("bad_edit", {}), result.get("status", {})
    top = {
        "nodes": result["nodes"],
        "apply_to_all_p50_s": change_.get("apply_to_all_p50_s"),
        "apply_to_all_p99_s": change_.get("apply_to_all_p99_s"),
        "api_requests_per_node_per_change": change_.get("api_requests_per_node_per_change"),
        "configmap_events_per_bad_edit": bad.get("configmap_events_per_bad_edit"),
        "status_seconds": status.get("status_seconds"),
        "apiserver_cpu_seconds": change_.get("apiserver_cpu_seconds"),
        "apiserver_peak_rss_mib": change_.get("apiserver_peak_rss_mib"),
        "etcd_cpu_seconds": change_.get("etcd_cpu_seconds"), "etcd_peak_rss_mib": change_.get("etcd_peak_rss_mib"),
    }
    missed = [f"{key} {top[key]} > {limit}" for key, limit in TARGETS.items()
              if top.get(key) is None or top[key] > limit]
    if status and (status.get("exit") != 0 or status.get("rows") != result["nodes"]):
        missed.append(f"ipmasq status: exit {status.get('exit')}, {status.get('rows')} rows of {result['nodes']}")
    return {**top, "missed": missed, "detail": result}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=100)
    parser.add_argument("--workers", type=int, default=0,
                        help="processes (default: one per 125 nodes, 1 to 8, and at most 450 nodes in each)")
    parser.add_argument("-o", "--output", choices=("text", "json"), default="text")
    parser.add_argument("--out", default=str(Path(__file__).parent / "out"))
    parser.add_argument("--settle", type=float, default=10.0, help="seconds idle before the change")
    parser.add_argument("--no-restart", dest="restart", action="store_false")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (logs, audit log, etcd data)")
    parser.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        first, count, port, workdir = args.worker
        return worker(int(first), int(count), int(port), Path(workdir))
    report = flatten(bench(args))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"fleet_{args.nodes}.json").write_text(json.dumps(report, indent=2) + "\n")
    if args.output == "json":
        print(json.dumps(report, indent=2))
    else:
        for key, value in report.items():
            if key != "detail":
                print(f"{key:<36} {value}")
    for line in report["missed"]:
        print(f"MISSED: {line}", file=sys.stderr)
    return 1 if report["missed"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
