"""The agent's loop over the stateful fake iptables: what it writes, when, and what it leaves alone."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
from pathlib import Path

import pytest

import ipmasq.agent.watch
from ipmasq.agent.loop import Agent, LoopSettings, Wakeup
from ipmasq.agent.reconcile import Reconciler
from ipmasq.agent.reports import FamilyWrite, ObjectCount, ProbeVerdict, SyncResult
from ipmasq.backends.iptables import IptablesBackend, Variant, choose_variant
from ipmasq.config import ConfigInput
from ipmasq.errors import ConfigError
from ipmasq.lab.kubelet import publish
from ipmasq.options import PolicyOptions
from ipmasq.policy.hash import policy_hash
from ipmasq.prefix import Family
from ipmasq.testing import FakeIptables
from tests.configs import agent_config
from tests.eventually import eventually

LOG = logging.getLogger("test.agent")
FOREIGN = (
    "*nat\n:KUBE-POSTROUTING - [0:0]\n"
    '-A POSTROUTING -m comment --comment "kubernetes postrouting rules" -j KUBE-POSTROUTING\n'
    "-A KUBE-POSTROUTING -m mark ! --mark 0x4000/0x4000 -j RETURN\n"
    "-A KUBE-POSTROUTING -j MARK --xor-mark 0x4000\nCOMMIT\n"
)


def make(fake: FakeIptables, options: PolicyOptions | None = None) -> Reconciler:
    options = options or PolicyOptions()
    backend = IptablesBackend(fake, chain=options.masq_chain, variant=Variant.NFT)
    return Reconciler(backend, options, log=LOG)


def ours(fake: FakeIptables, chain: str = "IP-MASQ-AGENT") -> list[str]:
    return fake.table().rules(chain)


def foreign(fake: FakeIptables) -> tuple[list[str], list[str]]:
    table = fake.table()
    return ([r for r in table.rules("POSTROUTING") if "KUBE" in r], table.rules("KUBE-POSTROUTING"))


@pytest.fixture
def fake() -> FakeIptables:
    f = FakeIptables()
    assert f.restore("iptables", FOREIGN).returncode == 0
    f.writes = 0
    return f


def test_first_pass_installs_then_idle_passes_write_nothing(fake: FakeIptables) -> None:
    rec = make(fake)
    rec.take_config(agent_config("nonMasqueradeCIDRs: [10.0.0.0/8]\n"))
    assert rec.reconcile().result is SyncResult.APPLIED
    assert [r.split(" ")[3] if " -d " in r else r.split(" -j ")[1] for r in ours(fake)] == [
        "169.254.0.0/16", "10.0.0.0/8", "MASQUERADE --random-fully"]
    fake.count("IP-MASQ-AGENT", 7)
    before = foreign(fake)
    for _ in range(10):
        assert rec.reconcile().result is SyncResult.IN_SYNC
    assert fake.writes == 1
    assert fake.counters("IP-MASQ-AGENT") == [7, 7, 7]  # nothing rewritten: counters survive
    assert foreign(fake) == before
    assert rec.ready


@pytest.mark.parametrize("drift", ["flush", "delete-chain", "delete-jump", "insert", "reorder", "duplicate-jump"])
def test_drift_is_repaired_and_foreign_rules_untouched(fake: FakeIptables, drift: str) -> None:
    rec = make(fake)
    rec.take_config(agent_config("nonMasqueradeCIDRs: [10.0.0.0/8, 192.168.0.0/16]\n"))
    rec.reconcile()
    installed = fake.save("iptables", "nat")
    table = fake.table()
    jump = next(r for r in table.rules("POSTROUTING") if "IP-MASQ-AGENT" in r)
    if drift == "flush":
        table.chains["IP-MASQ-AGENT"] = []
    elif drift == "delete-chain":
        table.chains["POSTROUTING"] = [r for r in table.chains["POSTROUTING"] if r[0] != jump]
        del table.chains["IP-MASQ-AGENT"]
    elif drift == "delete-jump":
        table.chains["POSTROUTING"] = [r for r in table.chains["POSTROUTING"] if r[0] != jump]
    elif drift == "insert":
        table.chains["IP-MASQ-AGENT"].insert(0, ["-A IP-MASQ-AGENT -d 8.8.8.0/24 -j RETURN", 0])
    elif drift == "reorder":
        table.chains["IP-MASQ-AGENT"].reverse()
    elif drift == "duplicate-jump":
        table.chains["POSTROUTING"].append([jump, 0])
    foreign_before = foreign(fake)
    assert fake.save("iptables", "nat") != installed
    assert rec.reconcile().result is SyncResult.APPLIED
    assert fake.save("iptables", "nat") == installed
    assert foreign(fake) == foreign_before
    assert rec.reconcile().result is SyncResult.IN_SYNC


def test_bad_config_keeps_last_good_and_logs_once(fake: FakeIptables, caplog: pytest.LogCaptureFixture) -> None:
    rec = make(fake)
    rec.take_config(agent_config("nonMasqueradeCIDRs: [10.0.0.0/8]\n"))
    rec.reconcile()
    good = fake.save("iptables", "nat")
    caplog.set_level(logging.INFO, logger=LOG.name)
    for _ in range(5):
        rec.take_config(agent_config("nonMasqueradeCIDRs: [10.0.0.1/8]\n"))
        fake.table().chains["IP-MASQ-AGENT"] = []  # drift while the config is bad
        assert rec.reconcile().result is SyncResult.APPLIED
        assert fake.save("iptables", "nat") == good
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1
    assert "/etc/config/ip-masq-agent:1" in errors[0] and "10.0.0.1/8" in errors[0]
    assert not rec.ready
    rec.take_config(agent_config("nonMasqueradeCIDRs: [10.0.0.0/8]\n"))
    assert rec.ready


def test_starting_with_bad_config_touches_nothing_until_a_good_one(fake: FakeIptables) -> None:
    rec = make(fake)
    before = fake.save("iptables", "nat")
    rec.take_config(agent_config("resyncInterval: 0s\n"))
    assert rec.reconcile().result is SyncResult.NO_POLICY
    rec.take_config(ConfigError("cannot read: Permission denied", source="/etc/config/ip-masq-agent"))
    assert rec.reconcile().result is SyncResult.NO_POLICY
    assert fake.save("iptables", "nat") == before
    assert fake.writes == 0 and not rec.ready
    rec.take_config(agent_config("nonMasqueradeCIDRs: []\n"))
    assert rec.reconcile().result is SyncResult.APPLIED
    assert len(ours(fake)) == 2  # link-local RETURN and MASQUERADE


def test_missing_file_means_defaults(fake: FakeIptables) -> None:
    rec = make(fake)
    rec.take_config(ConfigInput(()))
    rec.reconcile()
    assert sum("-j RETURN" in r for r in ours(fake)) == 4  # link-local and the three RFC 1918 ranges


def test_changed_masq_chain_removes_the_old_chain_and_jump(fake: FakeIptables) -> None:
    old = make(fake, PolicyOptions(masq_chain="IP-MASQ"))
    old.take_config(ConfigInput(()))
    old.reconcile()
    new = make(fake, PolicyOptions())
    new.take_config(ConfigInput(()))
    assert new.reconcile().result is SyncResult.APPLIED
    assert "IP-MASQ" not in fake.table().chains
    jumps = [r for r in fake.table().rules("POSTROUTING") if "ip-masq-agent" in r]
    assert len(jumps) == 1 and jumps[0].endswith("-j IP-MASQ-AGENT")
    assert "KUBE-POSTROUTING" in fake.table().chains


def test_busy_lock_and_rejected_payload_are_retried(fake: FakeIptables, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOG.name)
    rec = make(fake)
    rec.take_config(ConfigInput(()))
    fake.lock_busy = True
    assert rec.reconcile().result is SyncResult.FAILED
    assert rec.reconcile().result is SyncResult.FAILED
    assert not rec.ready
    fake.lock_busy = False
    fake.reject = "172.16.0.0/12"
    assert rec.reconcile().result is SyncResult.FAILED
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 2  # once for the lock (not per retry), once for the rejection
    assert "xtables lock" in errors[0]
    assert "rejected payload line: -A IP-MASQ-AGENT" in errors[1] and "172.16.0.0/12" in errors[1]
    assert "simulated rejection" in errors[1]  # the tool's stderr
    fake.reject = None
    assert rec.reconcile().result is SyncResult.APPLIED
    assert rec.ready


def test_ipv6_is_managed_with_ip6tables(fake: FakeIptables) -> None:
    rec = make(fake, PolicyOptions(enable_ipv6=True))
    rec.take_config(agent_config("nonMasqueradeCIDRs: [10.0.0.0/8, 'fd00::/8']\n"))
    rec.reconcile()
    assert [r.split(" ")[3] for r in fake.table("ip6tables").rules("IP-MASQ-AGENT")[:2]] == ["fe80::/10", "fd00::/8"]
    assert rec.reconcile().result is SyncResult.IN_SYNC


def test_remove_all_removes_only_ours(fake: FakeIptables) -> None:
    rec = make(fake, PolicyOptions(enable_ipv6=True))
    rec.take_config(ConfigInput(()))
    rec.reconcile()
    rec.backend.remove_all()
    for tool in ("iptables", "ip6tables"):
        assert "IP-MASQ-AGENT" not in fake.table(tool).chains
        assert not [r for r in fake.table(tool).rules("POSTROUTING") if "ip-masq-agent" in r]
    assert foreign(fake)[1] == fake.table().rules("KUBE-POSTROUTING") != []
    writes = fake.writes
    rec.backend.remove_all()
    assert fake.writes == writes  # nothing of ours: nothing written


def test_variant_choice_follows_iptables_wrappers() -> None:
    hint = "*mangle\n:KUBE-IPTABLES-HINT - [0:0]\nCOMMIT\n"
    many = "*filter\n" + "-A INPUT -j ACCEPT\n" * 12 + "COMMIT\n"
    assert choose_variant(legacy_dump="", nft_dump="") is Variant.NFT
    assert choose_variant(legacy_dump=many, nft_dump="") is Variant.LEGACY
    assert choose_variant(legacy_dump=many, nft_dump=hint) is Variant.NFT
    assert choose_variant(legacy_dump=hint, nft_dump=many) is Variant.LEGACY


@pytest.mark.parametrize("inotify", [True, False], ids=["inotify", "polling"])
def test_loop_follows_kubelet_updates_and_stops_promptly(fake: FakeIptables, tmp_path: Path, inotify: bool,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    # What notices an update is the watcher, not the resync 60 s away (further than any wait below): with inotify an
    # event, proven by a poll made an hour long (a watch that fell back to polling would never see the update here);
    # without it, the poll every POLL_SECONDS
    if inotify:
        monkeypatch.setattr(ipmasq.agent.watch, "POLL_SECONDS", 3600.0)
    config_dir = tmp_path / "config"
    publish(str(config_dir), "nonMasqueradeCIDRs: [10.0.0.0/8]\nresyncInterval: 60s\n")
    rec = make(fake)
    agent = Agent(rec, LoopSettings(config_path=str(config_dir / "ip-masq-agent"), use_inotify=inotify), log=LOG)
    wakeup = Wakeup()
    thread = threading.Thread(target=agent.run, args=(wakeup,))
    thread.start()
    try:
        eventually(lambda: "IP-MASQ-AGENT" in fake.table().chains and len(ours(fake)) == 3, "the config installed")
        publish(str(config_dir), "nonMasqueradeCIDRs: [10.0.0.0/8, 100.64.0.0/10]\nresyncInterval: 60s\n")
        eventually(lambda: any("100.64.0.0/10" in r for r in ours(fake)), "the update enforced")
        fake.table().chains["IP-MASQ-AGENT"] = []
        wakeup.request_resync()  # SIGHUP
        eventually(lambda: len(ours(fake)) == 4, "the flushed chain repaired")
        publish(str(config_dir), None)  # the ConfigMap disappears: defaults
        eventually(lambda: any("172.16.0.0/12" in r for r in ours(fake)), "the defaults enforced")
    finally:
        wakeup.request_stop()
        thread.join(30)  # a condition wait, not a speed bound: the next resync is 60 s away, only the stop ends it
    assert not thread.is_alive()
    assert "IP-MASQ-AGENT" in fake.table().chains  # stopping leaves the rules


def test_loop_resyncs_on_timer_and_backs_off(fake: FakeIptables, tmp_path: Path) -> None:
    path = tmp_path / "ip-masq-agent"
    path.write_text("resyncInterval: 100ms\n")
    rec = make(fake)
    # Passes are counted where they start, so the test waits on passes, not on a window a busy machine can stretch.
    starts: list[tuple[float, int]] = []
    reconcile = rec.reconcile

    def counted_reconcile():  # type: ignore[no-untyped-def]
        starts.append((time.monotonic(), len(fake.calls)))
        return reconcile()

    rec.reconcile = counted_reconcile  # type: ignore[method-assign]
    agent = Agent(rec, LoopSettings(config_path=str(path), backoff_initial=0.02, backoff_max=0.1), log=LOG)
    wakeup = Wakeup()
    thread = threading.Thread(target=agent.run, args=(wakeup,))
    thread.start()
    try:
        eventually(lambda: "IP-MASQ-AGENT" in fake.table().chains and rec.ready, "installed and ready")
        first = len(starts)
        eventually(lambda: len(starts) >= first + 4, "four more passes")
        idle = starts[first:first + 4]
        reads = [later[1] - earlier[1] for earlier, later in itertools.pairwise(idle)]
        # an idle resync only reads: each family's nat table once (IPv6 too, for objects of ours left there)
        assert reads == [2, 2, 2], fake.calls[idle[0][1]:]
        assert set(fake.calls[idle[0][1]:idle[-1][1]]) == {("iptables-nft-save", "-t", "nat"),
                                                           ("ip6tables-nft-save", "-t", "nat")}
        gaps = [later[0] - earlier[0] for earlier, later in itertools.pairwise(idle)]
        assert min(gaps) >= 0.09  # the 100ms timer paces them: load can only stretch a gap, never shorten it
        fake.lock_busy = True
        del fake.table().chains["POSTROUTING"][-1]
        eventually(lambda: not rec.ready, "not ready while the lock is busy")
        fake.lock_busy = False
        eventually(lambda: rec.ready and any("IP-MASQ" in r for r in fake.table().rules("POSTROUTING")),
                   "the jump back and ready")
    finally:
        wakeup.request_stop()
        thread.join(5)


def test_policy_change_hook_gets_the_replaced_and_the_new_policy_only_on_a_change(fake: FakeIptables) -> None:
    calls: list[tuple[list[str], list[str]]] = []
    rec = make(fake)
    rec.on_policy_change = lambda before, after: calls.append(
        ([str(e.prefix) for e in before.config.non_masquerade], [str(e.prefix) for e in after.config.non_masquerade]))
    rec.take_config(agent_config("nonMasqueradeCIDRs: [10.0.0.0/8, 172.16.0.0/12]\n"))
    assert rec.reconcile().result is SyncResult.APPLIED
    assert calls == []  # the first install: what the kernel held before is not a policy of ours
    fake.restore("iptables", "*nat\n-F IP-MASQ-AGENT\nCOMMIT\n")  # drift, same policy: no conntrack flush
    assert rec.reconcile().result is SyncResult.APPLIED
    assert calls == []
    rec.take_config(agent_config("nonMasqueradeCIDRs: [10.0.0.0/8]\n"))
    assert rec.reconcile().result is SyncResult.APPLIED
    assert calls == [(["10.0.0.0/8", "172.16.0.0/12"], ["10.0.0.0/8"])]
    # bad: the last good policy stays, nothing flushed
    rec.take_config(agent_config("nonMasqueradeCIDRs: [10.0.0.0/8\n"))
    assert rec.reconcile().result is SyncResult.IN_SYNC
    assert len(calls) == 1


def test_each_pass_hands_out_its_facts_as_one_value(fake: FakeIptables) -> None:
    rec = make(fake)
    seen = rec.take_config(agent_config("nonMasqueradeCIDRs: [10.0.0.0/8]\nresyncInterval: 20s\n"))
    assert seen.changed and seen.config_error is None and seen.resync_interval == 20
    assert seen.readiness == ProbeVerdict(False, "not ready: the current config is not applied yet")
    assert rec.policy is not None and seen.policy_hash == policy_hash(rec.policy)
    installed = rec.reconcile()
    # the chain, its jump, link-local RETURN, 10/8 RETURN, MASQUERADE, the chain's ownership marker and its record;
    # counted as rules: all but the two chains and the marker's record
    assert installed == dataclasses.replace(
        installed, result=SyncResult.APPLIED, config_error=None, backend_error=None, drift_repair=False,
        writes=(FamilyWrite(Family.V4, added=7, removed=0, installed=True),), removed_leftovers=(),
        policy_hash=seen.policy_hash, objects=(ObjectCount(Family.V4, rules=4, set_elements=0),),
        resync_interval=20.0, readiness=ProbeVerdict(True, "ready: the kernel matches the current config"))
    assert rec.take_config(agent_config("nonMasqueradeCIDRs: [10.0.0.0/8]\nresyncInterval: 20s\n")).changed is False
    idle = rec.reconcile()
    assert (idle.result, idle.writes, idle.drift_repair, idle.objects) == (SyncResult.IN_SYNC, (), False,
                                                                           installed.objects)
    fake.table().chains["IP-MASQ-AGENT"] = []  # someone flushes our chain: the same config, so a drift repair
    drift = rec.reconcile()
    assert (drift.result, drift.drift_repair) == (SyncResult.APPLIED, True)
    assert drift.writes == (FamilyWrite(Family.V4, added=3, removed=0, installed=False),)
    with pytest.raises(dataclasses.FrozenInstanceError):
        drift.result = SyncResult.FAILED  # type: ignore[misc]


def test_a_bad_config_and_a_failing_backend_are_in_the_report(fake: FakeIptables) -> None:
    rec = make(fake)
    rec.take_config(agent_config("nonMasqueradeCIDRs: [10.0.0.0/8]\n"))
    good = rec.reconcile()
    bad = rec.take_config(agent_config("nonMasqueradeCIDRs: [10.0.0.1/8]\n"))
    assert bad.changed and bad.config_error is not None and bad.config_error.startswith("/etc/config/ip-masq-agent:1")
    assert bad.policy_hash == good.policy_hash  # the last good policy is still the one enforced
    kept = rec.reconcile()
    assert kept.result is SyncResult.IN_SYNC and kept.config_error == bad.config_error
    assert not kept.readiness.ok and kept.readiness.why == f"not ready: config error: {bad.config_error}"
    rec.take_config(agent_config("nonMasqueradeCIDRs: [10.0.0.0/8, 192.168.0.0/16]\n"))
    fake.lock_busy = True
    failed = rec.reconcile()
    assert failed.result is SyncResult.FAILED and failed.backend_error is not None
    assert "xtables lock" in failed.backend_error and failed.readiness.why.startswith("not ready: iptables (nft): ")
    assert failed.objects == good.objects and failed.writes == ()  # still what the kernel was verified to hold
    assert failed.policy_hash != good.policy_hash
    fake.lock_busy = False
    applied = rec.reconcile()
    assert applied.result is SyncResult.APPLIED and not applied.drift_repair  # a config change, not drift
    assert applied.objects == (ObjectCount(Family.V4, rules=5, set_elements=0),) and applied.readiness.ok
