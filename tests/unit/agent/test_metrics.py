"""AgentVitals (what /metrics, /healthz and /readyz report) driven by the real Reconciler over the stateful fake.

/metrics is written by ipmasq.agent.exposition without prometheus-client; the library is the test oracle here:
every scrape below is parsed back with its own parser.
"""

from __future__ import annotations

import io
import json
import logging
import os
import subprocess
import threading
import time
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from ipmasq.agent.health import parse_listen_address
from ipmasq.agent.logs import configure_logging
from ipmasq.agent.loop import Agent, LoopSettings, Wakeup
from ipmasq.agent.metrics import LIVENESS_GRACE_SECONDS, AgentVitals, render_metrics
from ipmasq.agent.reconcile import Reconciler
from ipmasq.agent.reports import SyncResult
from ipmasq.backends.iptables import IptablesBackend, Variant
from ipmasq.config import ConfigInput
from ipmasq.errors import UsageError
from ipmasq.options import PolicyOptions
from ipmasq.testing import FakeIptables
from tests.clock import Clock
from tests.configs import agent_config
from tests.conftest import PYTHON
from tests.eventually import eventually

LOG = logging.getLogger("test.agent.metrics")


@pytest.fixture
def fake() -> FakeIptables:
    return FakeIptables()


def make(fake: FakeIptables, clock: Clock) -> tuple[Reconciler, AgentVitals]:
    backend = IptablesBackend(fake, chain="IP-MASQ-AGENT", variant=Variant.NFT)
    return Reconciler(backend, PolicyOptions(), log=LOG), AgentVitals(version="9.9", backend=backend.name,
                                                                      clock=clock, wall=lambda: 1.7e9)


def step(rec: Reconciler, status: AgentVitals, config: ConfigInput | None = None, *,
         seconds: float = 0.003) -> SyncResult:
    """What one pass of the loop does: read, hand the observer the report, reconcile, hand it the pass's report."""
    status.heartbeat()
    if config is not None:
        status.took_config(rec.take_config(config))
    report = rec.reconcile()
    status.reconciled(report, seconds)
    return report.result


def scrape(status: AgentVitals) -> dict[str, float]:
    """What /metrics serves, parsed back by prometheus-client, as {"name{label=value,...}": value}."""
    samples = {}
    for family in text_string_to_metric_families(render_metrics(status).decode()):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return samples


def test_counts_follow_installs_idle_passes_drift_and_reloads(fake: FakeIptables) -> None:
    clock = Clock()
    rec, status = make(fake, clock)
    two_ranges = agent_config("nonMasqueradeCIDRs: [10.0.0.0/8, 192.168.0.0/16]\n")
    assert step(rec, status, two_ranges) is SyncResult.APPLIED
    for _ in range(3):
        assert step(rec, status, two_ranges) is SyncResult.IN_SYNC
    fake.table().chains["IP-MASQ-AGENT"] = []  # someone flushes our chain
    assert step(rec, status) is SyncResult.APPLIED
    # a change, not drift
    assert step(rec, status, agent_config("nonMasqueradeCIDRs: [10.0.0.0/8]\n")) is SyncResult.APPLIED
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
    rec.take_config(agent_config("{}"))
    for seconds in (0.001, 0.2, 0.2, 3.0, 100.0):
        status.reconciled(rec.reconcile(), seconds)
    m = scrape(status)
    assert [m[f"ipmasq_sync_duration_seconds_bucket{{le={le}}}"] for le in ("0.005", "0.25", "5.0", "60.0", "+Inf")] \
        == [1, 3, 4, 4, 5]


def test_bad_config_makes_not_ready_while_the_last_good_stays_enforced(fake: FakeIptables) -> None:
    rec, status = make(fake, Clock())
    assert not status.readiness().ok and "starting" in status.readiness().why
    step(rec, status, agent_config("nonMasqueradeCIDRs: [10.0.0.0/8]\n"))
    assert status.readiness().ok
    good = fake.save("iptables", "nat")
    assert step(rec, status, agent_config("nonMasqueradeCIDRs: [10.0.0.1/8]\n")) is SyncResult.IN_SYNC
    ready = status.readiness()
    assert not ready.ok
    assert ready.why.startswith("not ready: config error: /etc/config/ip-masq-agent:1") and "10.0.0.1/8" in ready.why
    assert fake.save("iptables", "nat") == good
    m = scrape(status)
    assert m["ipmasq_config_load_errors_total"] == 1 and m["ipmasq_config_valid"] == 0 and m["ipmasq_ready"] == 0
    # a good config again: not ready until the pass that verifies the kernel holds it
    status.took_config(rec.take_config(agent_config("nonMasqueradeCIDRs: [10.0.0.0/8, 100.64.0.0/10]\n")))
    assert status.readiness().why == "not ready: the current config is not applied yet"
    status.reconciled(rec.reconcile(), 0.01)
    assert status.readiness().ok and scrape(status)["ipmasq_config_valid"] == 1


def test_backend_failure_is_not_ready_with_the_tools_error(fake: FakeIptables) -> None:
    rec, status = make(fake, Clock())
    fake.lock_busy = True
    assert step(rec, status, agent_config("{}")) is SyncResult.FAILED
    assert not status.readiness().ok and "xtables lock" in status.readiness().why
    assert scrape(status)['ipmasq_syncs_total{result=failed}'] == 1
    fake.lock_busy = False
    assert step(rec, status) is SyncResult.APPLIED and status.readiness().ok


def test_no_config_yet_touches_nothing_and_is_not_ready(fake: FakeIptables) -> None:
    rec, status = make(fake, Clock())
    assert step(rec, status, agent_config("nonMasqueradeCIDRs: [bogus]\n")) is SyncResult.NO_POLICY
    assert "config error" in status.readiness().why
    assert scrape(status)['ipmasq_syncs_total{result=no-policy}'] == 1


def test_seconds_since_last_success_is_computed_at_scrape(fake: FakeIptables) -> None:
    clock = Clock()
    rec, status = make(fake, clock)
    clock.now += 7  # never synced: counts from the start
    assert scrape(status)["ipmasq_seconds_since_last_successful_sync"] == 7
    step(rec, status, agent_config("{}"))
    clock.now += 42.5  # no hook runs in between
    assert scrape(status)["ipmasq_seconds_since_last_successful_sync"] == 42.5
    fake.lock_busy = True
    del fake.table().chains["POSTROUTING"][-1]  # drift that cannot be repaired while the xtables lock is held
    clock.now += 1
    assert step(rec, status) is SyncResult.FAILED
    assert scrape(status)["ipmasq_seconds_since_last_successful_sync"] == 43.5


def test_liveness_fails_when_the_loop_stops_beating(fake: FakeIptables) -> None:
    clock = Clock()
    rec, status = make(fake, clock)
    step(rec, status, agent_config("resyncInterval: 10s\n"))
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
    status = AgentVitals(version="9.9", backend="iptables")
    agent = Agent(rec, LoopSettings(config_path=str(path)), log=LOG, listener=status)
    wakeup = Wakeup()
    thread = threading.Thread(target=agent.run, args=(wakeup,))
    thread.start()
    try:
        eventually(lambda: status.snapshot().syncs["in-sync"] >= 5, "five idle passes")
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


def families_of(status: AgentVitals) -> dict[str, tuple[str, str]]:
    """{family name: (type, help)} as prometheus-client's parser reads what /metrics serves."""
    return {f.name: (f.type, f.documentation) for f in text_string_to_metric_families(render_metrics(status).decode())}


def test_every_family_has_its_type_and_help(fake: FakeIptables) -> None:
    rec, status = make(fake, Clock())
    step(rec, status, agent_config("nonMasqueradeCIDRs: [10.0.0.0/8]\n"))
    families = families_of(status)
    # the parser names a counter's family without _total; an info is a 0.0.4 gauge under its full name
    assert {name: kind for name, (kind, _) in families.items()} == {
        "ipmasq_syncs": "counter", "ipmasq_sync_duration_seconds": "histogram",
        "ipmasq_config_load_errors": "counter", "ipmasq_config_reloads": "counter",
        "ipmasq_drift_repairs": "counter", "ipmasq_loop_errors": "counter",
        "ipmasq_foreign_rewrites": "counter", "ipmasq_foreign_writer": "gauge",
        "ipmasq_seconds_since_last_successful_sync": "gauge",
        "ipmasq_last_successful_sync_timestamp_seconds": "gauge", "ipmasq_rules": "gauge",
        "ipmasq_set_elements": "gauge", "ipmasq_ready": "gauge", "ipmasq_config_valid": "gauge",
        "ipmasq_enforced_config_info": "gauge", "ipmasq_resync_interval_seconds": "gauge",
        "ipmasq_foreign_masquerade_rules": "gauge",
        "ipmasq_rule_packets": "counter", "ipmasq_rule_bytes": "counter",
        "ipmasq_node_trust_verified": "gauge", "ipmasq_summary_lease_lost_early": "counter",
        "ipmasq_build_info": "gauge",
        "process_virtual_memory_bytes": "gauge", "process_resident_memory_bytes": "gauge",
        "process_start_time_seconds": "gauge", "process_cpu_seconds": "counter", "process_open_fds": "gauge",
        "process_max_fds": "gauge",
    }
    assert all(help_text for _, help_text in families.values())
    assert families["ipmasq_syncs"][1] == "Reconcile passes, by result."


def test_label_values_are_escaped() -> None:
    hostile = 'v1 "quoted" back\\slash\nnew line'
    status = AgentVitals(version=hostile, backend="nftables", clock=Clock())
    text = render_metrics(status).decode()
    assert 'version="v1 \\"quoted\\" back\\\\slash\\nnew line"' in text  # one line, escaped
    assert scrape(status)[f"ipmasq_build_info{{backend=nftables,version={hostile}}}"] == 1


def test_process_metrics_come_from_proc_self() -> None:
    m = scrape(AgentVitals(version="9.9", backend="iptables"))
    with open("/proc/self/status") as f:
        rss_kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    assert abs(m["process_resident_memory_bytes"] - rss_kib * 1024) < 8 * 1024 * 1024
    assert m["process_virtual_memory_bytes"] >= m["process_resident_memory_bytes"]
    # the process's own start, read here: field 22 of /proc/self/stat (clock ticks after boot) plus /proc/stat's btime
    with open("/proc/self/stat") as f:
        starttime_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/stat") as f:
        boot = next(float(line.split()[1]) for line in f if line.startswith("btime "))
    started = boot + starttime_ticks / os.sysconf("SC_CLK_TCK")
    assert m["process_start_time_seconds"] == pytest.approx(started, abs=0.01)
    if not boot <= m["process_start_time_seconds"] <= time.time():
        raise AssertionError(f"process start {m['process_start_time_seconds']} before boot ({boot}) or in the future")
    assert 0 < m["process_cpu_seconds_total"] <= time.process_time() + 0.1
    assert 3 <= m["process_open_fds"] <= m["process_max_fds"]


def test_serving_metrics_never_imports_prometheus_client() -> None:
    script = ("import sys\n"
              "import ipmasq.commands.agent\n"
              "from ipmasq.agent.metrics import AgentVitals, render_metrics\n"
              "assert render_metrics(AgentVitals(version='1', backend='iptables')).startswith(b'# HELP')\n"
              "print(sorted(m for m in sys.modules if m.startswith('prometheus')))\n")
    result = subprocess.run([PYTHON, "-c", script], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"
