"""An operator's day two on the real cluster: Prometheus finds every agent by Kubernetes service discovery as
deploy/monitoring and docs/operations/monitoring.md ship it, an upgrade from the previous release's manifests and a
rollback under traffic, and `kubectl ipmasq uninstall` leaving nothing of ipmasq on any node or in the API (beside a
provider's agent: test_journeys.py).

The figures each test prints ([kubernetes lab] lines) are in docs/measurements.md.
"""

from __future__ import annotations

import json
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ipmasq.lab.kubernetes import agent
from ipmasq.lab.kubernetes.artifacts import prometheus_binary
from ipmasq.lab.kubernetes.cluster import Cluster
from ipmasq.lab.kubernetes.layout import CONTROL_PLANE, FAST_SYNC_FREQUENCY, LAB_NAMESPACE, NodeSpec
from ipmasq.lab.kubernetes.prometheus_operator import discovering, prometheus_identity, remove_prometheus_identity
from ipmasq.lab.kubernetes.webhook import deploy_webhook
from ipmasq.lab.prometheus import PrometheusServer
from ipmasq.lab.scenarios import KEEP_10_8, REFERENCE_OPTIONS
from ipmasq.monitoring import JOB, OBSERVER_JOB, scrape_config, scrape_configs
from tests.kernel.lab.kubernetes.conftest import kubectl_ipmasq, module_cluster, progress, wait_until
from tests.kernel.lab.kubernetes.upgrade import (
    PROBE_INTERVAL,
    PROBES_PER_PHASE,
    Traffic,
    phase_report,
    previous_release_deploy,
)

pytestmark = pytest.mark.kubernetes



@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with module_cluster() as lab:
        lab.restart_kubelets(FAST_SYNC_FREQUENCY)
        yield lab



def _fresh_agent(cluster: Cluster, shipped: str = "deploy", backend: str = agent.SHIPPED_BACKEND) -> None:
    agent.remove_agent(cluster)
    agent.apply_config(cluster, KEEP_10_8)
    agent.deploy_agent(cluster, shipped, backend=backend)
    for node in cluster.nodes:
        agent.wait_synced(cluster, node, KEEP_10_8, REFERENCE_OPTIONS, backend=backend)


# ---- monitoring --------------------------------------------------------------------------------------------------

_HTTP_STATUS = """
import sys, urllib.request, urllib.error
try:
    with urllib.request.urlopen(sys.argv[1], timeout=5) as r: print(r.status, len(r.read()))
except urllib.error.HTTPError as e: print(e.code, 0)
except OSError as e: print('refused', 0)
"""


def _http_status(cluster: Cluster, url: str) -> str:
    result = cluster.net["cp"].run([sys.executable, "-c", _HTTP_STATUS, url], timeout=30)
    return result.stdout.split()[0]


def test_prometheus_finds_every_agent_by_kubernetes_discovery(cluster: Cluster) -> None:
    """The documented scrape job (ipmasq.monitoring.scrape_config) in a real Prometheus outside the cluster, against
    the lab's API server: a target per node on its own address and port `metrics`, all up; IpMasqAgentAbsent
    silent, then firing once the agents are gone (the test's copy of the rules with `for:` shortened to 2 s)."""
    _fresh_agent(cluster)
    binary = prometheus_binary(progress)
    workdir = cluster.state / "prometheus"
    job = scrape_config()
    job.update(scrape_interval="1s", scrape_timeout="1s")
    job["kubernetes_sd_configs"][0].update(
        api_server=f"https://{CONTROL_PLANE}:6443",
        authorization={"credentials_file": str(prometheus_identity(cluster, workdir))},
        tls_config={"ca_file": str(cluster.state / "pki" / "ca.crt")})
    server = PrometheusServer(cluster.net["cp"], "127.0.0.1", str(workdir))
    try:
        started = time.monotonic()
        server.start((), for_seconds=2, scrape_configs=[job], binary=binary)
        want = {node.name: f"{node.address}:9848" for node in cluster.nodes}

        up_query = f'up{{job="{JOB}"}}'

        def every_target_up() -> bool:
            up = server.query(up_query)
            return {s["node"]: (s["instance"], v) for s, v in up} == {n: (a, 1.0) for n, a in want.items()}

        wait_until(every_target_up, 90, f"a target per node up ({want})")
        up_seconds = time.monotonic() - started
        # every target scraped several times and the rules evaluated since: still no IpMasqAgentAbsent
        wait_until(lambda: all(v >= 5 for _, v in server.query(f'count_over_time(up{{job="{JOB}"}}[1m])')), 60,
              "five scrapes of every target")
        alerts = server.alerts()
        assert not [a for a in alerts if a.name in ("IpMasqAgentAbsent", "IpMasqAgentDown")], alerts
        series = server.query(f'ipmasq_build_info{{job="{JOB}"}}')
        assert {s["node"] for s, _ in series} == set(want)
        # the scrape port serves /metrics and nothing else; the probes' port is not on the node's address at all
        for node in cluster.nodes:
            assert _http_status(cluster, f"http://{node.address}:9848/metrics") == "200"
            for path in ("/healthz", "/readyz", "/settings"):
                assert _http_status(cluster, f"http://{node.address}:9848{path}") == "404", path
            assert _http_status(cluster, f"http://{node.address}:9847/metrics") == "refused"
        progress(f"Prometheus (Kubernetes discovery, {binary}): {len(want)} targets up "
                 f"{up_seconds:.1f} s after it started; alerts while healthy: "
                 f"{sorted({(a.name, a.state) for a in alerts}) or 'none'}")
        removed = time.monotonic()
        agent.remove_agent(cluster)

        def absent_firing() -> bool:
            return any(a.name == "IpMasqAgentAbsent" and a.state == "firing" for a in server.alerts())

        wait_until(absent_firing, 90, f"IpMasqAgentAbsent firing once the agents are gone: {server.alerts()}")
        progress(f"IpMasqAgentAbsent firing {time.monotonic() - removed:.1f} s after the DaemonSet was deleted "
                 "(for: 2s in the test's copy)")
    finally:
        server.stop()
        remove_prometheus_identity(cluster)


def test_an_observe_only_cluster_is_scraped_as_observers_and_raises_no_alert_for_a_missing_agent(
        cluster: Cluster) -> None:
    """`kubectl apply -k deploy/overlays/observe` (no enforcing agent) and a real Prometheus with both documented
    scrape jobs: a target per node under job ipmasq-observer, on the node's address and the observer's declared port
    9849, up; IpMasqAgentAbsent, IpMasqAgentDown and IpMasqObserverDown silent; IpMasqAgentAbsent firing once the
    observers are gone too."""
    agent.remove_agent(cluster)
    agent.deploy_observe_overlay(cluster, "deploy/overlays/observe")
    binary = prometheus_binary(progress)
    workdir = cluster.state / "prometheus-observe"
    prometheus_identity(cluster, workdir)
    server = PrometheusServer(cluster.net["cp"], "127.0.0.1", str(workdir))
    try:
        started = time.monotonic()
        server.start((), for_seconds=2, binary=binary,
                     scrape_configs=[discovering(cluster, job, workdir / "token") for job in scrape_configs()])
        want = {node.name: f"{node.address}:9849" for node in cluster.nodes}

        def every_observer_up() -> bool:
            up = server.query(f'up{{job="{OBSERVER_JOB}"}}')
            return {s["node"]: (s["instance"], v) for s, v in up} == {n: (a, 1.0) for n, a in want.items()}

        wait_until(every_observer_up, 90, f"a target per node up ({want})")
        up_seconds = time.monotonic() - started
        wait_until(lambda: all(v >= 5 for _, v in server.query(f'count_over_time(up{{job="{OBSERVER_JOB}"}}[1m])')),
                   60, "five scrapes of every observer")
        assert server.query(f'up{{job="{JOB}"}}') == []  # nothing enforcing is installed, nothing is looked for
        alerts = server.alerts()
        assert not [a for a in alerts if a.name in ("IpMasqAgentAbsent", "IpMasqAgentDown", "IpMasqObserverDown")], \
            alerts
        for node in cluster.nodes:
            assert _http_status(cluster, f"http://{node.address}:9849/metrics") == "200"
            assert _http_status(cluster, f"http://{node.address}:9849/healthz") == "404"
            assert _http_status(cluster, f"http://{node.address}:9848/metrics") == "refused"  # loopback only
        progress(f"Prometheus (Kubernetes discovery, both jobs): {len(want)} observer targets up {up_seconds:.1f} s "
                 f"after it started; alerts on an observe-only cluster: "
                 f"{sorted({(a.name, a.state) for a in alerts}) or 'none'}")
        removed = time.monotonic()
        agent.remove_agent(cluster, daemonset=agent.OBSERVER)
        wait_until(lambda: any(a.name == "IpMasqAgentAbsent" and a.state == "firing" for a in server.alerts()), 90,
                   f"IpMasqAgentAbsent firing once the observers are gone: {server.alerts()}")
        progress(f"IpMasqAgentAbsent firing {time.monotonic() - removed:.1f} s after the observers' DaemonSet was "
                 "deleted (for: 2s in the test's copy)")
    finally:
        server.stop()
        agent.remove_agent(cluster, daemonset=agent.OBSERVER)
        remove_prometheus_identity(cluster)


# ---- upgrade and rollback ----------------------------------------------------------------------------------------

def _agent_templates(cluster: Cluster) -> dict[str, dict[str, Any]]:
    """node -> the running agent container as its pod says (after a rollout: the new template's)."""
    return {node: pod["spec"]["containers"][0] for node, pod in agent.agent_pods(cluster).items()}


def test_upgrade_from_the_previous_release_and_back_under_traffic(cluster: Cluster, tmp_path: Path) -> None:
    """The previous release's deploy/ (from the commit CHANGELOG.md names for it), then this release's, then the
    previous one's again, each `kubectl apply -k` with the lab's image, while every node's pod connects every 50 ms
    to the peer behind the VPN that admits only node addresses: every connection succeeds and leaves with its node's
    address."""
    previous, old_deploy = previous_release_deploy(tmp_path / "previous")
    _fresh_agent(cluster, str(old_deploy))
    # the ports each release's template declares (0.2.0 added `metrics`): checked after each apply below
    old_ports = {n: [p.get("name") for p in c.get("ports", [])] for n, c in _agent_templates(cluster).items()}
    traffic = Traffic(cluster)
    phases: dict[str, tuple[float, float]] = {}
    try:
        begun = time.monotonic()
        wait_until(lambda: traffic.count_since(begun) >= PROBES_PER_PHASE, 60, "traffic flowing from every node")
        for name, shipped in ((f"upgrade {previous} -> this release", "deploy"),
                              (f"rollback -> {previous}", str(old_deploy))):
            start = time.monotonic()
            before = {node: pod["metadata"]["uid"] for node, pod in agent.agent_pods(cluster).items()}
            agent.deploy_agent(cluster, shipped)
            for node in cluster.nodes:
                agent.wait_synced(cluster, node, KEEP_10_8, REFERENCE_OPTIONS)
            after = {node: pod["metadata"]["uid"] for node, pod in agent.agent_pods(cluster).items()}
            assert set(after) == set(before) and not set(after.values()) & set(before.values()), name  # rolled
            rolled = time.monotonic()
            wait_until(lambda rolled=rolled: traffic.count_since(rolled) >= PROBES_PER_PHASE, 60,
                  f"traffic after the {name}")
            phases[name] = (start, time.monotonic())
            ports = {n: [p.get("name") for p in c.get("ports", [])] for n, c in _agent_templates(cluster).items()}
            assert ports == ({n: ["metrics"] for n in ports} if shipped == "deploy" else old_ports), ports
    finally:
        traffic.stop()
    for name, (start, end) in phases.items():
        probes, wrong, failed = phase_report(cluster, traffic, start, end)
        progress(f"{name} under traffic: {probes} probes ({PROBE_INTERVAL} s apart, {len(cluster.nodes)} nodes, "
                 f"{end - start:.1f} s), {wrong} wrong source address, {failed} failed connections")
        assert probes > 2 * PROBES_PER_PHASE and wrong == 0 and failed == 0, (name, probes, wrong, failed)


# ---- uninstall ---------------------------------------------------------------------------------------------------

def _ours_on(cluster: Cluster, node: NodeSpec) -> list[str]:
    """What of ipmasq a node's kernel holds, read from outside: our chains and jumps in iptables (nft and legacy
    variants) for IPv4 and IPv6, our nftables table."""
    ns = cluster.namespace(node)
    found = []
    for save in ("iptables-nft-save", "ip6tables-nft-save", "iptables-legacy-save", "ip6tables-legacy-save"):
        listed = ns.run([save, "-t", "nat"], check=False).stdout
        found += [f"{save}: {line}" for line in listed.splitlines()
                  if not line.startswith("#") and re.search(r"ip-masq-agent|IP-MASQ", line, re.IGNORECASE)]
    tables = ns.run(["nft", "list", "tables"], check=False).stdout
    found += [f"nft: {line}" for line in tables.splitlines() if "ip-masq-agent" in line]
    return found


def _ipmasq_in_the_api(cluster: Cluster) -> list[str]:
    """Every object of ipmasq the API still holds (the lab's own probe pods in its namespace aside), the user's
    ConfigMap aside."""
    kinds = ("daemonsets,deployments,pods,services,serviceaccounts,secrets,configmaps,leases,roles,rolebindings,"
             "poddisruptionbudgets")
    cluster_kinds = "clusterroles,clusterrolebindings,customresourcedefinitions,validatingwebhookconfigurations"
    found = []
    for args in (("get", kinds, "-A"), ("get", cluster_kinds)):
        for item in cluster.kubectl_json(*args)["items"]:
            meta = item["metadata"]
            name, namespace = meta["name"], meta.get("namespace", "")
            if namespace == LAB_NAMESPACE or (item["kind"] == "ConfigMap" and name == agent.CONFIGMAP):
                continue
            if re.search(r"ipmasq|ip-masq-agent", f"{name} {json.dumps(meta.get('labels', {}))}"):
                found.append(f"{item['kind']} {namespace}/{name}")
    groups = cluster.kubectl("api-resources", "--api-group=ipmasq.dev", "-o", "name").stdout.split()
    return found + [f"api-resource {g}" for g in groups]


@pytest.mark.parametrize("backend", ["iptables", "nftables"])
def test_kubectl_ipmasq_uninstall_leaves_nothing(cluster: Cluster, backend: str) -> None:
    """The agent on every node (and, on the first run, the webhook): `kubectl ipmasq uninstall --dry-run` changes
    nothing; `kubectl ipmasq uninstall` leaves no agent pod, no chain or table on any node (read from outside, both
    iptables variants and families, nftables) and nothing of ipmasq in the API but the user's ConfigMap."""
    _fresh_agent(cluster, backend=backend)
    if backend == "iptables":
        deploy_webhook(cluster)
    before = {node.name: _ours_on(cluster, node) for node in cluster.nodes}
    assert all(before.values()), before
    dry = kubectl_ipmasq(cluster, "uninstall", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    for node in cluster.nodes:
        assert f"on node {node.name}" in dry.stdout
    assert set(agent.agent_pods(cluster)) == {n.name for n in cluster.nodes}  # the dry run changed nothing
    assert {node.name: _ours_on(cluster, node) for node in cluster.nodes} == before
    started = time.monotonic()
    result = kubectl_ipmasq(cluster, "uninstall")
    seconds = time.monotonic() - started
    assert result.returncode == 0, result.stdout + result.stderr
    assert not agent.agent_pods(cluster)
    left = cluster.kubectl_json("get", "pods", "-n", "kube-system", "-l", UNINSTALL_PODS)
    assert not left["items"]
    for node in cluster.nodes:
        assert _ours_on(cluster, node) == [], node.name
    assert _ipmasq_in_the_api(cluster) == []
    assert cluster.kubectl("get", "configmap", agent.CONFIGMAP, "-n", "kube-system", check=False).returncode == 0
    # every line `ipmasq uninstall` printed on a node is relayed, as `node NAME: line`
    per_node = {node.name: [line.split(": ", 1)[1] for line in result.stdout.splitlines()
                            if line.startswith(f"node {node.name}: ")] for node in cluster.nodes}
    assert all(any(line.startswith("removed: ") for line in said) for said in per_node.values()), result.stdout
    assert ("kept configmap/kube-system/ip-masq-agent: yours: the agents' config (the reference agent reads it "
            "too)") in result.stdout.splitlines()
    progress(f"kubectl ipmasq uninstall ({backend}{', with the webhook' if backend == 'iptables' else ''}) in "
             f"{seconds:.1f} s: " + " | ".join(f"{n}: {'; '.join(s)}" for n, s in per_node.items())
             + f" | {result.stdout.splitlines()[-1]}")


UNINSTALL_PODS = "app.kubernetes.io/part-of=ipmasq,app.kubernetes.io/component=uninstall"


def _node_ready(cluster: Cluster, node: NodeSpec) -> str:
    item = cluster.kubectl_json("get", "node", node.name)
    return next((c["status"] for c in item["status"].get("conditions", []) if c["type"] == "Ready"), "")


def test_kubectl_ipmasq_uninstall_with_a_node_down_cleans_the_others_and_names_it(cluster: Cluster) -> None:
    """One node's kubelet stops (its agent keeps running: containerd does not need kubelet): the node turns Ready
    Unknown, and its agent's pod, once deleted, stays Terminating until that kubelet is back. `kubectl ipmasq
    uninstall` still cleans every other node and the API, names the node NOT CLEANED (exit 1) and sends no pod
    there; with the kubelet back, `--all-nodes` cleans it."""
    _fresh_agent(cluster)
    down = cluster.nodes[-1]
    kubelet = cluster.kubelets.pop(down.name)
    kubelet.terminate()
    kubelet.wait(30)
    try:
        wait_until(lambda: _node_ready(cluster, down) == "Unknown", 120, f"{down.name} Ready Unknown")
        started = time.monotonic()
        result = kubectl_ipmasq(cluster, "uninstall")
        seconds = time.monotonic() - started
        assert result.returncode == 1, result.stdout + result.stderr
        lines = result.stdout.splitlines()
        assert any(line.startswith(f"node {down.name}: NOT CLEANED: the node is not Ready: no pod is sent there")
                   for line in lines), lines
        assert lines[-1].endswith(f"rules left on {down.name}"), lines[-1]
        for node in cluster.nodes:
            if node is not down:
                assert _ours_on(cluster, node) == [], node.name
        assert _ours_on(cluster, down)  # its rules stay, as said
        assert not cluster.kubectl_json("get", "pods", "-A", "-l", UNINSTALL_PODS)["items"]
        left = _ipmasq_in_the_api(cluster)
        assert [found for found in left if not found.startswith("Pod kube-system/ip-masq-agent-")] == [], left
    finally:
        cluster.start_kubelet(down)
        cluster.wait_nodes_ready()
    wait_until(lambda: not agent.agent_pods(cluster), 120, "the down node's agent pod ended by its kubelet")
    again = kubectl_ipmasq(cluster, "uninstall", "--all-nodes", "--image", cluster.artifacts.image)
    assert again.returncode == 0, again.stdout + again.stderr
    for node in cluster.nodes:
        assert _ours_on(cluster, node) == [], node.name
    progress(f"kubectl ipmasq uninstall with {down.name} down in {seconds:.1f} s: "
             + " | ".join(line for line in lines if line.startswith("node ")))
