"""Where a config came from (ipmasq.agent.origin): a value beside the config, compared by value, never changed once a
report carries it; the loop hands each pass the origin of the content that pass enforced, and a rejected config's
origin only on the rejection."""

from __future__ import annotations

import dataclasses
import logging
import threading
from pathlib import Path

import pytest

from ipmasq.agent.loop import Agent, LoopSettings, Wakeup
from ipmasq.agent.origin import FILE, ConfigOrigin
from ipmasq.agent.reconcile import Reconciler
from ipmasq.agent.reports import ConfigReport, PassReport
from ipmasq.backends.iptables import IptablesBackend, Variant
from ipmasq.config import ConfigInput
from ipmasq.options import PolicyOptions
from ipmasq.testing import FakeIptables
from tests.eventually import eventually


def api(version: str, digest: str) -> ConfigOrigin:
    return ConfigOrigin("api", digest=digest, configmaps=(("ip-masq-agent", version),), exists=True)


def test_the_files_origin_says_nothing_it_does_not_know() -> None:
    assert ConfigOrigin("file") == FILE
    assert (FILE.source, FILE.digest, FILE.configmaps, FILE.exists) == ("file", None, (), None)


def test_origins_are_values_equal_when_their_fields_are() -> None:
    assert api("7", "d" * 64) == api("7", "d" * 64)
    assert hash(api("7", "d" * 64)) == hash(api("7", "d" * 64))
    assert api("7", "d" * 64) != api("8", "d" * 64)  # the same content at a newer resourceVersion is another origin
    assert api("7", "d" * 64) != api("7", "e" * 64)
    assert ConfigOrigin("file", exists=False) != FILE  # the file, the ConfigMaps deleted: not the same fact
    assert len({api("7", "d" * 64), api("7", "d" * 64), FILE}) == 2


def test_an_origin_cannot_change_under_a_report_that_carries_it() -> None:
    origin = api("7", "d" * 64)
    with pytest.raises(dataclasses.FrozenInstanceError):
        origin.digest = "e" * 64  # type: ignore[misc]
    assert not hasattr(origin, "__dict__")  # slots: one per report, nothing else attached to it
    newer = dataclasses.replace(origin, configmaps=(("ip-masq-agent", "8"),))
    assert origin.configmaps == (("ip-masq-agent", "7"),) and newer.configmaps == (("ip-masq-agent", "8"),)


class ScriptedApi:
    """The API's side of the loop as it sees it (ApiConfig.choose): the content the test publishes, with its origin."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.current: tuple[ConfigInput, ConfigOrigin] | None = None

    def publish(self, text: str, origin: ConfigOrigin) -> None:
        with self.lock:
            self.current = (ConfigInput((("configmap/ip-masq-agent[config]", text.encode()),)), origin)

    def choose(self, file_read: object) -> tuple[object, ConfigOrigin]:
        with self.lock:
            assert self.current is not None
            return self.current


class Reports:
    def __init__(self) -> None:
        self.configs: list[ConfigReport] = []
        self.passes: list[PassReport] = []

    def heartbeat(self) -> None:
        pass

    def took_config(self, report: ConfigReport) -> None:
        self.configs.append(report)

    def reconciled(self, report: PassReport, seconds: float) -> None:
        self.passes.append(report)

    def waiting(self, why: str) -> None:
        pass

    def failed(self, why: str) -> None:
        pass


def test_a_pass_carries_the_origin_of_what_it_enforced_and_a_rejection_its_own(tmp_path: Path) -> None:
    fake = FakeIptables()
    reconciler = Reconciler(IptablesBackend(fake, chain="IP-MASQ-AGENT", variant=Variant.NFT), PolicyOptions(),
                            log=logging.getLogger("test.origin"))
    source, reports = ScriptedApi(), Reports()
    good, bad, fixed = api("5", "a" * 64), api("6", "b" * 64), api("7", "c" * 64)
    source.publish("nonMasqueradeCIDRs: [10.0.0.0/8]\nresyncInterval: 60s\n", good)
    agent = Agent(reconciler, LoopSettings(config_path=str(tmp_path / "ip-masq-agent")),
                  api_config=source, listener=reports, log=logging.getLogger("test.origin"))
    wakeup = Wakeup()
    thread = threading.Thread(target=agent.run, args=(wakeup,))
    thread.start()
    try:
        eventually(lambda: reports.passes and reports.passes[-1].readiness.ok, "the first config enforced")
        assert reports.passes[-1].origin == good and reports.configs[-1].origin == good

        source.publish("nonMasqueradeCIDRs: [10.0.0.0/33]\nresyncInterval: 60s\n", bad)
        passes = len(reports.passes)
        wakeup.request_look()
        eventually(lambda: len(reports.passes) > passes, "a pass after the bad config")
        rejected = next(report for report in reports.configs if report.origin == bad)
        assert rejected.config_error is not None
        # the kernel still holds the good content: the pass names its origin, never the rejected newer one
        assert reports.passes[-1].origin == good

        source.publish("nonMasqueradeCIDRs: [10.0.0.0/8, 100.64.0.0/10]\nresyncInterval: 60s\n", fixed)
        wakeup.request_look()
        eventually(lambda: reports.passes[-1].origin == fixed and reports.passes[-1].readiness.ok,
                   lambda: f"the fixed config enforced (last pass: {reports.passes[-1]})")
        assert any("100.64.0.0/10" in rule for rule in fake.table().rules("IP-MASQ-AGENT"))
    finally:
        wakeup.request_stop()
        thread.join(30)
    assert not thread.is_alive()
