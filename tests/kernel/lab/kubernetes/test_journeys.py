"""Operators' journeys on the real cluster, each one test that walks a persona's whole path and fails on the first
step that would page, mislead or break.

Self-managed, with GKE's flags (deploy/overlays/gke, its webhook and deploy/monitoring): the previous release's
manifests upgraded to this release's under traffic (a connection every 50 ms from every node: no wrong source
address, no failed connection), every target up and no alert, a bad ConfigMap denied at `kubectl apply`, the rollback,
and `kubectl ipmasq uninstall` leaving nothing of ipmasq in any node's kernel or in any resource type the API serves.

Beside a provider's agent (GKE's, AKS's, EKS's: a stand-in that is not ipmasq, ipmasq.lab.kubernetes.standin, as the
API shows that agent and as it writes its chain): `kubectl apply -k` of the observe overlay and of deploy/monitoring,
scraped by the lab's real Prometheus through Kubernetes discovery from what the Prometheus Operator makes of the
PodMonitor and PrometheusRule in the API (every target up, observers included; no alert); a change of the provider's
inputs that its agent does not follow (the status, the Events and the alert each say so; `kubectl ipmasq check NODE`
answers from the observer, as the observer compares); `kubectl ipmasq uninstall`: the provider's objects (the same
uids), its chain on every node (byte for byte) and a Helm chart's ClusterRole `ip-masq-agent` untouched, nothing of
ipmasq left in any node's kernel or in any resource type the API serves.

Each step prints a [kubernetes lab] line with its seconds (docs/measurements.md has a run's).
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from ipmasq.lab.kubernetes import agent, prometheus_operator, standin
from ipmasq.lab.kubernetes.cluster import Cluster
from ipmasq.lab.kubernetes.webhook import deploy_webhook
from ipmasq.lab.prometheus import PrometheusServer
from ipmasq.lab.scenarios import GKE_OPTIONS, KEEP_10_8
from ipmasq.monitoring import JOB, NOT_ENFORCED_OBSERVED, OBSERVER_JOB
from ipmasq.writers import AKS_CONFIGMAPS, EKS_DAEMONSET, ENV_EXCLUDE_SNAT_CIDRS
from tests.kernel.lab.kubernetes.conftest import (
    ipmasq_status,
    kubectl_ipmasq,
    module_cluster,
    pods_ready,
    progress,
    wait_until,
)
from tests.kernel.lab.kubernetes.remains import chain_lines, ipmasq_in_the_api, ipmasq_on_node
from tests.kernel.lab.kubernetes.upgrade import (
    PROBE_INTERVAL,
    PROBES_PER_PHASE,
    Traffic,
    phase_report,
    previous_release_deploy,
)

pytestmark = pytest.mark.kubernetes

FOLLOWED = "172.30.0.0/16"  # what AKS's and EKS's journeys' change adds, and the provider's agent never applies
OBSERVERS = f"k8s-app={agent.OBSERVER}"
UNINSTALL_PODS = "app.kubernetes.io/part-of=ipmasq,app.kubernetes.io/component=uninstall"


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with module_cluster() as lab:
        yield lab


class Journey:
    """A persona's path as steps, each timed and said as a progress line once done (the last line said before a
    failure is the last step that held)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.started = time.monotonic()
        self.steps: list[tuple[str, float]] = []

    @contextmanager
    def step(self, what: str) -> Iterator[None]:
        started = time.monotonic()
        progress(f"{self.name}: {what} ...")
        yield
        self.steps.append((what, time.monotonic() - started))
        progress(f"{self.name}: {what}: done in {self.steps[-1][1]:.1f} s")

    def done(self) -> None:
        progress(f"{self.name}: {len(self.steps)} steps in {time.monotonic() - self.started:.1f} s: "
                 + "; ".join(f"{what} {seconds:.1f} s" for what, seconds in self.steps))


# ---- a provider's agent beside ipmasq's observer -------------------------------------------------------------------

HELM_ROLE = {  # another program's ClusterRole of ipmasq's name, as a Helm chart labels what it installs
    "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
    "metadata": {"name": "ip-masq-agent", "labels": {
        "app.kubernetes.io/managed-by": "Helm", "app.kubernetes.io/name": "ip-masq-agent",
        "app.kubernetes.io/instance": "ip-masq-agent", "helm.sh/chart": "ip-masq-agent-2.8.0"},
        "annotations": {"meta.helm.sh/release-name": "ip-masq-agent", "meta.helm.sh/release-namespace": "kube-system"}},
    "rules": [{"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get"]}],
}


def _configmap(name: str, data: dict[str, str], labels: dict[str, str] | None = None) -> str:
    return json.dumps({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {
        "name": name, "namespace": "kube-system", **({"labels": labels} if labels else {})}, "data": data})


def _gke_inputs(cluster: Cluster, changed: bool) -> None:
    """The user's ip-masq-agent ConfigMap: GKE's defaults, then 10.0.0.0/8 alone (172.16.0.0/12 masqueraded)."""
    agent.apply_config(cluster, "nonMasqueradeCIDRs: [10.0.0.0/8]\n" if changed else "")


AKS_RECONCILED = "nonMasqueradeCIDRs:\n  - 10.0.0.0/8\nmasqLinkLocal: false\n"  # what AKS itself writes


def _aks_inputs(cluster: Cluster, changed: bool) -> None:
    """AKS's two ConfigMaps: the one AKS writes (its labels), the user's fragment (a CIDR added by the change)."""
    if not changed:
        cluster.kubectl("apply", "-f", "-", stdin=_configmap(
            AKS_CONFIGMAPS[0], {"ip-masq-agent-reconciled": AKS_RECONCILED},
            {**standin.ADDON_LABELS, "component": "ip-masq-agent", "kubernetes.azure.com/managedby": "aks"}))
    user = "nonMasqueradeCIDRs: [10.0.0.0/8" + (f", {FOLLOWED}" if changed else "") + "]\n"
    cluster.kubectl("apply", "-f", "-", stdin=_configmap(AKS_CONFIGMAPS[1], {"ip-masq-agent": user}))


def _eks_inputs(cluster: Cluster, changed: bool) -> None:
    """aws-node's env (the stand-in starts with it): one more excluded CIDR, which ipamd reads only at its start."""
    if changed:
        cluster.kubectl("set", "env", f"daemonset/{EKS_DAEMONSET}", "-n", "kube-system", "-c", EKS_DAEMONSET,
                        f"{ENV_EXCLUDE_SNAT_CIDRS}={','.join((*standin.EKS_EXCLUDED, FOLLOWED))}")


def _remove_inputs(cluster: Cluster, provider: str) -> None:
    names = {"gke": [agent.CONFIGMAP], "aks": list(AKS_CONFIGMAPS), "eks": []}[provider]
    if names:
        cluster.kubectl("delete", "configmap", *names, "-n", "kube-system", "--ignore-not-found")


@dataclass(frozen=True)
class Provider:
    name: str
    agent: standin.StandIn
    overlay: str
    inputs: Callable[[Cluster, bool], None]
    summary_on: str | None  # the ConfigMap the fleet's summary Event is written on (EKS's inputs are no ConfigMap)
    named: str  # what the status and check name once the change is not followed
    theirs: tuple[tuple[str, str], ...] = field(default=())  # the provider's objects besides its agent's: kind, name


PROVIDERS = {
    "gke": Provider("gke", standin.GKE, "deploy/overlays/observe", _gke_inputs, agent.CONFIGMAP, "172.16.0.0/12"),
    "aks": Provider("aks", standin.AKS, "deploy/overlays/observe/aks", _aks_inputs, AKS_CONFIGMAPS[1], FOLLOWED,
                    (("configmap", AKS_CONFIGMAPS[0]), ("configmap", AKS_CONFIGMAPS[1]))),
    "eks": Provider("eks", standin.EKS, "deploy/overlays/observe/eks", _eks_inputs, None, FOLLOWED),
}


def _uid(cluster: Cluster, kind: str, name: str, namespace: str | None = "kube-system") -> str:
    where = ("-n", namespace) if namespace else ()
    return str(cluster.kubectl_json("get", kind, name, *where)["metadata"]["uid"])


def _their_objects(cluster: Cluster, provider: Provider) -> dict[str, str]:
    """`kind/name` -> uid of everything of the provider's the uninstall must leave, and the Helm chart's role."""
    kinds = [("daemonset", provider.agent.name), ("configmap", provider.agent.rules_configmap), *provider.theirs]
    if provider.agent.service_account:
        kinds.append(("serviceaccount", provider.agent.service_account))
    found = {f"{kind}/{name}": _uid(cluster, kind, name) for kind, name in kinds}
    found["clusterrole/ip-masq-agent"] = _uid(cluster, "clusterrole", "ip-masq-agent", None)
    return found


def _their_pods(cluster: Cluster, provider: Provider) -> set[str]:
    return {p["metadata"]["uid"] for p in agent.agent_pods(cluster, label=f"k8s-app={provider.agent.name}").values()}


def _every_target(server: PrometheusServer) -> dict[tuple[str, str], tuple[str, float]]:
    """(job, node) -> (instance, up) of every target Prometheus scrapes."""
    return {(s.get("job", ""), s.get("node", "")): (s.get("instance", ""), v) for s, v in server.query("up")}


def _node_events(cluster: Cluster, reason: str) -> dict[str, str]:
    """node -> the message of its Event of `reason`."""
    events = cluster.kubectl_json("get", "events", "-A", "--field-selector",
                                  f"involvedObject.kind=Node,reason={reason}")
    return {e["involvedObject"]["name"]: e["message"] for e in events["items"]}


def _summary_events(cluster: Cluster, configmap: str) -> list[str]:
    events = cluster.kubectl_json("get", "events", "-n", "kube-system", "--field-selector",
                                  f"involvedObject.kind=ConfigMap,involvedObject.name={configmap},"
                                  "reason=ConfigNotEnforced")
    return [e["message"] for e in events["items"]]


def _check(cluster: Cluster, node: str) -> tuple[int, str, str]:
    result = kubectl_ipmasq(cluster, "check", node)
    return result.returncode, result.stdout, result.stderr


def _from_the_observer(provider: Provider, err: str) -> bool:
    """kubectl ipmasq said it ran in the observer's pod and compared as the observer does."""
    return (f": {agent.OBSERVER}-" in f": {err}" and f"observes {provider.name}'s agent: comparing as it does"
            in err)


@pytest.mark.parametrize("name", sorted(PROVIDERS))
def test_beside_a_providers_agent_observe_monitor_see_a_change_it_does_not_follow_and_uninstall(
        cluster: Cluster, name: str) -> None:
    provider = PROVIDERS[name]
    chain = provider.agent.chain
    journey = Journey(f"journey beside {name}'s agent")
    server: PrometheusServer | None = None
    try:
        with journey.step(f"{name}'s agent (a stand-in: {provider.agent.name}, {chain}), its inputs, a Helm chart's "
                          "ClusterRole ip-masq-agent"):
            provider.inputs(cluster, False)
            cluster.kubectl("apply", "-f", "-", stdin=json.dumps(HELM_ROLE))
            standin.deploy_as(cluster, provider.agent)
            before = {node.name: chain_lines(cluster, node, chain) for node in cluster.nodes}
            assert all(any(lines.values()) for lines in before.values()), before
        with journey.step(f"kubectl apply -k {provider.overlay}, deploy/monitoring (the Prometheus Operator's kinds)"):
            prometheus_operator.install_kinds(cluster)
            agent.deploy_observe_overlay(cluster, provider.overlay)
            prometheus_operator.deploy_monitoring(cluster)
            wait_until(lambda: ipmasq_status(cluster)[0] == 0, 120, "ipmasq status: every node in sync")
            rows = ipmasq_status(cluster)[1]["nodes"]
            assert {(r["mode"], r["writer"], r["chain"]) for r in rows} == {("observe", name, chain)}, rows
        with journey.step("Prometheus (the operator's jobs and rules from the API): every target up, no alert"):
            server = prometheus_operator.start_from_the_api(cluster, cluster.state / f"prometheus-{name}", progress)
            want = {(OBSERVER_JOB, n.name): (f"{n.address}:9849", 1.0) for n in cluster.nodes}
            wait_until(lambda: _every_target(server) == want, 90, f"every target up, observers only: {want}")
            wait_until(lambda: all(v >= 5 for _, v in server.query("count_over_time(up[1m])")), 60,
                       "five scrapes of every target")
            assert server.alerts() == []
        with journey.step("kubectl ipmasq check NODE: the observer's answer, in sync"):
            for node in cluster.nodes:
                code, out, err = _check(cluster, node.name)
                assert code == 0 and out.splitlines()[-1] in ("ok: the node's rules match the config",
                                                              "ok (warnings only)"), (node.name, code, out, err)
                assert _from_the_observer(provider, err), err
        with journey.step(f"a change {name}'s agent does not follow: the status, the Events, the alert say so"):
            changed = time.monotonic()
            provider.inputs(cluster, True)
            wait_until(lambda: all(not r["current"] and provider.named in r["why"]
                                   for r in ipmasq_status(cluster)[1].get("nodes", [])), 60,
                       f"ipmasq status: every node out of sync, naming {provider.named}")
            status_seconds = time.monotonic() - changed
            wait_until(lambda: set(_node_events(cluster, "ConfigNotEnforced")) == {n.name for n in cluster.nodes},
                       60, "a ConfigNotEnforced Event on every Node")
            if provider.summary_on is not None:
                wait_until(lambda: any(m.startswith("not enforced on 2 of 2 nodes") for m in _summary_events(
                    cluster, provider.summary_on or "")), 60, f"the summary Event on {provider.summary_on}")
            firing = {n.name: False for n in cluster.nodes}

            def alert_firing() -> bool:
                for a in server.alerts() if server else []:
                    if a.name == NOT_ENFORCED_OBSERVED and a.state == "firing" and a.label("node") in firing:
                        firing[str(a.label("node"))] = True
                return all(firing.values())

            wait_until(alert_firing, 90, f"{NOT_ENFORCED_OBSERVED} firing for every node")
            alert_seconds = time.monotonic() - changed
            assert pods_ready(cluster, OBSERVERS)
            progress(f"journey beside {name}'s agent: the change -> every status {status_seconds:.1f} s, the alert "
                     f"firing for every node {alert_seconds:.1f} s (its grace and for: shortened to 10 s and 2 s)")
        with journey.step("kubectl ipmasq check NODE: the observer's answer, out of sync"):
            for node in cluster.nodes:  # the provider's inputs as the API holds them: no volume to wait for
                code, out, err = _check(cluster, node.name)
                assert code == 1 and "NOT OK" in out and provider.named in out, (node.name, code, out, err)
                assert _from_the_observer(provider, err), err
        theirs = _their_objects(cluster, provider)
        pods = _their_pods(cluster, provider)
        with journey.step("kubectl ipmasq uninstall --dry-run, then kubectl ipmasq uninstall"):
            dry = kubectl_ipmasq(cluster, "uninstall", "--dry-run")
            assert dry.returncode == 0, dry.stdout + dry.stderr
            assert pods_ready(cluster, OBSERVERS)  # the dry run changed nothing
            result = kubectl_ipmasq(cluster, "uninstall")
            assert result.returncode == 0, result.stdout + result.stderr
            lines = result.stdout.splitlines()
            progress(f"journey beside {name}'s agent: kubectl ipmasq uninstall said:\n" + result.stdout.rstrip())
            assert not [line for line in lines if line.startswith("node ")], lines  # an observer writes no rules
            assert "kept clusterrole/ip-masq-agent: not ipmasq's (app.kubernetes.io/managed-by=Helm)" in lines, lines
            assert f"removed daemonset/kube-system/{agent.OBSERVER}: app.kubernetes.io/part-of=ipmasq" in lines
            for said in (dry.stdout.splitlines(), lines):
                if name == "gke":  # the names ipmasq's own drop-in has: kept, and said why
                    for kind in ("daemonset", "serviceaccount"):
                        assert (f"kept {kind}/kube-system/ip-masq-agent: not ipmasq's "
                                "(addonmanager.kubernetes.io/mode=Reconcile)") in said, said
        with journey.step(f"afterwards: {name}'s objects and pods (the same uids), its {chain} on every node (byte for "
                          "byte), nothing of ipmasq on any node or in any resource type the API serves"):
            assert _their_objects(cluster, provider) == theirs
            assert _their_pods(cluster, provider) == pods
            assert not cluster.kubectl_json("get", "pods", "-A", "-l", UNINSTALL_PODS)["items"]
            for node in cluster.nodes:
                assert chain_lines(cluster, node, chain) == before[node.name], node.name
                assert ipmasq_on_node(cluster, node, kept_chains=[chain]) == [], node.name
            left = ipmasq_in_the_api(cluster, kept=theirs.values())
            assert left == [], left
        journey.done()
    finally:
        if server is not None:
            server.stop()
        prometheus_operator.remove_prometheus_identity(cluster)
        kubectl_ipmasq(cluster, "uninstall")  # whatever of ipmasq a failed step left
        standin.remove_as(cluster, provider.agent)
        standin.clear(cluster, provider.agent.rules)
        cluster.kubectl("delete", "clusterrole", "ip-masq-agent", "--ignore-not-found")
        _remove_inputs(cluster, name)
        prometheus_operator.remove_kinds(cluster)


# ---- self-managed, with GKE's flags ----------------------------------------------------------------------------------

BAD = "nonMasqueradeCIDRs:\n  - 10.0.0.1/8\n"  # host bits set: the reference agent refuses it, so does every node


def _install(cluster: Cluster, deploy: Path | str, webhook: str) -> None:
    """`kubectl apply -k` of the agent (GKE's overlay), the webhook and monitoring of one release (the lab's image)."""
    agent.deploy_agent(cluster, str(Path(deploy) / "overlays" / "gke"))
    deploy_webhook(cluster, shipped=webhook)
    prometheus_operator.deploy_monitoring(cluster, Path(deploy) / "monitoring")
    for node in cluster.nodes:
        agent.wait_synced(cluster, node, KEEP_10_8, GKE_OPTIONS)


def _agent_pods(cluster: Cluster) -> dict[str, str]:
    return {node: pod["metadata"]["uid"] for node, pod in agent.agent_pods(cluster).items()}


def _phase(cluster: Cluster, traffic: Traffic, name: str, deploy: Path | str, webhook: str) -> tuple[float, float]:
    """One release's manifests applied under traffic: every agent pod replaced, the nodes' kernels verified, then
    PROBES_PER_PHASE more probes of every node; when it began and ended."""
    start = time.monotonic()
    before = _agent_pods(cluster)
    _install(cluster, deploy, webhook)
    after = _agent_pods(cluster)
    assert set(after) == set(before) and not set(after.values()) & set(before.values()), name  # rolled
    rolled = time.monotonic()
    wait_until(lambda: traffic.count_since(rolled) >= PROBES_PER_PHASE, 60, f"traffic after the {name}")
    return start, time.monotonic()


def test_self_managed_with_gkes_flags_monitored_guarded_upgraded_under_traffic_rolled_back_and_uninstalled(
        cluster: Cluster, tmp_path: Path) -> None:
    journey = Journey("self-managed journey (deploy/overlays/gke)")
    previous, old = previous_release_deploy(tmp_path / "previous")
    traffic: Traffic | None = None
    server: PrometheusServer | None = None
    phases: dict[str, tuple[float, float]] = {}
    try:
        with journey.step(f"{previous}'s deploy/overlays/gke, deploy/webhook, deploy/monitoring"):
            agent.apply_config(cluster, KEEP_10_8)
            prometheus_operator.install_kinds(cluster)
            _install(cluster, old, str(old / "webhook"))
            traffic = Traffic(cluster)
            begun = time.monotonic()
            wait_until(lambda: traffic.count_since(begun) >= PROBES_PER_PHASE, 60, "traffic flowing from every node")
        name = f"upgrade {previous} -> this release under traffic"
        with journey.step(name):
            phases[name] = _phase(cluster, traffic, name, "deploy", "deploy/overlays/gke/webhook")
        with journey.step("Prometheus (the operator's jobs and rules from the API): every target up, no alert"):
            server = prometheus_operator.start_from_the_api(cluster, cluster.state / "prometheus-self-managed",
                                                            progress)
            want = {(JOB, n.name): (f"{n.address}:9848", 1.0) for n in cluster.nodes}
            wait_until(lambda: _every_target(server) == want, 90, f"every target up: {want}")
            wait_until(lambda: all(v >= 5 for _, v in server.query("count_over_time(up[1m])")), 60,
                       "five scrapes of every target")
            assert server.alerts() == []
        with journey.step("a bad ConfigMap denied at kubectl apply"):
            bad = cluster.kubectl("apply", "-f", "-", check=False, stdin=_configmap(agent.CONFIGMAP, {"config": BAD}))
            assert bad.returncode != 0 and "denied the request" in bad.stderr, bad
            assert '"10.0.0.1/8" is not aligned' in bad.stderr and "[misaligned-cidr]" in bad.stderr, bad.stderr
            held = cluster.kubectl_json("get", "configmap", agent.CONFIGMAP, "-n", "kube-system")["data"]
            assert held == {"config": KEEP_10_8}
            progress(f"self-managed journey: kubectl apply of a bad ConfigMap: {bad.stderr.strip().splitlines()[-1]}")
        name = f"rollback -> {previous} under traffic"
        with journey.step(name):
            phases[name] = _phase(cluster, traffic, name, old, str(old / "webhook"))
            # what docs/operations/upgrade.md says a rollback to 0.2.0 brings back: its GKE overlay replaced the
            # agent's arguments and dropped --prometheus-address, so its agents serve no /metrics on the port they
            # declare, and IpMasqAgentDown fires for every node (and nothing else)
            down = {(JOB, n.name): (f"{n.address}:9848", 0.0) for n in cluster.nodes}
            wait_until(lambda: _every_target(server) == down, 60, f"every target down after the {name}: {down}")
            wait_until(lambda: {(a.name, a.label("node")) for a in server.alerts() if a.state == "firing"}
                       == {("IpMasqAgentDown", n.name) for n in cluster.nodes}, 60,
                       f"IpMasqAgentDown firing for every node, and nothing else, after the {name}")
        traffic.stop()
        for name, (start, end) in phases.items():
            probes, wrong, failed = phase_report(cluster, traffic, start, end)
            progress(f"self-managed journey: {name}: {probes} probes ({PROBE_INTERVAL} s apart, "
                     f"{len(cluster.nodes)} nodes, {end - start:.1f} s), {wrong} wrong source address, "
                     f"{failed} failed connections")
            assert probes > 2 * PROBES_PER_PHASE and wrong == 0 and failed == 0, (name, probes, wrong, failed)
        with journey.step("kubectl ipmasq uninstall"):
            result = kubectl_ipmasq(cluster, "uninstall")
            progress("self-managed journey: kubectl ipmasq uninstall said:\n" + result.stdout.rstrip())
            assert result.returncode == 0, result.stdout + result.stderr
            for node in cluster.nodes:
                assert any(line.startswith(f"node {node.name}: removed: ") for line in result.stdout.splitlines())
        with journey.step("afterwards: nothing of ipmasq on any node or in any resource type the API serves"):
            for node in cluster.nodes:  # kube-proxy drops the webhook Service's rules at its next sync
                with contextlib.suppress(AssertionError):
                    wait_until(lambda node=node: not ipmasq_on_node(cluster, node), 30, "")
                assert ipmasq_on_node(cluster, node) == [], node.name
            left = ipmasq_in_the_api(cluster)
            assert left == [], left
        journey.done()
    finally:
        if traffic is not None:
            traffic.stop()
        if server is not None:
            server.stop()
        prometheus_operator.remove_prometheus_identity(cluster)
        kubectl_ipmasq(cluster, "uninstall")
        agent.apply_config(cluster, None)
        prometheus_operator.remove_kinds(cluster)
