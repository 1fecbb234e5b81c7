"""Observe mode on real netfilter: another program writes the node's rules (a stand-in for GKE's agent, applying a
fixed rule set with iptables-restore), `ipmasq agent --observe gke` beside it says whether they enforce the config,
and writes nothing: the node's nat table stays byte for byte what the writer wrote, and a pod's connection leaves
with the source address the writer's rules give it, whatever the observer reports.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from ipmasq.lab.kubelet import publish
from ipmasq.lab.netns import Network
from tests.conftest import ROOT
from tests.kernel.agent.test_metrics import get, scrape
from tests.kernel.agent_harness import AWS_DB, NODE, POD, agent, wait_until, world

GKE_FLAGS = ("--masq-chain", "IP-MASQ", "--nomasq-all-reserved-ranges", "--random-fully=false")
GKE_DEFAULT = (ROOT / "tests" / "dumps" / "gke-1.14-aws-vpn.save").read_text()  # what GKE's agent writes
TEN = "nonMasqueradeCIDRs: [10.0.0.0/8]\n"


def _rendered(config: Path) -> str:
    """The rules the writer writes once it has caught up with `config` (its chain, no --random-fully)."""
    return subprocess.run([sys.executable, "-m", "ipmasq", "render", "--config", str(config), *GKE_FLAGS],
                          check=True, capture_output=True, text=True).stdout


def _table(text: str) -> list[str]:
    """The rules, without the comments (a timestamp) and the chains' packet counters (traffic moves them)."""
    return [line.split(" [")[0] if line.startswith(":") else line for line in text.splitlines()
            if not line.startswith("#")]


def _passes(node: object, result: str) -> float:
    return scrape(node).get(f"ipmasq_syncs_total{{result={result}}}", 0.0)  # type: ignore[arg-type]


def test_the_observer_reports_a_config_the_writers_rules_miss_and_writes_nothing(net: Network, tmp_path: Path) -> None:
    with world(net) as w:
        w.node.run(["iptables-restore", "--noflush"], stdin=GKE_DEFAULT)
        written = _table(w.nat())
        assert w.seen(AWS_DB) == POD  # GKE's defaults: the AWS VPC (172.16/12) sees the pod
        directory = str(tmp_path / "config")
        publish(directory, "")
        with agent(w.node, tmp_path / "agent.log", "--observe", "gke", *GKE_FLAGS, "--config",
                   f"{directory}/ip-masq-agent", "--api", "off") as observer:
            assert wait_until(lambda: _passes(w.node, "in-sync") >= 1, 20), observer.log
            assert get(w.node, "/readyz")[0] == 200
            # the ConfigMap changes, the writer's rules do not: out of sync, still ready, nothing written
            publish(directory, TEN)
            assert wait_until(lambda: _passes(w.node, "out-of-sync") >= 1, 20), observer.log
            code, body = get(w.node, "/readyz")
            assert code == 200 and "observing" in body, body
            assert observer.lines("do not enforce the config") and "172.16.0.0/12" in observer.log
            assert _table(w.nat()) == written and w.seen(AWS_DB) == POD
            # the writer catches up: in sync again, seen from the rules alone (no config change in between)
            w.node.run(["iptables", "-t", "nat", "-F", "IP-MASQ"])
            w.node.run(["iptables-restore", "--noflush"], stdin=_rendered(Path(directory) / "ip-masq-agent"))
            in_sync = _passes(w.node, "in-sync")
            assert wait_until(lambda: _passes(w.node, "in-sync") > in_sync + 1, 20), observer.log
            assert observer.lines("enforce the config (policy")
            assert w.seen(AWS_DB) == NODE  # the writer's new rules masquerade it, as the config says
            assert "observe mode" in observer.log and not observer.lines("took the node lock")
