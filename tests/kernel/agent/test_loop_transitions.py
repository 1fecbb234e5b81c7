"""Transitions on real netfilter, real TCP, the source the peer saw: a node moved to the other iptables variant, a
backend switch under continuous connections, SIGKILL in the middle of a switch, and two agents overlapping during a
rolling update. In every one the node must never be without rules nor masquerade by a config it no longer has."""

from __future__ import annotations

import random
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ipmasq.lab.kubelet import publish
from ipmasq.lab.netns import Namespace, Network, stop_process
from ipmasq.netfilter.iptables import render_restore
from ipmasq.prefix import Family
from tests.configs import policy_of
from tests.eventually import eventually
from tests.kernel.agent_harness import AWS_DB, NODE, ONPREM, POD, PORT, AgentProcess, agent, more_passes, world
from tests.kernel.flavors import nft_table

GOOGLE_DNS = "8.8.8.8"  # a public destination on the peer: masqueraded by default, kept by the fixed config
OLD = "nonMasqueradeCIDRs: [10.0.0.0/8]\nresyncInterval: 100ms\n"
NEW = "nonMasqueradeCIDRs: [10.0.0.0/8, 8.8.8.0/24]\nresyncInterval: 100ms\n"


def ours_in(node: Namespace, tool: str) -> list[str]:
    """Our lines in one variant's nat table, e.g. tool `iptables-legacy-save`."""
    return [line for line in node.run([tool, "-t", "nat"]).stdout.splitlines() if "ip-masq-agent" in line]


def plant(node: Namespace, config: Path, variant: str = "legacy") -> None:
    """What an agent of one variant left: its transaction (render's rules and the chain's ownership marker),
    restored into iptables-VARIANT."""
    rules = render_restore(policy_of(config.read_text()), Family.V4, with_marker=True)
    node.run([f"iptables-{variant}-restore", "--noflush"], stdin=rules)


def health(node: Namespace, address: str = "127.0.0.1:9847") -> tuple[int, str]:
    result = node.run([sys.executable, "-m", "ipmasq", "health", f"--address={address}"], check=False)
    return result.returncode, (result.stdout + result.stderr).strip()


def test_a_node_moved_to_the_nft_variant_loses_the_legacy_chain(net: Network, tmp_path: Path) -> None:
    old, new = tmp_path / "old.yaml", tmp_path / "ip-masq-agent"
    old.write_text(OLD)
    new.write_text(NEW)
    with world(net) as w:
        w.peer.run(["ip", "addr", "add", f"{GOOGLE_DNS}/32", "dev", "lo"])
        plant(w.node, old)
        plant(w.node, new, "nft")
        # the new config is in the nft variant, the old chain still in legacy: its masquerade of 8.8.8.0/24 wins
        assert w.seen(GOOGLE_DNS) == NODE
        check = w.node.run([sys.executable, "-m", "ipmasq", "check", f"--config={new}"], check=False)
        assert check.returncode == 1 and "other-variant-rules" in check.stdout, check.stdout
        with agent(w.node, tmp_path / "agent.log", f"--config={new}", "--backend=iptables",
                   "--iptables-variant=nft") as running:
            eventually(lambda: not ours_in(w.node, "iptables-legacy-save"),
                       lambda: f"the legacy chain removed\n{running.log}")
            assert any("8.8.8.0/24" in line for line in ours_in(w.node, "iptables-nft-save"))
            assert w.seen(GOOGLE_DNS) == POD and w.seen(AWS_DB) == NODE and w.seen(ONPREM) == POD
            eventually(lambda: health(w.node)[0] == 0, lambda: f"ready\n{health(w.node)}")
            check = w.node.run([sys.executable, "-m", "ipmasq", "check", f"--config={new}"], check=False)
            assert "other-variant-rules" not in check.stdout, check.stdout
            # an old agent of the legacy variant writes its chain again: the next pass removes it again
            plant(w.node, old)
            eventually(lambda: not ours_in(w.node, "iptables-legacy-save"),
                       lambda: f"the planted legacy chain removed again\n{running.log}")
            assert w.seen(GOOGLE_DNS) == POD
            assert len(running.lines("removed the objects of iptables (legacy)")) == 2
            assert not running.lines("ERROR")


CLIENT = """
import os, sys, time
from ipmasq.lab.probe import connect
stop, targets = sys.argv[1], sys.argv[2:]
while not os.path.exists(stop):
    for target in targets:
        print(target, connect(target, {port}, 3.0) or "FAILED", flush=True)
"""


@contextmanager
def client_loop(pod: Namespace, stop: Path, *targets: str) -> Iterator[list[str]]:
    """TCP connects from the pod, one after another, until the `with` ends; yields the lines `TARGET SEEN`."""
    lines: list[str] = []
    proc = pod.popen([sys.executable, "-c", CLIENT.format(port=PORT), str(stop), *targets], stdout=subprocess.PIPE,
                     stderr=subprocess.DEVNULL)
    try:
        yield lines
    finally:
        stop.touch()
        out, _ = proc.communicate(timeout=10)
        lines.extend(out.splitlines())


def test_switching_backends_under_continuous_connections_never_shows_a_wrong_source(net: Network,
                                                                                    tmp_path: Path) -> None:
    config = tmp_path / "ip-masq-agent"
    config.write_text(NEW)
    with world(net) as w:
        w.peer.sysctl("net.ipv4.tcp_max_tw_buckets", "0")  # a reused NATed port never meets a TIME_WAIT
        once = [sys.executable, "-m", "ipmasq", "agent", "--once", f"--config={config}"]
        w.node.run([*once, "--backend=iptables"])
        switches = []
        with client_loop(w.pod, tmp_path / "stop", AWS_DB, ONPREM) as lines:
            for backend in ("nftables", "iptables", "nftables", "iptables", "nftables"):
                result = w.node.run([*once, f"--backend={backend}"])
                switches.append(result.stderr)
        expected = {AWS_DB: NODE, ONPREM: POD}
        wrong = [line for line in lines if line.split()[1] != expected[line.split()[0]]]
        assert len(lines) > 20 and not wrong, wrong
        assert all("removed the objects of" in s for s in switches), switches
        assert nft_table(w.node) and not ours_in(w.node, "iptables-save")


def test_sigkill_during_backend_switches_never_leaves_the_node_without_rules(net: Network, tmp_path: Path) -> None:
    config = tmp_path / "ip-masq-agent"
    config.write_text(NEW)
    rng = random.Random(20)
    with world(net) as w:
        w.node.run([sys.executable, "-m", "ipmasq", "agent", "--once", f"--config={config}", "--backend=iptables"])
        killed_after: list[str] = []
        for attempt in range(16):
            backend = ("nftables", "iptables")[attempt % 2]
            proc = w.node.popen([sys.executable, "-m", "ipmasq", "agent", f"--config={config}", f"--backend={backend}",
                                 "--metrics-address="], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            assert proc.stderr is not None
            # kill somewhere around the switch: after the agent read its config, before or after it wrote
            lines: list[str] = []
            while not any("config loaded" in line for line in lines):
                line = proc.stderr.readline()
                assert line, "".join(lines)
                lines.append(line)
            time.sleep(rng.uniform(0.0, 0.08))  # the kill's moment, drawn at random (not a wait for anything)
            proc.kill()
            proc.wait()
            proc.stderr.close()
            iptables = ours_in(w.node, "iptables-save")
            table = nft_table(w.node)
            assert iptables or table, f"no rules after a kill during a switch to {backend}"
            if iptables:  # never half an iptables install: the chain comes with its jump and its rules
                assert any(line.startswith("-A POSTROUTING") for line in iptables) and len(iptables) >= 4
            killed_after.append("both" if iptables and table else "iptables" if iptables else "nftables")
        # the kills did fall in different places of the switch
        assert len(set(killed_after)) >= 2, killed_after
        assert w.seen(AWS_DB) == NODE and w.seen(ONPREM) == POD


def test_two_agents_overlapping_never_fight_and_the_second_takes_over(net: Network, tmp_path: Path) -> None:
    config_dir = tmp_path / "config"
    publish(str(config_dir), OLD)
    path = f"--config={config_dir}/ip-masq-agent"
    with world(net) as w:
        w.peer.run(["ip", "addr", "add", f"{GOOGLE_DNS}/32", "dev", "lo"])
        with agent(w.node, tmp_path / "old.log", path, "--backend=nftables") as old:
            eventually(lambda: old.lines("applied IPv4"), lambda: f"the old agent's first write\n{old.log}")
            log = (tmp_path / "new.log").open("w")
            proc = w.node.popen([sys.executable, "-m", "ipmasq", "agent", path, "--backend=iptables",
                                 "--metrics-address=127.0.0.1:9848"], stdout=log, stderr=subprocess.STDOUT)
            new = AgentProcess(proc, tmp_path / "new.log")
            try:
                eventually(lambda: new.lines("waiting for the node lock"),
                           lambda: f"the new agent waiting for the node lock\n{new.log}")
                eventually(lambda: health(w.node, "127.0.0.1:9848")[0] == 1, "the new agent not ready")
                _, why = health(w.node, "127.0.0.1:9848")
                assert "waiting for the node lock held by pid" in why, why
                live = w.node.run([sys.executable, "-m", "ipmasq", "health", "--live", "--address=127.0.0.1:9848"],
                                  check=False)
                assert live.returncode == 0, live.stdout
                # a config change while both run: only the holder writes it
                publish(str(config_dir), NEW)
                eventually(lambda: len(old.lines("applied IPv4")) == 2,
                           lambda: f"the change written by the old agent\n{old.log}")
                assert w.seen(GOOGLE_DNS) == POD
                assert not ours_in(w.node, "iptables-save") and not new.lines("applied")
                handles = nft_table(w.node, handles=True)
                more_passes(w.node, 3)  # three of the old agent's resyncs: nobody rewrites anything
                assert nft_table(w.node, handles=True) == handles
                old.stop()  # the rolling update ends the old pod: its table stays (SIGTERM keeps rules) ...
                # ... until the new agent, which takes the lock at once, removes it: its log says it found it there
                eventually(lambda: new.lines("removed the objects of nftables"),
                           lambda: f"the new agent removing the old agent's table\n{new.log}")
                assert not nft_table(w.node) and ours_in(w.node, "iptables-save")
                assert w.seen(GOOGLE_DNS) == POD and w.seen(AWS_DB) == NODE
                eventually(lambda: health(w.node, "127.0.0.1:9848")[0] == 0, "the new agent ready")
                # the new agent owns the node now: a later change is its to write
                publish(str(config_dir), OLD)
                # the kernel changes before the agent logs it: wait for both
                eventually(lambda: w.seen(GOOGLE_DNS) == NODE and len(new.lines("applied IPv4")) == 2,
                           lambda: f"the new agent's write, in the kernel and its log\n{new.log}")
                took, applied = new.lines("took the node lock"), new.lines("applied IPv4")
                assert len(took) == 1 and len(applied) == 2
                assert new.log.index(took[0]) < new.log.index(applied[0])  # nothing written before the lock
            finally:
                stop_process(proc)
                log.close()
        assert not new.lines("ERROR") and not old.lines("ERROR")
