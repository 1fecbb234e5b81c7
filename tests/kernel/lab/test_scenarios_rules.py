"""The lab's rules scenarios on both backends: what each peer saw, what decided it, and that `ipmasq explain` given
the same ConfigMap, node name, source, protocol and port answers the same; a terminated run leaves nothing behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from ipmasq.lab.netns import LAB_PREFIX
from ipmasq.lab.scenarios import SCENARIOS
from ipmasq.lab.topology import ADDR, PLAIN_PORT, STRICT_PORT
from tests.conftest import PYTHON

BACKENDS = ("iptables", "nftables")
CONFIG_FILE = "/etc/config/ip-masq-agent"
BY_HAND = f"iptables -t nat -I POSTROUTING -s {ADDR.node_pod_range} -d {ADDR.onprem_endpoint}/32 -j MASQUERADE"
KEEP_10_8 = ("config", None, f"{CONFIG_FILE}:2", "10.0.0.0/8")  # nonMasqueradeCIDRs' first entry
Expected = dict[str, tuple[str | None, bool, tuple[str, str | None, str | None, str | None]]]

# per scenario and phase, per target: (source the peer saw, connected, (reason, rule, defined at, matched prefix))
EXPECTED: dict[str, dict[str, Expected]] = {
    "hand-written-rule-lost": {
        "rule written by hand on the node": {
            f"{ADDR.onprem_endpoint}:443": (ADDR.node, True, ("hand-written", None, BY_HAND, "10.2.1.100/32")),
            f"{ADDR.vpc_vm}:8080": (ADDR.pod, True, KEEP_10_8)},
        "node recreated: the hand-written rule is gone": {  # the outage: the endpoint sees the pod IP again
            f"{ADDR.onprem_endpoint}:443": (ADDR.pod, False, KEEP_10_8),
            f"{ADDR.vpc_vm}:8080": (ADDR.pod, True, KEEP_10_8)},
        "the same rule declared in the ConfigMap's rules section": {
            f"{ADDR.onprem_endpoint}:443": (ADDR.node, True, ("rule", "onprem-endpoint-sees-node-ip",
                                                              f"{CONFIG_FILE}:4", "10.2.1.100/32")),
            f"{ADDR.vpc_vm}:8080": (ADDR.pod, True, KEEP_10_8)},
        "node recreated: the agent restores the declared rule": {
            f"{ADDR.onprem_endpoint}:443": (ADDR.node, True, ("rule", "onprem-endpoint-sees-node-ip",
                                                              f"{CONFIG_FILE}:4", "10.2.1.100/32")),
            f"{ADDR.vpc_vm}:8080": (ADDR.pod, True, KEEP_10_8)},
    },
    "partner-firewall-snat": {
        "node gke-prod-egress-pool-7f3k (matches the rule's nodes)": {
            f"{ADDR.partner}:443": (ADDR.spare_node, True, ("rule", "partner-sees-egress-address",
                                                            f"{CONFIG_FILE}:4", f"{ADDR.partner}/32")),
            f"{ADDR.vpc_vm}:8080": (ADDR.pod, True, KEEP_10_8)},
        "node gke-prod-general-pool-2b9x (matches none of the rule's nodes)": {  # refused by the firewall
            f"{ADDR.partner}:443": (ADDR.node, False, ("catch-all", None, None, None)),
            f"{ADDR.vpc_vm}:8080": (ADDR.pod, True, KEEP_10_8)},
    },
    "one-port-masquerade": {
        "nonMasqueradeCIDRs: [10.0.0.0/8]": {
            f"{ADDR.onprem_endpoint}:{STRICT_PORT}": (ADDR.pod, False, KEEP_10_8),
            f"{ADDR.onprem_endpoint}:{PLAIN_PORT}": (ADDR.pod, True, KEEP_10_8)},
        "rule: tcp 443 to the endpoint masqueraded": {
            f"{ADDR.onprem_endpoint}:{STRICT_PORT}": (ADDR.node, True, ("rule", "onprem-https-sees-node-ip",
                                                                        f"{CONFIG_FILE}:4", "10.2.1.100/32")),
            f"{ADDR.onprem_endpoint}:{PLAIN_PORT}": (ADDR.pod, True, KEEP_10_8)},
    },
}


def _explained(config: Path, node_name: str | None, destination: str, port: int) -> dict[str, Any]:
    argv = [PYTHON, "-m", "ipmasq", "explain", destination, f"--config={config}", f"--source={ADDR.pod}",
            "--protocol=tcp", f"--port={port}", f"--node-ip={ADDR.node}", "-o", "json"]
    if node_name is not None:
        argv.append(f"--node-name={node_name}")
    result = subprocess.run(argv, capture_output=True, text=True, check=True, env={**os.environ, "NODE_NAME": ""})
    (answer,) = json.loads(result.stdout)
    return dict(answer)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(EXPECTED))
def test_each_rules_scenario_shows_what_decided_and_the_peer_agrees(backend: str, name: str, tmp_path: Path) -> None:
    started = time.monotonic()
    result = subprocess.run([PYTHON, "-m", "ipmasq", "lab", "--scenario", name, "--backend", backend, "-o", "json"],
                            capture_output=True, text=True, timeout=120)
    seconds = time.monotonic() - started
    assert result.stdout.startswith("{"), result.stdout + result.stderr
    report = json.loads(result.stdout)
    assert report["ok"] and result.returncode == 0, json.dumps(report, indent=1) + result.stderr
    (scenario,) = report["scenarios"]
    observed = {p["name"]: {f"{o['destination']}:{o['port']}": (
        o["seen_source"], o["connected"], (o["decided_by"]["reason"], o["decided_by"]["rule_name"],
                                           o["decided_by"]["defined_at"], o["decided_by"]["matched"]))
        for o in p["probes"]} for p in scenario["phases"]}
    assert observed == EXPECTED[name]
    assert seconds < 30, f"{name} took {seconds:.1f} s"
    # explain itself, given the ConfigMap and the node's name, answers what the lab predicted, rule and line included
    for phase in SCENARIOS[name].phases:
        if phase.hand_written:
            continue  # a rule written by hand is in no ConfigMap: explain cannot know it (that is the point)
        config = tmp_path / "ip-masq-agent"
        assert phase.config is not None
        config.write_text(phase.config)
        for probe in phase.probes:
            answer = _explained(config, phase.options.node_name, probe.destination, probe.port)
            seen, _connected, (_reason, rule_name, defined_at, matched) = EXPECTED[name][phase.name][probe.target]
            assert (answer["source_seen"], answer["rule_name"], answer["matched"]) == (seen, rule_name, matched)
            if defined_at is not None:
                assert answer["defined_at"] == f"{config}:{defined_at.rsplit(':', 1)[1]}"


def _namespaces(pid: int) -> set[str]:
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return {line.split()[0] for line in listing.splitlines() if line.startswith(f"{LAB_PREFIX}{pid}x")}


def _processes(pattern: str) -> list[str]:
    found = subprocess.run(["pgrep", "-af", pattern], capture_output=True, text=True).stdout
    return [line for line in found.splitlines() if "pgrep" not in line]


def _wait(condition: Any, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return bool(condition())


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_lab_terminated_mid_scenario_leaves_no_namespace_or_process(backend: str) -> None:
    proc = subprocess.Popen([PYTHON, "-m", "ipmasq", "lab", "--scenario", "hand-written-rule-lost", "--backend",
                             backend], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    agent_pattern = f"config-hand-written-rule-lost/ip-masq-agent --backend {backend}"
    try:
        # the node's agent runs with the scenario's ConfigMap: the lab is mid-scenario
        assert _wait(lambda: _processes(agent_pattern) and _namespaces(proc.pid), timeout=30), proc.pid
        workdir = _processes(agent_pattern)[0].split("--config ", 1)[1].split("/config-", 1)[0]
        assert "ipmasq-lab-" in workdir
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) != 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # the agent and the probe servers all name the lab's working directory in their arguments
    assert _wait(lambda: not _processes(workdir), timeout=5), _processes(workdir)
    assert _namespaces(proc.pid) == set()
    assert not os.path.exists(workdir)
