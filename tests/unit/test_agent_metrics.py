"""AgentStatus (what /metrics, /healthz and /readyz report) driven by the real Reconciler over the stateful fake."""

from __future__ import annotations

import io
import json
import logging
import threading
import time
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import CollectorRegistry

from ipmasq.agent.health import parse_listen_address
from ipmasq.agent.logs import configure_logging
from ipmasq.agent.loop import Agent, LoopSettings, Wakeup
from ipmasq.agent.metrics import LIVENESS_GRACE_SECONDS, AgentStatus, collect
from ipmasq.agent.reconcile import Outcome, Reconciler
from ipmasq.backends.iptables import IptablesBackend, Variant
from ipmasq.config import ConfigInput
from ipmasq.errors import UsageError
from ipmasq.options import PolicyOptions
from ipmasq.testing import FakeIptables

LOG = logging.getLogger("test.agent.metrics")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def cfg(text: str) -> ConfigInput:
    return ConfigInput((("/etc/config/ip-masq-agent", text.encode()),))


@pytest.fixture
def fake() -> FakeIptables:
    return FakeIptables()


def make(fake: FakeIptables, clock: Clock) -> tuple[Reconciler, AgentStatus]:
    backend = IptablesBackend(fake, chain="IP-MASQ-AGENT", variant=Variant.NFT)
    return Reconciler(backend, PolicyOptions(), log=LOG), AgentStatus(version="9.9", backend=backend.name,
                                                                      clock=clock, wall=lambda: 1.7e9)


def step(rec: Reconciler, status: AgentStatus, config: ConfigInput | None = None, *, seconds: float = 0.003) -> Outcome:
    """What one pass of the loop does: read, tell the observer, reconcile, tell the observer."""
    status.heartbeat()
    if config is not None:
        status.observed(rec, changed=rec.observe(config))
    outcome = rec.reconcile()
    status.reconciled(rec, outcome, seconds)
    return outcome


def scrape(status: AgentStatus) -> dict[str, float]:
    """The exposition text parsed back, as {"name{label=value,...}": value}."""
    from prometheus_client import generate_latest

    class Collector:
        def collect(self):  # type: ignore[no-untyped-def]
            return collect(status)

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Collector())
    samples = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return samples


def test_counts_follow_installs_idle_passes_drift_and_reloads(fake: FakeIptables) -> None:
    clock = Clock()
    rec, status = make(fake, clock)
    assert step(rec, status, cfg("nonMasqueradeCIDRs: [10.0.0.0/8, 192.168.0.0/16]\n")) is Outcome.APPLIED
    for _ in range(3):
        assert step(rec, status, cfg("nonMasqueradeCIDRs: [10.0.0.0/8, 192.168.0.0/16]\n")) is Outcome.IN_SYNC
    fake.table().chains["IP-MASQ-AGENT"] = []  # someone flushes our chain
    assert step(rec, status) is Outcome.APPLIED
    assert step(rec, status, cfg("nonMasqueradeCIDRs: [10.0.0.0/8]\n")) is Outcome.APPLIED  # a change, not drift
    m = scrape(status)
    assert m['ipmasq_syncs_total{result=applied}'] == 3 and m['ipmasq_syncs_total{result=in-sync}'] == 3
    assert m["ipmasq_drift_repairs_total"] == 1
    assert m["ipmasq_config_reloads_total"] == 2 and m["ipmasq_config_load_errors_total"] == 0
    # the jump plus link-local RETURN, one RETURN per CIDR, MASQUERADE: what iptables-save shows
    assert m['ipmasq_rules{family=ipv4}'] == 1 + len(fake.table().rules("IP-MASQ-AGENT")) == 4
    assert m['ipmasq_set_elements{family=ipv4}'] == 0
    assert m['ipmasq_build_info{backend=iptables (nft),version=9.9}'] == 1
    assert m["ipmasq_ready"] == 1 and m["ipmasq_config_valid"] == 1
    assert m["ipmasq_sync_duration_seconds_count"] == 6
    assert m["ipmasq_sync_duration_seconds_bucket{le=0.005}"] == 6
    assert m["ipmasq_sync_duration_seconds_sum"] == pytest.approx(6 * 0.003)
    assert m["ipmasq_last_successful_sync_timestamp_seconds"] == 1.7e9


def test_duration_histogram_is_cumulative(fake: FakeIptables) -> None:
    rec, status = make(fake, Clock())
    rec.observe(cfg("{}"))
    for seconds in (0.001, 0.2, 0.2, 3.0, 100.0):
        status.reconciled(rec, rec.reconcile(), seconds)
    m = scrape(status)
    assert [m[f"ipmasq_sync_duration_seconds_bucket{{le={le}}}"] for le in ("0.005", "0.25", "5.0", "60.0", "+Inf")] \
        == [1, 3, 4, 4, 5]


def test_bad_config_makes_not_ready_while_the_last_good_stays_enforced(fake: FakeIptables) -> None:
    rec, status = make(fake, Clock())
    assert not status.readiness().ok and "starting" in status.readiness().why
    step(rec, status, cfg("nonMasqueradeCIDRs: [10.0.0.0/8]\n"))
    assert status.readiness().ok
    good = fake.save("iptables", "nat")
    assert step(rec, status, cfg("nonMasqueradeCIDRs: [10.0.0.1/8]\n")) is Outcome.IN_SYNC
    ready = status.readiness()
    assert not ready.ok
    assert ready.why.startswith("not ready: config error: /etc/config/ip-masq-agent:1") and "10.0.0.1/8" in ready.why
    assert fake.save("iptables", "nat") == good
    m = scrape(status)
    assert m["ipmasq_config_load_errors_total"] == 1 and m["ipmasq_config_valid"] == 0 and m["ipmasq_ready"] == 0
    # a good config again: not ready until the pass that verifies the kernel holds it
    status.observed(rec, changed=rec.observe(cfg("nonMasqueradeCIDRs: [10.0.0.0/8, 100.64.0.0/10]\n")))
    assert status.readiness().why == "not ready: the current config is not applied yet"
    status.reconciled(rec, rec.reconcile(), 0.01)
    assert status.readiness().ok and scrape(status)["ipmasq_config_valid"] == 1


def test_backend_failure_is_not_ready_with_the_tools_error(fake: FakeIptables) -> None:
    rec, status = make(fake, Clock())
    fake.lock_busy = True
    assert step(rec, status, cfg("{}")) is Outcome.FAILED
    assert not status.readiness().ok and "xtables lock" in status.readiness().why
    assert scrape(status)['ipmasq_syncs_total{result=failed}'] == 1
    fake.lock_busy = False
    assert step(rec, status) is Outcome.APPLIED and status.readiness().ok


def test_no_config_yet_touches_nothing_and_is_not_ready(fake: FakeIptables) -> None:
    rec, status = make(fake, Clock())
    assert step(rec, status, cfg("nonMasqueradeCIDRs: [bogus]\n")) is Outcome.NO_POLICY
    assert "config error" in status.readiness().why
    assert scrape(status)['ipmasq_syncs_total{result=no-policy}'] == 1


def test_seconds_since_last_success_is_computed_at_scrape(fake: FakeIptables) -> None:
    clock = Clock()
    rec, status = make(fake, clock)
    clock.now += 7  # never synced: counts from the start
    assert scrape(status)["ipmasq_seconds_since_last_successful_sync"] == 7
    step(rec, status, cfg("{}"))
    clock.now += 42.5  # no hook runs in between
    assert scrape(status)["ipmasq_seconds_since_last_successful_sync"] == 42.5
    fake.lock_busy = True
    del fake.table().chains["POSTROUTING"][-1]  # drift that cannot be repaired while the xtables lock is held
    clock.now += 1
    assert step(rec, status) is Outcome.FAILED
    assert scrape(status)["ipmasq_seconds_since_last_successful_sync"] == 43.5


def test_liveness_fails_when_the_loop_stops_beating(fake: FakeIptables) -> None:
    clock = Clock()
    rec, status = make(fake, clock)
    step(rec, status, cfg("resyncInterval: 10s\n"))
    clock.now += 3 * 10 + LIVENESS_GRACE_SECONDS - 1
    assert status.liveness().ok and status.liveness().why.startswith("alive")
    clock.now += 2
    live = status.liveness()
    assert not live.ok and live.why == "wedged: the loop's last heartbeat was 151s ago (limit 150s)"
    status.heartbeat()
    assert status.liveness().ok


def test_the_real_loop_feeds_the_observer(fake: FakeIptables, tmp_path: Path) -> None:
    path = tmp_path / "ip-masq-agent"
    path.write_text("resyncInterval: 20ms\n")
    rec, status = make(fake, Clock())
    status = AgentStatus(version="9.9", backend="iptables")
    agent = Agent(rec, LoopSettings(config_path=str(path)), log=LOG, observer=status)
    wakeup = Wakeup()
    thread = threading.Thread(target=agent.run, args=(wakeup,))
    thread.start()
    try:
        deadline = time.monotonic() + 5
        while status.snapshot().syncs["in-sync"] < 5 and time.monotonic() < deadline:
            time.sleep(0.01)
        snap = status.snapshot()
        assert snap.syncs["applied"] == 1 and snap.syncs["in-sync"] >= 5
        assert snap.config_reloads == 1 and status.readiness().ok and status.liveness().ok
    finally:
        wakeup.request_stop()
        thread.join(5)
    assert not thread.is_alive()


@pytest.mark.parametrize(("text", "parsed"), [("127.0.0.1:9847", ("127.0.0.1", 9847)), (":9847", ("", 9847)),
                                              ("[::1]:9847", ("::1", 9847))])
def test_parse_address(text: str, parsed: tuple[str, int]) -> None:
    assert parse_listen_address(text) == parsed


@pytest.mark.parametrize("text", ["127.0.0.1", "localhost:http", "127.0.0.1:70000", ""])
def test_parse_address_rejects(text: str) -> None:
    with pytest.raises(UsageError, match="expected HOST:PORT"):
        parse_listen_address(text)


def test_json_log_lines_are_one_object_per_event() -> None:
    stream = io.StringIO()
    log = configure_logging("json", stream=stream)
    try:
        log.error("iptables-restore: %s", "line 3 failed\nCOMMIT expected")
        log.info("config loaded")
    finally:
        logging.getLogger().handlers.clear()
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2
    first, second = (json.loads(line) for line in lines)
    assert first["level"] == "error" and first["msg"] == "iptables-restore: line 3 failed\nCOMMIT expected"
    assert first["logger"] == "ipmasq.agent" and first["time"].endswith("Z")
    assert second == {**second, "level": "info", "msg": "config loaded"}


def test_text_log_lines() -> None:
    stream = io.StringIO()
    log = configure_logging("text", stream=stream)
    try:
        log.warning("config warning: %s", "unknown key")
    finally:
        logging.getLogger().handlers.clear()
    (line,) = stream.getvalue().splitlines()
    assert line.endswith("Z ipmasq agent: WARNING config warning: unknown key")
