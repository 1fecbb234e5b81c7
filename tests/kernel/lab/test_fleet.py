"""The fleet lab: four nodes with the real agent, a real Prometheus, and nothing of it left afterwards."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

from ipmasq.lab.fleet import FLEET, INVALID, INVALID_ALERT, ROLLOUT_CONFIG, TAMPERED
from ipmasq.lab.netns import LAB_PREFIX
from ipmasq.lab.scenarios import GKE_FLAGS
from tests.conftest import PYTHON
from tests.eventually import eventually


@pytest.fixture(autouse=True)
def _prometheus_installed() -> None:
    if shutil.which("prometheus") is None:
        if os.environ.get("CI"):
            pytest.fail("the fleet lab needs prometheus (CI is set: kernel tests must run)")
        pytest.skip("the fleet lab needs prometheus (Debian: apt-get install prometheus)")


def _namespaces() -> set[str]:
    """The namespace lab's namespaces (the Kubernetes lab's, kl-*, come and go in the test run beside this one)."""
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return {line.split()[0] for line in listing.splitlines() if line.startswith(LAB_PREFIX)}


def _lab_processes() -> list[str]:
    """Processes the fleet lab starts: agents, probe server and Prometheus name its working directory (ipmasq-fleet-)
    in their arguments; the relay to Prometheus' API is the only `ipmasq.lab.prometheus relay`."""
    found = [subprocess.run(["pgrep", "-af", pattern], capture_output=True, text=True).stdout
             for pattern in ("ipmasq-fleet-", "ipmasq.lab.prometheus relay")]
    return [line for text in found for line in text.splitlines() if "pgrep" not in line]


def _assert_nothing_left(prefix: str) -> None:
    """Nothing of the lab run whose namespaces start with `prefix` (ipmq<its pid>x: another lab on the machine, or
    another test's namespaces, are not this run's)."""
    assert {name for name in _namespaces() if name.startswith(prefix)} == set()
    assert _lab_processes() == []


def test_a_rollout_seen_through_prometheus(tmp_path: Path) -> None:
    proc = subprocess.Popen([PYTHON, "-m", "ipmasq", "lab", "--scenario", "fleet-rollout", "-o", "json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    result = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    report = json.loads(result.stdout)
    assert report["ok"] and result.returncode == 0, json.dumps(report, indent=1) + result.stderr
    config = tmp_path / "ip-masq-agent"
    config.write_text(ROLLOUT_CONFIG)
    printed = subprocess.run([PYTHON, "-m", "ipmasq", "render", "--print-hash", "--config", str(config), *GKE_FLAGS],
                             capture_output=True, text=True, check=True).stdout.strip()
    nodes = {n["name"]: n for n in report["nodes"]}
    assert set(nodes) == {n.name for n in FLEET}
    # Prometheus' query API reported every node's enforced hash: the one `ipmasq render --print-hash` prints
    assert report["rollout_config_hash"] == printed != report["initial_config_hash"]
    assert {n["config_hash"] for n in nodes.values()} == {printed}
    assert all(n["pool"] in ("default-pool", "egress-pool") for n in nodes.values())
    # every node converged, measured from the rollout's start; the rollout is staggered node by node
    seconds = [nodes[n.name]["seconds_to_converge"] for n in FLEET]
    assert all(s is not None and 0 < s < 20 for s in seconds), seconds
    # the tampered node's drift alert and the invalid node's config alert went (pending and) firing, nowhere else
    assert "IpMasqAgentDriftRepairs firing" in nodes[TAMPERED]["alerts_seen"]
    assert nodes[INVALID]["alerts_seen"][-2:] == [f"{INVALID_ALERT} pending", f"{INVALID_ALERT} firing"]
    for name, node in nodes.items():
        if name not in (TAMPERED, INVALID):
            assert not any(a.endswith("firing") for a in node["alerts_seen"]), node
    # every probe, every step: the source the peer saw is explain's answer for the node's enforced config
    for node in nodes.values():
        steps = {p["step"] for p in node["probes"]}
        assert steps == {"initial", "rollout", "repaired", "invalid"} and node["probes_ok"], node
    invalid_after = {p["destination"]: p["seen_source"] for p in nodes[INVALID]["probes"] if p["step"] == "invalid"}
    assert invalid_after["172.30.12.110"] == "10.44.4.15"  # the last good config's decision, the pod IP
    _assert_nothing_left(f"{LAB_PREFIX}{proc.pid}x")


def test_a_terminated_lab_leaves_no_namespace_or_process() -> None:
    proc = subprocess.Popen([PYTHON, "-m", "ipmasq", "lab", "--scenario", "fleet-rollout"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    try:
        # the agents and Prometheus are up once the first step reports
        first = proc.stdout.readline()
        assert first.startswith("-- initial config"), first + proc.stdout.read()
        # the lab names its namespaces by its pid (ipmq<pid>x...): another lab on the machine is not this one's
        ours = f"{LAB_PREFIX}{proc.pid}x"
        assert _lab_processes() != [] and {name for name in _namespaces() if name.startswith(ours)}
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) != 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    eventually(lambda: not _lab_processes(), lambda: f"no process left: {_lab_processes()}")  # SIGKILLed ones reaped
    assert {name for name in _namespaces() if name.startswith(ours)} == set()
