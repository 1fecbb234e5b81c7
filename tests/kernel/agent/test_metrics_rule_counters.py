"""Per-rule counters on real netfilter, once per backend: connections through a config rule raise its
ipmasq_rule_packets_total as scraped from the agent's /metrics (a NAT rule sees each connection's first packet),
summed over the rule's kernel rules, and the rule really decided them (the peer saw the node's address)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ipmasq.lab.netns import Network
from tests.eventually import eventually
from tests.kernel.agent.test_metrics import scrape
from tests.kernel.agent_harness import AWS_DB, NODE, ONPREM, POD, agent, world
from tests.kernel.flavors import FLAVORS, Flavor

CONFIG = f"""\
nonMasqueradeCIDRs: [10.0.0.0/8]
resyncInterval: 1s
rules:
  - name: vpn-and-onprem-masquerade
    destinations: [{AWS_DB}/32, {ONPREM}/32]
    sources: [{POD}/32]
    action: masquerade
  - name: never-matches
    destinations: [198.51.100.0/24]
    action: preserve
"""
PACKETS = 'ipmasq_rule_packets_total{family=ipv4,rule=vpn-and-onprem-masquerade}'
BYTES = 'ipmasq_rule_bytes_total{family=ipv4,rule=vpn-and-onprem-masquerade}'
IDLE = 'ipmasq_rule_packets_total{family=ipv4,rule=never-matches}'


@pytest.mark.parametrize("flavor", FLAVORS, ids=str)
def test_traffic_through_a_rule_raises_its_counter(net: Network, tmp_path: Path, flavor: Flavor) -> None:
    config = tmp_path / "ip-masq-agent"
    config.write_text(CONFIG)
    with world(net) as w, agent(w.node, tmp_path / "agent.log", f"--config={config}", flavor.flag,
                                f"--lock-file={tmp_path / 'agent.lock'}") as running:
        eventually(lambda: PACKETS in scrape(w.node), lambda: f"the rule's packet counter served\n{running.log}")
        assert scrape(w.node)[PACKETS] == 0 and scrape(w.node)[IDLE] == 0
        # three connections to one of the rule's destinations, two to the other: one kernel rule each (iptables)
        for destination in (AWS_DB, AWS_DB, AWS_DB, ONPREM, ONPREM):
            assert w.seen(destination) == NODE, running.log  # the rule masqueraded it (10/8 alone would not)
        # read by the next pass (resync every 1s), never by the scrape itself
        eventually(lambda: scrape(w.node)[PACKETS] == 5,
                   lambda: f"five packets counted\n{(scrape(w.node), running.log)}")
        samples = scrape(w.node)
        assert samples[BYTES] >= 5 * 40  # each first packet (a SYN) is at least 40 bytes
        assert samples[IDLE] == 0
        # the counters are traffic, not drift: the rules were written once, every later pass found them in sync
        assert len(running.lines("applied IPv4 rules")) == 1, running.log
        assert "Traceback" not in running.log
