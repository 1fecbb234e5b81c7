"""The agent and the observer run exactly as the shipped overlays render them (kubectl kustomize: their arguments and
environment, the downward API's status.hostIP substituted for $(HOST_IP) as kubelet does), in a node's network
namespace: every declared container port is scraped from another namespace (where Prometheus would be) and answers
/metrics, the status port stays on the node's loopback, and the probes, run as kubelet runs them, pass.

An enforcing agent (deploy/overlays/gke, and the base) and an observer (deploy/overlays/observe) alone, then side by
side on one node, where the observer sees the enforcing agent's rules enforce the config.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from ipmasq.lab.netns import Namespace, Network
from tests.eventually import eventually
from tests.kernel.agent_harness import AgentProcess, agent
from tests.manifests import FIELDS, KUSTOMIZATIONS, argv, container_env, kustomize, workloads

NODE_IP, SCRAPER_IP = "10.142.15.203", "10.142.0.1"
POD_FIELDS = {**FIELDS, "status.hostIP": NODE_IP, "status.podIP": NODE_IP}

# GET one URL from inside a namespace: the status and the body, or the failure (refused: nothing listens)
_GET = """
import sys, urllib.error, urllib.request
try:
    answer = urllib.request.urlopen(sys.argv[1], timeout=5)
    print(answer.status); sys.stdout.write(answer.read().decode())
except urllib.error.HTTPError as e:
    print(e.code); sys.stdout.write(e.read().decode())
except OSError as e:
    print(0); print(getattr(e, "reason", e))
"""


def _get(namespace: Namespace, url: str) -> tuple[int, str]:
    out = namespace.run([sys.executable, "-c", _GET, url]).stdout
    code, _, body = out.partition("\n")
    return int(code), body


@contextmanager
def _node(net: Network) -> Iterator[tuple[Namespace, Namespace]]:
    node, scraper = net.add("node"), net.add("scraper")
    net.link(node, [f"{NODE_IP}/20"], scraper, [f"{SCRAPER_IP}/20"])
    for namespace in (node, scraper):
        namespace.sysctl("net.ipv4.tcp_max_tw_buckets", "0")
    yield node, scraper


def _container(kustomization: str) -> dict[str, Any]:
    (workload,) = workloads(kustomize(KUSTOMIZATIONS[kustomization]))
    assert workload["spec"]["template"]["spec"]["hostNetwork"] is True  # the node's namespace is the pod's
    (container,) = workload["spec"]["template"]["spec"]["containers"]
    return container


@contextmanager
def _run_as_rendered(node: Namespace, tmp_path: Path, kustomization: str) -> Iterator[AgentProcess]:
    container = _container(kustomization)
    words = argv(container, POD_FIELDS)
    assert words[0] == "agent" and f"--prometheus-address={NODE_IP}:" in " ".join(words), words
    with agent(node, tmp_path / f"{kustomization}.log", *words[1:], env=container_env(container, POD_FIELDS)) as run:
        yield run


def _probe(node: Namespace, container: dict[str, Any], kind: str) -> subprocess.CompletedProcess[str]:
    """The probe's exec command, inside the pod's (the node's) network namespace, as kubelet runs it."""
    command = container[kind]["exec"]["command"]
    assert command[0] == "ipmasq"
    return node.run([sys.executable, "-m", "ipmasq", *command[1:]], check=False,
                    env=container_env(container, POD_FIELDS))


def _metrics(text: str) -> dict[str, float]:
    return {f"{s.name}{sorted(s.labels.items())}" if s.labels else s.name: s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _scraped_on_every_declared_port(node: Namespace, scraper: Namespace, running: AgentProcess,
                                    kustomization: str) -> dict[int, dict[str, float]]:
    """Each declared port answers /metrics on the node's address, seen from the scraper; the status port answers
    only on the node's loopback; both probes pass. The samples scraped, by port."""
    container = _container(kustomization)
    scraped = {}
    for port in container["ports"]:
        url = f"http://{NODE_IP}:{port['containerPort']}/metrics"
        eventually(lambda url=url: _get(scraper, url)[0] == 200,
                   lambda url=url: f"an answer 200 from {url}: {_get(scraper, url)}\n{running.log}")
        samples = _metrics(_get(scraper, url)[1])
        assert samples["ipmasq_ready"] in (0.0, 1.0) and "ipmasq_syncs_total[('result', 'in-sync')]" in samples
        assert _get(scraper, f"http://{NODE_IP}:{port['containerPort']}/settings")[0] == 404  # /metrics alone
        scraped[port["containerPort"]] = samples
    (status,) = [a.split("=", 1)[1] for a in argv(container, POD_FIELDS) if a.startswith("--metrics-address=")]
    status_port = status.rsplit(":", 1)[1]
    assert _get(node, f"http://{status}/healthz")[0] == 200
    # loopback only: off the node, refused (or, side by side, the other agent's /metrics-only listener: 404)
    assert _get(scraper, f"http://{NODE_IP}:{status_port}/healthz")[0] in (0, 404)
    for kind in ("readinessProbe", "livenessProbe"):
        eventually(lambda kind=kind: _probe(node, container, kind).returncode == 0,
                   lambda kind=kind: f"the {kind} passing: {_probe(node, container, kind)}\n{running.log}")
    return scraped


@pytest.mark.parametrize("kustomization", ["gke", "base"])
def test_the_enforcing_agent_as_rendered_is_scraped_on_every_declared_port(net: Network, tmp_path: Path,
                                                                          kustomization: str) -> None:
    with _node(net) as (node, scraper), _run_as_rendered(node, tmp_path, kustomization) as running:
        (samples,) = _scraped_on_every_declared_port(node, scraper, running, kustomization).values()
        assert samples["ipmasq_syncs_total[('result', 'applied')]"] >= 1
        chain = "IP-MASQ" if kustomization == "gke" else "IP-MASQ-AGENT"  # GKE's flags are in force
        assert f":{chain} " in node.run(["iptables-save", "-t", "nat"]).stdout


def test_the_observer_as_rendered_is_scraped_on_every_declared_port(net: Network, tmp_path: Path) -> None:
    with _node(net) as (node, scraper), _run_as_rendered(node, tmp_path, "observe") as running:
        (samples,) = _scraped_on_every_declared_port(node, scraper, running, "observe").values()
        # nobody writes GKE's chain on this node: observed out of sync, and ready (it reports, never leaves service)
        eventually(lambda: _metrics(_get(scraper, f"http://{NODE_IP}:9849/metrics")[1])
                          .get("ipmasq_syncs_total[('result', 'out-of-sync')]", 0) >= 1,
                   lambda: f"an out-of-sync pass served on the node's address\n{running.log}")
        (build,) = [key for key in samples if key.startswith("ipmasq_build_info")]
        assert "('backend', 'observe (gke)')" in build
        assert node.run(["iptables-save", "-t", "nat"]).stdout.count("\n-A ") == 0  # it wrote nothing


def test_an_enforcing_and_an_observing_install_side_by_side_serve_every_port_of_both(net: Network,
                                                                                    tmp_path: Path) -> None:
    """deploy/overlays/gke and deploy/overlays/observe on one node (both DaemonSets tolerate every taint): no port
    taken twice, both scraped, and the observer sees the rules the enforcing agent wrote enforce the config."""
    with _node(net) as (node, scraper), ExitStack() as stack:
        enforcing = stack.enter_context(_run_as_rendered(node, tmp_path, "gke"))
        observing = stack.enter_context(_run_as_rendered(node, tmp_path, "observe"))
        _scraped_on_every_declared_port(node, scraper, enforcing, "gke")
        _scraped_on_every_declared_port(node, scraper, observing, "observe")
        eventually(lambda: _metrics(_get(scraper, f"http://{NODE_IP}:9849/metrics")[1])
                          .get("ipmasq_syncs_total[('result', 'in-sync')]", 0) >= 1,
                   lambda: f"the observer's in-sync pass served on the node's address\n{observing.log}")
        assert not observing.lines("cannot listen") and not enforcing.lines("cannot listen")
