"""What of ipmasq a cluster still holds, read from outside as an auditor would, and what of another program's it
holds: on every node the nat tables of every iptables variant and family and nftables' tables; in the API every
object of every resource type the API server serves (its discovery), not a list of the kinds ipmasq knows.

ipmasq in the API: an object labelled app.kubernetes.io/part-of=ipmasq, or with ipmasq's names (`ipmasq`,
`ip-masq-agent`) in its name or labels; the lab's own (its namespace, its probe pods) and the user's ConfigMap
aside, and whatever is another program's: the objects given as kept (a provider's, by uid), what those own (their
pods, controller revisions) and the cluster's Events about them. On a node: the ownership marker (IPMASQ-OWNS-),
ipmasq's nftables table, and any line of an ipmasq-named chain (IP-MASQ*, ip-masq-agent comments) that is not a kept
chain's.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterator
from typing import Any

from ipmasq.kube import objects
from ipmasq.kube.client import KubeClient, list_items
from ipmasq.kube.kubeconfig import load as load_kubeconfig
from ipmasq.lab.kubernetes.agent import CONFIGMAP
from ipmasq.lab.kubernetes.cluster import Cluster
from ipmasq.lab.kubernetes.layout import LAB_NAMESPACE, NodeSpec
from ipmasq.ownership import APPLICATION, PART_OF

SAVES = ("iptables-nft-save", "ip6tables-nft-save", "iptables-legacy-save", "ip6tables-legacy-save")
NFT_TABLE = "inet ip-masq-agent"
_NAMES = re.compile(r"ipmasq|ip-masq-agent", re.IGNORECASE)
_NODE_NAMES = re.compile(r"ip-masq-agent|IP-MASQ|IPMASQ", re.IGNORECASE)
_COUNTERS = re.compile(r" \[\d+:\d+\]$")
_XTABLES = ("nat", "filter", "mangle", "raw", "security")  # iptables-nft's tables


# ---- nodes -----------------------------------------------------------------------------------------------------------

def _nat(cluster: Cluster, node: NodeSpec) -> dict[str, list[str]]:
    """save tool -> its nat table's lines, counters aside (a chain's `[packets:bytes]`)."""
    ns = cluster.namespace(node)
    return {save: [_COUNTERS.sub("", line) for line in ns.run([save, "-t", "nat"], check=False).stdout.splitlines()
                   if line and not line.startswith(("#", "*", "COMMIT"))] for save in SAVES}


def _of_chain(line: str, chain: str) -> bool:
    return line.startswith((f":{chain} ", f"-A {chain} ")) or line.endswith(f" -j {chain}")


def chain_lines(cluster: Cluster, node: NodeSpec, chain: str) -> dict[str, list[str]]:
    """save tool -> the lines of `chain` as it prints them: its declaration (counters aside), its rules and every
    jump to it, in order: what a byte-for-byte comparison compares."""
    return {save: [line for line in lines if _of_chain(line, chain)] for save, lines in _nat(cluster, node).items()}


def ipmasq_on_node(cluster: Cluster, node: NodeSpec, kept_chains: Collection[str] = ()) -> list[str]:
    """What of ipmasq the node's kernel holds: the marker, an ipmasq-named chain's line that is not a kept chain's,
    ipmasq's nftables table, and any line naming ipmasq in another nftables table (kube-proxy's rules for ipmasq's
    webhook Service); iptables-nft's own tables are read above, as iptables-save prints them."""
    ns = cluster.namespace(node)
    found = [f"{save}: {line}" for save, lines in _nat(cluster, node).items() for line in lines
             if _NODE_NAMES.search(line) and not any(_of_chain(line, chain) for chain in kept_chains)]
    for table in ns.run(["nft", "list", "tables"], check=False).stdout.splitlines():
        family, name = table.removeprefix("table ").split(" ", 1)
        if table.endswith(NFT_TABLE):
            found.append(f"nft: {table}")
        elif not (family in ("ip", "ip6") and name in _XTABLES):
            listed = ns.run(["nft", "list", "table", family, name], check=False).stdout
            found += [f"nft {family} {name}: {line.strip()}" for line in listed.splitlines() if _NAMES.search(line)]
    return found


# ---- the API ---------------------------------------------------------------------------------------------------------

def _client(cluster: Cluster) -> KubeClient:
    return KubeClient(load_kubeconfig(str(cluster.kubeconfig)), timeout=30.0)


def _listable(client: KubeClient) -> Iterator[tuple[str, str]]:
    """The collection path and kind of every resource type the API server serves (each group's preferred
    version)."""
    versions = [f"/api/{version}" for version in client.get("/api")["versions"]]
    for group in client.get("/apis")["groups"]:
        versions.append(f"/apis/{group['preferredVersion']['groupVersion']}")
    for base in versions:
        for resource in client.get(base)["resources"]:
            if "/" not in resource["name"] and "list" in resource.get("verbs", []):
                yield f"{base}/{resource['name']}", str(resource["kind"])


def every_object(cluster: Cluster) -> dict[str, dict[str, Any]]:
    """uid -> object, of every resource type (Events once, whichever group served them)."""
    client = _client(cluster)
    try:
        found: dict[str, dict[str, Any]] = {}
        for path, kind in _listable(client):
            for item in list_items(client, path, objects.kube_object).items:
                found.setdefault(item["metadata"].get("uid", f"{path}/{item['metadata'].get('name')}"),
                                 {**item, "kind": kind})
        return found
    finally:
        client.close()


def _involved(item: dict[str, Any]) -> str | None:
    for key in ("involvedObject", "regarding"):
        ref = item.get(key)
        if isinstance(ref, dict) and isinstance(ref.get("uid"), str):
            return str(ref["uid"])
    return None


def _kept_closure(every: dict[str, dict[str, Any]], kept: Collection[str]) -> set[str]:
    """The kept uids and every object owned by one of them, transitively (a DaemonSet's pods and revisions)."""
    closure = set(kept)
    grew = True
    while grew:
        grew = False
        for uid, item in every.items():
            owners = {ref.get("uid") for ref in item["metadata"].get("ownerReferences") or []}
            if uid not in closure and owners & closure:
                closure.add(uid)
                grew = True
    return closure


def ipmasq_in_the_api(cluster: Cluster, kept: Collection[str] = ()) -> list[str]:
    """Every object of ipmasq the API still holds, as `KIND NAMESPACE/NAME (why)`; `kept`: the uids of another
    program's objects (what they own and the Events about them are theirs too)."""
    every = every_object(cluster)
    theirs = _kept_closure(every, kept)
    found = []
    for uid, item in sorted(every.items(), key=lambda pair: (pair[1]["kind"], pair[1]["metadata"].get("name", ""))):
        meta = item["metadata"]
        name, namespace = meta.get("name", ""), meta.get("namespace", "")
        labels = meta.get("labels") or {}
        if uid in theirs or namespace == LAB_NAMESPACE or (item["kind"] == "Namespace" and name == LAB_NAMESPACE):
            continue
        if item["kind"] == "ConfigMap" and (namespace, name) == ("kube-system", CONFIGMAP):
            continue  # the user's
        if labels.get(PART_OF) == APPLICATION:
            found.append(f"{item['kind']} {namespace}/{name} ({PART_OF}={APPLICATION})")
        elif item["kind"] == "Event":
            if _involved(item) not in theirs and _NAMES.search(str(item.get("reportingComponent") or item.get(
                    "source", {}).get("component") or "")):
                found.append(f"Event {namespace}/{name} (reported by ipmasq)")
        elif _NAMES.search(name) or any(_NAMES.search(f"{k}={v}") for k, v in labels.items()):
            found.append(f"{item['kind']} {namespace}/{name} (its name or labels)")
    return found
