"""When the agent hands its freed memory back (a full collection, then malloc_trim): after a pass that loaded a
changed config or wrote, never after an idle pass."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from ipmasq.agent import loop
from ipmasq.agent.loop import Agent, LoopSettings, Wakeup, _Schedule
from ipmasq.agent.reconcile import Reconciler
from ipmasq.backends.iptables import IptablesBackend, Variant
from ipmasq.backoff import Backoff
from ipmasq.options import PolicyOptions
from ipmasq.testing import FakeIptables
from tests.clock import Clock


def test_released_after_changes_and_writes_only(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    released: list[float] = []
    clock = Clock()

    def release() -> bool:
        released.append(clock.now)
        return True

    monkeypatch.setattr(loop, "release_free_memory", release)
    path = tmp_path / "ip-masq-agent"
    path.write_text("nonMasqueradeCIDRs: [10.0.0.0/8]\nresyncInterval: 1s\n")
    fake = FakeIptables()
    reconciler = Reconciler(IptablesBackend(fake, chain="IP-MASQ-AGENT", variant=Variant.NFT), PolicyOptions(),
                            log=logging.getLogger("test"))
    settings = LoopSettings(config_path=str(path), use_inotify=False)
    agent = Agent(reconciler, settings, log=logging.getLogger("test"), clock=clock)
    backoff = Backoff(settings.backoff_initial, settings.backoff_max, jitter=0.0)
    wakeup, schedule = Wakeup(), _Schedule(next_resync=clock.now, backoff=backoff)

    def pass_at(now: float) -> None:
        clock.now = now
        assert agent._iteration(wakeup, schedule)

    pass_at(1000.0)  # the first config, written
    pass_at(1001.0)  # idle
    pass_at(1100.0)  # idle, long after the last hand-back
    del fake.table().chains["POSTROUTING"][-1]  # drift: the pass writes
    pass_at(1101.0)
    path.write_text("nonMasqueradeCIDRs: [10.0.0.0/8, 172.16.0.0/12]\nresyncInterval: 1s\n")
    pass_at(1101.5)  # a changed config, before its resync is due
    pass_at(1102.5)  # idle
    assert released == [1000.0, 1101.0, 1101.5]
