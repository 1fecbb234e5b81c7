"""Nodes whose routing decides the source: each routed scenario built in namespaces, real TCP peers, and for every
phase and probe three answers that must agree: the source the peer saw (what the scenario and its how-to page say),
what `ipmasq trace` predicted on the node before the probe (as an operator runs it there: DEST --source POD
--protocol tcp --port P, trace reading the node's routes and rules itself), and what trace says offline from the
facts the lab dumped of that phase (`--routes routing.json --dump iptables.save --dump ruleset.json`). Where trace
cannot decide, the test names the field it asked for and fails, unless the kernel really could go either way (a
multipath route: then each hop, asked with --out-interface, gives the source the peer saw over it). The how-to
pages' `kubectl ipmasq trace NODE ...` transcripts are what trace prints on the lab's node. Nothing is left behind.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ipmasq.lab.netns import LAB_PREFIX
from ipmasq.lab.routed import RoutedLab, RoutedPhaseResult, RoutedResult, facts_directory, run_routed, trace_argv
from ipmasq.lab.routed_scenarios import ROUTED_SCENARIOS
from tests.conftest import PYTHON, ROOT
from tests.eventually import eventually

HOW_TO = ROOT / "docs" / "how-to"
# each routed scenario's how-to page, and the phase (index) each of its trace transcripts was run in, in order
PAGES: dict[str, tuple[str, tuple[int, ...]]] = {
    "two-uplinks": ("second-uplink-changes-the-source.md", (0, 0)),
    "eks-secondary-eni": ("eks-pod-on-a-secondary-eni.md", (0, 2)),
    "gke-multi-nic": ("gke-multi-nic-pod-source.md", (0,)),
}
_TRANSCRIPT = re.compile(r"^    \$ kubectl ipmasq trace NODE (.+)\n((?:    (?!\$).*\n)+)", re.MULTILINE)
Probes = list[list[dict[str, Any]]]  # each phase's probes, as the lab's JSON report has them


def _namespaces_of(pid: int) -> set[str]:
    """The lab namespaces a process made (their names carry its pid) and left."""
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in listing.splitlines() if line.startswith(f"{LAB_PREFIX}{pid}x")}


def transcripts(scenario: str) -> list[tuple[str, str]]:
    """The page's `$ kubectl ipmasq trace NODE ARGS` blocks: (ARGS, what it printed)."""
    page, _ = PAGES[scenario]
    text = (HOW_TO / page).read_text()
    return [(args, "".join(line[4:] + "\n" for line in printed.splitlines()))
            for args, printed in _TRANSCRIPT.findall(text)]


def _routed(name: str, backend: str, facts: Path) -> tuple[RoutedResult, dict[tuple[int, str], str]]:
    """The scenario run in this process (its facts dumped), and what trace printed on the node, in each phase, for
    each of its page's transcripts."""
    printed: dict[tuple[int, str], str] = {}
    phases = iter(range(100))

    def ask_transcripts(world: RoutedLab, _phase: RoutedPhaseResult) -> None:
        index = next(phases)
        for args, _ in transcripts(name):
            shown = world.node.run([sys.executable, "-m", "ipmasq", "trace", *args.split()], check=False, timeout=60)
            printed[(index, args)] = shown.stdout

    result = run_routed(ROUTED_SCENARIOS[name], backend=backend, facts=facts, after_phase=ask_transcripts)
    assert _namespaces_of(os.getpid()) == set()
    return result, printed


def _offline(directory: Path, probe: dict[str, Any], *flags: str) -> dict[str, Any]:
    """trace from the phase's dumped facts, as anyone may run it away from the node."""
    save = directory / ("ip6tables.save" if ":" in probe["destination"] else "iptables.save")
    argv = trace_argv(probe["pod_ip"], probe["destination"], probe["port"], "--routes", str(directory / "routing.json"),
                      "--dump", str(save), "--dump", str(directory / "ruleset.json"), *flags, "-o", "json")
    result = subprocess.run([PYTHON, *argv], capture_output=True, text=True, timeout=60)
    assert result.stdout, f"trace {' '.join(argv[2:])} exited {result.returncode}: {result.stderr}"
    report: dict[str, Any] = json.loads(result.stdout)
    return report


def _asked_for(reason: str | None) -> str:
    flags = sorted(set(re.findall(r"--[a-z][a-z-]+", reason or "")))
    return f"it asks for {', '.join(flags)}" if flags else "it names no field to give"


def assert_trace_predicted(name: str, phases: Probes, facts: Path) -> None:
    """For every phase and probe: the peer saw the scenario's source, and trace, on the node and offline from the
    phase's facts, predicted the source the packet leaves the node with, by the scenario's interface."""
    scenario = ROUTED_SCENARIOS[name]
    assert len(phases) == len(scenario.phases)
    for index, probes in enumerate(phases):
        directory = facts_directory(facts, scenario, index)
        assert len(probes) == len(scenario.phases[index].expects)
        for probe in probes:
            where = f"{name} phase {index + 1}: {probe['pod_ip']} -> {probe['destination']}:{probe['port']}"
            offline = _offline(directory, probe)
            answers = {"on the node": (probe["traced_source"], probe["traced_reason"], probe["traced_interface"]),
                       "offline": (offline["source_seen"], offline["source_seen_reason"],
                                   offline["egress_interface"])}
            hops = probe.get("hops")
            if hops:
                # the kernel really could go either way: the peer saw one hop's source, and trace says it cannot
                # know which, asks for --out-interface, and given each hop answers that hop's source
                assert probe["connected"] and probe["seen_source"] in hops.values(), (where, probe)
                for how, (source, reason, _) in answers.items():
                    assert source is None and "--out-interface" in (reason or ""), (where, how, reason)
                assert probe["traced_hops"] == hops, (where, probe["traced_hops"])
                for device, expected in hops.items():
                    asked = _offline(directory, probe, "--out-interface", device)
                    assert (asked["source_seen"], asked["egress_interface"]) == (expected, device), (where, asked)
                continue
            assert (probe["seen_source"], probe["connected"]) == (probe["expected_source"],
                                                                  probe["expected_source"] is not None), \
                f"{where}: the peer saw {probe['seen_source']}, the scenario says {probe['expected_source']}"
            for how, (source, reason, interface) in answers.items():
                if source is None and probe["node_source"] is not None:
                    pytest.fail(f"{where}: trace {how} cannot decide ({_asked_for(reason)}): {reason}; the kernel "
                                f"sent it with {probe['node_source']} and the peer saw {probe['seen_source']}")
                assert source == probe["node_source"], \
                    f"{where}: trace {how} says {source} ({reason}); the node sends {probe['node_source']}"
                assert interface == probe["leaves_by"], \
                    f"{where}: trace {how} says it leaves by {interface}, the scenario by {probe['leaves_by']}"


def assert_dumped_as_documented(name: str, result: RoutedResult, facts: Path) -> None:
    """Each phase's facts are the files docs/concepts/path.md's capture writes, as the node's tools print them."""
    scenario = ROUTED_SCENARIOS[name]
    for index, phase in enumerate(result.phases):
        directory = facts_directory(facts, scenario, index)
        # the routing dump trace reads: `ip -j -4 rule; ip -j -6 rule; ip -j route show table all; ip -j addr`,
        # one JSON array per command, each on a line of its own
        rules4, rules6, routes, links = (json.loads(line) for line in
                                         (directory / "routing.json").read_text().splitlines())
        assert any(r.get("table") == "main" and r["priority"] == 32766 for r in rules4)
        assert any(r.get("table") == "main" for r in rules6)
        assert any(r.get("dst") == "default" for r in routes)  # both families: `table all` lists IPv6's too
        assert any(":" in r.get("dst", "") for r in routes)
        assert {link["ifname"] for link in links} >= {"lo", "eth0", "eth1"}
        assert (directory / "iptables.save").exists() and (directory / "ip6tables.save").exists()
        assert isinstance(json.loads((directory / "ruleset.json").read_text())["nftables"], list)
        probes = json.loads((directory / "probes.json").read_text())
        assert [{k: v for k, v in p.items() if k not in ("protocol", "in_interface")} for p in probes] == \
            [o.as_dict() for o in phase.probes]
        assert all(p["in_interface"] and p["protocol"] == "tcp" for p in probes)
    # what each scenario writes on its node is where a reader of the dump finds it
    first = facts_directory(facts, scenario, 0)
    marks = {"two-uplinks": ("ip6tables.save", "--set-xmark 0x80/0x80"),
             "eks-secondary-eni": ("iptables.save", "-A AWS-SNAT-CHAIN-0"),
             "gke-multi-nic": ("routing.json", '"table":"101"')}
    file, text = marks[name]
    assert text in (first / file).read_text()


def assert_transcripts(name: str, printed: dict[tuple[int, str], str]) -> None:
    """The page's `kubectl ipmasq trace NODE ...` blocks are what trace printed on the lab's node in that phase."""
    _, phases = PAGES[name]
    blocks = transcripts(name)
    assert len(blocks) == len(phases), f"{PAGES[name][0]}: {len(blocks)} trace transcripts, expected {len(phases)}"
    for (args, shown), phase in zip(blocks, phases, strict=True):
        assert printed[(phase, args)] == shown, f"{PAGES[name][0]}: trace {args} (phase {phase + 1}) now prints:\n" \
            f"{printed[(phase, args)]}"


def _probes(result: RoutedResult) -> Probes:
    return [[o.as_dict() for o in phase.probes] for phase in result.phases]


def _seen(phases: Probes, phase: int) -> dict[tuple[str, str, int], str | None]:
    """(pod address, destination, port) -> the source the peer saw."""
    return {(p["pod_ip"], p["destination"], p["port"]): p["seen_source"] for p in phases[phase]}


@pytest.mark.parametrize("backend", ["iptables", "nftables"])
def test_two_uplinks_masquerade_takes_the_chosen_interfaces_primary_address(backend: str, tmp_path: Path) -> None:
    result, printed = _routed("two-uplinks", backend, tmp_path)
    phases = _probes(result)
    assert_trace_predicted("two-uplinks", phases, tmp_path)
    pod, pod6 = "10.44.14.15", "fd00:44:0:14::15"
    seen = _seen(phases, 0)
    assert seen.pop((pod, "198.51.100.20", 80)) in ("192.168.10.2", "192.168.20.2")  # the multipath route: one
    assert seen == {
        (pod, "203.0.113.10", 80): "192.168.10.2",  # main table, eth0
        (pod, "172.30.12.110", 80): "192.168.20.2",  # rule to 172.30.0.0/16 lookup 100, eth1
        (pod, "203.0.113.10", 5432): "192.168.20.2",  # marked: table 200, whose route says src .99: not taken
        (pod, "172.30.12.110", 5432): "192.168.20.2",
        (pod, "10.20.0.5", 80): pod,  # 10/8 keeps the pod's address on either uplink
        (pod, "10.20.0.5", 5432): pod,
        (pod6, "2001:db8:30::10", 80): "fd00:10::2",
        # IPv6: eth1's two addresses tie in source selection and the newer one (added second) wins
        (pod6, "2001:db8:30::10", 5432): "fd00:20::99",
        (pod6, "fd00:20:5::5", 80): pod6,
        (pod6, "fd00:20:5::5", 5432): pod6,
    }
    assert result.ok, result
    assert_dumped_as_documented("two-uplinks", result, tmp_path)
    if backend == "iptables":  # the lab's default, which the page's transcripts show
        assert_transcripts("two-uplinks", printed)


def test_eks_secondary_eni_pod_leaves_by_the_primary_eni_only_while_the_connmark_rules_hold(tmp_path: Path) -> None:
    result, printed = _routed("eks-secondary-eni", "iptables", tmp_path)
    phases = _probes(result)
    assert_trace_predicted("eks-secondary-eni", phases, tmp_path)
    primary, on_eni0, on_eni1 = "192.168.10.20", "192.168.10.51", "192.168.20.61"
    defaults, excluded, no_connmark = (_seen(phases, i) for i in range(3))
    assert defaults[(on_eni1, "172.16.50.10", 80)] == primary  # connmark 0x80 -> rule 1024 -> main -> eth0, SNAT
    assert defaults[(on_eni1, "192.168.30.10", 80)] == on_eni1  # the VPC: table 2, eth1, the pod's own address
    assert excluded[(on_eni1, "172.16.50.10", 80)] == on_eni1  # an excluded CIDR: no mark, no SNAT
    assert excluded[(on_eni0, "172.16.50.10", 80)] == on_eni0
    assert excluded[(on_eni1, "203.0.113.10", 80)] == primary
    # without the connmark the SNATed packet leaves eth1 and the VPC's source check drops it
    assert no_connmark[(on_eni1, "172.16.50.10", 80)] is None
    assert no_connmark[(on_eni0, "172.16.50.10", 80)] == primary
    assert result.ok, result
    assert_dumped_as_documented("eks-secondary-eni", result, tmp_path)
    assert_transcripts("eks-secondary-eni", printed)


@pytest.mark.parametrize("backend", ["iptables", "nftables"])
def test_gke_multi_nic_masquerades_to_the_second_interfaces_address(backend: str, tmp_path: Path) -> None:
    result, printed = _routed("gke-multi-nic", backend, tmp_path)
    phases = _probes(result)
    assert_trace_predicted("gke-multi-nic", phases, tmp_path)
    assert _seen(phases, 0) == {
        ("10.44.14.15", "10.130.0.6", 80): "10.44.14.15",
        ("10.44.14.15", "203.0.113.10", 80): "10.142.15.203",
        ("10.160.14.15", "10.150.1.50", 80): "10.160.14.15",
        ("10.160.14.15", "172.16.5.5", 80): "10.150.0.2",  # not the node's 10.142.15.203
    }
    assert result.ok, result
    assert_dumped_as_documented("gke-multi-nic", result, tmp_path)
    if backend == "iptables":
        assert_transcripts("gke-multi-nic", printed)


def test_the_lab_command_reports_trace_beside_each_peer_and_dumps_the_facts(tmp_path: Path) -> None:
    """`ipmasq lab --scenario NAME -o json --dump-facts DIR`, as a user runs it: trace's prediction beside what each
    peer saw, the same probes in the dump, and no namespace left."""
    proc = subprocess.Popen([PYTHON, "-m", "ipmasq", "lab", "--scenario", "gke-multi-nic", "--backend", "nftables",
                             "-o", "json", "--dump-facts", str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stdout, stderr = proc.communicate(timeout=300)
    report: dict[str, Any] = json.loads(stdout)
    assert report["ok"] and proc.returncode == 0, json.dumps(report, indent=1) + stderr
    assert _namespaces_of(proc.pid) == set()
    phases = [phase["probes"] for phase in report["scenarios"][0]["phases"]]
    assert_trace_predicted("gke-multi-nic", phases, tmp_path)
    dumped = json.loads((facts_directory(tmp_path, ROUTED_SCENARIOS["gke-multi-nic"], 0) / "probes.json").read_text())
    assert [{k: v for k, v in p.items() if k not in ("protocol", "in_interface")} for p in dumped] == phases[0]


def _processes(pattern: str) -> list[str]:
    listing = subprocess.run(["pgrep", "-af", pattern], capture_output=True, text=True).stdout
    return [line for line in listing.splitlines() if "pgrep" not in line]


def test_a_routed_scenario_terminated_mid_way_leaves_no_namespace_or_process() -> None:
    proc = subprocess.Popen([PYTHON, "-m", "ipmasq", "lab", "--scenario", "two-uplinks"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    # the node's agent runs with the scenario's ConfigMap: the world is built and the scenario under way
    agent = "agent-config/ip-masq-agent --backend iptables"
    try:
        eventually(lambda: _processes(agent) and _namespaces_of(proc.pid), f"lab {proc.pid}'s agent and namespaces")
        workdir = _processes(agent)[0].split("--config ", 1)[1].split("/agent-config", 1)[0]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) != 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # the agent and the probe servers name the scenario's working directory in their arguments
    eventually(lambda: not _processes(workdir), lambda: f"no process left: {_processes(workdir)}")
    assert _namespaces_of(proc.pid) == set()
    assert not os.path.exists(workdir)
