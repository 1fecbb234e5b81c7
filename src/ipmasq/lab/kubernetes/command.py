"""`ipmasq lab --kubernetes`: build (or take from the cache) what the cluster runs, bring it up, run the scenarios,
and take everything down again (or leave it up with --keep, for kubectl; --down removes it later)."""

from __future__ import annotations

import argparse
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ipmasq
from ipmasq.documents import print_document
from ipmasq.errors import UsageError
from ipmasq.lab.kubernetes.artifacts import cache_dir, ensure_artifacts, prometheus_binary
from ipmasq.lab.kubernetes.cluster import Cluster, cluster_is_up, tear_down
from ipmasq.lab.kubernetes.layout import NETNS_PREFIX, state_dir
from ipmasq.lab.netns import Network

__all__ = ["find_source", "run_kubernetes_lab"]


def find_source(given: str | None) -> Path:
    """The checkout whose Dockerfile and deploy/ the lab uses: --source, the one this ipmasq runs from (an
    editable install), or the current directory."""
    candidates = [Path(given)] if given is not None else [Path(ipmasq.__file__).resolve().parents[2], Path.cwd()]
    for candidate in candidates:
        if (candidate / "Dockerfile").is_file() and (candidate / "deploy" / "kustomization.yaml").is_file():
            return candidate
    raise UsageError(f"{candidates[0]}: not an ipmasq checkout (no Dockerfile and deploy/): pass --source DIR")


def run_kubernetes_lab(args: argparse.Namespace, *, print_scenario: Callable[[Any], None]) -> int:
    from ipmasq.lab.kubernetes.agent import deploy_agent
    from ipmasq.lab.kubernetes.scenarios import run_scenario, scenario_backend
    from ipmasq.lab.kubernetes.webhook import deploy_webhook, wait_webhook_serving
    from ipmasq.lab.run import ScenarioResult
    from ipmasq.lab.scenarios import SCENARIOS

    if args.down:
        tear_down()
        print(f"removed the Kubernetes lab (processes, namespaces {NETNS_PREFIX}-*, {state_dir()})")
        return 0
    if args.prepare:
        pass  # building touches no cluster: one may be up meanwhile
    elif cluster_is_up():
        raise UsageError("a Kubernetes lab cluster is already up (left by --keep?): "
                         "ipmasq lab --kubernetes --down removes it")
    else:
        tear_down()  # what a killed run may have left: stale namespaces and state
    started = time.monotonic()
    text = args.output == "text"

    def progress(line: str) -> None:
        print(f"[{time.monotonic() - started:6.1f} s] {line}", file=sys.stderr, flush=True)

    source = find_source(args.source)
    artifacts = ensure_artifacts(source, progress)
    if args.prepare:
        # the Prometheus the lab's monitoring test scrapes the agents with: built here too, so that no compiler runs
        # beside the lab's timed tests (a scenario run needs none)
        prometheus_binary(progress)
    progress(f"artifacts ready (cache: {cache_dir()})")
    if args.prepare:
        return 0
    chosen = list(SCENARIOS.values()) if args.scenario == "all" else [SCENARIOS[args.scenario]]
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    cluster = Cluster(artifacts, source, Network(NETNS_PREFIX), state_dir())
    results: list[ScenarioResult] = []
    seconds: list[float] = []
    kept = False
    try:
        cluster.up(progress)
        cluster.save()
        progress("cluster up")
        # the admission webhook, as shipped: every scenario's ConfigMap goes through it, and --keep leaves it
        progress(f"admission webhook serving (deploy/webhook, {deploy_webhook(cluster):.0f} s)")
        for index, scenario in enumerate(chosen):
            begun = time.monotonic()
            backend = args.backend or scenario_backend(index)
            results.append(run_scenario(cluster, scenario, progress=progress, backend=backend))
            seconds.append(time.monotonic() - begun)
            if text:
                print_scenario(results[-1])
                print(f"   ({seconds[-1]:.0f} s)\n")
        if args.keep:
            deploy_agent(cluster)  # the shipped DaemonSet, running as a user's would
            # the scenarios restart the kubelets, which makes every pod unready until its next probe: the cluster is
            # handed over once the API server calls the webhook again
            wait_webhook_serving(cluster)
            kept = True
    finally:
        if kept:
            _print_keep(cluster, json_output=not text)
        else:
            tear_down(cluster.net)
    ok = all(r.ok for r in results)
    if not text:
        report: dict[str, object] = {"ok": ok, "scenarios": [
            {"name": r.name, "summary": r.summary, "ok": r.ok, "error": r.error, "seconds": round(s, 1),
             "phases": [{"name": p.name, "ok": p.ok, "probes": [o.as_dict() for o in p.probes]} for p in r.phases]}
            for r, s in zip(results, seconds, strict=True)]}
        if kept:
            report.update(cluster.describe())
        print_document(args.output, "KubernetesLabReport", report)
    else:
        print(f"{'all scenarios behaved as explain predicts' if ok else 'SOME PROBES DIFFER FROM THE PREDICTION'}")
    return 0 if ok else 1


def _print_keep(cluster: Cluster, *, json_output: bool) -> None:
    if json_output:
        return  # -o json carries kubeconfig, nodes and pods
    facts = cluster.describe()
    out = sys.stderr
    print(f"\nthe cluster is up; kubeconfig: {facts['kubeconfig']}", file=out)
    print(f"  export KUBECONFIG={facts['kubeconfig']}", file=out)
    for node in facts["nodes"]:
        print(f"  node {node['name']} ({node['pool']}) {node['address']}, pods {node['pod_cidr']}, "
              f"network namespace {node['netns']}", file=out)
    for pod in facts["pods"]:
        print(f"  pod {pod['namespace']}/{pod['name']} on {pod['node']} ({pod['ip']})", file=out)
    probe = next((p for p in facts["pods"] if p["namespace"] == "ipmasq-lab"), None)
    if probe is not None:
        print(f"  a probe from a pod:  kubectl exec -n ipmasq-lab {probe['name']} -- "
              "python -m ipmasq.lab.probe connect 172.30.12.110 443", file=out)
    print("  the agent's check:   kubectl exec -n kube-system ds/ip-masq-agent -- ipmasq check", file=out)
    print("  the webhook:         kubectl apply -f CONFIGMAP  (a bad config is denied with its line; kubectl -n "
          "kube-system logs deploy/ipmasq-webhook)", file=out)
    print("  remove everything:   ipmasq lab --kubernetes --down", file=out)
