"""Every API path ipmasq asks the API server for, built in one place (the client, ipmasq.kube.client, takes paths).

Names come from flags, the agent's own node, or objects the API server listed: each is checked here to be what the API
server itself accepts as such a name (an object's a DNS subdomain, a namespace's a DNS label), so that no name can
reach another path or add a query, and a name the server would refuse is refused here, in one line, before any call.
"""

from __future__ import annotations

import re

from ipmasq.errors import UsageError, clip

__all__ = ["GROUP", "KIND", "PLURAL", "VERSION", "admission_policies", "admission_policy_bindings", "check_name",
           "check_namespace", "configmaps", "daemonsets", "events", "leases", "nodes", "pods", "resource", "statuses"]

GROUP = "ipmasq.dev"
VERSION = "v1alpha1"
KIND = "IPMasqAgentStatus"
PLURAL = "ipmasqagentstatuses"

# Kubernetes' own rules (k8s.io/apimachinery/pkg/util/validation): an object's name is a DNS subdomain (RFC 1123:
# dot-separated labels of a-z, 0-9 and '-', each beginning and ending with a letter or digit, 253 characters in all);
# a namespace is one DNS label (63 at most); a resource's plural a DNS-1035 label (a letter first). The length is
# checked before the expression, which then sees at most 253 characters.
_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_SUBDOMAIN = re.compile(rf"{_LABEL}(\.{_LABEL})*")
_DNS_LABEL = re.compile(_LABEL)
_SUBDOMAIN_MAX, _LABEL_MAX = 253, 63
# an API group/version ("v1", "apps/v1", "monitoring.coreos.com/v1": the group a subdomain) and a plural
_VERSION = re.compile(r"v[0-9]+((alpha|beta)[0-9]+)?")
_PLURAL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")


def _subdomain(text: str) -> bool:
    return len(text) <= _SUBDOMAIN_MAX and _SUBDOMAIN.fullmatch(text) is not None


def check_name(name: str) -> str:
    """`name` when it can be a Kubernetes object's name (a DNS subdomain); UsageError otherwise."""
    if not _subdomain(name):
        raise UsageError(f"not a Kubernetes name: {clip(name, 80)!r}")
    return name


def check_namespace(namespace: str) -> str:
    """`namespace` when it can be a namespace's name (a DNS label: no dot, 63 characters at most)."""
    if len(namespace) > _LABEL_MAX or not _DNS_LABEL.fullmatch(namespace):
        raise UsageError(f"not a Kubernetes namespace: {clip(namespace, 80)!r}")
    return namespace


def _one(base: str, name: str | None) -> str:
    return base if name is None else f"{base}/{check_name(name)}"


def configmaps(namespace: str, name: str | None = None) -> str:
    return _one(f"/api/v1/namespaces/{check_namespace(namespace)}/configmaps", name)


def events(namespace: str, name: str | None = None) -> str:
    return _one(f"/api/v1/namespaces/{check_namespace(namespace)}/events", name)


def leases(namespace: str, name: str | None = None) -> str:
    return _one(f"/apis/coordination.k8s.io/v1/namespaces/{check_namespace(namespace)}/leases", name)


def nodes(name: str | None = None) -> str:
    return _one("/api/v1/nodes", name)


def pods(namespace: str, name: str | None = None) -> str:
    return _one(f"/api/v1/namespaces/{check_namespace(namespace)}/pods", name)


def statuses(name: str | None = None) -> str:
    """The cluster-scoped IPMasqAgentStatus objects (one per node, named after it)."""
    return _one(f"/apis/{GROUP}/{VERSION}/{PLURAL}", name)


def daemonsets(namespace: str, name: str | None = None) -> str:
    return _one(f"/apis/apps/v1/namespaces/{check_namespace(namespace)}/daemonsets", name)


def admission_policies(name: str | None = None) -> str:
    """The cluster's ValidatingAdmissionPolicies (the node-trust policy: ipmasq.kube.nodetrust)."""
    return _one("/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicies", name)


def admission_policy_bindings(name: str | None = None) -> str:
    return _one("/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicybindings", name)


def resource(api_version: str, plural: str, *, namespace: str | None = None, name: str | None = None) -> str:
    """Any kind's collection or object: `resource("apps/v1", "daemonsets")` is every namespace's DaemonSets (a
    namespaced kind listed across the cluster), with `namespace` one namespace's, with `name` one object."""
    group, _, version = api_version.rpartition("/")
    if (not _VERSION.fullmatch(version) or ("/" in api_version and not _subdomain(group))
            or len(plural) > _LABEL_MAX or not _PLURAL.fullmatch(plural)):
        raise UsageError(f"not a Kubernetes resource: {clip(api_version, 80)!r} {clip(plural, 80)!r}")
    base = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    scope = "" if namespace is None else f"/namespaces/{check_namespace(namespace)}"
    return _one(f"{base}{scope}/{plural}", name)
