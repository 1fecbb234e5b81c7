"""The idle pass's fast path: no read while the kernel's fingerprint equals the one taken before a matching read.

The fingerprint here is ipmasq.testing.FakeFingerprint over the fake iptables: it moves with every write the fake
takes, as the real one (ipmasq.backends.generation.KernelFingerprint) does with any write by anyone, which the kernel
tests prove.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from ipmasq.agent.reconcile import FOREIGN_RECOUNT_PASSES, Reconciler
from ipmasq.agent.reports import SyncResult
from ipmasq.backends.iptables import IptablesBackend, Variant
from ipmasq.config import ConfigInput
from ipmasq.options import PolicyOptions
from ipmasq.testing import FakeFingerprint, FakeIptables
from tests.conftest import ROOT

LOG = logging.getLogger("test.fast_path")
CONFIG = ConfigInput((("/etc/config/ip-masq-agent", b"nonMasqueradeCIDRs: [10.0.0.0/8, 172.30.0.0/16]\n"),))


class Node:
    """The fake kernel and its fingerprint: every restore moves it, ours and `someone_wrote`'s."""

    def __init__(self) -> None:
        self.fake = FakeIptables()
        self.fingerprint = FakeFingerprint(self.fake)
        self.foreign_counts = 0

    def someone_wrote(self, restore: str) -> None:
        assert self.fake.restore("iptables", restore).returncode == 0

    def count_foreign(self) -> int:
        self.foreign_counts += 1
        return 0

    def reads(self) -> int:
        return sum(1 for call in self.fake.calls if call[0].endswith("-save"))


def reconciler(node: Node) -> Reconciler:
    backend = IptablesBackend(node.fake, chain="IP-MASQ-AGENT", variant=Variant.NFT)
    rec = Reconciler(backend, PolicyOptions(), log=LOG, fingerprint=node.fingerprint,
                     count_foreign=node.count_foreign)
    rec.take_config(CONFIG)
    return rec


def test_idle_passes_read_nothing_once_a_full_read_matched() -> None:
    node = Node()
    rec = reconciler(node)
    assert rec.reconcile().result is SyncResult.APPLIED
    # our own write changed the fingerprint: the next pass reads everything, finds it matching, keeps it
    before = node.reads()
    assert rec.reconcile().result is SyncResult.IN_SYNC
    assert node.reads() > before
    before, counts = node.reads(), node.foreign_counts
    for _ in range(25):  # more than FOREIGN_RECOUNT_PASSES: the foreign count is not redone either
        report = rec.reconcile()
        assert report.result is SyncResult.IN_SYNC
        assert report.readiness.ok
    assert node.reads() == before
    assert node.foreign_counts == counts
    assert not node.fake.calls[-1][0].endswith("-restore")


def test_a_change_by_another_program_is_read_and_repaired() -> None:
    node = Node()
    rec = reconciler(node)
    rec.reconcile()
    rec.reconcile()
    wanted = node.fake.table().rules("IP-MASQ-AGENT")
    node.someone_wrote("*nat\n-F IP-MASQ-AGENT\nCOMMIT\n")
    before = node.reads()
    report = rec.reconcile()
    assert report.result is SyncResult.APPLIED
    assert report.drift_repair
    assert node.reads() > before
    assert node.fake.table().rules("IP-MASQ-AGENT") == wanted
    # and a foreign rule added, with ours untouched: read (the fingerprint moved), nothing to write, counted again
    counts = node.foreign_counts
    rec.reconcile()  # reads back after the repair
    node.someone_wrote("*nat\n:KUBE-POSTROUTING - [0:0]\n-A POSTROUTING -j KUBE-POSTROUTING\nCOMMIT\n")
    before = node.reads()
    assert rec.reconcile().result is SyncResult.IN_SYNC
    assert node.reads() > before
    # recounted within FOREIGN_RECOUNT_PASSES passes, as without a fingerprint; then no more while nothing changes
    for _ in range(FOREIGN_RECOUNT_PASSES):
        rec.reconcile()
    assert node.foreign_counts == counts + 1
    for _ in range(2 * FOREIGN_RECOUNT_PASSES):
        rec.reconcile()
    assert node.foreign_counts == counts + 1


def test_no_fingerprint_means_every_pass_reads() -> None:
    node = Node()
    node.fingerprint.readable = False
    rec = reconciler(node)
    rec.reconcile()
    for _ in range(3):
        before = node.reads()
        assert rec.reconcile().result is SyncResult.IN_SYNC
        assert node.reads() > before


def test_a_new_config_is_read_and_written_whatever_the_fingerprint() -> None:
    node = Node()
    rec = reconciler(node)
    rec.reconcile()
    rec.reconcile()
    rec.take_config(ConfigInput((("/etc/config/ip-masq-agent", b"nonMasqueradeCIDRs: [10.0.0.0/8]\n"),)))
    assert rec.reconcile().result is SyncResult.APPLIED
    assert not any("172.30.0.0/16" in rule for rule in node.fake.table().rules("IP-MASQ-AGENT"))


def test_fingerprint_that_raises_means_a_full_read() -> None:
    node = Node()
    rec = reconciler(node)
    rec.reconcile()
    rec.reconcile()

    def broken() -> tuple[int, int]:
        raise OSError("netlink went away")

    rec.fingerprint = broken
    before = node.reads()
    assert rec.reconcile().result is SyncResult.IN_SYNC
    assert node.reads() > before


def test_sigterm_while_parsing_a_large_config_exits_at_once(tmp_path: Path) -> None:
    """The loop is in the middle of parsing 100,000 CIDRs (seconds) when SIGTERM comes: the parse is abandoned where
    it is (no config is loaded, no policy built), the process exits 0, and the backend was never
    called (a fake that fails any call)."""
    config = tmp_path / "config"
    config.mkdir()
    cidrs = [f"{20 + (2 * i >> 16)}.{(2 * i >> 8) & 255}.{2 * i & 255}.0/24" for i in range(100_000)]
    for part in range(2):
        chunk = cidrs[part * 50_000:(part + 1) * 50_000]
        head = "cidrLimit: 100000\n" if part == 0 else ""
        body = "nonMasqueradeCIDRs:\n" + "".join(f"- {c}\n" for c in chunk)
        (config / f"ip-masq-agent-{part}").write_text(head + body)
    script = textwrap.dedent(f"""
        import logging, signal, sys
        from ipmasq.agent.loop import Agent, LoopSettings, Wakeup
        from ipmasq.agent.reconcile import Reconciler
        from ipmasq.backends.iptables import IptablesBackend, Variant
        from ipmasq.config.source import config_from_bytes
        from ipmasq.options import PolicyOptions

        def no_kernel(argv, stdin=None):
            raise AssertionError("the backend was called")

        def load(config_input, options):  # the agent's loader, saying when it begins
            print("parsing", flush=True)
            return config_from_bytes(config_input, options)

        logging.basicConfig(stream=sys.stderr, level=logging.INFO)
        wakeup = Wakeup()
        signal.signal(signal.SIGTERM, lambda *_: wakeup.request_stop())
        rec = Reconciler(IptablesBackend(no_kernel, chain="IP-MASQ-AGENT", variant=Variant.NFT), PolicyOptions(),
                         log=logging.getLogger("agent"), load=load)
        agent = Agent(rec, LoopSettings(config_path={str(config)!r}, use_inotify=False), log=logging.getLogger("agent"))
        print("looping", flush=True)
        agent.run(wakeup)
        print("stopped, no policy" if rec.policy is None else "stopped with a policy", flush=True)
    """)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)
    assert proc.stdout is not None
    assert proc.stdout.readline() == "looping\n"
    assert proc.stdout.readline() == "parsing\n"  # the parse of 100,000 CIDRs has begun (it takes over a second)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)  # a condition wait, not a bound on speed
    assert "config loaded" not in err, "the signal came after the parse: the test proves nothing"
    assert proc.returncode == 0, err
    assert out == "stopped, no policy\n"  # the parse was cut off where it was: it never produced a policy
