"""When the agent hands its freed memory back (a full collection, then malloc_trim): after a pass that loaded a
changed config or wrote, and after an idle pass when it was not for RELEASE_IDLE_SECONDS; not after every idle pass
(each costs about 2.5 ms of CPU)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from ipmasq.agent import loop
from ipmasq.agent.loop import RELEASE_IDLE_SECONDS, Agent, LoopSettings, Wakeup, _Schedule
from ipmasq.agent.reconcile import Reconciler
from ipmasq.backends.iptables import IptablesBackend, Variant
from ipmasq.options import PolicyOptions
from ipmasq.testing import FakeIptables


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_released_after_changes_and_writes_and_now_and_then_when_idle(tmp_path: Path,
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
    wakeup, schedule = Wakeup(), _Schedule(next_resync=clock.now, backoff=settings.backoff_initial)

    def pass_at(now: float) -> None:
        clock.now = now
        assert agent._iteration(wakeup, schedule)

    half = RELEASE_IDLE_SECONDS / 2
    pass_at(1000.0)  # the first config, written
    pass_at(1000.0 + half)  # idle
    pass_at(1000.0 + RELEASE_IDLE_SECONDS)  # idle, but nothing handed back for RELEASE_IDLE_SECONDS
    pass_at(1000.0 + RELEASE_IDLE_SECONDS + half)  # idle
    del fake.table().chains["POSTROUTING"][-1]  # drift: the pass writes
    pass_at(1000.0 + RELEASE_IDLE_SECONDS + half + 1)
    path.write_text("nonMasqueradeCIDRs: [10.0.0.0/8, 172.16.0.0/12]\nresyncInterval: 1s\n")
    pass_at(1000.0 + RELEASE_IDLE_SECONDS + half + 2)  # a changed config, before its resync is due
    pass_at(1000.0 + RELEASE_IDLE_SECONDS + half + 3)  # idle, the last hand-back a second ago
    assert released == [1000.0, 1000.0 + RELEASE_IDLE_SECONDS, 1000.0 + RELEASE_IDLE_SECONDS + half + 1,
                        1000.0 + RELEASE_IDLE_SECONDS + half + 2]

