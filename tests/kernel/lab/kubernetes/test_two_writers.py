"""Two writers on one node, on the real cluster: `kubectl apply -k deploy/overlays/gke` beside a stand-in for GKE's
managed agent (a DaemonSet re-applying GKE's default IP-MASQ chain with iptables-restore: ipmasq.lab.kubernetes
.provider, not ipmasq). The agents stop repairing (no flapping), say ForeignWriter in their IPMasqAgentStatus and
metrics, leave the stand-in's rules working, and enforce the ConfigMap again once the stand-in is gone."""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Iterator

import pytest

from ipmasq.lab.kubernetes import agent, standin
from ipmasq.lab.kubernetes.cluster import Cluster
from ipmasq.lab.kubernetes.layout import FAST_SYNC_FREQUENCY, NodeSpec
from ipmasq.lab.scenarios import GKE_OPTIONS, PRESERVE_ONLY_10_8
from ipmasq.prefix import Family
from tests.kernel.lab.kubernetes.conftest import module_cluster, wait_until

pytestmark = pytest.mark.kubernetes

RESYNC = 2.0  # the ConfigMap's resyncInterval: the agents' passes
CONFIG = PRESERVE_ONLY_10_8 + f"resyncInterval: {RESYNC:g}s\n"
FIRST_QUIET = 3 * RESYNC  # ipmasq.agent.reconcile.FOREIGN_QUIET_PERIODS resync periods, doubling after each trial
METRICS = ("import urllib.request; "
           "print(urllib.request.urlopen('http://127.0.0.1:9847/metrics', timeout=5).read().decode())")


@pytest.fixture(scope="module")
def lab() -> Iterator[Cluster]:
    with module_cluster() as cluster:
        cluster.restart_kubelets(FAST_SYNC_FREQUENCY)
        yield cluster


def _metric(lab: Cluster, node: NodeSpec, name: str) -> float | None:
    """One sample of the node's agent (it serves on the node's loopback: hostNetwork), read in its namespace."""
    text = lab.namespace(node).run([sys.executable, "-c", METRICS], check=False).stdout
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return None


def _reasons(lab: Cluster) -> dict[str, str]:
    statuses = lab.kubectl_json("get", "ipmasqagentstatuses")["items"]
    return {s["metadata"]["name"]: str(s.get("status", s).get("reason", "")) for s in statuses}



def test_the_gke_overlay_beside_gkes_agent_stops_fighting_and_says_foreign_writer(lab: Cluster) -> None:
    agent.apply_config(lab, CONFIG)
    agent.deploy_agent(lab, "deploy/overlays/gke")
    for node in lab.nodes:
        agent.wait_synced(lab, node, CONFIG, GKE_OPTIONS)
    standin.deploy(lab, period=0.5, jump=False, wait=False)
    try:
        for node in lab.nodes:
            wait_until(lambda node=node: _metric(lab, node, 'ipmasq_foreign_writer{chain="IP-MASQ"}') == 1, 120,
                  f"{node.name}: ipmasq_foreign_writer")
        since = time.monotonic()
        repairs = {node.name: _metric(lab, node, "ipmasq_drift_repairs_total") or 0.0 for node in lab.nodes}
        wait_until(lambda: all("ForeignWriter: IP-MASQ" in r for r in _reasons(lab).values()) and len(_reasons(lab))
              == len(lab.nodes), 60, "every node's status says ForeignWriter")
        # no flapping: over ten resync periods only the trial repairs after each (doubling) quiet spell
        wait_until(lambda: time.monotonic() - since > 10 * RESYNC, 60, "ten resync periods")
        elapsed = time.monotonic() - since
        bound = math.ceil(math.log2(elapsed / FIRST_QUIET + 1)) + 1
        for node in lab.nodes:
            more = (_metric(lab, node, "ipmasq_drift_repairs_total") or 0.0) - repairs[node.name]
            assert more <= bound, f"{node.name}: {more:g} repairs in {elapsed:.0f} s (fighting: one per pass)"
            # the stand-in's rules stay and are what the kernel holds: between a trial repair and the stand-in's next
            # restore (its period) the agent's own rules are there for a moment, so this waits for the stand-in's
            wait_until(lambda node=node: any("172.16.0.0/12" in line for line in
                                             agent.kernel(lab, node, GKE_OPTIONS).read(Family.V4).objects),
                       10 * RESYNC, f"{node.name}: the stand-in's rules held")
    finally:
        standin.remove(lab)
    # the stand-in is gone: each agent repairs once its quiet spell ends and says so
    for node in lab.nodes:
        agent.wait_synced(lab, node, CONFIG, GKE_OPTIONS, timeout=180)
    wait_until(lambda: not any("ForeignWriter" in r for r in _reasons(lab).values()), 120, "ForeignWriter cleared")
    for node in lab.nodes:
        assert _metric(lab, node, 'ipmasq_foreign_writer{chain="IP-MASQ"}') is None
    agent.remove_agent(lab)
