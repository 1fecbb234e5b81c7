"""Two writers on one node, on real netfilter: the agent (the gke overlay's flags) beside a stand-in for GKE's managed
agent, a shell loop of `iptables-restore --noflush` of its own IP-MASQ chain (not ipmasq). The agent stops repairing
once it sees its chain rewritten after each repair (no flapping), says ForeignWriter (log, readiness, metrics), leaves
the stand-in's working rules alone (real TCP still leaves as they say), and repairs again once the stand-in stops.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

from ipmasq.lab.kubelet import publish
from ipmasq.lab.netns import Network, stop_process
from tests.eventually import eventually
from tests.kernel.agent.test_metrics import ADDRESS, health, scrape
from tests.kernel.agent_harness import AWS_DB, NODE, POD, agent, more_passes, ours, world

RESYNC = 0.2  # seconds: the agent's passes, so that the whole scene takes seconds
GKE = ("--masq-chain=IP-MASQ", "--nomasq-all-reserved-ranges", "--random-fully=false", "--backend=iptables",
       "--iptables-variant=nft", f"--metrics-address={ADDRESS}")
# GKE's agent with no ConfigMap: every reserved range kept (AWS_DB, in 172.16.0.0/12, keeps the pod's address)
STAND_IN_RULES = "*nat\n:IP-MASQ - [0:0]\n" + "".join(
    f"-A IP-MASQ -d {cidr} -j RETURN\n"
    for cidr in ("169.254.0.0/16", "10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10",
                 "192.0.0.0/24", "192.0.2.0/24", "192.88.99.0/24", "198.18.0.0/15", "198.51.100.0/24",
                 "203.0.113.0/24", "240.0.0.0/4")) + "-A IP-MASQ -j MASQUERADE\nCOMMIT\n"
# bounded: 2,000 rewrites, every 50 ms (the test stops it long before)
STAND_IN = "for i in $(seq 2000); do iptables-nft-restore --noflush < {rules}; sleep 0.05; done"
# the quiet spell before each trial repair starts at 3 resync periods and doubles (ipmasq.agent.reconcile)
FIRST_QUIET = 3 * RESYNC


def test_the_agent_stops_fighting_a_foreign_writer_and_resumes_when_it_is_gone(net: Network, tmp_path: Path) -> None:
    config_dir = tmp_path / "config"
    publish(str(config_dir), f"nonMasqueradeCIDRs: [10.0.0.0/8]\nresyncInterval: {int(RESYNC * 1000)}ms\n")
    rules = tmp_path / "stand-in.rules"
    rules.write_text(STAND_IN_RULES)
    with world(net) as w, agent(w.node, tmp_path / "agent.log", f"--config={config_dir}/ip-masq-agent",
                                *GKE) as running:
        eventually(lambda: "-A IP-MASQ -d 10.0.0.0/8" in w.nat(), lambda: f"the config written\n{running.log}")
        good = ours(w.nat(), "IP-MASQ")
        assert w.seen(AWS_DB) == NODE
        stand_in = w.node.popen(["sh", "-c", STAND_IN.format(rules=rules)])
        try:
            eventually(lambda: running.lines("ForeignWriter"), lambda: f"the other writer detected\n{running.log}")
            detected, since = len(running.lines("applied IPv4")), time.monotonic()
            assert "IP-MASQ" in running.lines("ForeignWriter")[0]
            ready = health(w.node)
            assert ready.returncode != 0 and "ForeignWriter: IP-MASQ" in ready.stdout + ready.stderr
            metrics = scrape(w.node)
            assert metrics["ipmasq_foreign_writer{chain=IP-MASQ}"] == 1
            assert metrics["ipmasq_foreign_rewrites_total"] >= 3
            assert metrics["ipmasq_syncs_total{result=foreign-writer}"] >= 1
            # the stand-in's rules stay and work: the agent does not remove them
            assert "-A IP-MASQ -d 172.16.0.0/12 -j RETURN" in w.nat()
            assert w.seen(AWS_DB) == POD
            # no flapping: over many passes only the trial repairs after each quiet spell, which doubles: the k-th
            # comes FIRST_QUIET * (2**k - 1) after the detection at the earliest (one more for the detection seen
            # late); fighting would be a repair every pass
            more_passes(w.node, round(4.0 / RESYNC), address=ADDRESS)
            repairs = len(running.lines("applied IPv4")) - detected
            elapsed = time.monotonic() - since
            assert repairs <= math.ceil(math.log2(elapsed / FIRST_QUIET + 1)) + 1, running.log
            assert repairs < elapsed / RESYNC / 4, running.log
            assert len(running.lines("ForeignWriter")) == 1  # said once
        finally:
            stop_process(stand_in)
        # the stand-in is gone: the agent repairs once its quiet spell ends, and stays in sync
        eventually(lambda: ours(w.nat(), "IP-MASQ") == good and health(w.node).returncode == 0,
                   lambda: f"repaired and ready once the other writer is gone\n{running.log}")
        assert running.lines("other writer of our rules is gone")
        assert w.seen(AWS_DB) == NODE
        assert "ipmasq_foreign_writer{chain=IP-MASQ}" not in scrape(w.node)
        settled = len(running.lines("applied IPv4"))
        more_passes(w.node, 10, address=ADDRESS)
        assert len(running.lines("applied IPv4")) == settled
