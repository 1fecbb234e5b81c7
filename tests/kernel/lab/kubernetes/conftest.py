"""What every Kubernetes lab test needs: root, the Debian packages, no cluster already up (a kept one), and a
cluster brought up for a module and taken down after it, leaving nothing behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from ipmasq.kube import paths
from ipmasq.kube.client import KubeClient
from ipmasq.kube.kubeconfig import load as load_kubeconfig
from ipmasq.lab.kubernetes.agent import AGENT_LABEL, agent_pods
from ipmasq.lab.kubernetes.artifacts import ensure_artifacts, missing_packages
from ipmasq.lab.kubernetes.cluster import Cluster, cluster_is_up, tear_down
from ipmasq.lab.kubernetes.layout import NETNS_PREFIX, state_dir
from ipmasq.lab.netns import Network
from tests.conftest import ROOT
from tests.eventually import eventually


def wait_until(condition: Callable[[], object], timeout: float, what: str, interval: float = 0.5) -> float:
    """Until `condition()` is true, asked every `interval` seconds; the seconds it took. AssertionError naming `what`
    after `timeout` (a condition waited on, never a bound on speed): the one waiting loop (tests.eventually's)."""
    started = time.monotonic()
    eventually(condition, what, timeout=timeout, interval=interval)
    return time.monotonic() - started


def run_ipmasq(cluster: Cluster, *args: str) -> subprocess.CompletedProcess[str]:
    """A command of this checkout's (ipmasq, kubectl-ipmasq) against the lab's cluster, as a user runs it."""
    bin_dir = str(Path(sys.executable).parent)
    env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig), "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    return subprocess.run(list(args), capture_output=True, text=True, env=env, timeout=120)


def kubectl_ipmasq(cluster: Cluster, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """`kubectl ipmasq ...` as an operator runs it: kubectl finds the plugin on PATH (the package's script)."""
    env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig),
           "PATH": f"{Path(sys.executable).parent}:{os.path.dirname(cluster.artifacts.toolchain.kubectl)}:"
                   f"{os.environ.get('PATH', '/usr/bin:/bin')}"}
    return subprocess.run([cluster.artifacts.toolchain.kubectl, "ipmasq", *args], capture_output=True, text=True,
                          env=env, timeout=timeout)


def ipmasq_status(cluster: Cluster, *nodes: str) -> tuple[int, dict[str, Any]]:
    """`ipmasq status -o json [NODE...]`: its exit status and document."""
    result = run_ipmasq(cluster, "ipmasq", "status", "-o", "json", *nodes)
    return result.returncode, json.loads(result.stdout) if result.stdout else {}


class Statuses:
    """The nodes' IPMasqAgentStatus objects, read through the API as `ipmasq status` reads them."""

    def __init__(self, cluster: Cluster) -> None:
        self.client = KubeClient(load_kubeconfig(str(cluster.kubeconfig)))
        self.nodes = [n.name for n in cluster.nodes]

    def enforcing(self, digest: str) -> dict[str, bool | None]:
        """node -> whether its status says its rules enforce the content of `digest` (None: not about it yet)."""
        shown: dict[str, bool | None] = {}
        for node in self.nodes:
            status = self.client.get(paths.statuses(node))
            about = status.get("configDigest") == digest
            shown[node] = (status.get("mismatch") is None) if about else None
        return shown


def pods_ready(cluster: Cluster, label: str = AGENT_LABEL) -> bool:
    """One pod of the DaemonSet on every node, each Ready."""
    pods = agent_pods(cluster, label=label).values()
    return len(pods) == len(cluster.nodes) and all(
        any(c.get("type") == "Ready" and c.get("status") == "True" for c in p["status"].get("conditions", []))
        for p in pods)


def progress(line: str) -> None:
    print(f"[kubernetes lab] {line}", file=sys.stderr, flush=True)


def timed_changes(cluster: Cluster, statuses: Statuses, changes: Sequence[tuple[Callable[[], None], str, bool]],
                  label: str = AGENT_LABEL) -> list[float]:
    """Each change made, then waited for until every node's status is about its content (`digest`) and says in sync
    or not (`want`): the seconds from the change to each node's status saying it (read every 0.1 s). The pods of
    `label` stay Ready throughout: drift is reported, never a reason to be NotReady."""
    seconds: list[float] = []
    for attempt, (change, digest, want) in enumerate(changes):
        changed = time.monotonic()
        change()
        seen: dict[str, float] = {}

        def reported(digest: str = digest, want: bool = want, seen: dict[str, float] = seen,
                     changed: float = changed) -> bool:
            for node, enforcing in statuses.enforcing(digest).items():
                if enforcing is want and node not in seen:
                    seen[node] = time.monotonic() - changed
            return len(seen) == len(cluster.nodes)

        wait_until(reported, 60, f"change {attempt}: every node's status about the new content", interval=0.1)
        seconds.extend(seen.values())
        assert pods_ready(cluster, label)
    return seconds


def report_latencies(what: str, seconds: list[float]) -> None:
    ordered = sorted(seconds)
    progress(f"{what} -> every node's status: {len(ordered)} node-samples, p50 {ordered[len(ordered) // 2]:.2f} s, "
             f"p99 {ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]:.2f} s, max {ordered[-1]:.2f} s")


def _host_netfilter() -> tuple[str, str]:
    """The machine's own rules: the lab must never write them."""
    iptables = subprocess.run(["iptables-save"], capture_output=True, text=True).stdout
    nft = subprocess.run(["nft", "list", "ruleset"], capture_output=True, text=True).stdout
    return "\n".join(line for line in iptables.splitlines() if not line.startswith("#")), nft


@contextmanager
def module_cluster() -> Iterator[Cluster]:
    """A cluster as users run it (kubelet's default sync period), for one test module; afterwards no process, no
    namespace of the lab is left, and the machine's own netfilter rules are as they were."""
    require_kubernetes_lab()
    tear_down()
    # a run stopped with SIGTERM (a killed job, scripts/test.sh interrupted) unwinds like Ctrl-C: the teardown below
    # runs and the cluster goes with it
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    artifacts = ensure_artifacts(ROOT, progress)
    before = _host_netfilter()
    lab = Cluster(artifacts, ROOT, Network(NETNS_PREFIX), state_dir())
    try:
        started = time.monotonic()
        lab.up(progress)
        progress(f"cluster up in {time.monotonic() - started:.1f} s")
        yield lab
    finally:
        tear_down(lab.net)
        assert not cluster_is_up()
        leftover = subprocess.run(["pgrep", "-af", f"{state_dir()}/"], capture_output=True, text=True).stdout
        assert leftover == "", leftover  # every process the lab started (probe servers too) went with it
        assert not [n for n in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
                    if n.startswith(f"{NETNS_PREFIX}-")]
        assert _host_netfilter() == before, "the lab changed the machine's own netfilter rules"


def require_kubernetes_lab() -> None:
    """Skip without root or a package (fail when CI is set: there the lab must run); fail if a cluster is up."""
    missing = missing_packages()
    if missing or os.geteuid() != 0:
        reason = f"the Kubernetes lab needs root and {' '.join(missing)}"
        if os.environ.get("CI"):
            pytest.fail(f"{reason} (CI is set: the Kubernetes lab must run)")
        pytest.skip(reason)
    if cluster_is_up():
        pytest.fail("a Kubernetes lab cluster is already up (ipmasq lab --kubernetes --down removes it)")
