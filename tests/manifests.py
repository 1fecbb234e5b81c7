"""deploy/ as kubectl renders it, and what its workloads serve: every kustomization, the combinations operators apply
together, and for each DaemonSet and Deployment its container's arguments read by ipmasq's own parser (with the
pod's environment substituted as kubelet substitutes it), so a declared port, a probe or a PodMonitor is held to the
listeners the program really opens, not to a string in a list.

Used by the unit tests (tests/unit/test_deploy*.py) and by the kernel test that starts the agent exactly as a
rendered overlay runs it (tests/kernel/agent/test_rendered_listeners.py).
"""

from __future__ import annotations

import copy
import subprocess
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path
from typing import Any

import yaml

from tests.conftest import ROOT
from tests.tools import KUBECTL, need

DEPLOY = ROOT / "deploy"
OVERLAYS = DEPLOY / "overlays"
OBSERVE = OVERLAYS / "observe"
# Every kustomization an operator applies, by the name the tests give it.
KUSTOMIZATIONS: dict[str, Path] = {
    "base": DEPLOY, "gke": OVERLAYS / "gke", "gke-webhook": OVERLAYS / "gke" / "webhook",
    "observe": OBSERVE, "observe-aks": OBSERVE / "aks", "observe-eks": OBSERVE / "eks",
    "webhook": DEPLOY / "webhook", "monitoring": DEPLOY / "monitoring",
}
# What operators apply together (docs/operations/install.md, docs/how-to/observe-a-provider-agent.md): the agent with
# its monitoring, GKE's with the webhook judging as GKE's agent reads, each observer with monitoring, and an enforcing
# and an observing install side by side (same nodes: both DaemonSets tolerate every taint).
COMBINATIONS: dict[str, tuple[str, ...]] = {
    "base+monitoring": ("base", "monitoring"),
    "base+monitoring+webhook": ("base", "monitoring", "webhook"),
    "gke+monitoring+webhook": ("gke", "monitoring", "gke-webhook"),
    "observe+monitoring": ("observe", "monitoring"),
    "observe+monitoring+webhook": ("observe", "monitoring", "gke-webhook"),
    "observe-eks+monitoring": ("observe-eks", "monitoring"),
    "observe-aks+monitoring": ("observe-aks", "monitoring"),
    "base+observe+monitoring": ("base", "observe", "monitoring"),
    "gke+observe-eks+monitoring": ("gke", "observe-eks", "monitoring"),
}
WORKLOAD_KINDS = ("DaemonSet", "Deployment")
# The downward API's values for a pod of the tests (status.hostIP: TEST-NET-2, never an address of this machine).
FIELDS = {"status.hostIP": "198.51.100.7", "status.podIP": "198.51.100.7", "spec.nodeName": "node-a",
          "metadata.name": "pod-a", "metadata.namespace": "kube-system"}
LOOPBACK = ("127.0.0.1", "::1", "localhost")
EVERYWHERE = ("", "0.0.0.0", "::")


def kubectl() -> str:
    return need("kubectl", KUBECTL)


@cache
def _rendered(path: Path) -> str:
    result = subprocess.run([kubectl(), "kustomize", str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stderr == "", result.stderr  # today's fields: no deprecation warning from kubectl's kustomize
    return result.stdout


def kustomize(path: Path) -> list[dict[str, Any]]:
    """`kubectl kustomize PATH`'s documents (rendered once per run; each call gets its own copy)."""
    return [d for d in yaml.safe_load_all(_rendered(path)) if d]


def object_id(doc: Mapping[str, Any]) -> tuple[str, str, str]:
    return doc["kind"], doc["metadata"].get("namespace", ""), doc["metadata"]["name"]


def combine(names: Iterable[str]) -> tuple[list[dict[str, Any]], list[str]]:
    """The objects a cluster holds after `kubectl apply -k` of each kustomization in turn, and the conflicts."""
    return applied_in_turn([(name, kustomize(KUSTOMIZATIONS[name])) for name in names])


def applied_in_turn(rendered: Iterable[tuple[str, list[dict[str, Any]]]]) -> tuple[list[dict[str, Any]], list[str]]:
    """The objects of each (name, documents) applied in turn, and the conflicts: an object two of them ship
    differently (the later apply would overwrite the earlier one's)."""
    held: dict[tuple[str, str, str], tuple[str, dict[str, Any]]] = {}
    conflicts = []
    for name, docs in rendered:
        for doc in docs:
            key = object_id(doc)
            if key in held and held[key][1] != doc:
                conflicts.append(f"{'/'.join(k for k in key if k)}: {held[key][0]} and {name} ship it differently")
            held.setdefault(key, (name, doc))
    return [doc for _, doc in held.values()], conflicts


def workloads(docs: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    return [copy.deepcopy(dict(d)) for d in docs if d["kind"] in WORKLOAD_KINDS]


# --- the pod's environment, as kubelet builds it -----------------------------------------------------------------

def expand(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes' `$(VAR)` expansion (k8s.io/kubernetes third_party/forked/golang/expansion): a defined VAR is
    replaced, an undefined one stays as written, `$$` is one `$`."""
    out, i = [], 0
    while i < len(text):
        if text[i] == "$" and i + 1 < len(text):
            if text[i + 1] == "$":
                out.append("$")
                i += 2
                continue
            if text[i + 1] == "(":
                end = text.find(")", i + 2)
                if end != -1:
                    name = text[i + 2:end]
                    out.append(env[name] if name in env else text[i:end + 1])
                    i = end + 1
                    continue
        out.append(text[i])
        i += 1
    return "".join(out)


def container_env(container: Mapping[str, Any], fields: Mapping[str, str] = FIELDS) -> dict[str, str]:
    """The container's environment: plain values (expanded against the ones before them) and the downward API's."""
    env: dict[str, str] = {}
    for entry in container.get("env", ()):
        if "value" in entry:
            env[entry["name"]] = expand(str(entry["value"]), env)
        else:
            path = entry["valueFrom"]["fieldRef"]["fieldPath"]
            assert path in fields, f"env {entry['name']}: a field the tests do not give: {path}"
            env[entry["name"]] = fields[path]
    return env


def argv(container: Mapping[str, Any], fields: Mapping[str, str] = FIELDS) -> list[str]:
    """The container's arguments as the program receives them (the image's entrypoint is `ipmasq`)."""
    env = container_env(container, fields)
    return [expand(str(arg), env) for arg in [*container.get("command", ()), *container.get("args", ())]]


def parse(words: list[str]) -> Any:
    """ipmasq's own parser for `words` (COMMAND FLAGS...): an unknown flag or a bad value fails the test."""
    from ipmasq.cli import NO_GO_FLAGS, build_parser
    from ipmasq.goflags import normalise_go_flags

    parser = build_parser(words[0])
    args, extra = parser.parse_known_args(words if words[0] in NO_GO_FLAGS else normalise_go_flags(words))
    assert not extra, f"{words[0]}: unrecognized arguments {extra}"
    return args


# --- what a container serves --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Listener:
    flag: str
    host: str  # "" or a wildcard: every address
    port: int
    scheme: str
    paths: frozenset[str]

    @property
    def loopback_only(self) -> bool:
        return self.host in LOOPBACK

    def reaches(self, host: str) -> bool:
        """Whether a connection to `host` (an address of the pod's network namespace) lands on this listener."""
        return self.host in EVERYWHERE or self.host == host


_CANDIDATE_PATHS = ("/metrics", "/healthz", "/readyz", "/settings", "/validate")


def _agent_paths(metrics_only: bool) -> frozenset[str]:
    """The paths an agent's listener answers (not 404), asked of the agent's own responders."""
    from ipmasq.agent.health import respond, respond_metrics_only
    from ipmasq.agent.metrics import AgentVitals

    answer = respond_metrics_only if metrics_only else respond
    status = AgentVitals(version="test", backend="test")
    return frozenset(p for p in _CANDIDATE_PATHS if answer(status, p).status != 404)


def listeners(container: Mapping[str, Any], fields: Mapping[str, str] = FIELDS) -> list[Listener]:
    """The sockets the container's program opens, from its parsed arguments (defaults included)."""
    from ipmasq.agent.health_probe import parse_listen_address

    words = argv(container, fields)
    assert words[:1] in (["agent"], ["webhook"]), f"not a workload of ipmasq's: {words[:2]}"
    args = parse(words)
    found = []
    if words[0] == "agent":
        if args.once:
            return []
        for flag, address, metrics_only in (("--metrics-address", args.metrics_address, False),
                                             ("--prometheus-address", args.prometheus_address, True)):
            if address:
                host, port = parse_listen_address(address)
                found.append(Listener(flag, host, port, "HTTP", _agent_paths(metrics_only)))
    else:
        from ipmasq.webhook.server import VALIDATE_PATH

        host, port = parse_listen_address(args.listen)
        found.append(Listener("--listen", host, port, "HTTPS", frozenset({VALIDATE_PATH, "/healthz", "/readyz"})))
    return found


def pod_address(pod: Mapping[str, Any], fields: Mapping[str, str] = FIELDS) -> str:
    return fields["status.hostIP"] if pod.get("hostNetwork") else fields["status.podIP"]


def probe_target(probe: Mapping[str, Any], container: Mapping[str, Any], pod: Mapping[str, Any],
                 fields: Mapping[str, str] = FIELDS) -> tuple[str, str, int, str]:
    """(scheme, host, port, path) a probe asks: an exec probe's `ipmasq health` inside the pod, an httpGet's
    kubelet from outside it (a named port resolved through the container's ports)."""
    from ipmasq.agent.health_probe import parse_listen_address

    if "exec" in probe:
        env = container_env(container, fields)
        command = [expand(word, env) for word in probe["exec"]["command"]]
        assert command[:2] == ["ipmasq", "health"], command
        args = parse(command[1:])
        host, port = parse_listen_address(args.address)
        return "HTTP", host or "127.0.0.1", port, "/healthz" if args.live else "/readyz"
    get = probe["httpGet"]
    port = get["port"]
    if isinstance(port, str):
        named = [p["containerPort"] for p in container.get("ports", ()) if p.get("name") == port]
        assert named, f"probe port {port!r} is not a port of the container"
        port = named[0]
    return get.get("scheme", "HTTP"), get.get("host", pod_address(pod, fields)), int(port), get.get("path", "/")


def workload_findings(workload: Mapping[str, Any], fields: Mapping[str, str] = FIELDS) -> list[str]:
    """What does not hold of one DaemonSet or Deployment: every declared port has a listener on it, reachable on the
    pod's address; every listener reachable off the pod is a declared port; every probe asks a served address."""
    pod = workload["spec"]["template"]["spec"]
    name = f"{workload['kind']} {workload['metadata']['name']}"
    findings = []
    for container in pod["containers"]:
        served = listeners(container, fields)
        address = pod_address(pod, fields)
        for port in container.get("ports", ()):
            on = [s for s in served if s.port == port["containerPort"]]
            if port.get("protocol", "TCP") != "TCP" or not on:
                findings.append(f"{name}: port {port.get('name')} {port['containerPort']}: nothing listens on it")
            elif not any(s.reaches(address) for s in on):
                findings.append(f"{name}: port {port.get('name')} {port['containerPort']}: served on "
                                f"{', '.join(s.host for s in on)} only, not the pod's address")
        declared = {p["containerPort"] for p in container.get("ports", ())}
        for s in served:
            if not s.loopback_only and s.port not in declared:
                findings.append(f"{name}: {s.flag} listens on {s.host or '*'}:{s.port}, no declared port")
        for kind in ("livenessProbe", "readinessProbe", "startupProbe"):
            if kind not in container:
                continue
            scheme, host, port, path = probe_target(container[kind], container, pod, fields)
            if not any(s.port == port and s.reaches(host) and s.scheme == scheme and path in s.paths
                       for s in served):
                findings.append(f"{name}: {kind} asks {scheme} {host}:{port}{path}, which nothing serves")
    return findings


# --- which pods a PodMonitor keeps --------------------------------------------------------------------------------

def selects(selector: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    """A Kubernetes label selector (matchLabels, matchExpressions) against a pod's labels."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expression in selector.get("matchExpressions", ()):
        key, operator, values = expression["key"], expression["operator"], expression.get("values", [])
        held = {"In": key in labels and labels[key] in values, "NotIn": labels.get(key) not in values,
                "Exists": key in labels, "DoesNotExist": key not in labels}[operator]
        if not held:
            return False
    return True


def scraped_jobs(monitor: Mapping[str, Any], workload: Mapping[str, Any],
                 fields: Mapping[str, str] = FIELDS) -> list[str]:
    """The jobs under which the PodMonitor scrapes a /metrics the workload's pods serve (empty: not scraped)."""
    spec = monitor["spec"]
    template = workload["spec"]["template"]
    namespaces = spec.get("namespaceSelector", {})
    namespace = workload["metadata"].get("namespace", "")
    if not namespaces.get("any") and namespace not in namespaces.get("matchNames", [monitor["metadata"]["namespace"]]):
        return []
    labels = template["metadata"].get("labels", {})
    if not selects(spec["selector"], labels):
        return []
    pod = template["spec"]
    jobs = []
    for endpoint in spec["podMetricsEndpoints"]:
        path, scheme = endpoint.get("path", "/metrics"), endpoint.get("scheme", "http")
        for container in pod["containers"]:
            ports = [p["containerPort"] for p in container.get("ports", ()) if p.get("name") == endpoint["port"]]
            served = [s for s in listeners(container, fields) if s.port in ports]
            if any(s.reaches(pod_address(pod, fields)) and path in s.paths and s.scheme.lower() == scheme
                   for s in served):
                jobs.append(labels.get(spec.get("jobLabel", ""), f"podMonitor/{monitor['metadata']['name']}"))
    return jobs


def policy_flags(container: Mapping[str, Any]) -> tuple[str, Any]:
    """(the ConfigMap whose content the container judges by these flags, "" when it follows no ip-masq-agent
    ConfigMap: an observer of AKS's or EKS's inputs; its policy options) from its parsed arguments."""
    from ipmasq.commands.common import options_from_args
    from ipmasq.writers import REFERENCE_CONFIGMAP, WRITERS

    words = argv(container)
    args = parse(words)
    writer = getattr(args, "observe", None) if words[0] == "agent" else None
    reads_the_configmap = writer is None or REFERENCE_CONFIGMAP in getattr(WRITERS.get(writer), "configmaps",
                                                                          (REFERENCE_CONFIGMAP,))
    return ("ip-masq-agent" if reads_the_configmap else ""), replace(options_from_args(args), node_name=None)


def hostport_clashes(workloads_: list[dict[str, Any]], fields: Mapping[str, str] = FIELDS) -> list[str]:
    """Listeners of host-network DaemonSets that run on the same nodes (the shipped ones tolerate every taint and
    select no node) that would take the same address and port: the later one could never bind."""
    taken: dict[tuple[str, int], str] = {}
    clashes = []
    for workload in workloads_:
        pod = workload["spec"]["template"]["spec"]
        if workload["kind"] != "DaemonSet" or not pod.get("hostNetwork"):
            continue
        for container in pod["containers"]:
            for s in listeners(container, fields):
                host = "*" if s.host in EVERYWHERE else s.host
                for (other_host, port), owner in taken.items():
                    if port == s.port and (host == other_host or "*" in (host, other_host)):
                        clashes.append(f"{workload['metadata']['name']} {s.flag} {host}:{s.port} and {owner}")
                taken[(host, s.port)] = f"{workload['metadata']['name']} {s.flag}"
    return clashes
