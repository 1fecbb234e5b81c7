"""enableIPv6 in the config as a real switch (the --enable-ipv6 flag, when given, wins), over both fakes: switched on
by a reload the IPv6 objects are written; switched off they are removed, and nobody else's IPv6 rules are touched."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from ipmasq.agent.reconcile import Reconciler
from ipmasq.agent.reports import SyncResult
from ipmasq.backends.iptables import IptablesBackend, Variant
from ipmasq.backends.nftables import NftablesBackend
from ipmasq.netfilter.nft import SET_NAMES, NftSet
from ipmasq.options import PolicyOptions
from ipmasq.prefix import Family
from ipmasq.testing import FakeIptables, FakeNft
from tests.configs import agent_config

LOG = logging.getLogger("test.ipv6-from-config")
ON = "enableIPv6: true\nnonMasqueradeCIDRs: [10.0.0.0/8, 'fd00::/8']\n" \
     "rules:\n  - name: v6-db\n    destinations: ['2001:db8::/32']\n    action: preserve\n"
OFF = "enableIPv6: false\nnonMasqueradeCIDRs: [10.0.0.0/8]\n"
ABSENT = "nonMasqueradeCIDRs: [10.0.0.0/8]\n"
FOREIGN6 = "*nat\n-A POSTROUTING -d fd00:77::/64 -j RETURN\nCOMMIT\n"


def ours6(fake: FakeIptables) -> list[str]:
    table = fake.table("ip6tables")
    return [r for chain, rules in table.chains.items() for r in table.rules(chain)
            if chain == "IP-MASQ-AGENT" or "IP-MASQ-AGENT" in r] + \
        [chain for chain in table.chains if chain == "IP-MASQ-AGENT"]


@pytest.mark.parametrize("switch_off", [OFF, ABSENT], ids=["false", "absent"])
def test_iptables_follows_the_config_switch(switch_off: str) -> None:
    fake = FakeIptables()
    assert fake.restore("ip6tables", FOREIGN6).returncode == 0
    reconciler = Reconciler(IptablesBackend(fake, chain="IP-MASQ-AGENT", variant=Variant.NFT), PolicyOptions(),
                            log=LOG)
    reconciler.take_config(agent_config(ABSENT))
    assert reconciler.reconcile().readiness.ok and not ours6(fake)

    reconciler.take_config(agent_config(ON))  # switched on: the IPv6 chain and its jump, the rule first
    report = reconciler.reconcile()
    assert report.result is SyncResult.APPLIED and [w.family for w in report.writes] == [Family.V6]
    rules = fake.table("ip6tables").rules("IP-MASQ-AGENT")
    assert "rule v6-db" in rules[0] and any("fd00::/8" in r for r in rules)
    assert reconciler.reconcile().result is SyncResult.IN_SYNC

    reconciler.take_config(agent_config(switch_off))  # switched off: ours gone, the foreign IPv6 rule stays
    report = reconciler.reconcile()
    assert report.result is SyncResult.APPLIED and report.readiness.ok
    assert [(w.family, w.added) for w in report.writes] == [(Family.V6, 0)]
    assert not ours6(fake)
    assert fake.table("ip6tables").rules("POSTROUTING") == ["-A POSTROUTING -d fd00:77::/64 -j RETURN"]
    writes = fake.writes
    assert reconciler.reconcile().result is SyncResult.IN_SYNC and fake.writes == writes


def test_the_flag_wins_over_the_config() -> None:
    fake = FakeIptables()
    reconciler = Reconciler(IptablesBackend(fake, chain="IP-MASQ-AGENT", variant=Variant.NFT),
                            PolicyOptions(enable_ipv6=False), log=LOG)
    reconciler.take_config(agent_config("enableIPv6: true\nnonMasqueradeCIDRs: [10.0.0.0/8]\n"))
    assert reconciler.reconcile().readiness.ok and not ours6(fake)
    # --enable-ipv6=true manages IPv6 whatever the config says
    fake = FakeIptables()
    reconciler = Reconciler(IptablesBackend(fake, chain="IP-MASQ-AGENT", variant=Variant.NFT),
                            PolicyOptions(enable_ipv6=True), log=LOG)
    reconciler.take_config(agent_config(OFF))
    assert reconciler.reconcile().readiness.ok and ours6(fake)


def test_an_ipv6_cidr_without_ipv6_keeps_the_last_good_config() -> None:
    fake = FakeIptables()
    reconciler = Reconciler(IptablesBackend(fake, chain="IP-MASQ-AGENT", variant=Variant.NFT), PolicyOptions(),
                            log=LOG)
    reconciler.take_config(agent_config(ON))
    assert reconciler.reconcile().readiness.ok
    seen = reconciler.take_config(agent_config("enableIPv6: false\nnonMasqueradeCIDRs: ['fd00::/8']\n"))
    assert seen.config_error is not None and "ipv6 is not enabled" in seen.config_error
    assert seen.config_error.startswith("/etc/config/ip-masq-agent:2: ")  # the CIDR's line
    assert reconciler.reconcile().result is SyncResult.IN_SYNC and ours6(fake)  # the last good config stays


def test_nftables_follows_the_config_switch() -> None:
    fake = FakeNft()
    backend = NftablesBackend(fake)
    reconciler = Reconciler(backend, PolicyOptions(), log=LOG)
    reconciler.take_config(agent_config(ON))
    assert reconciler.reconcile().readiness.ok
    table = backend.read_structure()
    assert table is not None and SET_NAMES[Family.V6] in {s.name for s in table.sets}
    assert any("v6-db" in r for c in table.chains for r in c.rules)

    reconciler.take_config(agent_config(OFF))
    report = reconciler.reconcile()
    assert report.result is SyncResult.APPLIED and report.readiness.ok
    table = backend.read_structure()
    assert table is not None and SET_NAMES[Family.V6] not in {s.name for s in table.sets}
    assert not any("v6-db" in r for c in table.chains for r in c.rules)
    assert reconciler.reconcile().result is SyncResult.IN_SYNC
    # a stale IPv6 set left in our table (an older agent, a hand edit) is removed although IPv6 is not managed
    key = ("inet", "ip-masq-agent")
    stale = NftSet(SET_NAMES[Family.V6], "ipv6_addr", ("interval",), ((1, 2),))
    fake.tables[key] = dataclasses.replace(fake.tables[key], sets=(*fake.tables[key].sets, stale))
    report = reconciler.reconcile()
    assert [w.family for w in report.writes] == [Family.V6]
    table = backend.read_structure()
    assert table is not None and SET_NAMES[Family.V6] not in {s.name for s in table.sets}
