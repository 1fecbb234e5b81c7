"""`ipmasq status [NODE...]` (and `kubectl ipmasq status`): one table for the whole cluster, from the API server.

Per node: the agent's pod, ready, the enforced policy hash, whether that is the ConfigMap's current content, the mode
(enforce: the agent writes the rules; observe: another program does, and the agent checks them), where the config
came from (api or file), drift repairs, and why not current. Exit 0 when every node named (every node when none is)
enforces the current config, in either mode; 1 when any does not (or the API cannot tell, or a named node does not
exist), or when the rows are unverified: the node-trust admission policy or its binding is not installed (or
cannot be read), so any agent's token could have written any row (ipmasq.fleet.nodetrust; every row is marked so
and one line says why); 2 on a usage error; 3 when the API server cannot be asked (no kubeconfig, no answer).
Every string the API gave is printed through ipmasq.errors.one_line: a status object, a pod or a ConfigMap name
cannot move the cursor, set a title or forge a row.
"""

from __future__ import annotations

import argparse
from typing import Any

from ipmasq.errors import ApiError, Forbidden, NotFound, UsageError, one_line
from ipmasq.fleet.nodetrust import read_node_trust
from ipmasq.fleet.view import FleetView, WriterContent, fleet_view
from ipmasq.kube import objects, paths
from ipmasq.kube.agentstatus import status_from_json
from ipmasq.kube.configmaps import configmap_state
from ipmasq.kube.kubeconfig import load as load_kubeconfig
from ipmasq.ownership import without_others_pods

__all__ = ["register", "run"]

# the agent's pods: the shipped DaemonSet's, and observe mode's beside a provider's agent (deploy/overlays/observe);
# a provider's agent of the same label (GKE's) is told apart by its DaemonSet (ipmasq.ownership)
AGENT_SELECTOR = "k8s-app in (ip-masq-agent,ipmasq-observer)"
PAGE = 500  # objects per list request (an agent pod or a status object: a few KiB each)
NODE_PAGE = 200  # a Node is larger (its images, addresses, conditions: 5-15 KiB)


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "status", help="does every node enforce the current ConfigMap? (from the API server)",
        description="Ask the API server, for every node (or the NODEs named): the agent's pod, ready, the policy "
        "hash it enforces and whether that is the ConfigMap's current content, the mode (enforce, or observe: "
        "another program writes the rules), where its config came from, drift repairs, why not current. Exit 1 "
        "when any of those nodes does not enforce the current config, or when the rows are unverified (the "
        "node-trust admission policy ip-masq-agent-own-node or its binding is not installed: any agent's token "
        "could have written any node's row).")
    parser.add_argument("nodes", nargs="*", metavar="NODE", help="only these nodes (default: every node)")
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
    client = KubeClient(load_kubeconfig(args.kubeconfig, context=args.context))
    try:
        view = _gather(client, args)
    except ApiError as exc:
        raise ApiError(f"the API server: {exc}") from None
    if args.output != "text":
        from ipmasq.documents import print_document

        print_document(args.output, "StatusReport", view.as_json())
    else:
        print(render_table(view))
    return 0 if view.ok else 1


def _gather(client: Any, args: argparse.Namespace) -> FleetView:
    from ipmasq.kube.client import list_items  # the client's one pager (ssl is loaded only when the API is asked)

    namespace = args.namespace
    configmaps = []
    try:
        for name in sorted({n for n in args.configmaps.split(",") if n}):
            try:
                obj = client.get(paths.configmaps(namespace, name))
            except NotFound:
                obj = None
            configmaps.append(configmap_state(namespace, name, args.configmap_key, obj))
        only = [paths.check_name(node) for node in getattr(args, "nodes", None) or []]
    except UsageError as exc:  # a name that cannot be a Kubernetes name
        raise UsageError(f"status: {exc}") from None

    def statuses() -> list[objects.AgentStatusObject]:
        try:
            return list_items(client, paths.statuses(), objects.agent_status, page=PAGE).items
        except NotFound:  # the CRD is not installed: no agent writes status
            return []

    # one after the other on the client's one kept-alive connection: a page is a round trip, not a TLS handshake
    written = statuses()
    pods = list_items(client, paths.pods(namespace), objects.pod, query={"labelSelector": AGENT_SELECTOR},
                      page=PAGE).items
    if pods:  # the label is also GKE's own agent's: its pods are never shown as a node's ipmasq agent
        try:
            daemonsets = list_items(client, paths.daemonsets(namespace), objects.kube_object, page=PAGE).items
        except (Forbidden, NotFound):  # who may not list DaemonSets sees every pod of the label, as before
            daemonsets = []
        pods = without_others_pods(daemonsets, pods)
    nodes = list_items(client, paths.nodes(), objects.node, page=NODE_PAGE).items
    names = [n["metadata"]["name"] for n in nodes]  # each checked by objects.node: a name is always there
    return fleet_view(configmaps, written, pods, names, only=only, writers=_writer_contents(client, written),
                      trust=read_node_trust(client))


def _writer_contents(client: Any, statuses: list[objects.AgentStatusObject]) -> list[WriterContent]:
    """The own inputs of each provider observed in the fleet (AKS's ConfigMaps, aws-node's env), read now, as its
    observers read them; a provider that reads the ip-masq-agent ConfigMap needs none."""
    from ipmasq.config.source import ConfigInput
    from ipmasq.observe.provider_inputs import NAMESPACE, current_input, own_inputs
    from ipmasq.writers import WRITERS

    observed = {s.writer for s in map(status_from_json, statuses) if s.mode == "observe" and s.writer}
    contents = []
    for writer in (WRITERS[name] for name in sorted(n for n in observed if n in WRITERS)):
        if not own_inputs(writer):
            continue
        sources = tuple([f"configmap/{name}" for name in sorted(writer.configmaps)]
                        + ([f"daemonset/{writer.daemonset}"] if writer.daemonset else []))
        read = current_input(client, writer, NAMESPACE)
        if isinstance(read, ConfigInput):
            contents.append(WriterContent(writer.name, sources, read.digest()))
        else:
            contents.append(WriterContent(writer.name, sources, None, one_line(read.message)))
    return contents


def render_table(view: FleetView) -> str:
    shown = ", ".join(f"{c.namespace}/{c.name}" + (f" (resourceVersion {one_line(c.resource_version or '')})"
                                                   if c.exists else " (absent: the defaults)")
                      for c in view.configmaps)
    lines = [f"ConfigMap {shown}: content {view.digest[:12]}"]
    for own in view.writers:  # observers of a provider that reads inputs of its own compare with those
        lines.append(f"{one_line(own.writer)}'s inputs ({', '.join(own.sources)}) in kube-system: "
                     + (f"content {own.digest[:12]}" if own.digest else f"not readable: {one_line(own.error or '')}"))
    header = ("NODE", "AGENT POD", "READY", "ENFORCED", "CURRENT", "MODE", "SOURCE", "DRIFT",
              "WHY NOT / LAST REJECTION")
    table: list[tuple[str, ...]] = [header]
    for row in view.rows:
        status = row.status
        mode = "-"
        if status is not None:
            mode = status.mode if status.mode != "observe" else f"observe ({status.writer or '?'}, {status.chain})"
        last = f"(last rejected: {status.last_rejection})" if status and status.last_rejection else ""
        if status is not None and status.ignored and not row.why:  # current, and yet a key the writer ignores
            last = f"(ignored by {status.writer or 'the writer'}: {status.ignored})"
        table.append(tuple(one_line(cell) for cell in (
            row.node, row.pod or "-",
            "yes" if status is not None and status.ready and row.pod_ready else "no",
            (status.policy_hash or "-")[:12] if status else "-",
            ("yes" if row.current else "NO") + ("" if row.verified else " (unverified)"),
            mode,
            status.config_source if status else "-",
            str(status.drift_repairs) if status else "-",
            row.why or last,
        )))
    widths = [max(len(r[i]) for r in table) for i in range(len(header) - 1)]
    for r in table:
        lines.append("  ".join(cell.ljust(width) for cell, width in zip(r, widths, strict=False)) + "  " + r[-1])
    current = sum(row.current for row in view.rows)
    lines.append(f"{current} of {len(view.rows)} nodes enforce the current config"
                 + ("" if view.trust.verified else f", UNVERIFIED: {one_line(view.trust.why)}"))
    if view.ignored:
        lines.append(f"({view.ignored} status object{'s' if view.ignored > 1 else ''} named after no node of the "
                     "cluster ignored)")
    return "\n".join(line.rstrip() for line in lines)
