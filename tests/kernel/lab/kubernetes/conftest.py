"""What every Kubernetes lab test needs: root, the Debian packages, no cluster already up (a kept one), and a
cluster brought up for a module and taken down after it, leaving nothing behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest

from ipmasq.lab.kubernetes.artifacts import ensure_artifacts, missing_packages
from ipmasq.lab.kubernetes.cluster import NETNS_PREFIX, Cluster, cluster_is_up, state_dir, tear_down
from ipmasq.lab.netns import Network
from tests.conftest import ROOT


def wait_until(condition: Callable[[], object], timeout: float, what: str, interval: float = 0.5) -> float:
    """Until `condition()` is true, asked every `interval` seconds; the seconds it took. AssertionError naming `what`
    after `timeout` (a condition waited on, never a bound on speed)."""
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > timeout:
            raise AssertionError(f"not within {timeout:.0f} s: {what}")
        time.sleep(interval)
    return time.monotonic() - started


def progress(line: str) -> None:
    print(f"[kubernetes lab] {line}", file=sys.stderr, flush=True)


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
