"""deploy/: the kustomize output (rendered by kubectl offline) is valid Kubernetes on every supported minor,
least-privilege, drop-in, and the webhook is sent exactly the ConfigMaps it judges."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import celpy
import hypothesis
import kubernetes_validate
import pytest
import yaml
from hypothesis import strategies as st

from ipmasq import __version__
from ipmasq.config import ConfigInput, config_from_bytes
from ipmasq.config.validate import KNOWN_KEYS
from ipmasq.lint.manifest import AGENT_CONFIGMAP, AGENT_NAMESPACE
from ipmasq.options import PolicyOptions
from ipmasq.webhook.review import decide
from tests.conftest import ROOT
from tests.hostile.admission import configmap
from tests.manifests import KUSTOMIZATIONS, kustomize

DEPLOY = ROOT / "deploy"
# what deploy/ installs: the release's tag (ipmasq.__version__) in a registry the project names
RELEASED_IMAGE = f"ghcr.io/ipmasq/ipmasq:{__version__}"
# The supported Kubernetes minors, oldest to newest (the README's install section names the same window): every
# document of deploy/ is validated strictly against the schemas of each.
SUPPORTED_MINORS = ("1.33", "1.34", "1.35", "1.36", "1.37")
# The Prometheus Operator's kinds (deploy/monitoring): no Kubernetes schema covers them, the operator's CRDs do.
PROMETHEUS_OPERATOR_KINDS = {"PodMonitor", "PrometheusRule"}


def daemonset(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (ds,) = [d for d in docs if d["kind"] == "DaemonSet"]
    return ds


def validate_on_every_supported_minor(doc: dict[str, Any]) -> None:
    for minor in SUPPORTED_MINORS:
        kubernetes_validate.validate(doc, f"{minor}.0", strict=True)


def test_the_schemas_of_every_supported_minor_are_installed() -> None:
    from kubernetes_validate.utils import all_versions

    assert {f"{minor}.0" for minor in SUPPORTED_MINORS} <= set(all_versions())


@pytest.mark.parametrize("path", [DEPLOY, DEPLOY / "overlays" / "gke"], ids=["base", "gke"])
def test_kustomize_output_validates_against_the_kubernetes_schemas(path: Path) -> None:
    docs = kustomize(path)
    assert {d["kind"] for d in docs} == {"DaemonSet", "ServiceAccount", "CustomResourceDefinition", "Role",
                                         "RoleBinding", "ClusterRole", "ClusterRoleBinding", "Lease",
                                         "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"}
    for doc in docs:
        validate_on_every_supported_minor(doc)


# Every kustomization is rendered and each of its documents validated on every supported minor: base and gke above,
# webhook and gke-webhook in their own test below, monitoring here (the Prometheus Operator's kinds only).
OBSERVE = DEPLOY / "overlays" / "observe"
OBSERVE_OVERLAYS = {"observe": OBSERVE, "observe-eks": OBSERVE / "eks", "observe-aks": OBSERVE / "aks"}
RENDERED = KUSTOMIZATIONS


@pytest.mark.parametrize("name", list(OBSERVE_OVERLAYS))
def test_observe_overlays_validate_against_the_kubernetes_schemas(name: str) -> None:
    docs = kustomize(OBSERVE_OVERLAYS[name])
    # the admission policy comes along: an observer's token, too, writes only for its own node
    assert {d["kind"] for d in docs} == {"DaemonSet", "ServiceAccount", "CustomResourceDefinition", "Role",
                                         "RoleBinding", "ClusterRole", "ClusterRoleBinding", "Lease",
                                         "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"}
    for doc in docs:
        validate_on_every_supported_minor(doc)


def test_monitoring_holds_only_kinds_no_kubernetes_schema_covers() -> None:
    docs = kustomize(DEPLOY / "monitoring")
    assert [doc["kind"] for doc in docs] == sorted(PROMETHEUS_OPERATOR_KINDS)
    for doc in docs:
        with pytest.raises(kubernetes_validate.SchemaNotFoundError):  # once one does, validate it instead
            kubernetes_validate.validate(doc, f"{SUPPORTED_MINORS[-1]}.0", strict=True)


def test_every_file_of_deploy_is_in_a_validated_kustomization_or_an_example() -> None:
    """A manifest added anywhere under deploy/ is validated (RENDERED, the examples), or this test says where it
    belongs."""
    included: set[Path] = set()
    rendered_dirs = {path.resolve() for path in RENDERED.values()}
    kustomizations = {k.parent.resolve(): yaml.safe_load(k.read_text()) for k in DEPLOY.rglob("kustomization.yaml")}
    while True:  # a directory another rendered one takes in (deploy/base, a component) is rendered with it
        grown = {(directory / entry).resolve() for directory, spec in kustomizations.items()
                 if directory in rendered_dirs for entry in spec.get("resources", []) + spec.get("components", [])
                 if (directory / entry).resolve().is_dir()}
        if grown <= rendered_dirs:
            break
        rendered_dirs |= grown
    for directory, spec in kustomizations.items():
        assert directory in rendered_dirs, directory / "kustomization.yaml"
        included.add(directory / "kustomization.yaml")
        entries = spec.get("resources", []) + [patch["path"] for patch in spec.get("patches", []) if "path" in patch]
        included |= {(directory / entry).resolve() for entry in entries if (directory / entry).resolve().is_file()}
    examples = {path.resolve() for path in (DEPLOY / "examples").glob("*.yaml")}
    rule_file = {(DEPLOY / "monitoring" / "ip-masq-agent.rules.yaml").resolve()}  # Prometheus' rule_files format
    assert {path.resolve() for path in DEPLOY.rglob("*.yaml")} == included | examples | rule_file


# the Lease's holder reads the node-trust policy and its binding, by name (ipmasq.fleet.nodetrust)
NODE_TRUST_READ = [("ClusterRole", "", "admissionregistration.k8s.io", resource, ("ip-masq-agent-own-node",),
                    ("get",)) for resource in ("validatingadmissionpolicies", "validatingadmissionpolicybindings")]


def test_the_agents_rights_are_exactly_its_configmap_events_status_reading_a_node_and_its_lease() -> None:
    docs = kustomize(DEPLOY)
    granted = sorted(
        (doc["kind"], doc["metadata"].get("namespace", ""), group, resource, tuple(rule.get("resourceNames", ())),
         tuple(sorted(rule["verbs"])))
        for doc in docs if doc["kind"] in ("Role", "ClusterRole")
        for rule in doc["rules"] for group in rule["apiGroups"] for resource in rule["resources"])
    assert granted == [
        ("ClusterRole", "", "", "nodes", (), ("get",)),
        *NODE_TRUST_READ,
        ("ClusterRole", "", "ipmasq.dev", "ipmasqagentstatuses", (), ("create", "list", "patch")),
        ("Role", "default", "", "events", (), ("create", "patch")),
        ("Role", "kube-system", "", "configmaps", ("ip-masq-agent",), ("get", "list", "watch")),
        ("Role", "kube-system", "", "events", (), ("create", "patch")),
        ("Role", "kube-system", "coordination.k8s.io", "leases", ("ip-masq-agent",), ("get", "patch")),
    ]
    (lease,) = [doc for doc in docs if doc["kind"] == "Lease"]  # shipped: the agents cannot create Leases
    assert (lease["metadata"]["namespace"], lease["metadata"]["name"]) == ("kube-system", "ip-masq-agent")
    bound = {(doc["kind"], doc["roleRef"]["name"]): doc["subjects"] for doc in docs
             if doc["kind"] in ("RoleBinding", "ClusterRoleBinding")}
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
    assert container["image"] == RELEASED_IMAGE


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
    validate_on_every_supported_minor(doc)
    assert (doc["metadata"]["name"], doc["metadata"]["namespace"]) == ("ip-masq-agent", "kube-system")
    config = config_from_bytes(ConfigInput(((str(example), doc["data"]["config"].encode()),)), PolicyOptions())
    assert config.non_masquerade


def test_image_install_script_installs_a_working_command(tmp_path: Path) -> None:
    prefix = tmp_path / "image-prefix"
    result = subprocess.run(["bash", str(ROOT / "scripts" / "install-image.sh"), str(ROOT), str(prefix),
                             "0123456789abcdef0123456789abcdef01234567"],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    # the release, and the commit the image was built from (the Dockerfile's REVISION), as the image prints them
    assert f"ipmasq {__version__} (commit 0123456789abcdef0123456789abcdef01234567)" in result.stdout
    render = subprocess.run([str(prefix / "bin" / "ipmasq"), "render", "--masq-chain=IP-MASQ"], capture_output=True,
                            text=True, check=True)
    assert render.stdout.startswith("*nat\n:IP-MASQ - [0:0]\n")
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert 'RUN /src/scripts/install-image.sh /src /opt/ipmasq "$REVISION"' in dockerfile
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


@pytest.mark.parametrize("name", ["webhook", "gke-webhook"])
def test_the_webhook_kustomization_is_narrow_failing_open_and_least_privilege(name: str) -> None:
    docs = kustomize(RENDERED[name])
    by_kind = {d["kind"]: d for d in docs}
    assert set(by_kind) == {"ServiceAccount", "Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding", "Deployment",
                            "PodDisruptionBudget", "Service", "ValidatingWebhookConfiguration", "NetworkPolicy"}
    for doc in docs:
        validate_on_every_supported_minor(doc)
    (hook,) = by_kind["ValidatingWebhookConfiguration"]["webhooks"]
    assert (hook["failurePolicy"], hook["sideEffects"], hook["timeoutSeconds"]) == ("Ignore", "None", 5)
    assert hook["rules"] == [{"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE", "UPDATE"],
                              "resources": ["configmaps"], "scope": "Namespaced"}]
    # the ConfigMaps it judges only: the tests below evaluate the expression against the webhook's own decision
    assert [condition["name"] for condition in hook["matchConditions"]] == ["judged-by-the-webhook"]
    assert "namespaceSelector" not in hook and "objectSelector" not in hook
    assert hook["admissionReviewVersions"] == ["v1"] and "caBundle" not in hook["clientConfig"]  # the webhook's job
    service = by_kind["Service"]
    assert hook["clientConfig"]["service"]["name"] == service["metadata"]["name"] == "ipmasq-webhook"
    deployment = by_kind["Deployment"]
    assert deployment["spec"]["replicas"] == 2 and by_kind["PodDisruptionBudget"]["spec"]["minAvailable"] == 1
    assert by_kind["PodDisruptionBudget"]["apiVersion"] == "policy/v1"
    pod = deployment["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True and "hostNetwork" not in pod
    (container,) = pod["containers"]
    assert container["args"][0] == "webhook" and container["image"] == RELEASED_IMAGE
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert by_kind["Role"]["rules"][0] == {"apiGroups": [""], "resources": ["secrets"],
                                           "resourceNames": ["ipmasq-webhook-certificate"], "verbs": ["get", "update"]}
    (cluster_rule,) = by_kind["ClusterRole"]["rules"]
    assert cluster_rule["resourceNames"] == ["ipmasq-webhook"] and cluster_rule["verbs"] == ["get", "patch"]


def test_the_gke_webhook_is_the_webhook_with_gke_agents_flags_and_nothing_else() -> None:
    """GKE's agent (enforced, or GKE's own, observed) reads the ConfigMap with --nomasq-all-reserved-ranges, which
    changes what lint finds: the webhook beside it judges with the same flags, from the one component both take."""
    plain, gke = kustomize(RENDERED["webhook"]), kustomize(RENDERED["gke-webhook"])
    (deployment,) = [d for d in gke if d["kind"] == "Deployment"]
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    agent_args = daemonset(kustomize(RENDERED["gke"]))["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args == ["webhook", "--masq-chain=IP-MASQ", "--nomasq-all-reserved-ranges"]
    assert set(args[1:]) <= set(agent_args)
    deployment["spec"]["template"]["spec"]["containers"][0]["args"] = ["webhook"]
    assert gke == plain


# --- Pod Security Standards (as Pod Security admission checks them, level "latest") --------------------------------

BASELINE_CAPABILITIES = {"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD",
                         "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT"}
SAFE_SYSCTLS = {"kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
                "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
                "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
                "net.ipv4.tcp_keepalive_probes"}
SELINUX_TYPES = {"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim", "projected",
                      "secret"}


def _containers(pod: dict[str, Any]) -> list[dict[str, Any]]:
    return [c for kind in ("initContainers", "containers", "ephemeralContainers") for c in pod.get(kind, [])]


def baseline_violations(pod: dict[str, Any]) -> list[str]:
    found = [f"{field}: true" for field in ("hostNetwork", "hostPID", "hostIPC") if pod.get(field)]
    found += [f"volume {v['name']}: hostPath" for v in pod.get("volumes", []) if "hostPath" in v]
    found += [f"sysctl {s['name']}" for s in pod.get("securityContext", {}).get("sysctls", [])
              if s["name"] not in SAFE_SYSCTLS]
    contexts = [("pod", pod.get("securityContext", {}))]
    for container in _containers(pod):
        where = f"container {container['name']}"
        security = container.get("securityContext", {})
        contexts.append((where, security))
        if security.get("privileged"):
            found.append(f"{where}: privileged")
        found += [f"{where}: capability {cap}" for cap in security.get("capabilities", {}).get("add", [])
                  if cap not in BASELINE_CAPABILITIES]
        found += [f"{where}: hostPort {port['hostPort']}" for port in container.get("ports", [])
                  if port.get("hostPort")]
        if security.get("procMount", "Default") != "Default":
            found.append(f"{where}: procMount")
        for handler in [container.get(probe, {}) for probe in ("livenessProbe", "readinessProbe", "startupProbe")] + [
                hook for hook in container.get("lifecycle", {}).values()]:
            found += [f"{where}: {action}.host" for action in ("httpGet", "tcpSocket")
                      if "host" in handler.get(action, {})]
    for where, security in contexts:
        if security.get("windowsOptions", {}).get("hostProcess"):
            found.append(f"{where}: hostProcess")
        if security.get("seccompProfile", {}).get("type") == "Unconfined":
            found.append(f"{where}: seccomp Unconfined")
        if security.get("appArmorProfile", {}).get("type", "RuntimeDefault") not in ("RuntimeDefault", "Localhost"):
            found.append(f"{where}: appArmorProfile")
        selinux = security.get("seLinuxOptions", {})
        if selinux.get("type", "") not in SELINUX_TYPES or "user" in selinux or "role" in selinux:
            found.append(f"{where}: seLinuxOptions")
    return found


def restricted_violations(pod: dict[str, Any]) -> list[str]:
    found = baseline_violations(pod)
    found += [f"volume {v['name']}: {kind}" for v in pod.get("volumes", [])
              for kind in set(v) - {"name"} - RESTRICTED_VOLUMES]
    pod_security = pod.get("securityContext", {})
    if pod_security.get("runAsUser") == 0:
        found.append("pod: runAsUser 0")
    for container in _containers(pod):
        where = f"container {container['name']}"
        security = container.get("securityContext", {})
        if security.get("allowPrivilegeEscalation") is not False:
            found.append(f"{where}: allowPrivilegeEscalation not false")
        if not security.get("runAsNonRoot", pod_security.get("runAsNonRoot")):
            found.append(f"{where}: runAsNonRoot not true")
        if security.get("runAsUser") == 0:
            found.append(f"{where}: runAsUser 0")
        seccomp = security.get("seccompProfile", pod_security.get("seccompProfile", {})).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            found.append(f"{where}: seccompProfile not RuntimeDefault or Localhost")
        capabilities = security.get("capabilities", {})
        if "ALL" not in capabilities.get("drop", []):
            found.append(f"{where}: capabilities do not drop ALL")
        found += [f"{where}: adds {cap}" for cap in capabilities.get("add", []) if cap != "NET_BIND_SERVICE"]
    return found


def webhook_pod() -> dict[str, Any]:
    (deployment,) = [d for d in kustomize(DEPLOY / "webhook") if d["kind"] == "Deployment"]
    pod: dict[str, Any] = deployment["spec"]["template"]["spec"]
    return pod


def test_the_webhook_passes_pod_security_restricted() -> None:
    pod = webhook_pod()
    assert restricted_violations(pod) == []
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}


def test_the_restricted_check_finds_what_the_webhook_would_break() -> None:
    """The checker above is not vacuous: each field the webhook sets is one restricted requires."""
    pod = webhook_pod()
    del pod["securityContext"]["seccompProfile"]
    (container,) = pod["containers"]
    container["securityContext"]["allowPrivilegeEscalation"] = True
    container["securityContext"]["capabilities"] = {"drop": ["NET_RAW"]}
    pod["securityContext"]["runAsNonRoot"] = False
    assert restricted_violations(pod) == [
        "container webhook: allowPrivilegeEscalation not false", "container webhook: runAsNonRoot not true",
        "container webhook: seccompProfile not RuntimeDefault or Localhost",
        "container webhook: capabilities do not drop ALL"]


@pytest.mark.parametrize("path", [DEPLOY, DEPLOY / "overlays" / "gke"], ids=["base", "gke"])
def test_the_agent_needs_a_privileged_namespace(path: Path) -> None:
    pod = daemonset(kustomize(path))["spec"]["template"]["spec"]
    assert baseline_violations(pod) == [
        "hostNetwork: true", "volume xtables-lock: hostPath", "volume node-lock: hostPath",
        "container ip-masq-agent: capability NET_ADMIN", "container ip-masq-agent: capability NET_RAW"]


def readme_install_section() -> str:
    readme = (ROOT / "README.md").read_text()
    return readme.split("\n## Install\n", 1)[1].split("\n## ", 1)[0]


def test_the_readme_labels_kube_system_privileged_for_every_pod_security_mode() -> None:
    """The agent (above) violates baseline: where a cluster's defaults enforce, warn or audit at baseline or
    restricted, kube-system needs all three modes at privileged for its pods and for a quiet `kubectl apply`."""
    (command,) = re.findall(r"^ +(kubectl label namespace .*)$", readme_install_section(), re.MULTILINE)
    words = command.split()
    assert words[:4] == ["kubectl", "label", "namespace", AGENT_NAMESPACE] and "--overwrite" in words
    labels = dict(word.split("=", 1) for word in words[4:] if "=" in word)
    assert labels == {f"pod-security.kubernetes.io/{mode}": "privileged" for mode in ("enforce", "warn", "audit")}


def test_the_readme_names_the_supported_window() -> None:
    section = " ".join(readme_install_section().split())
    assert f"Kubernetes {SUPPORTED_MINORS[0]} to {SUPPORTED_MINORS[-1]}" in section
    assert "restricted" in section and "privileged" in section


# --- matchConditions: the API server sends the webhook exactly the ConfigMaps its review judges ----------------------
# The CEL is evaluated by cel-python, whose `matches` is RE2 (google-re2) as the API server's is; the review's own
# decision is AdmissionVerdict.reviewed: False only for a ConfigMap it allows without a look (no denial, no warning
# possible).

GOOD_CONFIG = "nonMasqueradeCIDRs:\n  - 10.0.0.0/8\nmasqLinkLocal: false\nresyncInterval: 60s\n"
PEM = "-----BEGIN CERTIFICATE-----\nMIIDBTCCAe2gAwIBAgIIYnRj\n-----END CERTIFICATE-----\n"
DNS_NAME_CHARACTERS = "abcdefghijklmnopqrstuvwxyz0123456789-."  # all a ConfigMap's name may hold
# Python's str.isspace(), which the review's strip() uses
PYTHON_WHITESPACE = "".join(chr(c) for c in range(0x110000) if chr(c).isspace())


@pytest.fixture(scope="module")
def match_condition() -> celpy.Runner:
    (configuration,) = [d for d in kustomize(DEPLOY / "webhook") if d["kind"] == "ValidatingWebhookConfiguration"]
    (hook,) = configuration["webhooks"]
    (condition,) = hook["matchConditions"]
    environment = celpy.Environment()
    return environment.program(environment.compile(condition["expression"]))


def admission_request(obj: dict[str, Any], operation: str = "CREATE") -> dict[str, Any]:
    """As the API server sends it in the AdmissionReview (the `object` member included)."""
    return {"uid": "7c6f", "kind": {"group": "", "version": "v1", "kind": "ConfigMap"},
            "resource": {"group": "", "version": "v1", "resource": "configmaps"},
            "name": obj["metadata"]["name"], "namespace": obj["metadata"]["namespace"], "operation": operation,
            "userInfo": {"username": "admin"}, "object": obj}


def sent(program: celpy.Runner, obj: dict[str, Any], old: dict[str, Any] | None = None) -> bool:
    request = {k: v for k, v in admission_request(obj, "UPDATE" if old else "CREATE").items() if k != "object"}
    activation = {"object": celpy.json_to_cel(obj), "oldObject": celpy.json_to_cel(old), "request":
                  celpy.json_to_cel(request)}
    result = program.evaluate(activation)
    assert isinstance(result, celpy.celtypes.BoolType), result  # an error would skip the webhook (failurePolicy)
    return bool(result)


def judged(obj: dict[str, Any], old: dict[str, Any] | None = None) -> bool:
    request = admission_request(obj, "UPDATE" if old else "CREATE")
    if old is not None:
        request["oldObject"] = old
    return decide(request, PolicyOptions()).reviewed


KUBE_SYSTEM = AGENT_NAMESPACE
# (namespace, name, data, judged by the review, sent by the CEL): every row agrees but the last three
MATCH_TABLE = [
    (KUBE_SYSTEM, AGENT_CONFIGMAP, {"config": GOOD_CONFIG}, True, True),
    (KUBE_SYSTEM, AGENT_CONFIGMAP, {"config": "nonMasqueradeCIDRs: [10.0.0.0/33]\n"}, True, True),
    (KUBE_SYSTEM, AGENT_CONFIGMAP, None, True, True),  # no data: a warning
    ("default", AGENT_CONFIGMAP, {"config": GOOD_CONFIG}, True, True),  # never read: a warning
    ("payments", AGENT_CONFIGMAP, None, True, True),
    (KUBE_SYSTEM, "ip-masq-agent-5f7g8h9k2m", {"config": GOOD_CONFIG}, True, True),  # kustomize's hash suffix
    (KUBE_SYSTEM, "ip-masq-egress", {"ip-masq-egress": GOOD_CONFIG}, True, True),  # a config directory's family
    (KUBE_SYSTEM, "ipmasq-agent", {"config": GOOD_CONFIG}, True, True),
    (KUBE_SYSTEM, "ip-masq-agnet", {"config": GOOD_CONFIG}, True, True),
    (KUBE_SYSTEM, "masquerade-settings", {"config": GOOD_CONFIG}, True, True),
    (KUBE_SYSTEM, "ip-msaq-agent", {"config": GOOD_CONFIG}, True, True),  # no "masq": its letters send it
    (KUBE_SYSTEM, "ip-mas-agent", None, True, True),
    (KUBE_SYSTEM, "network-settings", {"settings": GOOD_CONFIG}, True, True),  # a value that starts like a config
    (KUBE_SYSTEM, "egress", {"nonMasqueradeCIDRs": "[10.0.0.0/8]"}, True, True),  # the config's key under data
    (KUBE_SYSTEM, "egress", {"RESYNCINTERVAL": "60s"}, True, True),  # keys match case-insensitively
    (KUBE_SYSTEM, "egress", {"notes": "\u00a0\u3000\tmasqLin\u212aLocal : false"}, True, True),  # Kelvin sign K
    (KUBE_SYSTEM, "egress", {"notes": "rules"}, True, True),  # no colon, nothing after it
    (KUBE_SYSTEM, "egress", {"notes": "rules" + " " * 35 + "apply"}, True, True),  # the review reads 40 characters
    (KUBE_SYSTEM, "kube-root-ca.crt", {"ca.crt": PEM}, False, False),
    (KUBE_SYSTEM, "coredns", {"Corefile": ".:53 {\n    forward . /etc/resolv.conf\n}\n"}, False, False),
    (KUBE_SYSTEM, "kube-proxy", {"config.conf": "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: "
                                                "KubeProxyConfiguration\nmode: iptables\n"}, False, False),
    (KUBE_SYSTEM, "kubeadm-config", {"ClusterConfiguration": "apiVersion: kubeadm.k8s.io/v1beta4\n"}, False, False),
    (KUBE_SYSTEM, "extension-apiserver-authentication", {"client-ca-file": PEM}, False, False),
    (KUBE_SYSTEM, "egress", {"notes": "rules apply: always"}, False, False),
    (KUBE_SYSTEM, "egress", {"notes": "# rules: none"}, False, False),
    (KUBE_SYSTEM, "egress", {"rulesets": "rulesets: none"}, False, False),
    (KUBE_SYSTEM, "ip-agent", None, False, False),
    ("kube-public", "cluster-info", {"kubeconfig": "apiVersion: v1\nkind: Config\n"}, False, False),
    ("default", "ipmasq-agent", None, False, False),  # outside kube-system only the agent's own name is judged
    ("payments", "app-config", {"config": GOOD_CONFIG}, False, False),  # an app's config, whatever it holds
    ("payments", "kube-root-ca.crt", {"ca.crt": PEM}, False, False),
    # sent, not judged: the CEL's letter count is a bound on difflib's ratio; RE2 folds U+017F (long s) into s; and
    # one whitespace count stands for the review's 40 characters (a key and 22 or more: the longest key's count)
    (KUBE_SYSTEM, "mapping-agents", None, False, True),
    (KUBE_SYSTEM, "egress", {"notes": "ma\u017fqLinkLocal: false"}, False, True),
    (KUBE_SYSTEM, "egress", {"notes": "rules" + " " * 22 + "apply"}, False, True),
]


def starts_with_a_key_then_a_long_gap(value: str) -> bool:
    """Where the CEL sends a value the review does not judge: a key, then 22 whitespace characters or more."""
    word = re.match(r"([^\s:]*)\s{22}", value.lstrip())
    return word is not None and word.group(1).lower() in KNOWN_KEYS


@pytest.mark.parametrize(("namespace", "name", "data", "is_judged", "is_sent"), MATCH_TABLE,
                         ids=[f"{row[0]}/{row[1]}-{i}" for i, row in enumerate(MATCH_TABLE)])
def test_the_webhook_is_sent_the_configmaps_its_review_judges(
        match_condition: celpy.Runner, namespace: str, name: str, data: dict[str, str] | None, is_judged: bool,
        is_sent: bool) -> None:
    obj = configmap(data, name=name, namespace=namespace)
    assert (judged(obj), sent(match_condition, obj)) == (is_judged, is_sent)


def test_an_update_is_sent_as_its_create_is(match_condition: celpy.Runner) -> None:
    """A label added to a stored bad config: judged (its problems become warnings), so sent."""
    old = configmap({"config": "nonMasqueradeCIDRs: [10.0.0.0/33]\n"})
    new = configmap({"config": "nonMasqueradeCIDRs: [10.0.0.0/33]\n"})
    new["metadata"]["labels"] = {"team": "network"}
    assert judged(new, old) and sent(match_condition, new, old)
    app = configmap({"settings": "debug: true\n"}, name="app-config", namespace="payments")
    assert not judged(app, app) and not sent(match_condition, app, app)


def one_edit_misspellings(name: str) -> set[str]:
    deleted = {name[:i] + name[i + 1:] for i in range(len(name))}
    swapped = {name[:i] + name[i + 1] + name[i] + name[i + 2:] for i in range(len(name) - 1)}
    replaced = {name[:i] + c + name[i + 1:] for i in range(len(name)) for c in DNS_NAME_CHARACTERS}
    inserted = {name[:i] + c + name[i:] for i in range(len(name) + 1) for c in DNS_NAME_CHARACTERS}
    return (deleted | swapped | replaced | inserted) - {name}


def test_every_one_letter_misspelling_of_the_agents_name_is_judged_and_sent(match_condition: celpy.Runner) -> None:
    names = one_edit_misspellings(AGENT_CONFIGMAP)
    assert len(names) > 900
    missed = [name for name in sorted(names)
              if not (judged(obj := configmap(None, name=name)) and sent(match_condition, obj))]
    assert missed == []


def misspelt(draw: st.DrawFn) -> str:
    name = AGENT_CONFIGMAP
    for _ in range(draw(st.integers(1, 4))):
        i = draw(st.integers(0, len(name)))
        c = draw(st.sampled_from(DNS_NAME_CHARACTERS))
        name = draw(st.sampled_from([name[:i] + name[i + 1:], name[:i] + c + name[i + 1:], name[:i] + c + name[i:]]))
    return name or "x"


@hypothesis.settings(max_examples=300, deadline=None)
@hypothesis.given(name=st.one_of(st.composite(misspelt)(), st.text(DNS_NAME_CHARACTERS, min_size=1, max_size=30)),
                  namespace=st.sampled_from([KUBE_SYSTEM, "default", "payments"]))
def test_every_name_the_review_judges_is_sent(match_condition: celpy.Runner, name: str, namespace: str) -> None:
    obj = configmap({"settings": "debug: true\n"}, name=name, namespace=namespace)
    if judged(obj):
        assert sent(match_condition, obj)


def key_spelling(draw: st.DrawFn) -> str:
    """A key of the agent's config in any case, its k sometimes the Kelvin sign (which lower() makes a k)."""
    key = draw(st.sampled_from(sorted(KNOWN_KEYS.values())))
    return "".join(draw(st.sampled_from([c.lower(), c.upper()] + (["\u212a"] if c.lower() == "k" else [])))
                   for c in key)


@hypothesis.settings(max_examples=400, deadline=None)
@hypothesis.given(
    value=st.one_of(
        st.tuples(st.text(PYTHON_WHITESPACE, max_size=3), st.composite(key_spelling)(),
                  st.text(PYTHON_WHITESPACE, max_size=40), st.sampled_from(["", ":", ": x", "x", " x", "s:"]),
                  st.text(max_size=20)).map("".join),
        st.text(max_size=60)),
    key=st.one_of(st.just("notes"), st.composite(key_spelling)().filter(lambda k: "\u212a" not in k)))
def test_a_kube_system_configmap_holding_a_config_is_sent_exactly_when_judged(
        match_condition: celpy.Runner, value: str, key: str) -> None:
    """The value's test is the review's (leading whitespace, a key in any case, then whitespace and a colon or the
    end, or whitespace up to the 40th character), but for the two cases of the table's last rows."""
    hypothesis.assume("\u017f" not in value)
    obj = configmap({key: value}, name="egress")
    is_judged, is_sent = judged(obj), sent(match_condition, obj)
    assert is_sent == is_judged or (is_sent and starts_with_a_key_then_a_long_gap(value))


# --- observe mode -------------------------------------------------------------------------------------------------


def _observer(path: Path) -> tuple[list[dict[str, Any]], dict[str, Any], dict[str, Any]]:
    docs = kustomize(path)
    ds = daemonset(docs)
    (container,) = ds["spec"]["template"]["spec"]["containers"]
    return docs, ds, container


def _rights(docs: list[dict[str, Any]]) -> list[tuple[str, str, str, str, tuple[str, ...], tuple[str, ...]]]:
    return sorted(
        (doc["kind"], doc["metadata"].get("namespace", ""), group, resource, tuple(rule.get("resourceNames", ())),
         tuple(sorted(rule["verbs"])))
        for doc in docs if doc["kind"] in ("Role", "ClusterRole")
        for rule in doc["rules"] for group in rule["apiGroups"] for resource in rule["resources"])


@pytest.mark.parametrize("name", list(OBSERVE_OVERLAYS))
def test_the_observer_never_touches_what_the_provider_manages(name: str) -> None:
    """GKE's addon manager reconciles a DaemonSet and a ServiceAccount named ip-masq-agent in kube-system (the
    addon manifest): the observer has names and a pod label of its own, and every binding names its own account."""
    docs, ds, _ = _observer(OBSERVE_OVERLAYS[name])
    names = {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert ("DaemonSet", "ipmasq-observer") in names and ("ServiceAccount", "ipmasq-observer") in names
    assert not {kind for kind, n in names if n == "ip-masq-agent"} - {"Lease"}
    assert ds["spec"]["selector"]["matchLabels"] == {"k8s-app": "ipmasq-observer"}
    assert ds["spec"]["template"]["metadata"]["labels"]["k8s-app"] == "ipmasq-observer"
    assert ds["spec"]["template"]["spec"]["serviceAccountName"] == "ipmasq-observer"
    for doc in docs:
        if doc["kind"] in ("RoleBinding", "ClusterRoleBinding"):
            assert doc["subjects"] == [{"kind": "ServiceAccount", "name": "ipmasq-observer",
                                        "namespace": "kube-system"}]
            assert (doc["roleRef"]["kind"], doc["roleRef"]["name"]) in names


@pytest.mark.parametrize("name", list(OBSERVE_OVERLAYS))
def test_the_observer_observes_writes_nothing_and_is_probed_where_it_serves(name: str) -> None:
    _, ds, container = _observer(OBSERVE_OVERLAYS[name])
    args = container["args"]
    writer = name.split("-", 1)[1] if "-" in name else "gke"
    assert args[0] == "agent" and f"--observe={writer}" in args
    (address,) = [a.split("=", 1)[1] for a in args if a.startswith("--metrics-address=")]
    assert address == "127.0.0.1:9848"  # beside an enforcing agent's 9847 on the same node
    # scraped on the node's address, beside an enforcing agent's 9848 there
    assert "--prometheus-address=$(HOST_IP):9849" in args
    assert [(p["name"], p["containerPort"]) for p in container["ports"]] == [("metrics", 9849)]
    for probe in ("livenessProbe", "readinessProbe"):
        assert f"--address={address}" in container[probe]["exec"]["command"]
    pod = ds["spec"]["template"]["spec"]
    assert "node-lock" not in {v["name"] for v in pod["volumes"]}  # the enforcing agent's lock: never taken
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    assert mounts["xtables-lock"]["readOnly"] is True and mounts["config"]["readOnly"] is True
    security = container["securityContext"]
    # reading: NET_ADMIN (nfnetlink, the x_tables sockopts), NET_RAW (iptables-legacy-save's raw socket)
    assert security["capabilities"] == {"drop": ["ALL"], "add": ["NET_ADMIN", "NET_RAW"]}
    assert security["privileged"] is False and security["readOnlyRootFilesystem"] is True
    assert baseline_violations(pod) == [
        "hostNetwork: true", "volume xtables-lock: hostPath",
        "container ip-masq-agent: capability NET_ADMIN", "container ip-masq-agent: capability NET_RAW"]


def test_observe_runs_gke_managed_agents_flags_by_default() -> None:
    _, _, container = _observer(OBSERVE)
    args = container["args"]
    assert "--masq-chain=IP-MASQ" in args and "--nomasq-all-reserved-ranges" in args
    assert "--config=/etc/config/ip-masq-agent" in args


@pytest.mark.parametrize("name", ["observe-aks", "observe-eks"])
def test_aks_and_eks_are_observed_with_their_profiles_flags_and_inputs(name: str) -> None:
    """Their chain, flags and inputs are the provider's (the agent refuses policy and ConfigMap flags with them)."""
    _, _, container = _observer(OBSERVE_OVERLAYS[name])
    flags = {a.split("=", 1)[0] for a in container["args"][1:]}
    assert flags == {"--observe", "--backend", "--metrics-address", "--prometheus-address"}


def test_the_observers_rights_are_its_configmaps_status_events_lease_and_for_eks_aws_node() -> None:
    shared = [
        ("ClusterRole", "", "", "nodes", (), ("get",)),
        *NODE_TRUST_READ,
        ("ClusterRole", "", "ipmasq.dev", "ipmasqagentstatuses", (), ("create", "list", "patch")),
        ("Role", "default", "", "events", (), ("create", "patch")),
        ("Role", "kube-system", "", "events", (), ("create", "patch")),
        ("Role", "kube-system", "coordination.k8s.io", "leases", ("ip-masq-agent",), ("get", "patch")),
    ]
    gke = ("Role", "kube-system", "", "configmaps", ("ip-masq-agent",), ("get", "list", "watch"))
    aks = ("Role", "kube-system", "", "configmaps",
           ("azure-ip-masq-agent-config-reconciled", "azure-ip-masq-agent-config"), ("get", "list", "watch"))
    aws_node = ("Role", "kube-system", "apps", "daemonsets", ("aws-node",), ("get", "list", "watch"))
    assert _rights(kustomize(OBSERVE)) == sorted([*shared, gke])
    assert _rights(kustomize(OBSERVE / "eks")) == sorted([*shared, aws_node])  # the CNI reads no ConfigMap
    assert _rights(kustomize(OBSERVE / "aks")) == sorted([*shared, aks])


@pytest.mark.parametrize("path", [DEPLOY, *OBSERVE_OVERLAYS.values()], ids=["enforce", *OBSERVE_OVERLAYS])
def test_the_shipped_podmonitor_scrapes_enforcing_agents_and_observers_as_jobs_of_their_own(path: Path) -> None:
    from ipmasq.monitoring import JOB, OBSERVER_JOB, pod_monitor

    _, ds, container = _observer(path)
    spec = pod_monitor()["spec"]
    labels = ds["spec"]["template"]["metadata"]["labels"]
    (expression,) = spec["selector"]["matchExpressions"]
    assert expression["operator"] == "In" and labels[expression["key"]] in expression["values"]
    assert ds["metadata"]["namespace"] in spec["namespaceSelector"]["matchNames"]
    (endpoint,) = spec["podMetricsEndpoints"]
    assert endpoint["port"] in {p["name"] for p in container["ports"]}
    # the job is the pods' label: the enforcing agents' alerts (job ip-masq-agent) never select an observer
    assert labels[spec["jobLabel"]] == (JOB if path == DEPLOY else OBSERVER_JOB)
