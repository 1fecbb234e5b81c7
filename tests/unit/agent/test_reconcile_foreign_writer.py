"""Two writers never fight: a chain rewritten by another program after each repair stops the repairs (ForeignWriter),
and they resume once the other writer is gone. Over the fake iptables with an injected clock; the kernel test
(tests/kernel/agent/test_reconcile_foreign_writer.py) does the same on real netfilter with a real stand-in writer.
"""

from __future__ import annotations

import logging

import pytest

from ipmasq.agent.metrics import AgentVitals, metric_families
from ipmasq.agent.reconcile import FOREIGN_QUIET_PERIODS, FOREIGN_REWRITES, Reconciler
from ipmasq.agent.reports import SyncResult
from ipmasq.backends.iptables import IptablesBackend, Variant
from ipmasq.config import ConfigInput
from ipmasq.options import PolicyOptions
from ipmasq.testing import FakeIptables
from tests.clock import Clock

CONFIG = ConfigInput((("/etc/config/ip-masq-agent", b"nonMasqueradeCIDRs: [10.0.0.0/8]\nresyncInterval: 10s\n"),))
# what GKE's agent would write into the same chain: its own defaults, not our config
OTHER = """*nat
:IP-MASQ-AGENT - [0:0]
-A IP-MASQ-AGENT -d 169.254.0.0/16 -j RETURN
-A IP-MASQ-AGENT -d 10.0.0.0/8 -j RETURN
-A IP-MASQ-AGENT -d 100.64.0.0/10 -j RETURN
-A IP-MASQ-AGENT -j MASQUERADE
COMMIT
"""
FLUSH = "*nat\n-F IP-MASQ-AGENT\nCOMMIT\n"


class Node:
    def __init__(self) -> None:
        self.fake = FakeIptables()
        self.clock = Clock()
        backend = IptablesBackend(self.fake, chain="IP-MASQ-AGENT", variant=Variant.NFT)
        self.rec = Reconciler(backend, PolicyOptions(), log=logging.getLogger("test.foreign"), clock=self.clock)
        self.rec.take_config(CONFIG)

    def other_writes(self, text: str = OTHER) -> None:
        assert self.fake.restore("iptables", text).returncode == 0

    def ours(self) -> list[str]:
        return self.fake.table().rules("IP-MASQ-AGENT")

    def resync(self) -> SyncResult:
        self.clock.now += 10.0
        return self.rec.reconcile().result


def test_three_rewrites_in_a_row_stop_the_repairs_and_say_so(caplog: pytest.LogCaptureFixture) -> None:
    node = Node()
    assert node.rec.reconcile().result is SyncResult.APPLIED
    good = node.ours()
    for _ in range(FOREIGN_REWRITES - 1):
        node.other_writes()
        assert node.resync() is SyncResult.APPLIED and node.ours() == good  # repaired, so far
    node.other_writes()
    writes = node.fake.writes
    with caplog.at_level(logging.INFO):
        report = node.rec.reconcile()
        assert report.result is SyncResult.FOREIGN_WRITER and report.foreign_rewrites == 1
        seen = report.foreign_writer
        assert seen is not None and seen.chain == "IP-MASQ-AGENT" and seen.rewrites == FOREIGN_REWRITES
        assert seen.extra_count == 4 and seen.missing_count == 3  # what the other writer holds, what it lacks
        assert "169.254.0.0/16" in " ".join(seen.extra)
        assert not report.readiness.ok and "ForeignWriter: IP-MASQ-AGENT" in report.readiness.why
        for _ in range(FOREIGN_QUIET_PERIODS - 1):  # the other writer keeps writing the same: no flapping
            node.other_writes()
            assert node.resync() is SyncResult.FOREIGN_WRITER
    assert node.ours() != good  # its rules stay in place, working
    assert node.fake.writes == writes + FOREIGN_QUIET_PERIODS - 1  # only the other writer wrote
    assert sum("ForeignWriter" in r.getMessage() for r in caplog.records) == 1  # one log line


def test_repairs_resume_once_the_other_writer_is_gone() -> None:
    node = Node()
    node.rec.reconcile()
    good = node.ours()
    for _ in range(FOREIGN_REWRITES):
        node.other_writes()
        node.resync()
    assert node.rec.reconcile().result is SyncResult.FOREIGN_WRITER
    writes = node.fake.writes
    # nothing changes any more: after the quiet periods one repair, then in sync
    results = [node.resync() for _ in range(FOREIGN_QUIET_PERIODS)]
    assert results[:-1] == [SyncResult.FOREIGN_WRITER] * (FOREIGN_QUIET_PERIODS - 1)
    assert results[-1] is SyncResult.APPLIED and node.ours() == good and node.fake.writes == writes + 1
    report = node.rec.reconcile()
    assert report.result is SyncResult.IN_SYNC and report.foreign_writer is None and report.readiness.ok
    # a later single rewrite is drift again, not a fight
    node.other_writes()
    assert node.resync() is SyncResult.APPLIED and node.ours() == good


def test_a_repair_undone_at_once_holds_again_and_waits_longer() -> None:
    node = Node()
    node.rec.reconcile()
    for _ in range(FOREIGN_REWRITES):
        node.other_writes()
        node.resync()
    for _ in range(FOREIGN_QUIET_PERIODS):
        node.resync()  # the last one repairs (a probe)
    node.other_writes()  # ... which the other writer undoes
    assert node.resync() is SyncResult.FOREIGN_WRITER
    # now twice as long before the next repair
    results = [node.resync() for _ in range(2 * FOREIGN_QUIET_PERIODS)]
    assert results[:-1] == [SyncResult.FOREIGN_WRITER] * (2 * FOREIGN_QUIET_PERIODS - 1)
    assert results[-1] is SyncResult.APPLIED


def test_deletions_are_drift_never_a_foreign_writer() -> None:
    node = Node()
    node.rec.reconcile()
    good = node.ours()
    for _ in range(2 * FOREIGN_REWRITES):
        node.other_writes(FLUSH)
        report = node.rec.reconcile()
        assert report.result is SyncResult.APPLIED and report.drift_repair and report.foreign_rewrites == 0
        assert node.ours() == good


def test_rewrites_far_apart_do_not_add_up() -> None:
    node = Node()
    node.rec.reconcile()
    for _ in range(2 * FOREIGN_REWRITES):
        node.clock.now += 100.0  # ten resync periods between rewrites: an operator's edits, repaired each time
        node.other_writes()
        assert node.rec.reconcile().result is SyncResult.APPLIED


def test_metrics_count_rewrites_and_name_the_chain() -> None:
    node = Node()
    status = AgentVitals(version="test", backend="iptables (nft)")
    status.reconciled(node.rec.reconcile(), 0.01)
    for _ in range(FOREIGN_REWRITES):
        node.other_writes()
        node.clock.now += 10.0
        status.reconciled(node.rec.reconcile(), 0.01)
    families = {f.name: f for f in metric_families(status.snapshot())}
    rewrites = families["ipmasq_foreign_rewrites_total"].samples
    assert [s.value for s in rewrites] == [FOREIGN_REWRITES]
    assert [dict(s.labels) for s in families["ipmasq_foreign_writer"].samples] == [{"chain": "IP-MASQ-AGENT"}]
    assert status.snapshot().syncs["foreign-writer"] == 1
    # gone: the gauge is absent again
    for _ in range(FOREIGN_QUIET_PERIODS + 1):
        node.clock.now += 10.0
        status.reconciled(node.rec.reconcile(), 0.01)
    families = {f.name: f for f in metric_families(status.snapshot())}
    assert families["ipmasq_foreign_writer"].samples == ()
