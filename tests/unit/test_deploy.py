"""deploy/: the kustomize output (rendered by kubectl offline) is valid Kubernetes, least-privilege, and drop-in."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from ipmasq.config import ConfigInput, config_from_bytes
from ipmasq.options import PolicyOptions
from tests.conftest import ROOT

DEPLOY = ROOT / "deploy"
K8S_VERSION = "1.30.0"


def kustomize(path: Path) -> list[dict[str, Any]]:
    if shutil.which("kubectl") is None:
        if os.environ.get("CI"):
            pytest.fail("kubectl is missing (scripts/bootstrap.sh installs Debian's kubernetes-client)")
        pytest.skip("kubectl is missing")
    result = subprocess.run(["kubectl", "kustomize", str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stderr == "", result.stderr  # today's fields: no deprecation warning from kubectl's kustomize
    return [d for d in yaml.safe_load_all(result.stdout) if d]


def daemonset(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (ds,) = [d for d in docs if d["kind"] == "DaemonSet"]
    return ds


@pytest.mark.parametrize("path", [DEPLOY, DEPLOY / "overlays" / "gke"], ids=["base", "gke"])
def test_kustomize_output_validates_against_the_kubernetes_schemas(path: Path) -> None:
    docs = kustomize(path)
    assert {d["kind"] for d in docs} == {"DaemonSet", "ServiceAccount", "CustomResourceDefinition", "Role",
                                         "RoleBinding", "ClusterRole", "ClusterRoleBinding", "Lease"}
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_the_agents_rights_are_exactly_its_configmap_events_status_reading_a_node_and_its_lease() -> None:
    docs = kustomize(DEPLOY)
    granted = sorted(
        (doc["kind"], doc["metadata"].get("namespace", ""), group, resource, tuple(rule.get("resourceNames", ())),
         tuple(sorted(rule["verbs"])))
        for doc in docs if doc["kind"] in ("Role", "ClusterRole")
        for rule in doc["rules"] for group in rule["apiGroups"] for resource in rule["resources"])
    assert granted == [
        ("ClusterRole", "", "", "nodes", (), ("get",)),
        ("ClusterRole", "", "ipmasq.dev", "ipmasqagentstatuses", (), ("create", "list", "patch")),
        ("Role", "default", "", "events", (), ("create", "patch")),
        ("Role", "kube-system", "", "configmaps", ("ip-masq-agent",), ("get", "list", "watch")),
        ("Role", "kube-system", "", "events", (), ("create", "patch")),
        ("Role", "kube-system", "coordination.k8s.io", "leases", ("ip-masq-agent",), ("get", "patch")),
    ]
    (lease,) = [doc for doc in docs if doc["kind"] == "Lease"]  # shipped: the agents cannot create Leases
    assert (lease["metadata"]["namespace"], lease["metadata"]["name"]) == ("kube-system", "ip-masq-agent")
    bound = {(doc["kind"], doc["roleRef"]["name"]): doc["subjects"] for doc in docs if doc["kind"].endswith("Binding")}
    assert set(bound) == {("RoleBinding", "ip-masq-agent"), ("RoleBinding", "ip-masq-agent-node-events"),
                          ("ClusterRoleBinding", "ip-masq-agent")}
    for subjects in bound.values():
        assert subjects == [{"kind": "ServiceAccount", "name": "ip-masq-agent", "namespace": "kube-system"}]


def test_daemonset_is_least_privilege_and_drop_in() -> None:
    ds = daemonset(kustomize(DEPLOY))
    assert ds["metadata"]["namespace"] == "kube-system"
    pod = ds["spec"]["template"]["spec"]
    assert pod["hostNetwork"] is True
    assert pod["priorityClassName"] == "system-node-critical"
    assert {"operator": "Exists"} in pod["tolerations"]
    assert pod["automountServiceAccountToken"] is True  # the API: its rights are the test above
    assert ds["spec"]["updateStrategy"]["type"] == "RollingUpdate"
    (container,) = pod["containers"]
    security = container["securityContext"]
    assert security["privileged"] is False and security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"] == {"drop": ["ALL"], "add": ["NET_ADMIN", "NET_RAW"]}
    assert container["resources"]["requests"] and container["resources"]["limits"]
    assert container["livenessProbe"]["exec"]["command"][:2] == ["ipmasq", "health"]
    assert container["readinessProbe"]["exec"]["command"][:2] == ["ipmasq", "health"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["config"]["configMap"] == {"name": "ip-masq-agent", "optional": True,
                                              "items": [{"key": "config", "path": "ip-masq-agent"}]}
    assert volumes["xtables-lock"]["hostPath"] == {"path": "/run/xtables.lock", "type": "FileOrCreate"}
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert mounts["config"] == "/etc/config" and mounts["xtables-lock"] == "/run/xtables.lock"
    assert container["image"] == "ipmasq/ipmasq:0.1.0"


def test_agents_of_one_node_share_the_node_lock_directory() -> None:
    """During a rolling update the old and the new pod must see one lock file: a host directory, at the default."""
    from ipmasq.agent.nodelock import DEFAULT_LOCK_DIRECTORY

    for path in (DEPLOY, DEPLOY / "overlays" / "gke"):
        pod = daemonset(kustomize(path))["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["node-lock"]["hostPath"] == {"path": DEFAULT_LOCK_DIRECTORY, "type": "DirectoryOrCreate"}
        mounts = {m["name"]: m for m in container["volumeMounts"]}
        assert mounts["node-lock"]["mountPath"] == DEFAULT_LOCK_DIRECTORY and not mounts["node-lock"].get("readOnly")
        assert not any(arg.startswith("--lock-file") for arg in container["args"])  # the default, under the mount


def test_gke_overlay_runs_what_gke_runs() -> None:
    args = daemonset(kustomize(DEPLOY / "overlays" / "gke"))["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--masq-chain=IP-MASQ" in args and "--nomasq-all-reserved-ranges" in args


@pytest.mark.parametrize("example", sorted((DEPLOY / "examples").glob("*.yaml")), ids=lambda p: p.name)
def test_example_configmaps_are_valid_and_load(example: Path) -> None:
    (doc,) = [d for d in yaml.safe_load_all(example.read_text()) if d]
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    assert (doc["metadata"]["name"], doc["metadata"]["namespace"]) == ("ip-masq-agent", "kube-system")
    config = config_from_bytes(ConfigInput(((str(example), doc["data"]["config"].encode()),)), PolicyOptions())
    assert config.non_masquerade


def test_image_install_script_installs_a_working_command(tmp_path: Path) -> None:
    prefix = tmp_path / "image-prefix"
    result = subprocess.run(["bash", str(ROOT / "scripts" / "install-image.sh"), str(ROOT), str(prefix)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "ipmasq 0.1.0" in result.stdout
    render = subprocess.run([str(prefix / "bin" / "ipmasq"), "render", "--masq-chain=IP-MASQ"], capture_output=True,
                            text=True, check=True)
    assert render.stdout.startswith("*nat\n:IP-MASQ - [0:0]\n")
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "RUN /src/scripts/install-image.sh /src /opt/ipmasq" in dockerfile
    assert not (prefix / "bin" / "pip").exists()  # the runtime stage copies the environment without pip


@pytest.mark.parametrize("path", [DEPLOY, DEPLOY / "overlays" / "gke"], ids=["base", "gke"])
def test_probes_query_the_loopback_address_the_agent_serves(path: Path) -> None:
    from ipmasq.agent.health import DEFAULT_METRICS_ADDRESS

    (container,) = daemonset(kustomize(path))["spec"]["template"]["spec"]["containers"]
    (address,) = [a.split("=", 1)[1] for a in container["args"] if a.startswith("--metrics-address=")]
    assert address.startswith("127.0.0.1:")  # hostNetwork: anything else would open the port on the node's IPs
    probes = [container["livenessProbe"]["exec"]["command"], container["readinessProbe"]["exec"]["command"]]
    for command in probes:
        given = [a.split("=", 1)[1] for a in command if a.startswith("--address=")]
        assert (given[0] if given else DEFAULT_METRICS_ADDRESS) == address
    assert "--live" in probes[0] and "--live" not in probes[1]


def test_the_webhook_kustomization_is_narrow_failing_open_and_least_privilege() -> None:
    docs = kustomize(DEPLOY / "webhook")
    by_kind = {d["kind"]: d for d in docs}
    assert set(by_kind) == {"ServiceAccount", "Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding", "Deployment",
                            "PodDisruptionBudget", "Service", "ValidatingWebhookConfiguration"}
    for doc in docs:
        if doc["kind"] != "PodDisruptionBudget":  # policy/v1beta1, what 1.20 serves; gone from today's schemas
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    (hook,) = by_kind["ValidatingWebhookConfiguration"]["webhooks"]
    assert (hook["failurePolicy"], hook["sideEffects"], hook["timeoutSeconds"]) == ("Ignore", "None", 5)
    assert hook["rules"] == [{"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE", "UPDATE"],
                              "resources": ["configmaps"], "scope": "Namespaced"}]
    assert hook["admissionReviewVersions"] == ["v1"] and "caBundle" not in hook["clientConfig"]  # the webhook's job
    service = by_kind["Service"]
    assert hook["clientConfig"]["service"]["name"] == service["metadata"]["name"] == "ipmasq-webhook"
    deployment = by_kind["Deployment"]
    assert deployment["spec"]["replicas"] == 2 and by_kind["PodDisruptionBudget"]["spec"]["minAvailable"] == 1
    pod = deployment["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True and "hostNetwork" not in pod
    (container,) = pod["containers"]
    assert container["args"][0] == "webhook" and container["image"] == "ipmasq/ipmasq:0.1.0"
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert by_kind["Role"]["rules"][0] == {"apiGroups": [""], "resources": ["secrets"],
                                           "resourceNames": ["ipmasq-webhook-certificate"], "verbs": ["get", "update"]}
    (cluster_rule,) = by_kind["ClusterRole"]["rules"]
    assert cluster_rule["resourceNames"] == ["ipmasq-webhook"] and cluster_rule["verbs"] == ["get", "patch"]
