"""The agent on real netfilter, once per backend: real TCP through pod -> node -> peer, and the source address the
peer really saw. Tests of one backend's own machinery (chain renames, the xtables lock) run for that backend only."""

from __future__ import annotations

import fcntl
import os
import sys
from pathlib import Path

import pytest

from ipmasq.lab.kubelet import publish
from ipmasq.lab.netns import Network
from tests.kernel.agent_harness import (
    AWS_DB,
    NODE,
    NODE6,
    ONPREM,
    PEER6_FAR,
    PEER6_GW,
    POD,
    POD6,
    agent,
    foreign,
    ours,
    wait_until,
    world,
)
from tests.kernel.flavors import FLAVORS, Flavor

GKE = ("--masq-chain=IP-MASQ", "--nomasq-all-reserved-ranges", "--random-fully=false")
FOREIGN = (
    "*nat\n:KUBE-POSTROUTING - [0:0]\n"
    '-A POSTROUTING -m comment --comment "kubernetes postrouting rules" -j KUBE-POSTROUTING\n'
    "-A KUBE-POSTROUTING -m mark ! --mark 0x4000/0x4000 -j RETURN\n"
    "-A KUBE-POSTROUTING -j MARK --xor-mark 0x4000\nCOMMIT\n"
)
# what each backend's table holds once the default policy is applied (iptables: jump, chain, 3 rules)
COMPLETE = {"iptables": 5, "nftables": 15}

backends = pytest.mark.parametrize("flavor", FLAVORS, ids=str)


@backends
def test_gke_upgrade_outage_then_fixed_by_a_kubelet_update_while_running(net: Network, tmp_path: Path,
                                                                      flavor: Flavor) -> None:
    config_dir = tmp_path / "config"
    config_dir.mkdir()  # the ConfigMap volume, with no ConfigMap yet: GKE's defaults
    with world(net) as w:
        with agent(w.node, tmp_path / "agent.log", f"--config={config_dir}/ip-masq-agent", *GKE, "-v=2",
                   "-logtostderr", flavor.flag) as running:
            assert wait_until(lambda: "172.16.0.0/12" in flavor.dump(w.node))
            # the outage: 172.30.0.0/16 is inside the default 172.16.0.0/12, so the AWS side sees the pod IP
            assert w.seen(AWS_DB) == POD
            publish(str(config_dir), "nonMasqueradeCIDRs:\n  - 10.0.0.0/8\nresyncInterval: 60s\n")
            assert wait_until(lambda: "172.16.0.0/12" not in flavor.dump(w.node), 2), running.log
            assert w.seen(AWS_DB) == NODE
            assert w.seen(ONPREM) == POD  # still inside 10.0.0.0/8
            took = running.stop()
            assert took < 1.0
            assert running.proc.returncode == 0
        # stopping left the rules: traffic keeps its behaviour while the agent is being upgraded
        assert w.seen(AWS_DB) == NODE
    assert len(running.lines("applied IPv4")) == 2
    assert len(running.lines(f"agent started: backend {flavor.backend}")) == 1


@backends
def test_drift_is_repaired_idle_writes_nothing_and_foreign_rules_are_untouched(net: Network, tmp_path: Path,
                                                                               flavor: Flavor) -> None:
    path = tmp_path / "ip-masq-agent"
    path.write_text("nonMasqueradeCIDRs: [10.0.0.0/8]\nresyncInterval: 100ms\n")
    with world(net) as w:
        w.node.run(["iptables-restore", "--noflush"], stdin=FOREIGN)
        with agent(w.node, tmp_path / "agent.log", f"--config={path}", flavor.flag) as running:
            assert wait_until(lambda: len(flavor.ours(w.node)) == COMPLETE[flavor.backend])
            good, foreign_before = flavor.ours(w.node), flavor.foreign(w.node)
            assert w.seen(AWS_DB) == NODE and w.seen(ONPREM) == POD
            if flavor.backend == "iptables":  # a rewrite would zero the counters: they must keep counting
                counted = [line for line in w.nat(counters=True).splitlines() if "-j MASQUERADE" in line]
                assert counted and not counted[0].startswith("[0:0]")
            fingerprint = flavor.fingerprint(w.node)
            wait_until(lambda: False, 1.0)  # ~10 idle resyncs
            assert flavor.fingerprint(w.node) == fingerprint  # same counters / same handles: nothing rewritten
            assert len(running.lines("applied")) == 1  # nothing written while idle
            drifts = flavor.drifts(good)
            for done, (name, commands) in enumerate(drifts.items(), start=2):
                for argv in commands:
                    w.node.run(argv)
                # the agent may repair before we can look: count its repairs instead of catching the drift
                repaired = wait_until(lambda: len(running.lines("applied")) == done  # noqa: B023
                                      and flavor.ours(w.node) == good, 2)
                assert repaired, f"{name} not repaired: {running.log}"
                assert flavor.foreign(w.node) == foreign_before, name
            assert w.seen(AWS_DB) == NODE
            assert len(running.lines("applied")) == 1 + len(drifts)
            assert not running.lines("ERROR")


@backends
def test_bad_config_keeps_the_last_good_one_and_a_bad_start_touches_nothing(net: Network, tmp_path: Path,
                                                                            flavor: Flavor) -> None:
    config_dir = tmp_path / "config"
    publish(str(config_dir), "nonMasqueradeCIDRs: [10.0.0.1/8]\nresyncInterval: 100ms\n")  # misaligned
    with world(net) as w:
        w.node.run(["iptables-restore", "--noflush"], stdin=FOREIGN)
        before = flavor.foreign(w.node)
        with agent(w.node, tmp_path / "agent.log", f"--config={config_dir}/ip-masq-agent", flavor.flag) as running:
            wait_until(lambda: False, 0.4)
            assert flavor.foreign(w.node) == before and not flavor.ours(w.node)  # bad start: untouched
            assert len(running.lines("ERROR")) == 1 and "ip-masq-agent:1" in running.log
            publish(str(config_dir), "nonMasqueradeCIDRs: [10.0.0.0/8]\nresyncInterval: 100ms\n")
            assert wait_until(lambda: len(flavor.ours(w.node)) == COMPLETE[flavor.backend], 2), running.log
            good = flavor.ours(w.node)
            publish(str(config_dir), "nonMasqueradeCIDRs: 10.0.0.0/8\nresyncInterval: 100ms\n")  # scalar: bad
            assert wait_until(lambda: len(running.lines("ERROR")) == 2, 2)
            for argv in flavor.drifts(good)["flush chain" if flavor.backend == "nftables" else "flush"]:
                w.node.run(argv)
            assert wait_until(lambda: flavor.ours(w.node) == good, 2)  # still repairing drift with the last good
            wait_until(lambda: False, 0.5)
            assert len(running.lines("ERROR")) == 2  # once per change, not per tick
            assert "keeping the last good config" in running.lines("ERROR")[-1]
            assert w.seen(AWS_DB) == NODE


def test_changed_chain_name_and_uninstall(net: Network, tmp_path: Path) -> None:
    from tests.conftest import PYTHON

    node = net.add("node")
    node.run(["iptables-restore", "--noflush"], stdin=FOREIGN)
    before = node.run(["iptables-save", "-t", "nat"]).stdout
    missing = str(tmp_path / "none")
    node.run([PYTHON, "-m", "ipmasq", "agent", "--once", "--backend=iptables", f"--config={missing}", *GKE,
              "--enable-ipv6"])
    assert ":IP-MASQ - " in node.run(["ip6tables-save", "-t", "nat"]).stdout
    node.run([PYTHON, "-m", "ipmasq", "agent", "--once", "--backend=iptables", f"--config={missing}"])
    after = node.run(["iptables-save", "-t", "nat"]).stdout
    assert ":IP-MASQ " not in after and "-j IP-MASQ\n" not in after and len(ours(after)) == 7
    assert foreign(after) == foreign(before)
    node.run([PYTHON, "-m", "ipmasq", "uninstall"])  # v4 default chain, and v6's IP-MASQ found by its comment
    assert foreign(node.run(["iptables-save", "-t", "nat"]).stdout) == foreign(before)
    assert "ip-masq-agent" not in node.run(["iptables-save", "-t", "nat"]).stdout
    assert "ip-masq-agent" not in node.run(["ip6tables-save", "-t", "nat"]).stdout


@backends
def test_ipv6(net: Network, tmp_path: Path, flavor: Flavor) -> None:
    path = tmp_path / "ip-masq-agent"
    path.write_text("nonMasqueradeCIDRs: [10.0.0.0/8, 'fd00::/8']\nresyncInterval: 100ms\n")
    with world(net, ipv6=True) as w, agent(w.node, tmp_path / "agent.log", f"--config={path}",
                                           "--enable-ipv6", flavor.flag) as running:
        assert wait_until(lambda: any("fd00::/8" in line for line in flavor.ours(w.node, 6)))
        assert w.seen(PEER6_FAR) == NODE6
        assert w.seen(PEER6_GW) == POD6
        assert w.seen(AWS_DB) == NODE
        good = flavor.ours(w.node, 6)
        for name, commands in flavor.drifts(good, family=6).items():
            if name not in ("flush", "flush set"):
                continue
            for argv in commands:
                w.node.run(argv)
            assert wait_until(lambda: flavor.ours(w.node, 6) == good, 2), running.log
        assert w.seen(PEER6_GW) == POD6


def test_busy_xtables_lock_and_a_rejected_restore_are_retried(net: Network, tmp_path: Path) -> None:
    lock = tmp_path / "xtables.lock"  # a private lock file: the machine's own lock is never held
    path = tmp_path / "ip-masq-agent"
    path.write_text("resyncInterval: 100ms\n")
    with world(net) as w, lock.open("w") as held:
        env = {"XTABLES_LOCKFILE": str(lock)}
        legacy = ("--backend=iptables", "--iptables-variant=legacy", f"--config={path}")
        fcntl.flock(held, fcntl.LOCK_EX)
        with agent(w.node, tmp_path / "agent.log", *legacy, env=env) as running:
            assert wait_until(lambda: "xtables lock" in running.log, 5), running.log
            assert running.proc.poll() is None
            assert "ip-masq-agent" not in w.node.run(["iptables-legacy-save", "-t", "nat"]).stdout
            fcntl.flock(held, fcntl.LOCK_UN)
            assert wait_until(lambda: "applied IPv4" in running.log, 8), running.log
            assert w.seen(AWS_DB) == POD  # legacy rules: 172.16.0.0/12 is a default non-masquerade range
        # a restore the kernel rejects: a foreign rule still jumps to a chain we would delete (old --masq-chain)
        w.node.run([sys.executable, "-m", "ipmasq", "agent", "--once", *legacy, "--masq-chain=OLD"],
                   env={**os.environ, **env})
        w.node.run(["iptables-legacy", "-t", "nat", "-N", "FOREIGN-X"])
        w.node.run(["iptables-legacy", "-t", "nat", "-A", "FOREIGN-X", "-j", "OLD"])
        with agent(w.node, tmp_path / "agent2.log", *legacy, env=env) as running:
            assert wait_until(lambda: "rejected payload line: -X OLD" in running.log, 5), running.log
            assert running.proc.poll() is None
            w.node.run(["iptables-legacy", "-t", "nat", "-D", "FOREIGN-X", "-j", "OLD"])
            assert wait_until(lambda: "recovered" in running.log, 8), running.log
            assert ":OLD" not in w.node.run(["iptables-legacy-save", "-t", "nat"]).stdout
