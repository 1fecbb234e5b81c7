"""The agent on real netfilter, once per backend: real TCP through pod -> node -> peer, and the source address the
peer really saw. Tests of one backend's own machinery (chain renames, the xtables lock) run for that backend only.

Config rules on real netfilter, once per backend: for each field a rule can test, the source address the peer
really saw for a real TCP connection equals what `ipmasq explain` answers for that packet.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ipmasq.lab.kubelet import publish
from ipmasq.lab.netns import Namespace, Network
from tests.eventually import eventually
from tests.kernel.agent_harness import (
    AWS_DB,
    NODE,
    NODE6,
    ONPREM,
    PEER6_FAR,
    PEER6_GW,
    POD,
    POD6,
    PORT,
    agent,
    foreign,
    more_passes,
    ours,
    passes,
    world,
)
from tests.kernel.flavors import FLAVORS, Flavor
from tests.kernel.servers import LAB_PROBE, serving

GKE = ("--masq-chain=IP-MASQ", "--nomasq-all-reserved-ranges", "--random-fully=false")
FOREIGN = (
    "*nat\n:KUBE-POSTROUTING - [0:0]\n"
    '-A POSTROUTING -m comment --comment "kubernetes postrouting rules" -j KUBE-POSTROUTING\n'
    "-A KUBE-POSTROUTING -m mark ! --mark 0x4000/0x4000 -j RETURN\n"
    "-A KUBE-POSTROUTING -j MARK --xor-mark 0x4000\nCOMMIT\n"
)
# what each backend's table holds once the default policy is applied (iptables: jump, chain, 3 rules)
# with the ownership marker (a chain and its rule; a set of 5 listed lines)
COMPLETE = {"iptables": 7, "nftables": 20}

backends = pytest.mark.parametrize("flavor", FLAVORS, ids=str)


@backends
def test_gke_upgrade_outage_then_fixed_by_a_kubelet_update_while_running(net: Network, tmp_path: Path,
                                                                      flavor: Flavor) -> None:
    config_dir = tmp_path / "config"
    config_dir.mkdir()  # the ConfigMap volume, with no ConfigMap yet: GKE's defaults
    with world(net) as w:
        with agent(w.node, tmp_path / "agent.log", f"--config={config_dir}/ip-masq-agent", *GKE, "-v=2",
                   "-logtostderr", flavor.flag) as running:
            eventually(lambda: "172.16.0.0/12" in flavor.dump(w.node), "GKE's defaults written")
            # the outage: 172.30.0.0/16 is inside the default 172.16.0.0/12, so the AWS side sees the pod IP
            assert w.seen(AWS_DB) == POD
            publish(str(config_dir), "nonMasqueradeCIDRs:\n  - 10.0.0.0/8\nresyncInterval: 60s\n")
            eventually(lambda: "172.16.0.0/12" not in flavor.dump(w.node),
                       lambda: f"the ConfigMap's config written\n{running.log}")
            assert w.seen(AWS_DB) == NODE
            assert w.seen(ONPREM) == POD  # still inside 10.0.0.0/8
            running.stop()
            # SIGTERM ends the wait for the next resync (60 s away) at once: an agent that waited for it would have
            # been killed (-9) when stop_process's grace ran out, long before
            assert running.proc.returncode == 0, running.log
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
            eventually(lambda: len(flavor.ours(w.node)) == COMPLETE[flavor.backend], "the config written")
            good, foreign_before = flavor.ours(w.node), flavor.foreign(w.node)
            assert w.seen(AWS_DB) == NODE and w.seen(ONPREM) == POD
            if flavor.backend == "iptables":  # a rewrite would zero the counters: they must keep counting
                counted = [line for line in w.nat(counters=True).splitlines() if "-j MASQUERADE" in line]
                assert counted and not counted[0].startswith("[0:0]")
            fingerprint = flavor.fingerprint(w.node)
            more_passes(w.node, 10)  # ten idle resyncs
            assert flavor.fingerprint(w.node) == fingerprint  # same counters / same handles: nothing rewritten
            assert len(running.lines("applied")) == 1  # nothing written while idle
            drifts = flavor.drifts(good)
            for name, commands in drifts.items():
                before = len(running.lines("applied"))
                for argv in commands:
                    w.node.run(argv)
                # the agent may repair before we can look: count its repairs instead of catching the drift (a drift
                # of two commands may be repaired twice, when a pass falls between them)
                eventually(lambda: len(running.lines("applied")) > before  # noqa: B023
                           and flavor.ours(w.node) == good, lambda: f"{name} repaired\n{running.log}")  # noqa: B023
                assert flavor.foreign(w.node) == foreign_before, name
                # quiet passes before the next drift: drifts each within two resync periods of the last repair are
                # another program rewriting the rules (the two-writers test's case), which the agent stops repairing
                more_passes(w.node, 4)
            assert w.seen(AWS_DB) == NODE
            repairs = len(running.lines("applied"))
            assert 1 + len(drifts) <= repairs <= 1 + 2 * len(drifts)
            more_passes(w.node, 5)  # five idle resyncs again: once repaired, nothing more is written
            assert len(running.lines("applied")) == repairs
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
            eventually(lambda: passes(w.node, "no-policy") >= 1, "a pass without a good config")
            assert flavor.foreign(w.node) == before and not flavor.ours(w.node)  # bad start: untouched
            assert len(running.lines("ERROR")) == 1 and "ip-masq-agent:1" in running.log
            publish(str(config_dir), "nonMasqueradeCIDRs: [10.0.0.0/8]\nresyncInterval: 100ms\n")
            eventually(lambda: len(flavor.ours(w.node)) == COMPLETE[flavor.backend],
                       lambda: f"the good config written\n{running.log}")
            good = flavor.ours(w.node)
            publish(str(config_dir), "nonMasqueradeCIDRs: 10.0.0.0/8\nresyncInterval: 100ms\n")  # scalar: bad
            eventually(lambda: len(running.lines("ERROR")) == 2, "the second bad config refused")
            for argv in flavor.drifts(good)["flush chain" if flavor.backend == "nftables" else "flush"]:
                w.node.run(argv)
            eventually(lambda: flavor.ours(w.node) == good, "the drift repaired with the last good config")
            more_passes(w.node, 5)
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
    assert ":IP-MASQ " not in after and "-j IP-MASQ\n" not in after and len(ours(after)) == 9  # marker too
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
        eventually(lambda: any("fd00::/8" in line for line in flavor.ours(w.node, 6)), "the IPv6 rules written")
        assert w.seen(PEER6_FAR) == NODE6
        assert w.seen(PEER6_GW) == POD6
        assert w.seen(AWS_DB) == NODE
        good = flavor.ours(w.node, 6)
        for name, commands in flavor.drifts(good, family=6).items():
            if name not in ("flush", "flush set"):
                continue
            for argv in commands:
                w.node.run(argv)
            eventually(lambda: flavor.ours(w.node, 6) == good, lambda: f"the IPv6 rules written\n{running.log}")
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
            eventually(lambda: "xtables lock" in running.log,
                       lambda: f"the agent waiting for the xtables lock\n{running.log}")
            assert running.proc.poll() is None
            assert "ip-masq-agent" not in w.node.run(["iptables-legacy-save", "-t", "nat"]).stdout
            fcntl.flock(held, fcntl.LOCK_UN)
            eventually(lambda: "applied IPv4" in running.log, lambda: f"the write once the lock is free\n{running.log}")
            assert w.seen(AWS_DB) == POD  # legacy rules: 172.16.0.0/12 is a default non-masquerade range
        # a restore the kernel rejects: a foreign rule still jumps to a chain we would delete (old --masq-chain)
        w.node.run([sys.executable, "-m", "ipmasq", "agent", "--once", *legacy, "--masq-chain=OLD"],
                   env={**os.environ, **env})
        w.node.run(["iptables-legacy", "-t", "nat", "-N", "FOREIGN-X"])
        w.node.run(["iptables-legacy", "-t", "nat", "-A", "FOREIGN-X", "-j", "OLD"])
        with agent(w.node, tmp_path / "agent2.log", *legacy, env=env) as running:
            eventually(lambda: "rejected payload line: -X OLD" in running.log,
                       lambda: f"the rejected payload line logged\n{running.log}")
            assert running.proc.poll() is None
            w.node.run(["iptables-legacy", "-t", "nat", "-D", "FOREIGN-X", "-j", "OLD"])
            eventually(lambda: "recovered" in running.log, lambda: f"the recovery logged\n{running.log}")
            assert ":OLD" not in w.node.run(["iptables-legacy-save", "-t", "nat"]).stdout


POD_B = "10.44.14.16"  # a second pod address on the pod's side
SPARE = "10.142.15.204"  # a spare node address a partner's firewall would allow
SPARE6 = "fd42::204"
OTHER_PORT = 9090
CONFIG = f"""\
nonMasqueradeCIDRs: [10.0.0.0/8]
rules:
  - name: pod-b-keeps-its-ip
    destinations: [{AWS_DB}/32]
    sources: [{POD_B}/32]
    action: preserve
  - name: onprem-9090-fixed-address
    destinations: [{ONPREM}/32]
    protocol: tcp
    ports: [{OTHER_PORT}, "9990-9999"]
    action: snat
    snatTo: {SPARE}
  - name: egress-pool-masquerades-10-2
    destinations: [10.2.0.0/16]
    nodes: ["egress-*"]
    action: masquerade
"""
# (pod source, destination, port): every rule above matched and missed, and the overlap of the last two
PACKETS = [(POD, AWS_DB, PORT), (POD_B, AWS_DB, PORT), (POD, ONPREM, OTHER_PORT), (POD, ONPREM, PORT),
           (POD_B, ONPREM, OTHER_PORT)]
CONNECT = (
    "import socket, sys\n"
    "source, host, port = sys.argv[1], sys.argv[2], int(sys.argv[3])\n"
    "try:\n"
    "    with socket.create_connection((host, port), timeout=2, source_address=(source, 0)) as c:\n"
    "        data = b''\n"
    "        while not data.endswith(b'\\n'):\n"
    "            chunk = c.recv(256)\n"
    "            if not chunk:\n"
    "                break\n"
    "            data += chunk\n"
    "    print(data.decode().strip() or 'FAILED')\n"
    "except OSError:\n"
    "    print('FAILED')\n"
)



def seen(pod: Namespace, source: str, destination: str, port: int) -> str | None:
    """The source address the peer saw for a TCP connection from `source` in the pod namespace."""
    for _ in range(3):  # a fresh link may still be resolving neighbours
        out = pod.run([sys.executable, "-c", CONNECT, source, destination, str(port)], check=False).stdout.strip()
        if out and out != "FAILED":
            return out
    return None


def explained(config: Path, source: str, destination: str, port: int, node_name: str, node_ip: str,
              *extra: str) -> dict[str, object]:
    result = subprocess.run([sys.executable, "-m", "ipmasq", "explain", destination, f"--config={config}",
                             f"--source={source}", "--protocol=tcp", f"--port={port}", f"--node-name={node_name}",
                             f"--node-ip={node_ip}", "-o", "json", *extra], capture_output=True, text=True, check=True)
    (answer,) = json.loads(result.stdout)["results"]
    assert answer["depends_on"] == []  # every field was given
    return dict(answer)


def interface_of(ns: Namespace, address: str) -> str:
    for line in ns.run(["ip", "-o", "addr", "show"]).stdout.splitlines():
        if f" {address}/" in line:
            return line.split()[1]
    raise AssertionError(f"no interface holds {address}")


@backends
@pytest.mark.parametrize("node_name", ["egress-1", "general-7"])
def test_each_rule_field_changes_what_the_peer_sees_as_explain_says(net: Network, tmp_path: Path, flavor: Flavor,
                                                                   node_name: str) -> None:
    config = tmp_path / "ip-masq-agent"
    config.write_text(CONFIG)
    with world(net) as w, serving(w.peer, [*LAB_PROBE, "serve", str(OTHER_PORT)]):
        w.peer.sysctl("net.ipv4.tcp_max_tw_buckets", "0")  # a reused NATed port never meets a TIME_WAIT
        w.pod.run(["ip", "addr", "add", f"{POD_B}/32", "dev", "lo"])
        w.node.run(["ip", "addr", "add", f"{SPARE}/20", "dev", interface_of(w.node, NODE)])
        with agent(w.node, tmp_path / "agent.log", f"--config={config}", flavor.flag,
                   f"--node-name={node_name}") as running:
            eventually(lambda: "rule onprem-9090-fixed-address" in flavor.dump(w.node),
                       lambda: f"the config rule written\n{running.log}")
            # the node-scoped rule is in the kernel exactly on a matching node
            assert ("rule egress-pool-masquerades-10-2" in flavor.dump(w.node)) == node_name.startswith("egress-")
            observed = {}
            for source, destination, port in PACKETS:
                answer = explained(config, source, destination, port, node_name, NODE)
                observed[(source, destination, port)] = seen(w.pod, source, destination, port)
                assert observed[(source, destination, port)] == answer["source_seen"], (source, destination, port,
                                                                                        answer, running.log)
    egress = node_name.startswith("egress-")
    assert observed == {
        (POD, AWS_DB, PORT): NODE,  # no rule: the list's catch-all
        (POD_B, AWS_DB, PORT): POD_B,  # the source-scoped rule
        (POD, ONPREM, OTHER_PORT): SPARE,  # the port-scoped snat rule, ahead of the overlapping node rule
        (POD, ONPREM, PORT): NODE if egress else POD,  # another port: the node rule, or on other nodes the list
        (POD_B, ONPREM, OTHER_PORT): SPARE,
    }


@backends
def test_an_ipv6_rule_snats_to_a_spare_node_address(net: Network, tmp_path: Path, flavor: Flavor) -> None:
    config = tmp_path / "ip-masq-agent"
    config.write_text(f'rules:\n  - name: far-v6\n    destinations: ["{PEER6_FAR}/128"]\n    protocol: tcp\n'
                      f'    ports: [{PORT}]\n    action: snat\n    snatTo: "{SPARE6}"\n')
    with world(net, ipv6=True) as w:
        w.peer.sysctl("net.ipv4.tcp_max_tw_buckets", "0")
        w.node.run(["ip", "-6", "addr", "add", f"{SPARE6}/64", "dev", interface_of(w.node, NODE6), "nodad"])
        with agent(w.node, tmp_path / "agent.log", f"--config={config}", "--enable-ipv6", flavor.flag) as running:
            eventually(lambda: "rule far-v6" in flavor.dump(w.node, 6), lambda: f"the IPv6 rule written\n{running.log}")
            answer = explained(config, POD6, PEER6_FAR, PORT, "any", NODE6, "--enable-ipv6")
            assert answer["source_seen"] == SPARE6 and answer["rule_name"] == "far-v6"
            assert w.seen(PEER6_FAR) == SPARE6, running.log
