"""Every API path ipmasq asks the API server for, built in one place (the client, ipmasq.kube.client, takes paths):
one ApiInfo per kind (group, version, plural, namespaced: lightkube's api_info) makes each of its paths.

Names come from flags, the agent's own node, or objects the API server listed: each is checked here to be what the API
server itself accepts as such a name (an object's a DNS subdomain, a namespace's a DNS label), so that no name can
reach another path or add a query, and a name the server would refuse is refused here, in one line, before any call.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ipmasq.errors import UsageError, clip

__all__ = ["ADMISSION_POLICIES", "ADMISSION_POLICY_BINDINGS", "CONFIGMAPS", "DAEMONSETS", "EVENTS", "GROUP", "KIND",
           "LEASES", "NODES", "PLURAL", "PODS", "SECRETS", "STATUSES", "VERSION", "WEBHOOK_CONFIGURATIONS", "ApiInfo",
           "admission_policies", "admission_policy_bindings", "check_name", "check_namespace", "configmaps",
           "daemonsets", "events", "leases", "nodes", "pods", "resource", "secrets", "statuses",
           "webhook_configurations"]

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


@dataclass(frozen=True, slots=True)
class ApiInfo:
    """One kind's place in the API, as lightkube's api_info holds it: its group ("" for the core group), version,
    plural and whether its objects live in a namespace. Checked when made (a group a DNS subdomain, a version
    v1/v1beta2..., a plural a DNS-1035 label), so a path built from it has only names checked here in it."""

    group: str
    version: str
    plural: str
    namespaced: bool

    def __post_init__(self) -> None:
        if (not _VERSION.fullmatch(self.version) or (self.group != "" and not _subdomain(self.group))
                or len(self.plural) > _LABEL_MAX or not _PLURAL.fullmatch(self.plural)):
            raise UsageError(f"not a Kubernetes resource: {clip(self.api_version, 80)!r} {clip(self.plural, 80)!r}")

    @classmethod
    def of(cls, api_version: str, plural: str, *, namespaced: bool) -> ApiInfo:
        """From an apiVersion as objects carry it ("v1", "apps/v1")."""
        group, _, version = api_version.rpartition("/")
        if "/" in api_version and not group:
            raise UsageError(f"not a Kubernetes resource: {clip(api_version, 80)!r} {clip(plural, 80)!r}")
        return cls(group, version, plural, namespaced)

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    def path(self, namespace: str | None = None, name: str | None = None) -> str:
        """The collection (`name` None) or one object. A namespaced kind without `namespace`: every namespace's
        collection (a name then is refused: an object is always in one namespace); a cluster-scoped kind takes none."""
        if namespace is not None and not self.namespaced:
            raise UsageError(f"{self.plural} are not in a namespace (asked for {clip(namespace, 80)!r})")
        if name is not None and namespace is None and self.namespaced:
            raise UsageError(f"one of {self.plural} is named within its namespace ({clip(name, 80)!r} has none)")
        base = f"/apis/{self.group}/{self.version}" if self.group else f"/api/{self.version}"
        scope = "" if namespace is None else f"/namespaces/{check_namespace(namespace)}"
        collection = f"{base}{scope}/{self.plural}"
        return collection if name is None else f"{collection}/{check_name(name)}"


# Every kind ipmasq itself reads or writes (`kubectl ipmasq uninstall` names more: ipmasq.uninstall.plan.KINDS)
CONFIGMAPS = ApiInfo("", "v1", "configmaps", namespaced=True)
EVENTS = ApiInfo("", "v1", "events", namespaced=True)
NODES = ApiInfo("", "v1", "nodes", namespaced=False)
PODS = ApiInfo("", "v1", "pods", namespaced=True)
SECRETS = ApiInfo("", "v1", "secrets", namespaced=True)
LEASES = ApiInfo("coordination.k8s.io", "v1", "leases", namespaced=True)
DAEMONSETS = ApiInfo("apps", "v1", "daemonsets", namespaced=True)
STATUSES = ApiInfo(GROUP, VERSION, PLURAL, namespaced=False)  # one per node, named after it
ADMISSION_POLICIES = ApiInfo("admissionregistration.k8s.io", "v1", "validatingadmissionpolicies", namespaced=False)
ADMISSION_POLICY_BINDINGS = ApiInfo("admissionregistration.k8s.io", "v1", "validatingadmissionpolicybindings",
                                    namespaced=False)
WEBHOOK_CONFIGURATIONS = ApiInfo("admissionregistration.k8s.io", "v1", "validatingwebhookconfigurations",
                                 namespaced=False)


def configmaps(namespace: str, name: str | None = None) -> str:
    return CONFIGMAPS.path(namespace, name)


def events(namespace: str, name: str | None = None) -> str:
    return EVENTS.path(namespace, name)


def leases(namespace: str, name: str | None = None) -> str:
    return LEASES.path(namespace, name)


def nodes(name: str | None = None) -> str:
    return NODES.path(None, name)


def pods(namespace: str, name: str | None = None) -> str:
    return PODS.path(namespace, name)


def secrets(namespace: str, name: str | None = None) -> str:
    return SECRETS.path(namespace, name)


def statuses(name: str | None = None) -> str:
    """The cluster-scoped IPMasqAgentStatus objects (one per node, named after it)."""
    return STATUSES.path(None, name)


def daemonsets(namespace: str, name: str | None = None) -> str:
    return DAEMONSETS.path(namespace, name)


def admission_policies(name: str | None = None) -> str:
    """The cluster's ValidatingAdmissionPolicies (the node-trust policy: ipmasq.fleet.nodetrust)."""
    return ADMISSION_POLICIES.path(None, name)


def admission_policy_bindings(name: str | None = None) -> str:
    return ADMISSION_POLICY_BINDINGS.path(None, name)


def webhook_configurations(name: str | None = None) -> str:
    """The cluster's ValidatingWebhookConfigurations (the webhook's own: its caBundle, ipmasq.webhook.keeper)."""
    return WEBHOOK_CONFIGURATIONS.path(None, name)


def resource(api_version: str, plural: str, *, namespace: str | None = None, name: str | None = None) -> str:
    """Any kind's collection or object: `resource("apps/v1", "daemonsets")` is every namespace's DaemonSets (a
    namespaced kind listed across the cluster), with `namespace` one namespace's, with `name` one object (of a
    cluster-scoped kind when no namespace is given)."""
    return ApiInfo.of(api_version, plural, namespaced=namespace is not None).path(namespace, name)
