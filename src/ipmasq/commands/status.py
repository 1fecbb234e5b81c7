"""`ipmasq status` (and `kubectl ipmasq status`): one table for the whole cluster, from the API server.

Per node: the agent's pod, ready, the enforced policy hash, whether that is the ConfigMap's current content, where the
config came from (api or file), drift repairs, the last rejection. Exit 0 when every node enforces the current
config, 1 when any does not, 2 on a usage error, 3 when the API server cannot be asked (no kubeconfig, no answer).
"""

from __future__ import annotations

import argparse
from typing import Any

from ipmasq.errors import ApiError, NotFound
from ipmasq.kube.agentstatus import status_path
from ipmasq.kube.configmaps import configmap_state
from ipmasq.kube.credentials import from_kubeconfig
from ipmasq.kube.fleet import FleetView, fleet_view

__all__ = ["register", "run"]

AGENT_SELECTOR = "k8s-app=ip-masq-agent"
PAGE = 500  # objects per list request (an agent pod or a status object: a few KiB each)
NODE_PAGE = 200  # a Node is larger (its images, addresses, conditions: 5-15 KiB)


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "status", help="does every node enforce the current ConfigMap? (from the API server)",
        description="Ask the API server, for every node: the agent's pod, ready, the policy hash it enforces and "
        "whether that is the ConfigMap's current content, where its config came from, drift repairs, the last "
        "rejected config. Exit 1 when any node does not enforce the current config.")
    add_status_flags(parser)
    parser.set_defaults(func=run)


def add_status_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kubeconfig", metavar="PATH", help="default: $KUBECONFIG, else ~/.kube/config")
    parser.add_argument("--context", metavar="NAME", help="a context of the kubeconfig (default: its current one)")
    parser.add_argument("-n", "--namespace", default="kube-system", metavar="NAMESPACE",
                        help="where the agent and its ConfigMaps are (default %(default)s, whatever the context's "
                        "namespace: that is where workloads are, the agent is a node DaemonSet)")
    parser.add_argument("--configmaps", default="ip-masq-agent", metavar="NAME[,NAME...]",
                        help="the ConfigMaps the agents follow (default %(default)s)")
    parser.add_argument("--configmap-key", default="config", metavar="KEY", help="default %(default)s")
    parser.add_argument("-o", "--output", choices=("text", "json", "yaml"), default="text",
                        help="text (default), json or yaml: the same document, with its apiVersion and kind")


def run(args: argparse.Namespace) -> int:
    from ipmasq.kube.client import KubeClient

    # no kubeconfig, or no API server answering: could not run (ipmasq.cli's exit 3), never "a node is not current"
    client = KubeClient(from_kubeconfig(args.kubeconfig, context=args.context))
    try:
        view = _gather(client, args)
    except ApiError as exc:
        raise ApiError(f"the API server: {exc}") from None
    if args.output != "text":
        from ipmasq.commands.common import print_document

        print_document(args.output, "StatusReport", view.as_json())
    else:
        print(render_table(view))
    return 0 if view.all_current else 1


def _gather(client: Any, args: argparse.Namespace) -> FleetView:
    namespace = args.namespace
    configmaps = []
    for name in sorted({n for n in args.configmaps.split(",") if n}):
        try:
            obj = client.get(f"/api/v1/namespaces/{namespace}/configmaps/{name}")
        except NotFound:
            obj = None
        configmaps.append(configmap_state(namespace, name, args.configmap_key, obj))

    def statuses() -> list[Any]:
        try:
            return _list(client, status_path())
        except NotFound:  # the CRD is not installed: no agent writes status
            return []

    # one after the other on the client's one kept-alive connection: a page is a round trip, not a TLS handshake
    written = statuses()
    pods = _list(client, f"/api/v1/namespaces/{namespace}/pods", {"labelSelector": AGENT_SELECTOR})
    nodes = _list(client, "/api/v1/nodes", page=NODE_PAGE)
    names = [n["metadata"]["name"] for n in nodes if isinstance(n, dict)]
    return fleet_view(configmaps, written, pods, names)


def _list(client: Any, path: str, query: dict[str, str] | None = None, *, page: int = PAGE) -> list[Any]:
    """Every item, in pages: one answer for 5,000 nodes' objects would pass the client's bound on an answer."""
    items: list[Any] = []
    ask = {**(query or {}), "limit": str(page)}
    while True:
        answer = client.get(path, query=ask)
        items += answer.get("items") or []
        more = (answer.get("metadata") or {}).get("continue")
        if not more:
            return items
        ask = {**(query or {}), "limit": str(page), "continue": more}


def render_table(view: FleetView) -> str:
    shown = ", ".join(f"{c.namespace}/{c.name}" + (f" (resourceVersion {c.resource_version})" if c.exists
                                                   else " (absent: the defaults)") for c in view.configmaps)
    lines = [f"ConfigMap {shown}: content {view.digest[:12]}"]
    header = ("NODE", "AGENT POD", "READY", "ENFORCED", "CURRENT", "SOURCE", "DRIFT", "WHY NOT / LAST REJECTION")
    table = [header]
    for row in view.rows:
        status = row.status
        table.append((
            row.node, row.pod or "-",
            "yes" if status is not None and status.ready and row.pod_ready else "no",
            (status.policy_hash or "-")[:12] if status else "-",
            "yes" if row.current else "NO",
            status.config_source if status else "-",
            str(status.drift_repairs) if status else "-",
            row.why or (f"(last rejected: {status.last_rejection})" if status and status.last_rejection else ""),
        ))
    widths = [max(len(r[i]) for r in table) for i in range(len(header) - 1)]
    for r in table:
        lines.append("  ".join(cell.ljust(width) for cell, width in zip(r, widths, strict=False)) + "  " + r[-1])
    current = sum(row.current for row in view.rows)
    lines.append(f"{current} of {len(view.rows)} nodes enforce the current config")
    return "\n".join(line.rstrip() for line in lines)
