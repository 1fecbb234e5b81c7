"""An operator's day two on the real cluster: Prometheus finds every agent by Kubernetes service discovery as
deploy/monitoring and docs/operations/monitoring.md ship it, an upgrade from the previous release's manifests and a
rollback under traffic, and `kubectl ipmasq uninstall` leaving nothing on any node or in the API.

The figures each test prints ([kubernetes lab] lines) are in docs/measurements.md.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tarfile
import threading
import time
from collections.abc import Iterator
from io import BytesIO
from pathlib import Path
from typing import Any

import pytest

from ipmasq.lab.kubernetes import agent
from ipmasq.lab.kubernetes.artifacts import prometheus_binary
from ipmasq.lab.kubernetes.cluster import CONTROL_PLANE, FAST_SYNC_FREQUENCY, LAB_NAMESPACE, Cluster, NodeSpec
from ipmasq.lab.kubernetes.webhook import deploy_webhook
from ipmasq.lab.prometheus import PrometheusServer
from ipmasq.lab.scenarios import KEEP_10_8, REFERENCE_OPTIONS
from ipmasq.lab.topology import ADDR, STRICT_PORT
from ipmasq.monitoring import JOB, scrape_config
from tests.conftest import ROOT
from tests.kernel.lab.kubernetes.conftest import module_cluster, progress, wait_until

pytestmark = pytest.mark.kubernetes

PROBE_INTERVAL = "0.05"  # a connection every 50 ms from every node's probe pod
PROBES_PER_PHASE = 40  # each node's connections seen after a phase's rollout before the next one starts


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


def _prometheus_identity(cluster: Cluster, workdir: Path) -> Path:
    """A service account allowed exactly what the scrape job's discovery needs (pods in kube-system: get, list,
    watch), and a token of it in a file, as an operator gives a Prometheus outside the cluster."""
    cluster.kubectl("apply", "-f", "-", stdin=json.dumps({"apiVersion": "v1", "kind": "List", "items": [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "prometheus", "namespace": LAB_NAMESPACE}},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
         "metadata": {"name": "lab-prometheus", "namespace": "kube-system"},
         "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
         "metadata": {"name": "lab-prometheus", "namespace": "kube-system"},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "lab-prometheus"},
         "subjects": [{"kind": "ServiceAccount", "name": "prometheus", "namespace": LAB_NAMESPACE}]},
    ]}))
    token = cluster.kubectl("create", "token", "prometheus", "-n", LAB_NAMESPACE, "--duration=1h").stdout.strip()
    path = workdir / "token"
    workdir.mkdir(parents=True, exist_ok=True)
    path.write_text(token)
    path.chmod(0o600)
    return path


def _remove_prometheus_identity(cluster: Cluster) -> None:
    cluster.kubectl("delete", "rolebinding,role", "lab-prometheus", "-n", "kube-system", "--ignore-not-found")
    cluster.kubectl("delete", "serviceaccount", "prometheus", "-n", LAB_NAMESPACE, "--ignore-not-found")


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
        authorization={"credentials_file": str(_prometheus_identity(cluster, workdir))},
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
        _remove_prometheus_identity(cluster)


# ---- upgrade and rollback ----------------------------------------------------------------------------------------

def _previous_release_deploy(into: Path) -> tuple[str, Path]:
    """deploy/ as the previous release shipped it: the newest commit whose src/ipmasq/__init__.py still said that
    version (found with git: the commit that changed it, then its parent)."""
    versions = re.findall(r"^## (\d+\.\d+\.\d+) ", (ROOT / "CHANGELOG.md").read_text(), re.MULTILINE)
    previous = versions[1]
    changed = subprocess.run(["git", "-C", str(ROOT), "log", "-1", "--format=%H", "-S",
                              f'__version__ = "{previous}"', "--", "src/ipmasq/__init__.py"],
                             capture_output=True, text=True, check=True).stdout.strip()
    assert changed, f"git history has no commit that changed the version from {previous} (a shallow clone?)"
    commit = f"{changed}^"
    shown = subprocess.run(["git", "-C", str(ROOT), "show", f"{commit}:src/ipmasq/__init__.py"],
                           capture_output=True, text=True, check=True).stdout
    assert f'__version__ = "{previous}"' in shown
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", commit, "deploy"], capture_output=True,
                             check=True).stdout
    into.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    return previous, into / "deploy"


class Traffic:
    """From every node's probe pod, a connection every 50 ms to the peer behind the VPN, each line (the source the
    peer saw, or FAILED) kept with the time it arrived."""

    def __init__(self, cluster: Cluster) -> None:
        self.lines: dict[str, list[tuple[float, str]]] = {node.name: [] for node in cluster.nodes}
        pods = cluster.probe_pods()
        self.clients = {node.name: subprocess.Popen(
            [cluster.artifacts.toolchain.kubectl, f"--kubeconfig={cluster.kubeconfig}", "exec", "-n", LAB_NAMESPACE,
             pods[node.name][0], "--", "python", "-m", "ipmasq.lab.probe", "repeat", f"{ADDR.aws_db}:{STRICT_PORT}",
             "--seconds", "900", "--interval", PROBE_INTERVAL, "--timeout", "1"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) for node in cluster.nodes}
        self.readers = [threading.Thread(target=self._read, args=(name, client), daemon=True)
                        for name, client in self.clients.items()]
        for reader in self.readers:
            reader.start()

    def _read(self, name: str, client: subprocess.Popen[str]) -> None:
        assert client.stdout is not None
        for line in client.stdout:
            if line.endswith("\n"):
                self.lines[name].append((time.monotonic(), line.strip()))

    def count_since(self, since: float) -> int:
        return min(sum(1 for at, _ in lines if at >= since) for lines in self.lines.values())

    def between(self, name: str, start: float, end: float) -> list[str]:
        return [line for at, line in self.lines[name] if start <= at < end]

    def stop(self) -> None:
        for client in self.clients.values():
            client.kill()
            client.wait(timeout=30)
        for reader in self.readers:
            reader.join(timeout=30)


def _agent_templates(cluster: Cluster) -> dict[str, dict[str, Any]]:
    """node -> the running agent container as its pod says (after a rollout: the new template's)."""
    return {node: pod["spec"]["containers"][0] for node, pod in agent.agent_pods(cluster).items()}


def test_upgrade_from_the_previous_release_and_back_under_traffic(cluster: Cluster, tmp_path: Path) -> None:
    """0.1.0's deploy/ (as the release before this one shipped it), then this release's, then 0.1.0's again, each
    `kubectl apply -k` with the lab's image, while every node's pod connects every 50 ms to the peer behind the VPN
    that admits only node addresses: every connection succeeds and leaves with its node's address."""
    previous, old_deploy = _previous_release_deploy(tmp_path / "previous")
    _fresh_agent(cluster, str(old_deploy))
    assert not any(c.get("ports") for c in _agent_templates(cluster).values())  # the old template: no scrape port
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
            assert all(v == (["metrics"] if shipped == "deploy" else []) for v in ports.values()), ports
    finally:
        traffic.stop()
    for name, (start, end) in phases.items():
        probes = wrong = failed = 0
        for node in cluster.nodes:
            seen = traffic.between(node.name, start, end)
            probes += len(seen)
            failed += sum(1 for s in seen if s == "FAILED")
            wrong += sum(1 for s in seen if s not in ("FAILED", node.address))
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


def _kubectl_ipmasq(cluster: Cluster, *args: str) -> subprocess.CompletedProcess[str]:
    """`kubectl ipmasq ...` as an operator runs it: kubectl finds the plugin on PATH (the package's script)."""
    env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig),
           "PATH": f"{Path(sys.executable).parent}:{os.path.dirname(cluster.artifacts.toolchain.kubectl)}:"
                   f"{os.environ.get('PATH', '/usr/bin:/bin')}"}
    return subprocess.run([cluster.artifacts.toolchain.kubectl, "ipmasq", *args], capture_output=True, text=True,
                          env=env, timeout=600)


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
    dry = _kubectl_ipmasq(cluster, "uninstall", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    for node in cluster.nodes:
        assert f"on node {node.name}" in dry.stdout
    assert set(agent.agent_pods(cluster)) == {n.name for n in cluster.nodes}  # the dry run changed nothing
    assert {node.name: _ours_on(cluster, node) for node in cluster.nodes} == before
    started = time.monotonic()
    result = _kubectl_ipmasq(cluster, "uninstall")
    seconds = time.monotonic() - started
    assert result.returncode == 0, result.stdout + result.stderr
    assert not agent.agent_pods(cluster)
    left = cluster.kubectl_json("get", "pods", "-n", "kube-system", "-l", "app.kubernetes.io/name=ipmasq-uninstall")
    assert not left["items"]
    for node in cluster.nodes:
        assert _ours_on(cluster, node) == [], node.name
    assert _ipmasq_in_the_api(cluster) == []
    assert cluster.kubectl("get", "configmap", agent.CONFIGMAP, "-n", "kube-system", check=False).returncode == 0
    per_node = [line for line in result.stdout.splitlines() if line.startswith("node ")]
    assert len(per_node) == len(cluster.nodes) and all("removed: " in line for line in per_node), result.stdout
    progress(f"kubectl ipmasq uninstall ({backend}{', with the webhook' if backend == 'iptables' else ''}) in "
             f"{seconds:.1f} s: " + " | ".join(per_node) + f" | {result.stdout.splitlines()[-1]}")
