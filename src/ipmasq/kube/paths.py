"""Every API path ipmasq asks the API server for, built in one place (the client, ipmasq.kube.client, takes paths).

Names come from flags, the agent's own node, or objects the API server listed: each is checked here to be one path
segment a Kubernetes name can be (a DNS subdomain), so that no name can reach another path or add a query.
"""

from __future__ import annotations

import re

from ipmasq.errors import UsageError, clip

__all__ = ["GROUP", "KIND", "PLURAL", "VERSION", "check_name", "configmaps", "daemonsets", "events", "leases",
           "nodes", "pods", "statuses"]

GROUP = "ipmasq.dev"
VERSION = "v1alpha1"
KIND = "IPMasqAgentStatus"
PLURAL = "ipmasqagentstatuses"

# a DNS subdomain (RFC 1123), as Kubernetes checks a name: what a Node, a ConfigMap or a namespace can be called
_NAME = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")


def check_name(name: str) -> str:
    """`name` when it can be a Kubernetes object's name (a DNS subdomain); UsageError otherwise."""
    if not _NAME.fullmatch(name):
        raise UsageError(f"not a Kubernetes name: {clip(name, 80)!r}")
    return name


def _one(base: str, name: str | None) -> str:
    return base if name is None else f"{base}/{check_name(name)}"


def configmaps(namespace: str, name: str | None = None) -> str:
    return _one(f"/api/v1/namespaces/{check_name(namespace)}/configmaps", name)


def events(namespace: str, name: str | None = None) -> str:
    return _one(f"/api/v1/namespaces/{check_name(namespace)}/events", name)


def leases(namespace: str, name: str | None = None) -> str:
    return _one(f"/apis/coordination.k8s.io/v1/namespaces/{check_name(namespace)}/leases", name)


def nodes(name: str | None = None) -> str:
    return _one("/api/v1/nodes", name)


def pods(namespace: str) -> str:
    return f"/api/v1/namespaces/{check_name(namespace)}/pods"


def statuses(name: str | None = None) -> str:
    """The cluster-scoped IPMasqAgentStatus objects (one per node, named after it)."""
    return _one(f"/apis/{GROUP}/{VERSION}/{PLURAL}", name)


def daemonsets(namespace: str, name: str | None = None) -> str:
    return _one(f"/apis/apps/v1/namespaces/{check_name(namespace)}/daemonsets", name)
