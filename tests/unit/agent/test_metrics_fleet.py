"""The fleet view's per-node facts: which config the kernel enforces (the same short hash `ipmasq render
--print-hash` prints for the config file), and the resync interval the alerts compare staleness with."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from ipmasq.agent.metrics import AgentVitals, render_metrics
from ipmasq.agent.reconcile import FOREIGN_RECOUNT_PASSES, Reconciler
from ipmasq.backends.iptables import IptablesBackend, Variant
from ipmasq.cli import main
from ipmasq.config import ConfigInput
from ipmasq.options import PolicyOptions
from ipmasq.testing import FakeIptables

GOOD = "nonMasqueradeCIDRs: [10.0.0.0/8]\nresyncInterval: 30s\n"
OTHER = "nonMasqueradeCIDRs: [10.0.0.0/8, 172.16.0.0/12]\nresyncInterval: 30s\n"


def _samples(status: AgentVitals, name: str) -> list[tuple[dict[str, str], float]]:
    return [(dict(s.labels), s.value) for family in text_string_to_metric_families(render_metrics(status).decode())
            for s in family.samples if s.name == name]


def _printed_hash(tmp_path: Path, text: str, capsys: pytest.CaptureFixture[str]) -> str:
    config = tmp_path / "ip-masq-agent"
    config.write_text(text)
    assert main(["render", "--config", str(config), "--print-hash"]) == 0
    return capsys.readouterr().out.strip()


def test_enforced_config_hash_is_what_render_prints(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rec = Reconciler(IptablesBackend(FakeIptables(), chain="IP-MASQ-AGENT", variant=Variant.NFT), PolicyOptions(),
                     log=logging.getLogger("test.fleet"))
    status = AgentVitals(version="0", backend="iptables (nft)")
    assert _samples(status, "ipmasq_enforced_config_info") == []  # nothing enforced before the first pass

    status.took_config(rec.take_config(ConfigInput((("/etc/config/ip-masq-agent", GOOD.encode()),))))
    status.reconciled(rec.reconcile(), 0.01)
    good = _printed_hash(tmp_path, GOOD, capsys)
    assert len(good) == 16 and int(good, 16) >= 0
    assert _samples(status, "ipmasq_enforced_config_info") == [({"config_hash": good}, 1.0)]
    assert _samples(status, "ipmasq_resync_interval_seconds") == [({}, 30.0)]

    # a bad config: the kernel still enforces the last good one, and the metric says so
    status.took_config(rec.take_config(ConfigInput((("/etc/config/ip-masq-agent", b"nonMasqueradeCIDRs: [bogus]\n"),))))
    status.reconciled(rec.reconcile(), 0.01)
    assert _samples(status, "ipmasq_enforced_config_info") == [({"config_hash": good}, 1.0)]
    assert _samples(status, "ipmasq_config_valid") == [({}, 0.0)]

    status.took_config(rec.take_config(ConfigInput((("/etc/config/ip-masq-agent", OTHER.encode()),))))
    status.reconciled(rec.reconcile(), 0.01)
    other = _printed_hash(tmp_path, OTHER, capsys)
    assert other != good
    assert _samples(status, "ipmasq_enforced_config_info") == [({"config_hash": other}, 1.0)]


def test_the_hash_ignores_spelling_but_not_meaning(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spelled = "# a comment\nnonmasqueradecidrs:\n  - 10.0.0.0/8\nresyncInterval: 0.5m\n"
    assert _printed_hash(tmp_path, spelled, capsys) == _printed_hash(tmp_path, GOOD, capsys)
    assert _printed_hash(tmp_path, GOOD.replace("30s", "31s"), capsys) != _printed_hash(tmp_path, GOOD, capsys)


_JUMP = ('-A POSTROUTING -m comment --comment "ip-masq-agent: ensure nat POSTROUTING directs all non-LOCAL '
         'destination traffic to our custom IP-MASQ-AGENT chain" -m addrtype ! --dst-type LOCAL -j IP-MASQ-AGENT')
KUBENET_SAVE = "\n".join([
    "*nat", ":POSTROUTING ACCEPT [0:0]", ":IP-MASQ-AGENT - [0:0]", _JUMP,
    '-A POSTROUTING ! -d 10.0.0.0/8 -m comment --comment "kubenet: SNAT for outbound traffic from cluster" '
    "-m addrtype ! --dst-type LOCAL -j MASQUERADE",
    "-A POSTROUTING -s 100.64.0.0/16 -d 10.1.2.100/32 -j SNAT --to-source 10.142.0.50",
    '-A IP-MASQ-AGENT -d 10.0.0.0/8 -m comment --comment "ip-masq-agent: local traffic is not subject to MASQUERADE" '
    "-j RETURN",
    '-A IP-MASQ-AGENT -m comment --comment "ip-masq-agent: outbound traffic is subject to MASQUERADE (must be last '
    'in chain)" -j MASQUERADE',
    "COMMIT", "*filter", "-A FORWARD -j MASQUERADE-LOOKALIKE", "COMMIT", "",
])

NFT_RULESET = """table inet ip-masq-agent {
	chain postrouting {
		type nat hook postrouting priority srcnat; policy accept;
		masquerade fully-random
	}
}
table ip nat {
	chain POSTROUTING {
		counter masquerade
	}
}
table ip cni-nat {
	chain nat-postrouting {
		type nat hook postrouting priority srcnat; policy accept;
		meta mark 0x4000 masquerade fully-random
		ip saddr 10.4.0.0/14 snat to 10.142.0.9
	}
}
"""


def test_foreign_nat_rules_are_counted_ours_and_iptables_nft_tables_aside() -> None:
    from ipmasq.netfilter.iptables import count_foreign_nat as count_iptables
    from ipmasq.netfilter.nft import count_foreign_nat as count_nft

    assert count_iptables(KUBENET_SAVE) == 2  # kubenet's MASQUERADE and the hand-written SNAT; not ours, not filter
    assert count_nft(NFT_RULESET) == 2  # a CNI's masquerade and snat; not our table, not iptables-nft's nat


def test_kube_proxys_service_masquerade_is_not_foreign() -> None:
    """Every kube-proxy node has it, and it takes only the Service traffic kube-proxy marked: counting it made
    IpMasqAgentForeignMasquerade fire on every healthy node."""
    from ipmasq.netfilter.iptables import count_foreign_nat as count_iptables
    from ipmasq.netfilter.nft import count_foreign_nat as count_nft
    from tests.conftest import ROOT

    dumps = ROOT / "tests" / "dumps"
    assert count_iptables((dumps / "kube-proxy-iptables-nat.save").read_text()) == 0
    assert count_nft((dumps / "kube-proxy-nftables.nft").read_text()) == 0
    # the same MASQUERADE in another chain is counted
    assert count_iptables("*nat\n-A POSTROUTING -m comment --comment \"kubernetes service traffic requiring SNAT\" "
                          "-j MASQUERADE\nCOMMIT\n") == 1


def test_foreign_masquerade_metric_follows_the_counter() -> None:
    counted = iter([3, 1])
    rec = Reconciler(IptablesBackend(FakeIptables(), chain="IP-MASQ-AGENT", variant=Variant.NFT), PolicyOptions(),
                     log=logging.getLogger("test.fleet"), count_foreign=lambda: next(counted))
    status = AgentVitals(version="0", backend="iptables (nft)")
    assert _samples(status, "ipmasq_foreign_masquerade_rules") == []  # not counted yet: absent, not 0
    status.took_config(rec.take_config(ConfigInput((("/etc/config/ip-masq-agent", GOOD.encode()),))))
    status.reconciled(rec.reconcile(), 0.01)  # the first pass installs our rules: counted
    assert _samples(status, "ipmasq_foreign_masquerade_rules") == [({}, 3.0)]
    for _ in range(FOREIGN_RECOUNT_PASSES - 1):  # idle passes do not re-read the whole nat table every time
        status.reconciled(rec.reconcile(), 0.01)
        assert _samples(status, "ipmasq_foreign_masquerade_rules") == [({}, 3.0)]
    status.reconciled(rec.reconcile(), 0.01)
    assert _samples(status, "ipmasq_foreign_masquerade_rules") == [({}, 1.0)]
