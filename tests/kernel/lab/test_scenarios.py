"""The lab in CI: every scenario, and explain's model proven against the kernel on random cases.

The lab's rules scenarios on both backends: what each peer saw, what decided it, and that `ipmasq explain` given
the same ConfigMap, node name, source, protocol and port answers the same; a terminated run leaves nothing behind.
"""

from __future__ import annotations

import ipaddress
import json
import os
import random
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest

from ipmasq.cloudnat import follow_path
from ipmasq.lab.kubelet import publish
from ipmasq.lab.netns import LAB_PREFIX, Network
from ipmasq.lab.run import NodeAgent
from ipmasq.lab.scenarios import SCENARIOS, policy_for
from ipmasq.lab.topology import ADDR, OPEN_PORT, PLAIN_PORT, STRICT_PORT, Probe, build_lab
from ipmasq.options import PolicyOptions
from tests.conftest import PYTHON
from tests.eventually import eventually

BACKENDS = ("iptables", "nftables")


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_scenario_behaves_as_the_outage_it_reproduces(backend: str) -> None:
    result = subprocess.run([PYTHON, "-m", "ipmasq", "lab", "--backend", backend, "-o", "json"],
                            capture_output=True, text=True, timeout=300)
    report = json.loads(result.stdout)
    assert report["ok"] and result.returncode == 0, json.dumps(report, indent=1) + result.stderr
    phases = {s["name"]: {p["name"]: {pr["destination"]: pr for pr in p["probes"]} for p in s["phases"]}
              for s in report["scenarios"]}
    assert set(phases) == {"incident-gke-1.14", "vpn-inside-10-8", "private-endpoint", "cloud-nat-ranges",
                           "agent-down", "hand-written-rule-lost", "partner-firewall-snat", "one-port-masquerade"}
    # GKE 1.14 upgrade: the outage (pod IP, rejected by the AWS side) and the fix (node IP, accepted)
    incident = phases["incident-gke-1.14"]
    before, after = incident["GKE 1.14 defaults, no ConfigMap"], incident[
        "ConfigMap nonMasqueradeCIDRs: [10.0.0.0/8] published"]
    assert (before[ADDR.aws_db]["seen_source"], before[ADDR.aws_db]["connected"]) == (ADDR.pod, False)
    assert (after[ADDR.aws_db]["seen_source"], after[ADDR.aws_db]["connected"]) == (ADDR.node, True)
    # Cloud NAT: secondary-only Cloud NAT silently drops internet traffic while the agent is up
    nat = phases["cloud-nat-ranges"]
    assert nat["agent up, Cloud NAT LIST_OF_SECONDARY_IP_RANGES"][ADDR.internet]["connected"] is False
    assert nat["agent down, Cloud NAT PRIMARY_IP_RANGE"][ADDR.internet]["connected"] is False
    assert nat["agent down, Cloud NAT ALL_IP_RANGES"][ADDR.internet]["seen_source"] == ADDR.nat_ip
    # a stopped agent leaves the rules: traffic keeps flowing
    down = phases["agent-down"]
    assert down["agent stopped (SIGTERM): rules kept"][ADDR.aws_db]["seen_source"] == ADDR.node


# Destinations the node must reach through the router (not its own subnets, not special-purpose space).
_EXCLUDED = [ipaddress.ip_network(n) for n in ("0.0.0.0/8", "10.44.0.0/14", "10.142.0.0/20", "10.250.0.0/16",
                                                "127.0.0.0/8", "224.0.0.0/3")]


def _random_case(rng: random.Random) -> tuple[str, list[str]]:
    """A random config whose prefixes nest around a few anchors, and destinations near those anchors."""
    anchors = [rng.getrandbits(32) for _ in range(3)]
    anchors.append(int(ipaddress.IPv4Address("169.254.169.254")))

    def prefix_near(anchor: int) -> str:
        length = rng.choice([8, 12, 16, 20, 24, 28, 32])
        network = anchor & ~((1 << (32 - length)) - 1) & 0xFFFFFFFF
        return f"{ipaddress.IPv4Address(network)}/{length}"

    preserve = sorted({prefix_near(rng.choice(anchors)) for _ in range(rng.randint(0, 5))})
    masquerade = sorted({prefix_near(rng.choice(anchors)) for _ in range(rng.randint(0, 3))} - set(preserve))
    lines = ["nonMasqueradeCIDRs: [" + ", ".join(preserve) + "]"]
    if masquerade:
        lines.append("masqueradeCIDRs: [" + ", ".join(masquerade) + "]")
    lines.append(f"masqLinkLocal: {rng.choice(['true', 'false'])}")
    destinations: list[str] = []
    while len(destinations) < 10:
        anchor = rng.choice(anchors)
        address = ipaddress.IPv4Address(anchor ^ rng.getrandbits(rng.choice([0, 4, 10, 18, 26])))
        if any(address in n for n in _EXCLUDED) or str(address) in destinations:
            continue
        destinations.append(str(address))
    return "\n".join(lines) + "\n", destinations


@pytest.mark.parametrize("backend", BACKENDS)
def test_explain_predicts_the_source_every_peer_sees(net: Network, backend: str, tmp_path: object) -> None:
    """300 random (config, destination) cases: the source the peer saw equals explain's prediction."""
    rng_start = 20261121 + BACKENDS.index(backend)  # fixed, so a failure names a case that can be replayed
    rng = random.Random(rng_start)
    lab = build_lab(net, anyip_peers=True)
    options = PolicyOptions()
    config_dir = f"{lab.workdir}/config"
    publish(config_dir, "nonMasqueradeCIDRs: []\n")
    agent = NodeAgent(lab, backend, (), config_dir)
    checked = 0
    reasons: dict[str, int] = {}
    try:
        agent.start()
        for case in range(30):
            config, destinations = _random_case(rng)
            publish(config_dir, config)
            policy = policy_for(config, options)
            agent.wait_synced(policy)
            results = lab.probe([Probe(d, OPEN_PORT) for d in destinations], timeout=1.0)
            for result in results:
                verdict = policy.verdict(result.probe.destination)
                predicted = follow_path(verdict, pod_ip=ADDR.pod, node_ip=ADDR.node, cloud_nat=None).source_seen
                assert result.connected, f"random.Random({rng_start}) case {case}: {result} (config {config!r})"
                assert result.seen_source == predicted, (
                    f"random.Random({rng_start}) case {case}: {result.probe.destination} predicted {predicted} "
                    f"({verdict.reason.value}, {verdict.matched}) but the peer saw {result.seen_source}; "
                    f"config {config!r}")
                checked += 1
                reasons[verdict.reason.value] = reasons.get(verdict.reason.value, 0) + 1
    finally:
        agent.stop()
        lab.close()
    assert checked == 300
    # the random cases really exercise every kind of decision, not just the catch-all
    assert {"config", "exception", "catch-all", "link-local"} <= set(reasons), reasons


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
    (answer,) = json.loads(result.stdout)["results"]
    return dict(answer)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(EXPECTED))
def test_each_rules_scenario_shows_what_decided_and_the_peer_agrees(backend: str, name: str, tmp_path: Path) -> None:
    result = subprocess.run([PYTHON, "-m", "ipmasq", "lab", "--scenario", name, "--backend", backend, "-o", "json"],
                            capture_output=True, text=True, timeout=300)  # a hang guard only
    assert result.stdout.startswith("{"), result.stdout + result.stderr
    report = json.loads(result.stdout)
    assert report["ok"] and result.returncode == 0, json.dumps(report, indent=1) + result.stderr
    (scenario,) = report["scenarios"]
    observed = {p["name"]: {f"{o['destination']}:{o['port']}": (
        o["seen_source"], o["connected"], (o["decided_by"]["reason"], o["decided_by"]["rule_name"],
                                           o["decided_by"]["defined_at"], o["decided_by"]["matched"]))
        for o in p["probes"]} for p in scenario["phases"]}
    assert observed == EXPECTED[name]
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


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_lab_terminated_mid_scenario_leaves_no_namespace_or_process(backend: str) -> None:
    proc = subprocess.Popen([PYTHON, "-m", "ipmasq", "lab", "--scenario", "hand-written-rule-lost", "--backend",
                             backend], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    agent_pattern = f"config-hand-written-rule-lost/ip-masq-agent --backend {backend}"
    try:
        # the node's agent runs with the scenario's ConfigMap: the lab is mid-scenario
        eventually(lambda: _processes(agent_pattern) and _namespaces(proc.pid),
                   f"lab {proc.pid}'s agent and namespaces")
        workdir = _processes(agent_pattern)[0].split("--config ", 1)[1].split("/config-", 1)[0]
        assert "ipmasq-lab-" in workdir
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) != 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # the agent and the probe servers all name the lab's working directory in their arguments
    eventually(lambda: not _processes(workdir), lambda: f"no process left: {_processes(workdir)}")
    assert _namespaces(proc.pid) == set()
    assert not os.path.exists(workdir)
