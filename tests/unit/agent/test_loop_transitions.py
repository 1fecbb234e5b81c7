"""Transitions the agent must survive without lying: a loop that stops completing passes (readiness goes stale), an
unexpected exception (the loop goes on), a second agent on the node (it waits for the node lock), a metrics port
still held by the agent being replaced (retried), and `check` naming our objects in the other variant."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import threading
from pathlib import Path

import pytest

from ipmasq.agent.health import EndpointServer, query
from ipmasq.agent.loop import Agent, LoopSettings, Wakeup, wait_for_node_lock
from ipmasq.agent.metrics import READINESS_GRACE_SECONDS, AgentVitals
from ipmasq.agent.nodelock import NodeLock, default_lock_path
from ipmasq.agent.reconcile import Reconciler
from ipmasq.backends.base import Adopt
from ipmasq.backends.iptables import IptablesBackend, Variant
from ipmasq.diagnose.leftovers import OTHER_VARIANT_RULES, leftover_findings, read_leftovers
from ipmasq.errors import IpmasqError
from ipmasq.findings import Severity
from ipmasq.options import PolicyOptions
from ipmasq.policy.policy import Policy
from ipmasq.prefix import Family
from ipmasq.testing import FakeIptables
from tests.clock import Clock
from tests.configs import agent_config
from tests.conftest import PYTHON
from tests.eventually import eventually
from tests.unit.backends.test_choose_switch import Node, iptables_pass

LOG = logging.getLogger("test.agent.transitions")


def test_readiness_goes_stale_when_no_pass_completes() -> None:
    clock = Clock()
    fake = FakeIptables()
    rec = Reconciler(IptablesBackend(fake, chain="IP-MASQ-AGENT", variant=Variant.NFT), PolicyOptions(), log=LOG)
    status = AgentVitals(version="9.9", backend="iptables", clock=clock)
    status.took_config(rec.take_config(agent_config("resyncInterval: 10s\n")))
    status.reconciled(rec.reconcile(), 0.01)
    assert status.readiness().ok and status.snapshot().ready
    clock.now += 2 * 10 + READINESS_GRACE_SECONDS  # at the limit: still the last pass's word
    status.heartbeat()  # a loop that beats but completes no pass (a wedged tool) is alive and not ready
    assert status.readiness().ok
    clock.now += 1
    ready = status.readiness()
    assert not ready.ok and ready.why == ("not ready: stale: the loop's last completed pass was 81s ago "
                                          "(limit 80s; resync every 10s)")
    assert not status.snapshot().ready and status.liveness().ok
    status.reconciled(rec.reconcile(), 0.01)
    assert status.readiness().ok


class Flaky:
    """A backend whose read raises what no code path expects, until `healed` is set."""

    def __init__(self, inner: IptablesBackend) -> None:
        self.inner = inner
        self.healed = threading.Event()

    @property
    def name(self) -> str:
        return self.inner.name

    def read(self, family: Family, *, adopt: Adopt = Adopt.CONFIGURED) -> object:
        if not self.healed.is_set():
            raise KeyError("a field no parser expected")
        return self.inner.read(family, adopt=adopt)

    def desired(self, policy: Policy, family: Family) -> object:
        return self.inner.desired(policy, family)

    def apply(self, policy: Policy, family: Family, current: object) -> None:
        self.inner.apply(policy, family, current)  # type: ignore[arg-type]

    def remove_all(self, *, adopt: Adopt = Adopt.NONE) -> object:
        return self.inner.remove_all(adopt=adopt)


def test_an_unexpected_exception_never_ends_the_loop(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "ip-masq-agent"
    path.write_text("resyncInterval: 20ms\n")
    fake = FakeIptables()
    flaky = Flaky(IptablesBackend(fake, chain="IP-MASQ-AGENT", variant=Variant.NFT))
    rec = Reconciler(flaky, PolicyOptions(), log=LOG)  # type: ignore[arg-type]
    status = AgentVitals(version="9.9", backend="iptables")
    agent = Agent(rec, LoopSettings(config_path=str(path), backoff_initial=0.01), log=LOG, listener=status)
    wakeup = Wakeup()
    thread = threading.Thread(target=agent.run, args=(wakeup,))
    with caplog.at_level(logging.INFO):
        thread.start()
        try:
            eventually(lambda: status.snapshot().loop_errors >= 4, "four errors, retried with backoff, each counted")
            assert thread.is_alive() and status.liveness().ok
            ready = status.readiness()
            assert not ready.ok and ready.why == ("not ready: unexpected error in the agent loop: KeyError: 'a field "
                                                  "no parser expected'")
            assert not status.snapshot().ready
            flaky.healed.set()
            eventually(lambda: status.snapshot().syncs["applied"] == 1, "one pass applied once healed")
            eventually(lambda: status.readiness().ok, "ready once healed")
        finally:
            wakeup.request_stop()
            thread.join(5)
    assert not thread.is_alive()
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    # once for all its occurrences, one line, no traceback
    assert [r.getMessage() for r in errors] == [
        "unexpected error in the agent loop: KeyError: 'a field no parser expected' (not ready; will retry)"]
    assert errors[0].exc_info is None
    assert "ip-masq-agent" in fake.save("iptables", "nat")


def test_a_second_agent_waits_for_the_node_lock_and_takes_over(tmp_path: Path,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    path = str(tmp_path / "run" / "agent.lock")
    first = NodeLock(path)
    assert first.try_acquire() and first.held
    second = NodeLock(path)
    polls: list[int | None] = []  # each time the waiting agent looked for the holder: once per poll
    holder = second.holder
    second.holder = lambda: polls.append(holder()) or polls[-1]  # type: ignore[method-assign]
    status = AgentVitals(version="9.9", backend="")
    wakeup = Wakeup()
    got: list[bool] = []
    with caplog.at_level(logging.INFO):
        thread = threading.Thread(target=lambda: got.append(wait_for_node_lock(second, wakeup, log=LOG,
                                                                              listener=status, poll=0.01)))
        thread.start()
        eventually(lambda: "waiting" in status.readiness().why, "not ready: waiting for the node lock")
        ready = status.readiness()
        assert not ready.ok and ready.why.startswith(f"not ready: waiting for the node lock held by pid {os.getpid()}")
        assert status.liveness().ok
        eventually(lambda: len(polls) >= 10, "ten polls of the held lock")  # many polls: logged once
        first.close()  # the first agent exits
        thread.join(5)
    assert got == [True] and second.held
    assert Path(path).read_text() == f"{os.getpid()}\n"
    messages = [r.getMessage() for r in caplog.records]
    assert sum("waiting for the node lock" in m for m in messages) == 1
    assert sum("took the node lock" in m for m in messages) == 1
    # a third one is stopped while it waits: it never held the lock
    third, stop = NodeLock(path), Wakeup()
    stop.request_stop()
    assert wait_for_node_lock(third, stop, log=LOG) is False and not third.held
    second.close()


def test_the_kernel_releases_the_node_lock_of_a_killed_agent(tmp_path: Path) -> None:
    path = str(tmp_path / "agent.lock")
    holder = subprocess.Popen([PYTHON, "-c", "import sys, time\nfrom ipmasq.agent.nodelock import NodeLock\n"
                               f"assert NodeLock({path!r}).try_acquire()\nprint('held', flush=True)\ntime.sleep(60)\n"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        lock = NodeLock(path)
        assert not lock.try_acquire() and lock.holder() == holder.pid
        holder.send_signal(signal.SIGKILL)
        holder.wait(5)
        assert lock.try_acquire()
        lock.close()
    finally:
        holder.kill()
        holder.wait()


def test_the_default_lock_is_one_per_network_namespace() -> None:
    inode = os.stat("/proc/self/ns/net").st_ino
    assert default_lock_path() == f"/run/ip-masq-agent/agent-netns-{inode}.lock"
    assert default_lock_path("/tmp/x") == f"/tmp/x/agent-netns-{inode}.lock"


def test_an_unusable_lock_file_is_one_line() -> None:
    with pytest.raises(IpmasqError, match=r"^cannot open the node lock /proc/nope/agent.lock \(--lock-file\): "):
        NodeLock("/proc/nope/agent.lock").try_acquire()


def test_a_metrics_port_in_use_is_retried_until_free(caplog: pytest.LogCaptureFixture) -> None:
    held = socket.socket()
    held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    held.bind(("127.0.0.1", 0))
    held.listen()
    address = f"127.0.0.1:{held.getsockname()[1]}"
    status = AgentVitals(version="9.9", backend="iptables")
    with pytest.raises(IpmasqError, match="cannot listen on"):
        EndpointServer(status, address).start()  # without waiting: one clear error, as before
    server = EndpointServer(status, address)
    with caplog.at_level(logging.INFO):
        server.start(wait_if_in_use=True, log=LOG)
        try:
            assert not server.serving
            held.close()  # the old agent exits
            eventually(lambda: server.serving, "the freed port bound")
            answer = query(address, "/healthz")
            assert answer.ok and answer.why.startswith("alive")
        finally:
            server.stop()
    messages = [r.getMessage() for r in caplog.records]
    assert sum("cannot listen on" in m for m in messages) == 1
    assert sum("serving /metrics" in m for m in messages) == 1


def test_a_metrics_server_stopped_while_it_waits_exits_at_once() -> None:
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    try:
        server = EndpointServer(AgentVitals(version="9.9", backend=""), f"127.0.0.1:{held.getsockname()[1]}")
        server.start(wait_if_in_use=True)
        stopper = threading.Thread(target=server.stop)
        stopper.start()
        stopper.join(30)  # a condition wait: the port is still held, so only stop() can end the wait for it
        assert not stopper.is_alive() and not server.serving
        with pytest.raises(OSError):  # stop() ended the wait while the port was still held: not the port freeing up
            socket.create_server(held.getsockname())
    finally:
        held.close()


def test_check_names_our_objects_in_the_other_variant() -> None:
    node = Node()
    iptables_pass(node, variant=Variant.LEGACY)
    iptables_pass(node, variant=Variant.NFT)
    assert read_leftovers(node, PolicyOptions(), "nftables") == ("iptables (legacy)", "iptables (nft)")
    places = read_leftovers(node, PolicyOptions(), "iptables")  # the node's variant: nft (a tie goes to nft)
    assert places == ("iptables (legacy)",)
    (finding,) = leftover_findings(places, "iptables")
    assert finding.id == OTHER_VARIANT_RULES and finding.severity is Severity.ERROR
    assert "our objects are also in iptables (legacy)" in finding.message
    node.missing = {"iptables-legacy-save", "ip6tables-legacy-save", "nft"}
    assert read_leftovers(node, PolicyOptions(), "iptables") == ()  # missing tools hold nothing
    assert leftover_findings((), "iptables") == ()
