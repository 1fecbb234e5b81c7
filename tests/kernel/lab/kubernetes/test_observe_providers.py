"""Observe mode for the providers whose inputs are not the ip-masq-agent ConfigMap, on the real cluster: the shipped
overlay (`kubectl apply -k deploy/overlays/observe/eks`, the lab's image in it) beside a stand-in for the provider's
agent (ipmasq.lab.kubernetes.standin: a shell loop of iptables-restore of the provider's rule shape, not ipmasq).

EKS: the stand-in is the `aws-node` DaemonSet, its container carrying the VPC CNI's SNAT settings in its env and
writing AWS-SNAT-CHAIN-0 as the CNI writes it. The env changes (one more excluded CIDR) and the chain does not: every
node is reported out of sync with the reason, pods stay Ready; the writer catches up on one node and that node turns
in sync. AKS the same way, its two ConfigMaps (the one AKS writes, the user's fragment) as the inputs, with the
fleet's summary Event on the user's. So the observer's rights (get/list/watch of those objects by name, with a
metadata.name field selector), the admission policy and the live path are proven against a real API server. How
long each report took (the inputs changed -> every node's status object says it, polled through the API) is
printed, never asserted (docs/measurements.md has them).
"""

from __future__ import annotations

import functools
import json
import sys
import time
from collections.abc import Iterator

import pytest
import yaml

from ipmasq.config.source import ConfigInput, config_digest
from ipmasq.kube.configmaps import ConfigMapState
from ipmasq.lab.kubernetes import agent, standin
from ipmasq.lab.kubernetes.cluster import Cluster
from ipmasq.observe.provider_inputs import EnvState, input_of
from ipmasq.testing.writers import aws_snat_rules, ip_masq_agent_rules
from ipmasq.writers import AKS_CONFIGMAPS, EKS_CHAIN, EKS_DAEMONSET, ENV_EXCLUDE_SNAT_CIDRS, WRITERS
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

SAMPLES = 5  # env changes timed to the nodes' status, each way
VPC = "10.0.0.0/8"  # the lab's nodes, pods and services: in-cluster traffic keeps its address, as in a VPC
EXCLUDED = ("192.168.0.0/16",)  # what the CNI was started with
MORE = (*EXCLUDED, "172.30.0.0/16")  # the env after the change, not applied by the CNI (ipamd reads it at start)
OBSERVERS = f"k8s-app={agent.OBSERVER}"
AKS_AGENT = "azure-ip-masq-agent"  # AKS's DaemonSet (the stand-in plays it)
AKS_CHAIN = WRITERS["aks"].chain

_wait = functools.partial(wait_until, interval=0.1)  # its latencies are read at 0.1 s


@pytest.fixture(scope="module")
def lab() -> Iterator[Cluster]:
    with module_cluster() as cluster:
        yield cluster


_SCRAPE = """
import sys, urllib.request, urllib.error
try:
    with urllib.request.urlopen(sys.argv[1], timeout=5) as r: print(r.status, b"ipmasq_build_info" in r.read())
except urllib.error.HTTPError as e: print(e.code, False)
except OSError: print("refused", False)
"""


def _every_declared_port_scraped(cluster: Cluster, shipped: str) -> None:
    """Each node's observer, as the overlay runs it, answers /metrics on the node's address at every port its
    DaemonSet declares, from the control plane's namespace (where the lab's Prometheus runs)."""
    built = cluster.kubectl("kustomize", str(cluster.source / shipped)).stdout
    (daemonset,) = [d for d in yaml.safe_load_all(built) if d and d["kind"] == "DaemonSet"]
    ports = [p["containerPort"] for c in daemonset["spec"]["template"]["spec"]["containers"] for p in c["ports"]]
    assert ports == [9849]
    for node in cluster.nodes:
        for port in ports:
            url = f"http://{node.address}:{port}/metrics"
            answer = cluster.net["cp"].run([sys.executable, "-c", _SCRAPE, url], timeout=30).stdout.split()
            assert answer == ["200", "True"], (url, answer)


def _env(exclusions: tuple[str, ...]) -> dict[str, str]:
    return {ENV_EXCLUDE_SNAT_CIDRS: ",".join(exclusions)}


def _digest(env: dict[str, str]) -> str:
    """The digest the observer's status names for this env (its input read as the observer reads it)."""
    read = input_of([EnvState("kube-system", EKS_DAEMONSET, True, tuple(sorted(env.items())))])
    assert isinstance(read, ConfigInput)
    return config_digest(tuple(data for _, data in read.files))


def _set_env(cluster: Cluster, env: dict[str, str]) -> None:
    cluster.kubectl("set", "env", f"daemonset/{EKS_DAEMONSET}", "-n", "kube-system", "-c", EKS_DAEMONSET,
                    *(f"{k}={v}" for k, v in env.items()))


def test_an_aws_node_env_the_cni_has_not_applied_is_reported_on_every_node_and_one_that_catches_up_turns_in_sync(
        lab: Cluster) -> None:
    rules = aws_snat_rules(VPC, EXCLUDED, standin.HOST_IP)
    standin.deploy(lab, rules, name=EKS_DAEMONSET, env=_env(EXCLUDED))
    agent.deploy_observe_overlay(lab, "deploy/overlays/observe/eks")
    _every_declared_port_scraped(lab, "deploy/overlays/observe/eks")
    statuses = Statuses(lab)
    _wait(lambda: ipmasq_status(lab)[0] == 0, 120, "ipmasq status: every node in sync with aws-node's env")
    view = ipmasq_status(lab)[1]
    assert {(row["mode"], row["writer"], row["chain"]) for row in view["nodes"]} == {("observe", "eks", EKS_CHAIN)}
    # the env changes back and forth (each change rolls aws-node's pods, as on EKS); the chain never does
    changes = [(functools.partial(_set_env, lab, env), _digest(env), attempt % 2 == 1)
               for attempt, env in enumerate(_env(MORE if i % 2 == 0 else EXCLUDED) for i in range(SAMPLES * 2))]
    seconds = timed_changes(lab, statuses, changes, OBSERVERS)
    report_latencies("observe mode (eks), aws-node env change", seconds)
    # the exclusion added, not applied anywhere: exit 1, every node named with why
    changed = time.monotonic()
    _set_env(lab, _env(MORE))
    took = _wait(lambda: all(not r["current"] and "172.30.0.0/16" in r["why"]
                             for r in ipmasq_status(lab)[1].get("nodes", [])), 60,
                 "ipmasq status: every node out of sync, naming the exclusion")
    progress(f"observe mode (eks), aws-node env change -> `ipmasq status` says every node out of sync: "
             f"{time.monotonic() - changed:.2f} s ({took:.2f} s of polling the command)")
    text = run_ipmasq(lab, "ipmasq", "status")
    assert text.returncode == 1 and text.stdout.count("172.30.0.0/16") >= 2, text
    assert pods_ready(lab, OBSERVERS)
    # the writer catches up on one node (its pods restarted with the new env; one of them applies it)
    standin.wait_rolled_out(lab, EKS_DAEMONSET)
    caught, behind = lab.nodes[0], lab.nodes[1]
    more = aws_snat_rules(VPC, MORE, standin.HOST_IP)
    started = time.monotonic()
    standin.catch_up(lab, caught, more, name=EKS_DAEMONSET)
    standin.wait_written(lab, caught, more, timeout=30)
    written = time.monotonic() - started
    digest = _digest(_env(MORE))
    took = _wait(lambda: statuses.enforcing(digest)[caught.name] is True, 30, "the caught-up node in sync")
    progress(f"observe mode (eks), the node's chain changed -> its status: {took + written:.2f} s after the writer "
             f"was told ({written:.2f} s until its loop restored them)")
    assert statuses.enforcing(digest)[behind.name] is False
    _wait(lambda: ipmasq_status(lab, caught.name)[0] == 0, 30, "ipmasq status NODE: exit 0 for the caught-up node")
    assert ipmasq_status(lab)[0] == 1 and ipmasq_status(lab, behind.name)[0] == 1
    assert pods_ready(lab, OBSERVERS)
    standin.remove(lab, name=EKS_DAEMONSET)
    agent.remove_agent(lab, daemonset=agent.OBSERVER)


AKS_RECONCILED = "nonMasqueradeCIDRs:\n  - 10.0.0.0/8\nmasqLinkLocal: false\n"  # what AKS itself writes
AKS_USER = ("nonMasqueradeCIDRs: [10.0.0.0/8]\n", "nonMasqueradeCIDRs: [10.0.0.0/8, 172.30.0.0/16]\n")  # the user's


def _aks_configmaps(user: str) -> list[tuple[str, str, str]]:
    """(name, key, text) of AKS's two ConfigMaps, in name order (the observer's)."""
    return [(AKS_CONFIGMAPS[1], "ip-masq-agent", user), (AKS_CONFIGMAPS[0], "ip-masq-agent-reconciled", AKS_RECONCILED)]


def _aks_digest(user: str) -> str:
    read = input_of([ConfigMapState("kube-system", name, True, None, keys=((key, text.encode()),))
                     for name, key, text in _aks_configmaps(user)])
    assert isinstance(read, ConfigInput)
    return config_digest(tuple(data for _, data in read.files))


def _apply_aks(cluster: Cluster, user: str) -> None:
    for name, key, text in _aks_configmaps(user):
        cluster.kubectl("apply", "-f", "-", stdin=json.dumps({
            "apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name, "namespace": "kube-system"},
            "data": {key: text}}))


def test_a_user_fragment_aks_has_not_merged_in_is_reported_on_every_node_and_one_that_catches_up_turns_in_sync(
        lab: Cluster) -> None:
    rules = ip_masq_agent_rules(AKS_CHAIN, ("10.0.0.0/8",), random_fully=False)
    _apply_aks(lab, AKS_USER[0])
    standin.deploy(lab, rules, name=AKS_AGENT)
    agent.deploy_observe_overlay(lab, "deploy/overlays/observe/aks")
    _every_declared_port_scraped(lab, "deploy/overlays/observe/aks")
    statuses = Statuses(lab)
    _wait(lambda: ipmasq_status(lab)[0] == 0, 120, "ipmasq status: every node in sync with AKS's two ConfigMaps")
    view = ipmasq_status(lab)[1]
    assert {(row["mode"], row["writer"], row["chain"]) for row in view["nodes"]} == {("observe", "aks", AKS_CHAIN)}
    changes = [(functools.partial(_apply_aks, lab, user), _aks_digest(user), user == AKS_USER[0])
               for user in (AKS_USER[1], AKS_USER[0]) * SAMPLES]
    seconds = timed_changes(lab, statuses, changes, OBSERVERS)
    report_latencies("observe mode (aks), user ConfigMap change", seconds)
    _apply_aks(lab, AKS_USER[1])
    _wait(lambda: all(not r["current"] and "172.30.0.0/16" in r["why"]
                      for r in ipmasq_status(lab)[1].get("nodes", [])), 60,
          "ipmasq status: every node out of sync, naming the CIDR")
    assert pods_ready(lab, OBSERVERS)

    def summary() -> list[str]:  # on the first of AKS's ConfigMaps in name order: the user's
        events = lab.kubectl_json("get", "events", "-n", "kube-system", "--field-selector",
                                  f"involvedObject.kind=ConfigMap,involvedObject.name={AKS_CONFIGMAPS[1]},"
                                  "reason=ConfigNotEnforced")
        return [e["message"] for e in events["items"]]

    _wait(lambda: any(m.startswith(f"not enforced on 2 of 2 nodes (observed: the rules of aks in {AKS_CHAIN})")
                      for m in summary()), 60, "one summary Event on the user's ConfigMap")
    caught, behind = lab.nodes[0], lab.nodes[1]
    merged = ip_masq_agent_rules(AKS_CHAIN, ("10.0.0.0/8", "172.30.0.0/16"), random_fully=False)
    standin.catch_up(lab, caught, merged, name=AKS_AGENT)
    standin.wait_written(lab, caught, merged, timeout=30)
    digest = _aks_digest(AKS_USER[1])
    _wait(lambda: statuses.enforcing(digest)[caught.name] is True, 30, "the caught-up node in sync")
    assert statuses.enforcing(digest)[behind.name] is False
    _wait(lambda: ipmasq_status(lab, caught.name)[0] == 0, 30, "ipmasq status NODE: exit 0 for the caught-up node")
    assert ipmasq_status(lab)[0] == 1 and pods_ready(lab, OBSERVERS)
    standin.remove(lab, name=AKS_AGENT)
    agent.remove_agent(lab, daemonset=agent.OBSERVER)
