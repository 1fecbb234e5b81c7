"""ipmasq removed from a whole cluster (`kubectl ipmasq uninstall`): the agent from every node and its rules with it,
then everything of ipmasq in the API; the user's `ip-masq-agent` ConfigMap stays.

The agent leaves its rules on SIGTERM on purpose (a restart must not cost a node its SNAT), so deleting the
DaemonSet alone leaves the last config enforced on every node with nothing repairing or reporting it. The order:

    1. the agent's DaemonSet deleted, and its pods waited for until gone: nothing re-adds the rules after step 2;
    2. on every node, a short-lived pod with the agent's image and privileges (hostNetwork, NET_ADMIN, NET_RAW, the
       xtables lock) runs `ipmasq uninstall`: our chain and jumps in both iptables variants and both families, and
       our nftables table; what it removed comes back as the pod's termination message, and the pod is deleted;
    3. the API objects: the webhook's configuration first (no call to a webhook being removed), its Deployment and
       the rest of deploy/webhook, deploy/monitoring's PodMonitor and PrometheusRule, the agents' status objects
       and their CRD, the Lease, the RBAC and the service account; then the pods those owned (the webhook's, the
       observers') waited for until gone.

An object already gone is not an error (an uninstall run twice, or after `kubectl delete -k deploy/`). A node whose
pod does not finish is reported and makes the run fail, with what to run on that node by hand; the rest goes on.
`plan` (the --dry-run) reads only. The work goes through ipmasq.kube.client (the one API client); the clock and the
wait are injected, so the unit tests run it against a fake API at once.
"""

from __future__ import annotations

import contextlib
import hashlib
import shlex
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from ipmasq.errors import ApiError, NotFound, one_line
from ipmasq.version import IMAGE

__all__ = ["AGENT_SELECTOR", "API_OBJECTS", "DEFAULT_IMAGE", "ApiObject", "NodeOutcome", "Plan", "Report",
           "UninstallApi", "describe", "main", "plan", "uninstall"]

NAMESPACE = "kube-system"
DAEMONSET = "ip-masq-agent"
AGENT_SELECTOR = "k8s-app=ip-masq-agent"
CONFIGMAP = "ip-masq-agent"  # the user's: never removed
DEFAULT_IMAGE = IMAGE  # when the DaemonSet is already gone (--image overrides)
POD_LABEL = {"app.kubernetes.io/name": "ipmasq-uninstall"}
POD_SELECTOR = "app.kubernetes.io/name=ipmasq-uninstall"
POD_GONE_SECONDS = 60.0
# the pods of what step 3 deletes, removed by the garbage collector after their owner: waited for, so that nothing
# of ipmasq is left when the run ends (the webhook's, the observers')
OWNED_POD_SELECTORS = ("app.kubernetes.io/name=ipmasq-webhook", "k8s-app=ipmasq-observer")
STATUS_PATH = "/apis/ipmasq.dev/v1alpha1/ipmasqagentstatuses"
TERMINATION_MESSAGE_BYTES = 4096  # what kubelet keeps of a termination message
POLL_SECONDS = 0.5


@dataclass(frozen=True, slots=True)
class ApiObject:
    """One object of ipmasq in the API: how it is named to people and where it lives."""

    kind: str
    name: str
    path: str  # the object's API path

    @property
    def label(self) -> str:
        return f"{self.kind.lower()}/{self.name}"


def _namespaced(group_version: str, plural: str, kind: str, namespace: str, name: str) -> ApiObject:
    base = "/api/v1" if group_version == "v1" else f"/apis/{group_version}"
    return ApiObject(kind, f"{namespace}/{name}", f"{base}/namespaces/{namespace}/{plural}/{name}")


def _cluster(group_version: str, plural: str, kind: str, name: str) -> ApiObject:
    base = "/api/v1" if group_version == "v1" else f"/apis/{group_version}"
    return ApiObject(kind, name, f"{base}/{plural}/{name}")


RBAC = "rbac.authorization.k8s.io/v1"
# Everything deploy/, deploy/webhook and deploy/monitoring install (a unit test keeps this list equal to what
# kustomize renders), in the order removed, and the webhook's certificate Secret, which it makes itself. The
# DaemonSet is step 1; the status objects go before their CRD.
WEBHOOK_OBJECTS = (
    _cluster("admissionregistration.k8s.io/v1", "validatingwebhookconfigurations", "ValidatingWebhookConfiguration",
             "ipmasq-webhook"),
    _namespaced("apps/v1", "deployments", "Deployment", NAMESPACE, "ipmasq-webhook"),
    _namespaced("policy/v1", "poddisruptionbudgets", "PodDisruptionBudget", NAMESPACE, "ipmasq-webhook"),
    _namespaced("v1", "services", "Service", NAMESPACE, "ipmasq-webhook"),
    _namespaced("v1", "secrets", "Secret", NAMESPACE, "ipmasq-webhook-certificate"),
    _namespaced(RBAC, "rolebindings", "RoleBinding", NAMESPACE, "ipmasq-webhook"),
    _namespaced(RBAC, "roles", "Role", NAMESPACE, "ipmasq-webhook"),
    _cluster(RBAC, "clusterrolebindings", "ClusterRoleBinding", "ipmasq-webhook"),
    _cluster(RBAC, "clusterroles", "ClusterRole", "ipmasq-webhook"),
    _namespaced("v1", "serviceaccounts", "ServiceAccount", NAMESPACE, "ipmasq-webhook"),
)
MONITORING_OBJECTS = (
    _namespaced("monitoring.coreos.com/v1", "podmonitors", "PodMonitor", NAMESPACE, "ip-masq-agent"),
    _namespaced("monitoring.coreos.com/v1", "prometheusrules", "PrometheusRule", NAMESPACE, "ip-masq-agent"),
)
CRD = _cluster("apiextensions.k8s.io/v1", "customresourcedefinitions", "CustomResourceDefinition",
               "ipmasqagentstatuses.ipmasq.dev")
AGENT_OBJECTS = (
    CRD,
    _namespaced("coordination.k8s.io/v1", "leases", "Lease", NAMESPACE, "ip-masq-agent"),
    _namespaced(RBAC, "rolebindings", "RoleBinding", NAMESPACE, "ip-masq-agent"),
    _namespaced(RBAC, "roles", "Role", NAMESPACE, "ip-masq-agent"),
    _namespaced(RBAC, "rolebindings", "RoleBinding", "default", "ip-masq-agent-node-events"),
    _namespaced(RBAC, "roles", "Role", "default", "ip-masq-agent-node-events"),
    _cluster(RBAC, "clusterrolebindings", "ClusterRoleBinding", "ip-masq-agent"),
    _cluster(RBAC, "clusterroles", "ClusterRole", "ip-masq-agent"),
    _namespaced("v1", "serviceaccounts", "ServiceAccount", NAMESPACE, "ip-masq-agent"),
)
# the admission policy that holds each agent to its own node: gone with the agents it holds
ADMISSION = "admissionregistration.k8s.io/v1"
POLICY_OBJECTS = (
    _cluster(ADMISSION, "validatingadmissionpolicybindings", "ValidatingAdmissionPolicyBinding",
             "ip-masq-agent-own-node"),
    _cluster(ADMISSION, "validatingadmissionpolicies", "ValidatingAdmissionPolicy", "ip-masq-agent-own-node"),
)
# observe mode (deploy/overlays/observe and its eks/ and aks/): it writes no rules, so no node is visited for it
OBSERVER = "ipmasq-observer"
OBSERVER_OBJECTS = (
    _namespaced("apps/v1", "daemonsets", "DaemonSet", NAMESPACE, OBSERVER),
    _namespaced(RBAC, "rolebindings", "RoleBinding", NAMESPACE, OBSERVER),
    _namespaced(RBAC, "roles", "Role", NAMESPACE, OBSERVER),
    _namespaced(RBAC, "rolebindings", "RoleBinding", NAMESPACE, f"{OBSERVER}-aws-node"),
    _namespaced(RBAC, "roles", "Role", NAMESPACE, f"{OBSERVER}-aws-node"),
    _namespaced(RBAC, "rolebindings", "RoleBinding", "default", f"{OBSERVER}-node-events"),
    _namespaced(RBAC, "roles", "Role", "default", f"{OBSERVER}-node-events"),
    _cluster(RBAC, "clusterrolebindings", "ClusterRoleBinding", OBSERVER),
    _cluster(RBAC, "clusterroles", "ClusterRole", OBSERVER),
    _namespaced("v1", "serviceaccounts", "ServiceAccount", NAMESPACE, OBSERVER),
)
AGENT_DAEMONSET = _namespaced("apps/v1", "daemonsets", "DaemonSet", NAMESPACE, DAEMONSET)
API_OBJECTS = (AGENT_DAEMONSET, *WEBHOOK_OBJECTS, *MONITORING_OBJECTS, *OBSERVER_OBJECTS, *POLICY_OBJECTS,
               *AGENT_OBJECTS)


class UninstallApi(Protocol):
    """What the uninstall asks of the API server (ipmasq.kube.client.KubeClient has it)."""

    def get(self, path: str, *, query: dict[str, str] | None = None) -> dict[str, Any]: ...

    def create(self, path: str, body: dict[str, Any]) -> dict[str, Any]: ...

    def delete(self, path: str) -> dict[str, Any]: ...


@dataclass(frozen=True, slots=True)
class Plan:
    """What an uninstall would remove, as read from the API (the --dry-run prints it)."""

    nodes: tuple[str, ...]
    image: str
    chain_flags: tuple[str, ...]  # the agent's --masq-chain, passed on so renamed chains go too
    agent_pods: tuple[str, ...]
    objects: tuple[ApiObject, ...]  # those present, in the order removed
    statuses: tuple[str, ...]  # the IPMasqAgentStatus objects (they go with their CRD)


@dataclass(frozen=True, slots=True)
class NodeOutcome:
    node: str
    ok: bool
    removed: tuple[str, ...]  # `ipmasq uninstall`'s lines: "removed: iptables (nft)", or "nothing to remove"
    why: str  # the failure, when not ok
    seconds: float


@dataclass(frozen=True, slots=True)
class Report:
    nodes: tuple[NodeOutcome, ...]
    removed: tuple[str, ...]  # the API objects removed, as kind/name
    seconds: float

    @property
    def ok(self) -> bool:
        return all(node.ok for node in self.nodes)


def _present(api: UninstallApi, path: str) -> dict[str, Any] | None:
    try:
        return api.get(path)
    except NotFound:
        return None


def _items(api: UninstallApi, path: str, query: dict[str, str] | None = None) -> list[dict[str, Any]]:
    try:
        answer = api.get(path, query=query)
    except NotFound:  # a kind whose CRD is not installed (the status objects, the Prometheus Operator's)
        return []
    items = answer.get("items")
    return [item for item in items if isinstance(item, dict)] if isinstance(items, list) else []


def _name(obj: dict[str, Any]) -> str:
    metadata = obj.get("metadata")
    name = metadata.get("name") if isinstance(metadata, dict) else None
    return name if isinstance(name, str) else ""


def plan(api: UninstallApi, *, image: str | None = None) -> Plan:
    """Read what is there: nodes, the agent's image and chain, its pods, ipmasq's objects. Writes nothing."""
    daemonset = _present(api, AGENT_DAEMONSET.path)
    container: dict[str, Any] = {}
    if daemonset is not None:
        containers = daemonset.get("spec", {}).get("template", {}).get("spec", {}).get("containers") or [{}]
        container = containers[0] if isinstance(containers[0], dict) else {}
    shipped_image = container.get("image") if isinstance(container.get("image"), str) else None
    args = [a for a in container.get("args") or [] if isinstance(a, str)]
    chain_flags = tuple(a for a in args if a.startswith("--masq-chain="))
    nodes = tuple(sorted(_name(n) for n in _items(api, "/api/v1/nodes") if _name(n)))
    pods = tuple(sorted(_name(p) for p in _items(api, f"/api/v1/namespaces/{NAMESPACE}/pods",
                                                 {"labelSelector": AGENT_SELECTOR})))
    objects = tuple(o for o in API_OBJECTS if _present(api, o.path) is not None)
    statuses = tuple(sorted(_name(s) for s in _items(api, STATUS_PATH) if _name(s)))
    return Plan(nodes, image or shipped_image or DEFAULT_IMAGE, chain_flags, pods, objects, statuses)


def describe(p: Plan) -> list[str]:
    """The --dry-run's lines: what would be removed, in order."""
    lines = [f"would delete {AGENT_DAEMONSET.label} and wait for its pods to go: "
             + (", ".join(p.agent_pods) if p.agent_pods else "(none running)")]
    chain = one_line(" ".join(p.chain_flags))
    lines += [f"would run `ipmasq uninstall{' ' + chain if chain else ''}` on node {one_line(node)} (pod with "
              f"image {one_line(p.image)}): iptables (legacy, nft) IPv4 and IPv6, nftables" for node in p.nodes]
    lines += [f"would delete {one_line(o.label)}" for o in p.objects if o != AGENT_DAEMONSET and o != CRD]
    if CRD in p.objects:
        lines.append(f"would delete {CRD.label} and its {len(p.statuses)} status object(s)"
                     + (f": {', '.join(one_line(s) for s in p.statuses)}" if p.statuses else ""))
    lines.append(f"would keep configmap/{NAMESPACE}/{CONFIGMAP} (yours)")
    return lines


def _pod(node: str, image: str, chain_flags: tuple[str, ...]) -> dict[str, Any]:
    """The pod that removes the rules on one node: the agent's own privileges and no more, its report written as
    the termination message (read from the pod's status: no log streaming needed)."""
    digest = hashlib.sha256(node.encode()).hexdigest()[:8]
    # the flags come from the DaemonSet (the API's word): quoted, never read by the shell as anything but words
    command = " ".join(["ipmasq", "uninstall", *map(shlex.quote, chain_flags)]) + " >/dev/termination-log 2>&1"
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"generateName": f"ipmasq-uninstall-{digest}-", "namespace": NAMESPACE,
                     "labels": dict(POD_LABEL)},
        "spec": {
            "nodeName": node, "hostNetwork": True, "restartPolicy": "Never", "automountServiceAccountToken": False,
            "priorityClassName": "system-node-critical", "tolerations": [{"operator": "Exists"}],
            "terminationGracePeriodSeconds": 5,
            "containers": [{
                "name": "uninstall", "image": image, "imagePullPolicy": "IfNotPresent",
                "command": ["/bin/sh", "-c", command],
                "terminationMessagePolicy": "File",
                "securityContext": {"privileged": False, "allowPrivilegeEscalation": False,
                                    "readOnlyRootFilesystem": True, "runAsUser": 0,
                                    "capabilities": {"drop": ["ALL"], "add": ["NET_ADMIN", "NET_RAW"]}},
                "volumeMounts": [{"name": "xtables-lock", "mountPath": "/run/xtables.lock"},
                                 {"name": "tmp", "mountPath": "/tmp"}],
            }],
            "volumes": [{"name": "xtables-lock", "hostPath": {"path": "/run/xtables.lock", "type": "FileOrCreate"}},
                        {"name": "tmp", "emptyDir": {"medium": "Memory", "sizeLimit": "1Mi"}}],
        },
    }


def _terminated(pod: dict[str, Any]) -> tuple[int, str] | None:
    """The container's exit code and termination message, once it has ended."""
    for status in pod.get("status", {}).get("containerStatuses") or []:
        terminated = status.get("state", {}).get("terminated") if isinstance(status, dict) else None
        if isinstance(terminated, dict):
            code = terminated.get("exitCode")
            message = terminated.get("message")
            return (code if isinstance(code, int) else -1,
                    message[:TERMINATION_MESSAGE_BYTES] if isinstance(message, str) else "")
    return None


def _wait_gone(api: UninstallApi, deadline: float, clock: Callable[[], float], sleep: Callable[[float], None],
               path: str, query: dict[str, str]) -> list[str]:
    """Wait until the list is empty or the deadline passes; what is left."""
    while True:
        left = [_name(item) for item in _items(api, path, query)]
        if not left or clock() >= deadline:
            return left
        sleep(POLL_SECONDS)


def _delete(api: UninstallApi, obj: ApiObject) -> bool:
    try:
        api.delete(obj.path)
    except NotFound:
        return False
    return True


def _run_on_nodes(api: UninstallApi, p: Plan, timeout: float, clock: Callable[[], float],
                  sleep: Callable[[float], None]) -> list[NodeOutcome]:
    started = clock()
    pods_path = f"/api/v1/namespaces/{NAMESPACE}/pods"
    created: dict[str, str] = {}
    outcomes: dict[str, NodeOutcome] = {}
    for node in p.nodes:
        try:
            created[node] = _name(api.create(pods_path, _pod(node, p.image, p.chain_flags)))
        except ApiError as exc:
            outcomes[node] = NodeOutcome(node, False, (), f"its pod could not be created: {one_line(str(exc))}", 0.0)
    deadline = started + timeout
    try:
        while len(outcomes) < len(p.nodes):
            for node, pod in created.items():
                if node in outcomes:
                    continue
                try:
                    ended = _terminated(api.get(f"{pods_path}/{pod}"))
                except ApiError as exc:
                    outcomes[node] = NodeOutcome(node, False, (), f"pod {pod}: {one_line(str(exc))}",
                                                 clock() - started)
                    continue
                if ended is None:
                    continue
                code, message = ended
                lines = tuple(one_line(line) for line in message.splitlines() if line.strip())
                outcomes[node] = (NodeOutcome(node, True, lines, "", clock() - started) if code == 0 else
                                  NodeOutcome(node, False, lines, f"ipmasq uninstall exited {code}",
                                              clock() - started))
            if len(outcomes) < len(p.nodes):
                if clock() >= deadline:
                    for node in p.nodes:
                        outcomes.setdefault(node, NodeOutcome(
                            node, False, (), f"its pod did not finish within {timeout:.0f} s (node down or the "
                            "image not pullable?)", clock() - started))
                    break
                sleep(POLL_SECONDS)
    finally:
        for pod in created.values():
            with contextlib.suppress(ApiError):  # reported by the node's outcome already, or gone
                api.delete(f"{pods_path}/{pod}")
    # gone before the run ends: nothing of the uninstall is left in the API either (kubelet confirms each deletion)
    _wait_gone(api, clock() + POD_GONE_SECONDS, clock, sleep, pods_path, {"labelSelector": POD_SELECTOR})
    return [outcomes[node] for node in p.nodes]


def uninstall(api: UninstallApi, *, image: str | None = None, timeout: float = 180.0,
              clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
              say: Callable[[str], None] = lambda line: None) -> Report:
    """Remove ipmasq from the cluster as the module's docstring says; `say` hears each step as it happens."""
    started = clock()
    p = plan(api, image=image)
    removed: list[str] = []
    if _delete(api, AGENT_DAEMONSET):
        removed.append(AGENT_DAEMONSET.label)
    left = _wait_gone(api, started + timeout, clock, sleep, f"/api/v1/namespaces/{NAMESPACE}/pods",
                      {"labelSelector": AGENT_SELECTOR})
    if left:
        raise ApiError(f"the agent's pods are still running {timeout:.0f} s after its DaemonSet was deleted: "
                       f"{one_line(', '.join(left))}; nothing else was removed")
    say(f"deleted {AGENT_DAEMONSET.label}: no agent pod is left ({clock() - started:.1f} s)")
    nodes = _run_on_nodes(api, p, timeout, clock, sleep)
    for outcome in nodes:
        say(_node_line(outcome))
    for obj in _in_order(p.objects):
        if obj == CRD:
            statuses = [_name(s) for s in _items(api, STATUS_PATH)]
            for status in statuses:
                if _delete(api, ApiObject("IPMasqAgentStatus", status, f"{STATUS_PATH}/{status}")):
                    removed.append(f"ipmasqagentstatus/{status}")
        if _delete(api, obj):
            removed.append(obj.label)
    for label in removed:
        if label != AGENT_DAEMONSET.label:  # said first, above
            say(f"deleted {one_line(label)}")
    for selector in OWNED_POD_SELECTORS:
        left = _wait_gone(api, clock() + POD_GONE_SECONDS, clock, sleep, f"/api/v1/namespaces/{NAMESPACE}/pods",
                          {"labelSelector": selector})
        if left:  # the objects are deleted: kubelet is still ending these (a node down keeps them for a while)
            say(f"pods still terminating {POD_GONE_SECONDS:.0f} s later: {one_line(', '.join(left))}")
    say(f"kept configmap/{NAMESPACE}/{CONFIGMAP} (yours)")
    return Report(tuple(nodes), tuple(removed), clock() - started)


def _in_order(objects: Iterable[ApiObject]) -> list[ApiObject]:
    present = set(objects)
    return [o for o in API_OBJECTS if o in present and o != AGENT_DAEMONSET]


def _node_line(outcome: NodeOutcome) -> str:
    node = one_line(outcome.node)
    what = "; ".join(outcome.removed) or "no report"
    if outcome.ok:
        return f"node {node}: {what} ({outcome.seconds:.1f} s)"
    return (f"node {node}: FAILED: {one_line(outcome.why)} ({what}); on that node run: ipmasq uninstall "
            f"(the rules stay until then)")


USAGE = "usage: kubectl ipmasq uninstall [--dry-run] [--image IMAGE] [--timeout SECONDS]"


def main(argv: list[str], *, kubeconfig: str | None = None, context: str | None = None,
         image: str | None = None) -> int:
    """`kubectl ipmasq uninstall` (kubectl's flags and --image taken by the plugin): no prompt; --dry-run prints what
    would go and changes nothing. Exit 0 when every node's rules and every object are gone, 1 when a node's could not
    be removed (named), 2 for a usage error, 3 when the API server could not be asked."""
    from ipmasq.cli import ArgumentParser, Exit
    from ipmasq.errors import UsageError
    from ipmasq.kube.client import KubeClient
    from ipmasq.kube.kubeconfig import load as load_kubeconfig

    parser = ArgumentParser(prog="kubectl ipmasq uninstall",
                            description="Remove ipmasq from every node (its rules too) and from the API; the "
                            "ip-masq-agent ConfigMap is kept. --image IMAGE: the image of the pods that remove the "
                            "rules (default: the DaemonSet's).")
    parser.add_argument("--dry-run", action="store_true", help="print what would be removed, change nothing")
    parser.add_argument("--timeout", type=float, default=180.0, metavar="SECONDS",
                        help="how long the agent's pods, then the nodes' uninstall pods, may take (default 180)")
    try:
        args = parser.parse_args(argv)
    except UsageError as exc:
        print(f"kubectl ipmasq uninstall: {one_line(str(exc))}", file=sys.stderr)
        return Exit.USAGE
    except SystemExit as exc:  # --help
        return Exit.OK if exc.code in (0, None) else Exit.USAGE
    if not 0 < args.timeout <= 3600:
        print("kubectl ipmasq uninstall: --timeout must be between 0 and 3600 seconds", file=sys.stderr)
        return Exit.USAGE
    try:
        client = KubeClient(load_kubeconfig(kubeconfig, context=context), timeout=30.0)
        if args.dry_run:
            for line in describe(plan(client, image=image)):
                print(line)
            return Exit.OK
        report = uninstall(client, image=image, timeout=args.timeout, say=print)
    except ApiError as exc:
        print(f"kubectl ipmasq uninstall: {one_line(str(exc))}", file=sys.stderr)
        return Exit.COULD_NOT_RUN
    failed = [n.node for n in report.nodes if not n.ok]
    print(f"uninstalled in {report.seconds:.1f} s: {len(report.nodes) - len(failed)} of {len(report.nodes)} nodes "
          f"clean, {len(report.removed)} objects removed" + (f"; rules left on {', '.join(failed)}" if failed else ""))
    return Exit.FINDINGS if failed else Exit.OK
