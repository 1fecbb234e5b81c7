"""The lab in CI: every scenario, and explain's model proven against the kernel on random cases."""

from __future__ import annotations

import ipaddress
import json
import random
import subprocess

import pytest

from ipmasq.cloudnat import follow_path
from ipmasq.lab.kubelet import publish
from ipmasq.lab.netns import Network
from ipmasq.lab.run import NodeAgent
from ipmasq.lab.scenarios import policy_for
from ipmasq.lab.topology import ADDR, OPEN_PORT, Probe, build_lab
from ipmasq.options import PolicyOptions
from tests.conftest import PYTHON

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
