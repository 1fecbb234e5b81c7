"""Every API path (ipmasq.kube.paths): the paths themselves, and names checked as the API server checks them, so a
name from a flag or from a listed object never reaches another path, adds a query, or is sent only to be refused."""

from __future__ import annotations

import re

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from ipmasq.errors import UsageError
from ipmasq.kube import paths

# The oracle: Kubernetes' own rules, transcribed from k8s.io/apimachinery/pkg/util/validation/validation.go
# (dns1123LabelFmt, dns1123SubdomainFmt, DNS1123LabelMaxLength, DNS1123SubdomainMaxLength; Go's ^...$ is fullmatch).
# An object's name (a Node, a ConfigMap, a Lease, an Event, a Pod, a DaemonSet, a custom resource) is a DNS subdomain
# (NameIsDNSSubdomain); a namespace's is a DNS label (ValidateNamespaceName: NameIsDNSLabel).
K8S_LABEL = "[a-z0-9]([-a-z0-9]*[a-z0-9])?"
K8S_SUBDOMAIN = K8S_LABEL + "(\\." + K8S_LABEL + ")*"


def is_dns1123_subdomain(value: str) -> bool:
    return len(value) <= 253 and re.fullmatch(K8S_SUBDOMAIN, value) is not None


def is_dns1123_label(value: str) -> bool:
    return len(value) <= 63 and re.fullmatch(K8S_LABEL, value) is not None


def accepts(check: object, value: str) -> bool:
    try:
        check(value)  # type: ignore[operator]
    except UsageError:
        return False
    return True


def test_each_kinds_path() -> None:
    assert paths.configmaps("kube-system") == "/api/v1/namespaces/kube-system/configmaps"
    assert paths.configmaps("kube-system", "ip-masq-agent") == "/api/v1/namespaces/kube-system/configmaps/ip-masq-agent"
    assert paths.events("default", "node-1.17a2b") == "/api/v1/namespaces/default/events/node-1.17a2b"
    assert paths.leases("kube-system", "ipmasq-summary") == \
        "/apis/coordination.k8s.io/v1/namespaces/kube-system/leases/ipmasq-summary"
    assert paths.nodes() == "/api/v1/nodes"
    assert paths.nodes("gke-pool-1-abcd.c.project.internal") == "/api/v1/nodes/gke-pool-1-abcd.c.project.internal"
    assert paths.pods("kube-system", "ipmasq-x7k2p") == "/api/v1/namespaces/kube-system/pods/ipmasq-x7k2p"
    assert paths.statuses() == "/apis/ipmasq.dev/v1alpha1/ipmasqagentstatuses"
    assert paths.statuses("node-1") == "/apis/ipmasq.dev/v1alpha1/ipmasqagentstatuses/node-1"
    assert paths.daemonsets("kube-system", "aws-node") == "/apis/apps/v1/namespaces/kube-system/daemonsets/aws-node"


def test_any_kinds_path() -> None:
    assert paths.resource("v1", "configmaps") == "/api/v1/configmaps"
    assert paths.resource("v1", "configmaps", namespace="kube-system", name="a") == \
        "/api/v1/namespaces/kube-system/configmaps/a"
    assert paths.resource("apps/v1", "daemonsets") == "/apis/apps/v1/daemonsets"
    assert paths.resource("monitoring.coreos.com/v1", "prometheusrules", namespace="monitoring", name="ipmasq") == \
        "/apis/monitoring.coreos.com/v1/namespaces/monitoring/prometheusrules/ipmasq"
    assert paths.resource("ipmasq.dev/v1alpha1", "ipmasqagentstatuses", name="n") == paths.statuses("n")
    assert paths.resource("admissionregistration.k8s.io/v1", "validating-admission-policies") == \
        "/apis/admissionregistration.k8s.io/v1/validating-admission-policies"
    assert paths.resource("example.com/v2beta3", "widgets") == "/apis/example.com/v2beta3/widgets"


@pytest.mark.parametrize("name", [
    "a", "0", "a-b", "a.b", "node-1.example.internal", "1-2-3", "a" * 63, "a" * 253, ".".join(["a" * 63] * 4)[:253],
    "a" * 100 + "." + "b" * 100,  # a subdomain's labels are not held to 63 by Kubernetes' name check, only its length
])
def test_names_the_api_server_accepts_are_accepted(name: str) -> None:
    assert is_dns1123_subdomain(name)
    assert paths.check_name(name) == name


@pytest.mark.parametrize("name", [
    "", "A", "Node-1", "-a", "a-", ".a", "a.", "a..b", "a.-b", "a-.b", "a_b", "a b", "a/b", "/", "..", ".", "a?b",
    "a#b", "a%2Fb", "a\nb", "a\n", "\n", "a\x00", "a:b", "a@b", "\u0430", "a\u200b", "\uff41", "a" * 254,
    "a/../../secrets", "a?watch=true", "a%2F..%2Fsecrets",
])
def test_names_the_api_server_refuses_are_refused_in_one_line(name: str) -> None:
    assert not is_dns1123_subdomain(name)
    with pytest.raises(UsageError) as refused:
        paths.check_name(name)
    message = str(refused.value)
    assert message.startswith("not a Kubernetes name: ") and "\n" not in message and len(message) < 120


@pytest.mark.parametrize("namespace", ["kube-system", "default", "a", "0", "a" * 63])
def test_namespaces_the_api_server_accepts_are_accepted(namespace: str) -> None:
    assert paths.check_namespace(namespace) == namespace
    assert paths.configmaps(namespace) == f"/api/v1/namespaces/{namespace}/configmaps"


@pytest.mark.parametrize("namespace", ["kube.system", "a.b", "a" * 64, "", "Kube-system", "-a", "a-", "a/b", "..",
                                       "a\n"])
def test_a_namespace_is_one_dns_label(namespace: str) -> None:
    assert not is_dns1123_label(namespace)
    builders = [paths.configmaps, paths.events, paths.leases, paths.pods, paths.daemonsets,
                lambda ns: paths.resource("v1", "configmaps", namespace=ns)]
    for build in builders:
        with pytest.raises(UsageError, match="not a Kubernetes namespace"):
            build(namespace)


@pytest.mark.parametrize(("api_version", "plural"), [
    ("", "configmaps"), ("v1", ""), ("/v1", "configmaps"), ("apps/", "daemonsets"), ("Apps/v1", "daemonsets"),
    ("apps/V1", "daemonsets"), ("apps/v1/x", "daemonsets"), ("../v1", "daemonsets"), ("apps/v1?x=1", "daemonsets"),
    ("apps/v1", "Daemonsets"), ("apps/v1", "daemon/sets"), ("apps/v1", "1daemonsets"), ("apps/v1", "daemonsets-"),
    ("apps/v1", "a" * 64), ("a..b/v1", "things"), ("a" * 254 + "/v1", "things"), ("apps/v1beta", "daemonsets"),
    ("apps/vbeta1", "daemonsets"), ("apps/v1\n", "daemonsets"),
])
def test_a_resource_that_cannot_exist_is_refused(api_version: str, plural: str) -> None:
    with pytest.raises(UsageError, match="not a Kubernetes resource"):
        paths.resource(api_version, plural)


def test_a_long_hostile_name_is_quoted_clipped_and_escaped() -> None:
    hostile = "\x1b[31m" + "x" * 100_000
    with pytest.raises(UsageError) as refused:
        paths.nodes(hostile)
    message = str(refused.value)
    assert "\x1b" not in message and len(message) < 120


_NAMEISH = st.text(alphabet="abz09-.A_/?%#\n\u0430", max_size=70) | st.builds(
    lambda label, count: ".".join([label] * count), st.from_regex(K8S_LABEL, fullmatch=True), st.integers(1, 40))


@settings(max_examples=500, deadline=None)
@given(_NAMEISH)
@example("a" * 253)
@example("a" * 254)
@example("a" * 63)
@example("a" * 64)
def test_check_name_and_check_namespace_agree_with_kubernetes(value: str) -> None:
    assert accepts(paths.check_name, value) == is_dns1123_subdomain(value)
    assert accepts(paths.check_namespace, value) == is_dns1123_label(value)


@settings(max_examples=300, deadline=None)
@given(namespace=_NAMEISH, name=_NAMEISH)
def test_an_accepted_name_is_exactly_one_path_segment(namespace: str, name: str) -> None:
    try:
        path = paths.configmaps(namespace, name)
    except UsageError:
        return
    assert path.split("/") == ["", "api", "v1", "namespaces", namespace, "configmaps", name]
    assert not set(path) & set("?#%\\ \n") and ".." not in path.split("/")


# ---- ApiInfo: one kind's place in the API (group, version, plural, namespaced), the builder behind every path ----


def test_every_kind_s_paths_come_from_its_api_info() -> None:
    assert paths.SECRETS.path("kube-system", "ipmasq-webhook-certificate") == \
        "/api/v1/namespaces/kube-system/secrets/ipmasq-webhook-certificate"
    assert paths.secrets("kube-system") == "/api/v1/namespaces/kube-system/secrets"
    assert paths.webhook_configurations("ipmasq-webhook") == \
        "/apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations/ipmasq-webhook"
    assert paths.PODS.path() == "/api/v1/pods"  # a namespaced kind across every namespace
    assert paths.DAEMONSETS.path() == "/apis/apps/v1/daemonsets"
    assert paths.STATUSES.api_version == "ipmasq.dev/v1alpha1" and paths.NODES.api_version == "v1"
    assert paths.ApiInfo.of("apps/v1", "daemonsets", namespaced=True) == paths.DAEMONSETS
    assert paths.ApiInfo.of("v1", "nodes", namespaced=False) == paths.NODES


def test_a_path_the_kind_s_scope_does_not_have_is_refused_in_one_line() -> None:
    with pytest.raises(UsageError, match="nodes are not in a namespace") as refused:
        paths.NODES.path("kube-system", "node-1")
    assert "\n" not in str(refused.value)
    with pytest.raises(UsageError, match="named within its namespace"):
        paths.PODS.path(None, "ipmasq-x7k2p")  # no such path: an object of a namespaced kind is in a namespace


@pytest.mark.parametrize("info", [paths.CONFIGMAPS, paths.EVENTS, paths.LEASES, paths.PODS, paths.SECRETS,
                                  paths.DAEMONSETS])
@pytest.mark.parametrize("name", ["a/../../secrets", "a?watch=true", "A", "", "a" * 254, "a%2Fb", "\x1b[2J"])
def test_every_namespaced_kind_checks_the_object_s_name(info: paths.ApiInfo, name: str) -> None:
    with pytest.raises(UsageError, match="not a Kubernetes name") as refused:
        info.path("kube-system", name)
    assert "\n" not in str(refused.value) and "\x1b" not in str(refused.value)


@pytest.mark.parametrize("info", [paths.NODES, paths.STATUSES, paths.ADMISSION_POLICIES,
                                  paths.ADMISSION_POLICY_BINDINGS, paths.WEBHOOK_CONFIGURATIONS])
@pytest.mark.parametrize("name", ["a/b", "a?b", "Node-1", "..", "a\n"])
def test_every_cluster_scoped_kind_checks_the_object_s_name(info: paths.ApiInfo, name: str) -> None:
    with pytest.raises(UsageError, match="not a Kubernetes name"):
        info.path(None, name)


@pytest.mark.parametrize(("group", "version", "plural"), [
    ("Apps", "v1", "daemonsets"), ("apps", "V1", "daemonsets"), ("apps/x", "v1", "daemonsets"),
    ("apps", "v1", "daemon/sets"), ("apps", "v1", "a" * 64), ("a..b", "v1", "things"), ("apps", "v1beta", "x"),
    ("apps", "v1/../..", "x"), ("", "", "nodes"),
])
def test_an_api_info_that_cannot_exist_is_refused_when_made(group: str, version: str, plural: str) -> None:
    with pytest.raises(UsageError, match="not a Kubernetes resource"):
        paths.ApiInfo(group, version, plural, namespaced=True)


@settings(max_examples=300, deadline=None)
@given(namespace=_NAMEISH, name=_NAMEISH)
def test_an_api_info_path_is_exactly_its_segments(namespace: str, name: str) -> None:
    try:
        path = paths.LEASES.path(namespace, name)
    except UsageError:
        return
    assert path.split("/") == ["", "apis", "coordination.k8s.io", "v1", "namespaces", namespace, "leases", name]
