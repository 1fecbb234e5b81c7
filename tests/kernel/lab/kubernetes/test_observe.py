"""Observe mode on the real cluster: a stand-in for GKE's managed agent (not ipmasq: a shell loop of iptables-restore
of GKE's default rule set, ipmasq.lab.kubernetes.standin) writes IP-MASQ on every node, and ipmasq runs beside it in
observe mode, as the shipped DaemonSet with `--observe=gke` and GKE's flags.

The ConfigMap changes and the writer's rules do not: every node is reported out of sync in its status object and
`ipmasq status`, with one summary Event on the ConfigMap saying so, while every pod stays Ready; the writer catches
up on one node and that node turns in sync. How long each report took (the ConfigMap or the rules changed -> the
node's status object says it, polled through the API) is printed, never asserted (docs/measurements.md has them).
"""

from __future__ import annotations

import functools
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

from ipmasq.kube import paths
from ipmasq.lab.kubernetes import agent, standin
from ipmasq.lab.kubernetes.cluster import Cluster
from tests.kernel.lab.kubernetes.conftest import (
    Statuses,
    ipmasq_status,
    module_cluster,
    pods_ready,
    progress,
    report_latencies,
    run_ipmasq,
    timed_changes,
    wait_until,
)

pytestmark = pytest.mark.kubernetes

GKE = ("--masq-chain=IP-MASQ", "--nomasq-all-reserved-ranges", "--random-fully=false")  # the writer's own flags
DEFAULTS = ""  # GKE's defaults: what the stand-in's fixed rule set enforces
FIX = "nonMasqueradeCIDRs:\n  - 10.0.0.0/8\n"  # the ConfigMap users apply to stop preserving 172.16.0.0/12
SAMPLES = 5  # ConfigMap changes timed to the nodes' status


@pytest.fixture(scope="module")
def lab() -> Iterator[Cluster]:
    with module_cluster() as cluster:
        yield cluster


_wait = functools.partial(wait_until, interval=0.1)  # its latencies are read at 0.1 s


def _rendered(config: str) -> str:
    """The rules GKE's agent writes once it has read `config` (what the stand-in takes when it catches up)."""
    return subprocess.run([sys.executable, "-m", "ipmasq", "render", "--config", "-", *GKE], input=config,
                          check=True, capture_output=True, text=True).stdout


def test_a_configmap_the_providers_agent_does_not_apply_is_reported_on_every_node_and_one_that_catches_up_turns_in_sync(
        lab: Cluster) -> None:
    from ipmasq.config.source import config_digest

    standin.deploy(lab)
    agent.apply_config(lab, DEFAULTS)
    agent.deploy_observer(lab, "gke", GKE)
    statuses = Statuses(lab)
    _wait(lambda: ipmasq_status(lab)[0] == 0, 60, "ipmasq status: every node in sync with GKE's defaults")
    view = ipmasq_status(lab)[1]
    assert {(row["mode"], row["writer"], row["chain"]) for row in view["nodes"]} == {("observe", "gke", "IP-MASQ")}
    # the ConfigMap changes back and forth; the writer's rules never do: timed to every node's status
    changes = []
    for attempt in range(SAMPLES * 2):
        config = FIX if attempt % 2 == 0 else DEFAULTS
        # the key is there, empty or not; the fix is never enforced by the stand-in, the defaults are
        changes.append((functools.partial(agent.apply_config, lab, config), config_digest((config.encode(),)),
                        attempt % 2 == 1))
    report_latencies("observe mode, ConfigMap change", timed_changes(lab, statuses, changes))
    # the fix applied, not enforced anywhere: exit 1, every node named with why; one summary Event on the ConfigMap
    agent.apply_config(lab, FIX)
    _wait(lambda: all(not r["current"] and r["why"].startswith("observed: gke's rules in IP-MASQ do not enforce")
                      for r in ipmasq_status(lab)[1].get("nodes", [])), 30, "ipmasq status: every node out of sync")
    text = run_ipmasq(lab, "ipmasq", "status")
    assert text.returncode == 1 and text.stdout.count("observed: gke's rules in IP-MASQ do not enforce") == 2, text
    assert "0 of 2 nodes enforce the current config" in text.stdout

    def summary() -> list[str]:
        events = lab.kubectl_json("get", "events", "-n", "kube-system", "--field-selector",
                                  f"involvedObject.kind=ConfigMap,involvedObject.name={agent.CONFIGMAP},"
                                  "reason=ConfigNotEnforced")
        return [e["message"] for e in events["items"]]

    _wait(lambda: any(m.startswith("not enforced on 2 of 2 nodes (observed: the rules of gke in IP-MASQ)")
                      for m in summary()), 60, "one summary Event on the ConfigMap")
    assert len(summary()) == 1, summary()
    assert pods_ready(lab)
    # the writer catches up on one node: that node turns in sync, the other stays out
    caught, behind = lab.nodes[0], lab.nodes[1]
    fix_digest = config_digest((FIX.encode(),))
    rules = _rendered(FIX)
    started = time.monotonic()
    standin.catch_up(lab, caught, rules)
    standin.wait_written(lab, caught, rules, timeout=30)
    written = time.monotonic() - started
    took = _wait(lambda: statuses.enforcing(fix_digest)[caught.name] is True, 30, "the caught-up node in sync")
    progress(f"observe mode, the node's rules changed -> its status: {took + written:.2f} s after the writer was "
             f"told ({written:.2f} s until its loop restored them)")
    assert statuses.enforcing(fix_digest)[behind.name] is False
    _wait(lambda: ipmasq_status(lab, caught.name)[0] == 0, 30, "ipmasq status NODE: exit 0 for the caught-up node")
    assert ipmasq_status(lab)[0] == 1 and ipmasq_status(lab, behind.name)[0] == 1
    assert pods_ready(lab)
    # a key GKE's agent ignores (ipmasq's masqueradeCIDRs): the caught-up node's rules are what that agent writes
    # from it, so the node is in sync, and the key is said beside (status, ipmasq status, one Event), no mismatch
    vpn = FIX + "masqueradeCIDRs:\n  - 10.11.0.0/24\n"
    assert _rendered(vpn) != rules  # ipmasq itself would masquerade 10.11.0.0/24: not what the node holds
    agent.apply_config(lab, vpn)
    vpn_digest = config_digest((vpn.encode(),))
    _wait(lambda: statuses.enforcing(vpn_digest)[caught.name] is True, 30, "the caught-up node in sync, key ignored")
    said = statuses.client.get(paths.statuses(caught.name))
    assert said.get("mismatch") is None, said
    assert "GKE's managed agent ignores masqueradeCIDRs" in said["ignoredByWriter"], said
    assert "10.11.0.0/24 stays un-masqueraded" in said["ignoredByWriter"], said
    code, view = ipmasq_status(lab, caught.name)
    (row,) = view["nodes"]
    assert code == 0 and row["current"] and "10.11.0.0/24 stays un-masqueraded" in row["ignored_by_writer"], view
    _wait(lambda: "10.11.0.0/24 stays un-masqueraded" in lab.kubectl(
        "get", "events", "-n", "default", "--field-selector",
        f"involvedObject.name={caught.name},reason=IgnoredByWriter").stdout, 30, "one IgnoredByWriter Event")
    assert "(ignored by gke: GKE's managed agent ignores masqueradeCIDRs" in run_ipmasq(
        lab, "ipmasq", "status", caught.name).stdout
    standin.remove(lab)
    agent.remove_agent(lab)


def test_an_enforcing_agents_status_follows_its_kernel_within_the_fleets_spread(lab: Cluster) -> None:
    """The status writers' spread grows with the fleet: on the lab's two nodes a node's status object says what
    its kernel holds a fraction of a second after it holds it. Timed per node (the kernel read in the node's
    namespace, the status through the API, both polled), printed, never asserted."""
    from ipmasq.lab.scenarios import REFERENCE_OPTIONS, policy_for
    from ipmasq.policy.hash import policy_hash

    configs = [FIX + "resyncInterval: 60s\n", FIX.replace("10.0.0.0/8", "10.0.0.0/9") + "resyncInterval: 60s\n"]
    agent.apply_config(lab, configs[1])
    agent.deploy_agent(lab)
    statuses = Statuses(lab)
    _wait(lambda: ipmasq_status(lab)[0] == 0, 60, "every node current")
    # the Lease's holder tallies a content once and says the fleet's size on the Lease, which keeps it: the agents
    # deployed now (the observe test's Lease is still there) hear it at their first ask, within 5 s of their start;
    # on a new cluster a node hears it at its next ask (2-3 minutes) and is spread as a fleet of unknown size (2 s)
    # until then
    lease = paths.leases("kube-system", agent.CONFIGMAP)
    _wait(lambda: (statuses.client.get(lease).get("metadata", {}).get("annotations") or {}).get(
        "ipmasq.dev/nodes") == "2", 60, "the fleet's size on the Lease")
    lags: list[float] = []
    for attempt in range(SAMPLES * 4):
        config = configs[attempt % 2]
        agent.apply_config(lab, config)
        wants = {node.name: policy_for(config, agent.node_options(REFERENCE_OPTIONS, node)) for node in lab.nodes}
        kernels = {node.name: agent.kernel(lab, node, REFERENCE_OPTIONS) for node in lab.nodes}
        seen: dict[tuple[str, str], float] = {}

        def every_node(wants: dict[str, Any] = wants, kernels: dict[str, Any] = kernels,
                       seen: dict[tuple[str, str], float] = seen) -> bool:
            for name, want in wants.items():  # both nodes in each round: neither is timed late for the other
                kernel = kernels[name]
                if (name, "kernel") not in seen and all(kernel.read(f) == kernel.desired(want, f)
                                                        for f in want.families):
                    seen[name, "kernel"] = time.monotonic()
                if (name, "status") not in seen and statuses.client.get(paths.statuses(name)).get(
                        "policyHash") == policy_hash(want):
                    seen[name, "status"] = time.monotonic()
            return len(seen) == 2 * len(wants)

        _wait(every_node, 60, f"attempt {attempt}: every node's kernel and status")
        lags.extend(seen[name, "status"] - seen[name, "kernel"] for name in wants)
    ordered = sorted(lags)
    progress(f"enforce mode, kernel -> the node's status on 2 nodes: {len(ordered)} samples (in order: "
             + ", ".join(f"{lag:.2f}" for lag in lags) + f"), p50 "
             f"{ordered[len(ordered) // 2]:.2f} s, p99 {ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]:.2f}"
             f" s, max {ordered[-1]:.2f} s")
    agent.remove_agent(lab)
