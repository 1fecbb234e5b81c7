"""`ipmasq lab --kubernetes` as a user runs it: one scenario with -o json and --keep (the cluster stays up, kubectl
works with the kubeconfig it names, a pod on every node takes `kubectl exec` probes), then --down; and bad input
(the API port in use) is one line, with nothing left behind."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from ipmasq.lab.kubernetes.cluster import cluster_is_up, tear_down
from ipmasq.lab.kubernetes.layout import API_PORT, NETNS_PREFIX, state_dir
from ipmasq.lab.topology import ADDR, OPEN_PORT
from tests.kernel.lab.kubernetes.conftest import require_kubernetes_lab

pytestmark = pytest.mark.kubernetes


@pytest.fixture(autouse=True)
def _lab_possible() -> None:
    require_kubernetes_lab()


def _lab(*args: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ipmasq", "lab", "--kubernetes", *args], capture_output=True,
                          text=True, timeout=timeout)


def _left_behind() -> list[str]:
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    # every process the lab starts names its state directory in its arguments (the world's probe servers too)
    processes = subprocess.run(["pgrep", "-f", f"{state_dir()}/"], capture_output=True, text=True).stdout.split()
    return ([n for n in namespaces if n.startswith(f"{NETNS_PREFIX}-")] + (["state"] if state_dir().exists() else [])
            + [f"pid {pid}" for pid in processes])


def test_keep_leaves_a_cluster_kubectl_can_use_and_down_removes_it() -> None:
    try:
        run = _lab("--scenario", "vpn-inside-10-8", "-o", "json", "--keep")
        assert run.returncode == 0, run.stderr[-3000:]
        report = json.loads(run.stdout)
        assert report["ok"] and [s["name"] for s in report["scenarios"]] == ["vpn-inside-10-8"]
        assert {p["node"] for phase in report["scenarios"][0]["phases"] for p in phase["probes"]} == {
            n["name"] for n in report["nodes"]}
        kubeconfig = report["kubeconfig"]
        nodes = subprocess.run(["kubectl", f"--kubeconfig={kubeconfig}", "get", "nodes", "-o", "name"],
                               capture_output=True, text=True, check=True).stdout.split()
        assert sorted(nodes) == sorted(f"node/{n['name']}" for n in report["nodes"])
        probes = [p for p in report["pods"] if p["namespace"] == "ipmasq-lab"]
        agents = [p for p in report["pods"] if p["namespace"] == "kube-system"]
        assert len(probes) == len(agents) == len(report["nodes"])  # the agent is left running, as installed
        for pod in probes:
            seen = subprocess.run(["kubectl", f"--kubeconfig={kubeconfig}", "exec", "-n", "ipmasq-lab", pod["name"],
                                   "--", "python", "-m", "ipmasq.lab.probe", "connect", ADDR.vpc_vm,
                                   str(OPEN_PORT)], capture_output=True, text=True, timeout=60).stdout.strip()
            assert seen == pod["ip"]  # 10/8 keeps the pod's address (the reference defaults)
        assert "[" in run.stderr and "cluster up" in run.stderr  # progress, with the seconds each step took
        # the admission webhook is left in place too: a bad config is denied by the API server
        assert "admission webhook serving (deploy/webhook" in run.stderr
        bad = ('{"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "ip-masq-agent", "namespace": '
               '"kube-system"}, "data": {"config": "nonMasqueradeCIDRs: [10.0.0.0/33]"}}')
        denied = subprocess.run(["kubectl", f"--kubeconfig={kubeconfig}", "apply", "-f", "-"], input=bad,
                                capture_output=True, text=True, timeout=60)
        assert denied.returncode != 0 and "denied the request" in denied.stderr, denied.stderr
    finally:
        down = _lab("--down", timeout=120)
    assert down.returncode == 0, down.stderr
    assert not cluster_is_up() and _left_behind() == []


def test_the_api_port_in_use_is_one_line_and_nothing_is_left() -> None:
    tear_down()
    with socket.socket() as taken:
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # the last cluster's port may be in TIME_WAIT
        taken.bind(("127.0.0.1", API_PORT))
        taken.listen()
        run = _lab("--scenario", "vpn-inside-10-8", timeout=300)
    assert run.returncode == 3  # could not run
    last = run.stderr.strip().splitlines()[-1]
    assert last == f"ipmasq lab: 127.0.0.1:{API_PORT} (the lab's API port) is in use: Address already in use"
    assert "Traceback" not in run.stderr
    assert not cluster_is_up() and _left_behind() == []


def test_ctrl_c_while_the_cluster_comes_up_leaves_nothing() -> None:
    lab = subprocess.Popen([sys.executable, "-m", "ipmasq", "lab", "--kubernetes", "--scenario", "vpn-inside-10-8"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    assert lab.stderr is not None
    try:
        for line in lab.stderr:  # interrupted once kubelets and containerd run: the most there is to clean up
            if "nodes Ready" in line:
                break
        assert cluster_is_up()
        lab.send_signal(signal.SIGINT)
        lab.wait(120)
    finally:
        lab.kill()
    assert lab.returncode == 130
    assert not cluster_is_up() and _left_behind() == []


def test_down_without_a_cluster_and_kubernetes_flags_misused() -> None:
    assert _lab("--down", timeout=60).returncode == 0
    for flag in ("--down", "--prepare"):
        misuse = subprocess.run([sys.executable, "-m", "ipmasq", "lab", flag], capture_output=True, text=True)
        assert misuse.returncode == 2 and "use it with --kubernetes" in misuse.stderr
    prepared = _lab("--prepare", timeout=600)  # the cache is warm: nothing to build, and no cluster comes up
    assert prepared.returncode == 0 and "artifacts ready" in prepared.stderr and not cluster_is_up()
    fleet = _lab("--scenario", "fleet-rollout", timeout=60)
    assert fleet.returncode == 2 and "namespace lab only" in fleet.stderr


def test_a_module_that_cannot_be_had_is_one_line_before_any_cluster_starts(tmp_path: Path) -> None:
    """An empty cache and no way to the module proxy: the run ends at the first module it cannot download, naming
    it, with no namespace, process or state made; --prepare the same."""
    env = {**os.environ, "IPMASQ_LAB_CACHE": str(tmp_path / "cache"), "GOPROXY": "off"}
    for args in (("--scenario", "vpn-inside-10-8"), ("--prepare",)):
        run = subprocess.run([sys.executable, "-m", "ipmasq", "lab", "--kubernetes", *args], capture_output=True,
                             text=True, timeout=300, env=env)
        assert run.returncode == 3, run.stderr[-2000:]  # could not run
        last = run.stderr.strip().splitlines()[-1]
        assert re.fullmatch(r"ipmasq lab: a Go module could not be downloaded for gomod/kubernetes: go: "
                            r"[a-z0-9./-]+@v[0-9][^ ]*: module lookup disabled by GOPROXY=off", last), last
        assert "Traceback" not in run.stderr and "network:" not in run.stderr  # no cluster began
        assert not cluster_is_up() and _left_behind() == []
        assert not (tmp_path / "cache" / "kubernetes").exists()  # nothing half-built where a build is looked for
