"""The admission webhook on a real cluster: the real API server calls `ipmasq webhook`, deployed from deploy/webhook
(two replicas, their certificate made by the webhook and trusted through the caBundle it keeps), while the shipped
agent runs on every node. One cluster for the module; in CI a missing package or root is a failure, never a skip.
"""

from __future__ import annotations

import base64
import json
import math
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from ipmasq.lab.kubernetes import agent, webhook
from ipmasq.lab.kubernetes.cluster import Cluster
from ipmasq.lab.kubernetes.layout import FAST_SYNC_FREQUENCY, PRIVILEGED_NAMESPACE_LABELS
from ipmasq.lab.scenarios import KEEP_10_8, REFERENCE_OPTIONS
from ipmasq.webhook.review import respond
from tests.conftest import ROOT
from tests.eventually import eventually
from tests.hostile.admission import configmap, hostile_configmaps
from tests.kernel.lab.kubernetes.conftest import module_cluster, progress

pytestmark = pytest.mark.kubernetes

GOOD = KEEP_10_8
BAD_CIDR = "nonMasqueradeCIDRs:\n  - 10.0.0.0/8\n  - 10.0.0.0/33\n"


_progress = progress


@pytest.fixture(scope="module")
def lab() -> Iterator[Cluster]:
    """The cluster with the shipped agent (a good config, kubelet syncing every 2 s) and the shipped webhook."""
    with module_cluster() as lab:
        lab.restart_kubelets(FAST_SYNC_FREQUENCY)
        agent.apply_config(lab, GOOD)
        agent.deploy_agent(lab)
        _progress(f"webhook serving in {webhook.deploy_webhook(lab):.1f} s")
        yield lab


def _kubectl(lab: Cluster, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return lab.kubectl(*args, stdin=stdin, check=False, timeout=60)


def _manifest(config: str, *, name: str = "ip-masq-agent", namespace: str = "kube-system") -> str:
    return json.dumps(configmap({"config": config}, name=name, namespace=namespace))


def _stored_config(lab: Cluster) -> str | None:
    found = _kubectl(lab, "get", "configmap", "ip-masq-agent", "-n", "kube-system", "-o", "json")
    return json.loads(found.stdout)["data"].get("config") if found.returncode == 0 else None


def _restore(lab: Cluster) -> None:
    applied = _kubectl(lab, "apply", "-f", "-", stdin=_manifest(GOOD))
    assert applied.returncode == 0 and applied.stderr == "", applied.stderr


def test_the_webhook_runs_as_shipped(lab: Cluster) -> None:
    pods = webhook.webhook_pods(lab)
    assert len(pods) == 2 and all(_ready(p) for p in pods)
    configuration = lab.kubectl_json("get", "validatingwebhookconfiguration", "ipmasq-webhook")
    (hook,) = configuration["webhooks"]
    assert (hook["failurePolicy"], hook["sideEffects"], hook["timeoutSeconds"]) == ("Ignore", "None", 5)
    assert hook["rules"] == [{"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE", "UPDATE"],
                              "resources": ["configmaps"], "scope": "Namespaced"}]
    secret = lab.kubectl_json("get", "secret", "ipmasq-webhook-certificate", "-n", "kube-system")
    assert hook["clientConfig"]["caBundle"] == secret["data"]["ca-bundle.crt"]  # both replicas serve that CA's cert


def _webhook_calls(lab: Cluster) -> float:
    """How often the API server has called the webhook (its own counter, every result and type summed)."""
    metrics = lab.kubectl("get", "--raw", "/metrics").stdout
    return sum(sample.value for family in text_string_to_metric_families(metrics)
               if family.name == "apiserver_admission_webhook_request" for sample in family.samples
               if sample.name.endswith("_total") and sample.labels.get("name", "").startswith("configmaps.ipmasq"))


def test_the_api_server_calls_the_webhook_only_for_the_configmaps_it_judges(lab: Cluster) -> None:
    """matchConditions: a write of any other ConfigMap never reaches the webhook (the API server's own count of
    its calls stays put), while the agent's ConfigMap and a near-miss name are sent."""
    before = _webhook_calls(lab)
    # a bad config under another name in another namespace (nobody reads it), and kube-system's own ConfigMaps
    unrelated = [("app-settings", "default", {"config": BAD_CIDR}),
                 ("coredns", "kube-system", {"Corefile": ".:53 {\n    forward . /etc/resolv.conf\n}\n"}),
                 ("kube-proxy", "kube-system", {"config.conf": "mode: nftables\n"})]
    for name, namespace, data in unrelated:
        written = _kubectl(lab, "apply", "--dry-run=server", "-f", "-",
                           stdin=json.dumps(configmap(data, name=name, namespace=namespace)))
        assert written.returncode == 0 and written.stderr == "", written.stderr
    assert _webhook_calls(lab) == before
    judged = _kubectl(lab, "apply", "--dry-run=server", "-f", "-", stdin=_manifest(BAD_CIDR))
    assert judged.returncode != 0 and "denied the request" in judged.stderr
    near_miss = _kubectl(lab, "apply", "--dry-run=server", "-f", "-",
                         stdin=_manifest(GOOD, name="ip-masq-agent-config"))
    assert near_miss.returncode == 0 and "Warning:" in near_miss.stderr, near_miss.stderr
    assert _webhook_calls(lab) >= before + 2


def _pod_of(lab: Cluster, shipped: str, kind: str, namespace: str) -> str:
    """The pod a shipped workload makes (its template, as the lab's overlay renders it), in `namespace`."""
    rendered = lab.kubectl("kustomize", str(agent.lab_overlay(lab, shipped, lab.artifacts.image))).stdout
    (workload,) = [d for d in yaml.safe_load_all(rendered) if d and d["kind"] == kind]
    template = workload["spec"]["template"]
    # its service account exists only in its own namespace; Pod Security does not look at it
    spec = {key: value for key, value in template["spec"].items() if key != "serviceAccountName"}
    return json.dumps({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "psa-check", "namespace": namespace,
                                                                       "labels": template["metadata"]["labels"]},
                       "spec": spec})


def test_the_webhooks_pods_pass_pod_security_restricted(lab: Cluster) -> None:
    """Created (a server-side dry run: admission runs, nothing is stored) in a namespace that enforces and warns at
    `restricted`, the webhook's pod is admitted without a warning; the agent's pod, which needs hostNetwork and
    NET_ADMIN, is refused there, so the check is real."""
    namespace = "psa-restricted"
    _kubectl(lab, "create", "namespace", namespace)
    try:
        lab.kubectl("label", "--overwrite", "namespace", namespace, "pod-security.kubernetes.io/enforce=restricted",
                    "pod-security.kubernetes.io/warn=restricted")
        created = _kubectl(lab, "create", "--dry-run=server", "-f", "-",
                           stdin=_pod_of(lab, webhook.SHIPPED, "Deployment", namespace))
        assert created.returncode == 0 and "Warning" not in created.stderr, created.stderr
        refused = _kubectl(lab, "create", "--dry-run=server", "-f", "-",
                           stdin=_pod_of(lab, "deploy", "DaemonSet", namespace))
        assert refused.returncode != 0 and 'violates PodSecurity "restricted:latest"' in refused.stderr, refused
    finally:
        _kubectl(lab, "delete", "namespace", namespace, "--wait=false")


def test_pod_security_baseline_is_enforced_where_a_namespace_says_nothing_and_kube_system_admits_the_agent(
        lab: Cluster) -> None:
    """The lab's API server enforces `baseline` cluster-wide: the agent's pod is refused in an unlabelled namespace
    and admitted in kube-system, labelled as the README tells users to label it."""
    namespace = "psa-unlabelled"
    _kubectl(lab, "create", "namespace", namespace)
    try:
        refused = _kubectl(lab, "create", "--dry-run=server", "-f", "-",
                           stdin=_pod_of(lab, "deploy", "DaemonSet", namespace))
        assert refused.returncode != 0 and 'violates PodSecurity "baseline:latest"' in refused.stderr, refused
        assert "host namespaces" in refused.stderr  # hostNetwork, what the agent cannot do without
        admitted = _kubectl(lab, "create", "--dry-run=server", "-f", "-",
                            stdin=_pod_of(lab, "deploy", "DaemonSet", "kube-system"))
        assert admitted.returncode == 0 and "Warning" not in admitted.stderr, admitted.stderr
    finally:
        _kubectl(lab, "delete", "namespace", namespace, "--wait=false")
    labels = lab.kubectl_json("get", "namespace", "kube-system")["metadata"]["labels"]
    assert {k: labels.get(k) for k in PRIVILEGED_NAMESPACE_LABELS} == PRIVILEGED_NAMESPACE_LABELS
    # what users are told to run is what the lab runs
    (command,) = [line.split() for line in (ROOT / "README.md").read_text().splitlines()
                  if "kubectl label namespace kube-system" in line]
    assert dict(word.split("=", 1) for word in command if "=" in word) == PRIVILEGED_NAMESPACE_LABELS


def test_kubectl_apply_of_a_config_the_agent_refuses_is_denied_with_its_line(lab: Cluster, tmp_path: Path) -> None:
    manifest = tmp_path / "ip-masq-agent.yaml"
    manifest.write_text("apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: ip-masq-agent\n  namespace: kube-system\n"
                        "data:\n  config: |\n" + "".join(f"    {line}\n" for line in BAD_CIDR.splitlines()))
    applied = _kubectl(lab, "apply", "-f", str(manifest))
    assert applied.returncode != 0
    assert 'admission webhook "configmaps.ipmasq-webhook.kube-system.svc" denied the request' in applied.stderr
    assert "data.config line 3 `- 10.0.0.0/33`" in applied.stderr and "[invalid-cidr]" in applied.stderr
    assert _stored_config(lab) == GOOD


def test_kubectl_replace_of_a_misspelt_key_is_denied(lab: Cluster) -> None:
    stored = lab.kubectl_json("get", "configmap", "ip-masq-agent", "-n", "kube-system")
    stored["data"]["config"] = "nonMasqueradeCIDR:\n  - 10.0.0.0/8\n"  # the agent accepts it, then its defaults
    replaced = _kubectl(lab, "replace", "-f", "-", stdin=json.dumps(stored))
    assert replaced.returncode != 0 and "denied the request" in replaced.stderr
    assert "did you mean 'nonMasqueradeCIDRs'?" in replaced.stderr and "data.config line 1" in replaced.stderr
    assert _stored_config(lab) == GOOD


def test_kubectl_create_configmap_from_file(lab: Cluster, tmp_path: Path) -> None:
    """With whatever file was at hand: a config with a lookalike dash, the manifest itself, the key named after the
    file; each denied with what to do, then the right file created silently."""
    assert _kubectl(lab, "delete", "configmap", "ip-masq-agent", "-n", "kube-system").returncode == 0
    try:
        dash = tmp_path / "dash.yaml"
        dash.write_text("nonMasqueradeCIDRs:\n  \u2013 10.0.0.0/8\n")
        manifest = tmp_path / "ip-masq-agent.yaml"
        manifest.write_text(_manifest(GOOD))
        good = tmp_path / "config"
        good.write_text(GOOD)
        named = tmp_path / "egress.yaml"
        named.write_text(GOOD)
        cases = [(f"--from-file=config={dash}", "EN DASH (U+2013)"),
                 (f"--from-file=config={manifest}", "[config-is-manifest]"),
                 (f"--from-file={named}", "--from-file=config=FILE")]
        for from_file, expected in cases:
            created = _kubectl(lab, "create", "configmap", "ip-masq-agent", "-n", "kube-system", from_file)
            assert created.returncode != 0 and "denied the request" in created.stderr, created.stderr
            assert expected in created.stderr, created.stderr
            assert _stored_config(lab) is None
        created = _kubectl(lab, "create", "configmap", "ip-masq-agent", "-n", "kube-system", f"--from-file={good}")
        assert created.returncode == 0 and created.stderr == "", created.stderr
    finally:
        _kubectl(lab, "delete", "configmap", "ip-masq-agent", "-n", "kube-system", "--ignore-not-found")
        _restore(lab)
    assert _stored_config(lab) == GOOD


def test_what_lint_warns_about_is_admitted_with_kubectls_warnings(lab: Cluster) -> None:
    try:
        applied = _kubectl(lab, "apply", "-f", "-", stdin=_manifest("nonMasqueradeCIDRs: []\nresyncInterval: 100ms\n"))
        assert applied.returncode == 0, applied.stderr
        warnings = [line for line in applied.stderr.splitlines() if line.startswith("Warning: ")]
        assert len(warnings) == 2, applied.stderr
        assert "[empty-non-masquerade]" in warnings[0] and "[short-resync-interval]" in warnings[1]
        assert _stored_config(lab) == "nonMasqueradeCIDRs: []\nresyncInterval: 100ms\n"
    finally:
        _restore(lab)


def test_configmaps_meant_for_the_agent_that_it_never_reads_are_warned_about(lab: Cluster) -> None:
    for name, namespace, expected in [("ip-masq-agent", "default", "is never read"),
                                      ("ipmasq-agent", "kube-system", "looks meant for the ip-masq agent"),
                                      ("ip-masq-agent-7g4k9d2b5f", "kube-system", "disableNameSuffixHash")]:
        try:
            created = _kubectl(lab, "create", "-f", "-", stdin=_manifest(GOOD, name=name, namespace=namespace))
            assert created.returncode == 0, created.stderr
            assert expected in created.stderr and created.stderr.startswith("Warning: "), created.stderr
        finally:
            _kubectl(lab, "delete", "configmap", name, "-n", namespace, "--ignore-not-found")
    other = _kubectl(lab, "create", "configmap", "unrelated", "-n", "kube-system", "--from-literal=a=b")
    _kubectl(lab, "delete", "configmap", "unrelated", "-n", "kube-system")
    assert other.returncode == 0 and other.stderr == ""


def _webhook_logs(lab: Cluster) -> dict[str, list[str]]:
    """pod name -> its log lines."""
    return {pod["metadata"]["name"]: _kubectl(lab, "logs", "-n", "kube-system", pod["metadata"]["name"]
                                              ).stdout.splitlines() for pod in webhook.webhook_pods(lab)}


def _memory_kib(lab: Cluster, field: str) -> int:
    """The largest of the replicas' webhook processes: VmRSS (resident now) or VmHWM (its peak so far)."""
    sizes = []
    for pod in webhook.webhook_pods(lab):
        status = _kubectl(lab, "exec", "-n", "kube-system", pod["metadata"]["name"], "--", "cat", "/proc/1/status")
        sizes.append(int(re.search(rf"{field}:\s+(\d+) kB", status.stdout).group(1)))  # type: ignore[union-attr]
    return max(sizes)


def test_the_hostile_corpus_gets_one_answer_each_in_time(lab: Cluster, tmp_path: Path) -> None:
    """Every case sent through the API server (a server-side dry run: the webhook is called, nothing is stored),
    answered as the pure decision answers it, logged once by the webhook, which keeps serving."""
    cases = hostile_configmaps()
    logs_before = _webhook_logs(lab)
    idle = _memory_kib(lab, "VmRSS")
    seconds: dict[str, float] = {}
    for name, obj in cases.items():
        meta = obj["metadata"]
        exists = _kubectl(lab, "get", "configmap", meta["name"], "-n", meta["namespace"]).returncode == 0
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(obj))
        started = time.monotonic()
        result = _kubectl(lab, "replace" if exists else "create", "--dry-run=server", "-f", str(path))
        seconds[name] = time.monotonic() - started
        _, verdict = respond(_review(obj, "UPDATE" if exists else "CREATE"))
        if verdict.allowed:
            assert result.returncode == 0, f"{name}: {result.stderr[-500:]}"
            assert result.stderr.count("Warning: ") == len(verdict.warnings), f"{name}: {result.stderr[-500:]}"
        else:
            assert result.returncode != 0 and "denied the request" in result.stderr, f"{name}: {result.stderr[-500:]}"
            first = verdict.message.splitlines()[1] if verdict.message else ""
            assert first[:60] in result.stderr, f"{name}: {result.stderr[-500:]}"
    new_lines = [line for pod, lines in _webhook_logs(lab).items() for line in lines[len(logs_before.get(pod, [])):]]
    reviewed = [name for name, obj in cases.items() if respond(_review(obj, "CREATE"))[1].reviewed]
    decision = re.compile(r" of ConfigMap \S+ \(uid \S+, by \S+\) in ([0-9.]+) s")
    decisions = sorted(float(m.group(1)) for line in new_lines if (m := decision.search(line)))
    assert len(decisions) == len(reviewed), new_lines  # one answer each, from the webhook itself
    round_trips = sorted(seconds.values())
    peak = _memory_kib(lab, "VmHWM")
    _progress(f"hostile corpus: {len(cases)} ConfigMaps, {len(reviewed)} reviewed; webhook decision p50 "
              f"{_percentile(decisions, 50):.3f} s p99 {_percentile(decisions, 99):.3f} s max {decisions[-1]:.3f} s; "
              f"kubectl round trip p99 {_percentile(round_trips, 99):.3f} s max {round_trips[-1]:.3f} s; "
              f"resident before {idle / 1024:.1f} MiB, peak {peak / 1024:.1f} MiB")
    assert decisions[-1] < 5.0  # the configuration's timeoutSeconds
    assert len(webhook.webhook_pods(lab)) == 2
    assert all(p["status"]["containerStatuses"][0]["restartCount"] == 0 for p in webhook.webhook_pods(lab))
    assert _stored_config(lab) == GOOD
    rejected = _kubectl(lab, "apply", "--dry-run=server", "-f", "-", stdin=_manifest(BAD_CIDR))
    assert "denied the request" in rejected.stderr  # still serving


def _review(obj: dict[str, Any], operation: str) -> dict[str, Any]:
    meta = obj["metadata"]
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
        "uid": "local", "kind": {"group": "", "version": "v1", "kind": "ConfigMap"},
        "resource": {"group": "", "version": "v1", "resource": "configmaps"}, "name": meta["name"],
        "namespace": meta["namespace"], "operation": operation, "object": obj}}


def _percentile(values: list[float], percent: float) -> float:
    return values[min(len(values) - 1, math.ceil(len(values) * percent / 100) - 1)]


def test_with_the_webhook_scaled_to_zero_writes_pass_and_the_agent_still_refuses(lab: Cluster) -> None:
    webhook.scale_webhook(lab, 0)
    try:
        started = time.monotonic()
        applied = _kubectl(lab, "apply", "-f", "-", stdin=_manifest(BAD_CIDR))
        assert applied.returncode == 0, applied.stderr  # failurePolicy Ignore: nothing blocks the write
        assert time.monotonic() - started < 5
        other = _kubectl(lab, "create", "configmap", "written-without-webhook", "-n", "kube-system",
                         "--from-literal=a=b")
        assert other.returncode == 0, other.stderr
        _kubectl(lab, "delete", "configmap", "written-without-webhook", "-n", "kube-system")
        eventually(lambda: not any(_ready(p) for p in agent.agent_pods(lab).values()),  # the agent refuses it
                   "the agents not Ready with a config they must refuse", timeout=90, interval=0.5)
        for node in lab.nodes:
            agent.wait_synced(lab, node, GOOD, REFERENCE_OPTIONS, timeout=0)  # the last good rules stay
        logs = _kubectl(lab, "logs", "-n", "kube-system", "-l", agent.AGENT_LABEL, "--tail=-1").stdout
        assert "10.0.0.0/33" in logs
    finally:
        _restore(lab)
        webhook.scale_webhook(lab, 2)
        webhook.wait_webhook_serving(lab)
    eventually(lambda: all(_ready(p) for p in agent.agent_pods(lab).values()),
               "the agents Ready again with the good config", timeout=90, interval=0.5)


def _ready(pod: dict[str, Any]) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in pod["status"].get("conditions", []))


def test_two_replicas_renew_one_certificate_and_no_call_fails_open(lab: Cluster) -> None:
    """Certificates valid 0.002 days (renewed about every 15 s) read every 2 s, the Secret deleted first: for a
    minute and more the replicas make, renew and switch certificates while a bad config is sent again and again, and
    every call is answered (denied); a call that failed (TLS refused, no endpoint) would have been admitted."""
    args = ["webhook", "--certificate-days=0.002", "--certificate-check=2"]
    lab.kubectl("patch", "deployment", webhook.DEPLOYMENT, "-n", "kube-system", "--type=json", "-p",
                json.dumps([{"op": "replace", "path": "/spec/template/spec/containers/0/args", "value": args}]))
    webhook.scale_webhook(lab, 2)  # the rolled pods only, both ready
    webhook.wait_webhook_serving(lab)
    webhook.wait_endpoints_ready(lab)  # the API server's endpoints follow the pods' readiness
    lab.kubectl("delete", "secret", "ipmasq-webhook-certificate", "-n", "kube-system")
    certificates: set[str] = set()
    answers: list[str] = []
    deadline = time.monotonic() + 75
    # made, renewed, renewed: three certificates are the proof; calls go on until then (or the deadline fails it)
    while time.monotonic() < deadline and len(certificates) < 3:
        sent = _kubectl(lab, "apply", "--dry-run=server", "-f", "-", stdin=_manifest(BAD_CIDR))
        answers.append("denied" if "denied the request" in sent.stderr else f"{sent.returncode} {sent.stderr}")
        secret = _kubectl(lab, "get", "secret", "ipmasq-webhook-certificate", "-n", "kube-system", "-o", "json")
        if secret.returncode == 0:
            certificates.add(json.loads(secret.stdout)["data"]["tls.crt"])
    failed = [a for a in answers if a != "denied"]
    assert not failed, f"{len(failed)} of {len(answers)} calls not answered: {failed[:3]}"
    assert len(certificates) >= 3, f"{len(certificates)} certificates seen in the Secret"  # made, renewed, renewed
    secret = lab.kubectl_json("get", "secret", "ipmasq-webhook-certificate", "-n", "kube-system")
    (hook,) = lab.kubectl_json("get", "validatingwebhookconfiguration", "ipmasq-webhook")["webhooks"]
    trusted = base64.b64decode(hook["clientConfig"]["caBundle"])
    assert base64.b64decode(secret["data"]["ca.crt"]) in trusted
    logs = "\n".join(line for lines in _webhook_logs(lab).values() for line in lines)
    assert "renewed the serving certificate" in logs and "serving the renewed certificate" in logs
    _progress(f"certificate rotation: {len(certificates)} certificates in {len(answers)} calls, all answered")
