"""kubectl ipmasq: kubectl's flags with kubectl's meaning, one error style, ipmasq's own pods chosen (never a
provider's of the same name), unique debug pods with ipmasq's image, a krew manifest.

What the plugin asks kubectl is seen through a stand-in `kubectl` on PATH that records its arguments and answers as
kubectl would (the real cluster's answers are the Kubernetes lab's, tests/kernel/lab/kubernetes/test_cluster.py)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import yaml

from ipmasq import __version__
from ipmasq.kubectl_plugin import (
    DEFAULT_NAMESPACE,
    SUBCOMMANDS,
    KubectlFlags,
    choose_pod,
    debug_pod_name,
    main,
    observer_check,
    split_kubectl_flags,
)
from ipmasq.version import IMAGE
from tests.conftest import ROOT

PLUGIN = [sys.executable, "-c", "import sys; from ipmasq.kubectl_plugin import main; sys.exit(main())"]


def test_usage_errors_are_one_line_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "usage: kubectl ipmasq COMMAND" in capsys.readouterr().err
    assert main(["frobnicate"]) == 2
    assert capsys.readouterr().err == ("kubectl ipmasq: unknown command 'frobnicate' (commands: "
                                       f"{', '.join(SUBCOMMANDS)})\n")
    assert main(["stauts"]) == 2
    assert "(did you mean status?)" in capsys.readouterr().err
    assert main(["check", "--masq-chain=X"]) == 2
    assert capsys.readouterr().err.startswith("kubectl ipmasq check: name the node first: ")
    assert main(["-n"]) == 2
    assert capsys.readouterr().err == "kubectl ipmasq: -n needs a value\n"
    assert main(["status", "--image", "x"]) == 2
    assert main(["--help"]) == 0
    help_ = capsys.readouterr().out
    assert all(f"kubectl ipmasq {sub.usage}" in help_ for sub in SUBCOMMANDS.values())
    assert "-n, --namespace" in help_ and "--context" in help_ and "--kubeconfig" in help_


def test_a_mistyped_flag_of_check_is_named_before_the_cluster_is_asked(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", "node-1", "--masq-chian=IP-MASQ"]) == 2
    assert capsys.readouterr().err == ("kubectl ipmasq check: unrecognized arguments: --masq-chian "
                                       "(did you mean --masq-chain?)\n")


def test_help_says_kubectl_ipmasq(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["status", "--help"])
    assert capsys.readouterr().out.startswith("usage: kubectl ipmasq status ")
    assert main(["trace", "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: kubectl ipmasq trace NODE DEST --source POD_IP")
    assert "usage: kubectl ipmasq trace NODE" in out and "--protocol" in out and "usage: ipmasq" not in out


@pytest.mark.parametrize("args", [
    ["-n", "ops", "--context", "prod", "--kubeconfig", "/k", "check", "node-1"],
    ["check", "node-1", "--namespace=ops", "--context=prod", "--kubeconfig=/k"],
    ["--namespace", "ops", "check", "--context", "prod", "node-1", "--kubeconfig=/k"],
    ["-nops", "check", "node-1", "--context=prod", "--kubeconfig", "/k"],
])
def test_kubectl_flags_anywhere_in_every_form(args: list[str]) -> None:
    flags, rest = split_kubectl_flags(args)
    assert flags == KubectlFlags(kubeconfig="/k", context="prod", namespace="ops")
    assert rest == ["check", "node-1"]
    assert flags.kubectl_args() == ["--kubeconfig=/k", "--context=prod", "--namespace=ops"]


def test_the_namespace_is_kube_system_unless_given_and_nothing_after_double_dash_is_taken() -> None:
    flags, rest = split_kubectl_flags(["trace", "node-1", "8.8.8.8", "--source", "10.4.0.5", "--image=i:2", "--",
                                       "-n", "x"])
    assert flags == KubectlFlags(image="i:2") and flags.namespace == DEFAULT_NAMESPACE == "kube-system"
    assert rest == ["trace", "node-1", "8.8.8.8", "--source", "10.4.0.5", "--", "-n", "x"]
    assert KubectlFlags().kubectl_args() == ["--namespace=kube-system"]


def test_debug_pod_names_are_unique_within_a_second_and_valid_pod_names() -> None:
    # 100 operators in one second: with 32 random bits a collision is about one in a million runs (2,000 names and
    # 24 bits collided in one run of twelve)
    names = {debug_pod_name() for _ in range(100)}
    assert len(names) == 100
    assert all(re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", n) and len(n) <= 63 for n in names)


def _daemonset(name: str, uid: str, labels: dict[str, str], args: list[str], image: str) -> dict[str, object]:
    return {"metadata": {"name": name, "namespace": "kube-system", "uid": uid, "labels": labels},
            "spec": {"selector": {"matchLabels": {"k8s-app": name}}, "template": {"spec": {"containers": [
                {"name": "ip-masq-agent", "image": image, "args": args}]}}}}


def _pod(name: str, owner_uid: str) -> dict[str, object]:
    return {"metadata": {"name": name, "namespace": "kube-system", "labels": {"k8s-app": "ip-masq-agent"},
                         "ownerReferences": [{"kind": "DaemonSet", "uid": owner_uid, "controller": True}]}}


OURS = {"app.kubernetes.io/part-of": "ipmasq", "app.kubernetes.io/name": "ipmasq", "k8s-app": "ip-masq-agent"}
GKE_ADDON = {"k8s-app": "ip-masq-agent", "addonmanager.kubernetes.io/mode": "Reconcile"}
GKE_IMAGE = "gke.gcr.io/ip-masq-agent:v2.9.3-gke.5"
ENFORCING = _daemonset("ip-masq-agent", "uid-enforce", OURS, ["agent", "--masq-chain=IP-MASQ"], "reg/ipmasq:9")
OBSERVER = _daemonset("ipmasq-observer", "uid-observe", {**OURS, "k8s-app": "ipmasq-observer"},
                      ["agent", "--observe=gke"], "reg/ipmasq:9")
GOOGLES = _daemonset("ip-masq-agent", "uid-google", GKE_ADDON, ["--masq-chain=IP-MASQ"], GKE_IMAGE)


def test_check_runs_in_the_enforcing_agents_pod_else_the_observers_never_anothers() -> None:
    # GKE's own agent beside ipmasq's observer: the observer's pod, though Google's has the name and the label
    choice = choose_pod([GOOGLES, OBSERVER], [_pod("ip-masq-agent-x1", "uid-google"),
                                              _pod("ipmasq-observer-x1", "uid-observe")], "kube-system")
    assert (choice.pod, choice.container) == ("ipmasq-observer-x1", "ip-masq-agent")
    # an enforcing agent and an observer on one node: the enforcing one's
    choice = choose_pod([OBSERVER, ENFORCING], [_pod("ipmasq-observer-x1", "uid-observe"),
                                                _pod("ip-masq-agent-x1", "uid-enforce")], "kube-system")
    assert choice.pod == "ip-masq-agent-x1"
    # a pod named and labelled as the agent's, owned by nobody of ipmasq's, is never chosen
    choice = choose_pod([ENFORCING], [_pod("ip-masq-agent-x1", "uid-someone")], "kube-system")
    assert choice.pod is None and choice.image == "reg/ipmasq:9"
    assert choice.looked_for == "looked for the pods of daemonset/kube-system/ip-masq-agent"


def test_where_only_a_providers_agent_runs_the_debug_pod_has_ipmasqs_image_and_says_what_it_looked_for() -> None:
    choice = choose_pod([GOOGLES], [_pod("ip-masq-agent-x1", "uid-google")], "kube-system")
    assert choice.pod is None and choice.image == IMAGE != GKE_IMAGE
    assert choice.looked_for == ("no DaemonSet of ipmasq in kube-system; not ipmasq's: "
                                 "daemonset/kube-system/ip-masq-agent: not ipmasq's "
                                 "(addonmanager.kubernetes.io/mode=Reconcile)")
    hostile = _daemonset("x\x1b[2Jy", "u", {"app.kubernetes.io/managed-by": "Helm\nnext"}, [], "i")
    assert "\n" not in choose_pod([hostile, "not an object"], ["nor this"], "kube-system").looked_for
    odd_pods = [{"metadata": {"name": "p", "ownerReferences": 5}}, {"metadata": {"name": 7}}, {"metadata": []},
                {"metadata": {"name": "q", "ownerReferences": [None, {"uid": 3}]}}]
    assert choose_pod([ENFORCING], odd_pods, "kube-system").pod is None
    assert "\x1b" not in choose_pod([hostile], [], "kube-system").looked_for


def _fake_kubectl(tmp_path: Path, *, daemonsets: list[object], pods: list[object]) -> tuple[dict[str, str], Path]:
    """A `kubectl` on PATH that logs each call's arguments (one JSON list a line) and what it was given on stdin
    (stdin.jsonl), and answers as kubectl would."""
    log = tmp_path / "calls.jsonl"
    script = tmp_path / "bin" / "kubectl"
    script.parent.mkdir()
    script.write_text(f"""#!{sys.executable}
import json, sys
args = sys.argv[1:]
with open({str(log)!r}, "a") as f:
    f.write(json.dumps(args) + "\\n")
words = [a for a in args if not a.startswith("--")]
if words[:2] == ["get", "daemonsets"]:
    print(json.dumps({{"items": {daemonsets!r}}}))
elif words[:2] == ["get", "pods"]:
    print(json.dumps({{"items": {pods!r}}}))
elif words[:1] == ["get"]:  # a provider's inputs, as -o yaml prints them
    print("kind: List\\nitems: [{{kind: " + words[1] + ", metadata: {{name: " + words[2] + "}}}}]")
elif words[:1] == ["exec"]:
    print("ran on the node:", " ".join(args[args.index("--") + 1:]))
    if "-i" in args:
        with open({str(tmp_path / "stdin.txt")!r}, "w") as f:
            f.write(sys.stdin.read())
    sys.exit(1)
else:
    if words[:1] == ["apply"]:
        with open({str(tmp_path / "stdin.jsonl")!r}, "a") as f:
            f.write(json.dumps(json.loads(sys.stdin.read())) + "\\n")
    sys.exit(1)
""")
    script.chmod(0o755)
    env = {**os.environ, "PATH": f"{script.parent}:{os.environ['PATH']}", "PYTHONPATH": str(ROOT / "src")}
    return env, log


def test_check_asks_kubectl_with_the_same_cluster_user_and_namespace_and_keeps_the_exit_code(tmp_path: Path) -> None:
    env, log = _fake_kubectl(tmp_path, daemonsets=[ENFORCING], pods=[_pod("ip-masq-agent-x1", "uid-enforce")])
    done = subprocess.run([*PLUGIN, "check", "node-1", "-n", "ops", "--context", "prod", "--kubeconfig", "/k",
                           "--masq-chain=IP-MASQ"], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, done.stderr  # ipmasq check's own exit code on the node
    assert done.stdout == "ran on the node: ipmasq check --masq-chain=IP-MASQ\n"
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert [c[3:5] for c in calls] == [["get", "daemonsets"], ["get", "pods"], ["exec", "ip-masq-agent-x1"]]
    assert "spec.nodeName=node-1,status.phase=Running" in calls[1]
    assert all(c[:3] == ["--kubeconfig=/k", "--context=prod", "--namespace=ops"] for c in calls)


def test_check_in_an_observers_pod_compares_as_that_observer_does_with_the_providers_inputs_from_the_api(
        tmp_path: Path) -> None:
    # GKE's agent beside ipmasq's observer of it: the check compares with what GKE's agent intends (--writer gke),
    # from the ip-masq-agent ConfigMap as the API holds it (kube-system's, whatever -n says), handed on stdin
    env, log = _fake_kubectl(tmp_path, daemonsets=[GOOGLES, OBSERVER], pods=[
        _pod("ip-masq-agent-x1", "uid-google"), _pod("ipmasq-observer-x1", "uid-observe")])
    done = subprocess.run([*PLUGIN, "check", "node-1", "-n", "ops", "-o", "json"], env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 1, done.stderr
    assert done.stdout == "ran on the node: ipmasq check --writer gke --manifest - -o json\n"
    assert done.stderr == ("kubectl ipmasq: ipmasq-observer-x1 observes gke's agent: comparing as it does, with "
                           "configmap/ip-masq-agent as the API holds them now\n")
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert calls[2] == ["--namespace=kube-system", "get", "configmap", "ip-masq-agent", "-o", "yaml",
                        "--ignore-not-found"]
    assert calls[3][:4] == ["--namespace=ops", "exec", "-i", "ipmasq-observer-x1"]
    assert "name: ip-masq-agent" in (tmp_path / "stdin.txt").read_text()
    # told what to compare with, the check runs as told, in the observer's pod, nothing on its stdin
    (tmp_path / "stdin.txt").unlink()
    done = subprocess.run([*PLUGIN, "check", "node-1", "--config=/etc/config/ip-masq-agent"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.stdout == "ran on the node: ipmasq check --config=/etc/config/ip-masq-agent\n"
    assert not (tmp_path / "stdin.txt").exists() and done.stderr == ""


@pytest.mark.parametrize(("writer", "args", "expected"), [
    ("aks", [], (["--writer", "aks", "--manifest", "-"], [("configmap", "azure-ip-masq-agent-config-reconciled"),
                                                          ("configmap", "azure-ip-masq-agent-config")])),
    ("eks", ["-o", "yaml"], (["--writer", "eks", "--manifest", "-"], [("daemonset", "aws-node")])),
    ("reference", ["--pod-range", "10.4.0.0/14"], (["--writer", "reference", "--manifest", "-"],
                                                   [("configmap", "ip-masq-agent")])),
    ("gke", ["--masq-chain=IP-MASQ"], None), ("gke", ["-nomasq-all-reserved-ranges"], None),
    ("eks", ["--vpc-cidr", "10.0.0.0/16"], None), ("gke", ["--from-dump", "x"], None), ("gke", ["--agent=none"], None),
    ("cilium", [], None), ("no-such-writer", [], None),
])
def test_what_makes_a_check_compare_as_the_observer_does(writer: str, args: list[str],
                                                         expected: tuple[list[str], list[tuple[str, str]]] | None,
                                                         ) -> None:
    assert observer_check(writer, args) == expected


def test_a_failing_kubectl_is_one_line_and_could_not_run(tmp_path: Path) -> None:
    # only GKE's agent: the debug pod, with ipmasq's image (never Google's), then kubectl fails to make it
    env, _ = _fake_kubectl(tmp_path, daemonsets=[GOOGLES], pods=[_pod("ip-masq-agent-x1", "uid-google")])
    done = subprocess.run([*PLUGIN, "trace", "node-1", "8.8.8.8", "--source", "10.4.0.5"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 3, done.stderr
    lines = done.stderr.splitlines()
    assert re.fullmatch(r"kubectl ipmasq: no ipmasq agent or observer on node-1 \(no DaemonSet of ipmasq in "
                        r"kube-system; not ipmasq's: daemonset/kube-system/ip-masq-agent: not ipmasq's "
                        r"\(addonmanager.kubernetes.io/mode=Reconcile\)\): running in pod "
                        r"kube-system/ipmasq-debug-\d+-[0-9a-f]{8} \(ghcr.io/ipmasq/ipmasq:.*\)", lines[0]), lines
    assert lines[1:] == ["kubectl ipmasq trace: kubectl exited 1"]
    (pod,) = [json.loads(line) for line in (tmp_path / "stdin.jsonl").read_text().splitlines()]
    assert pod["spec"]["containers"][0]["image"] == IMAGE
    assert pod["metadata"]["labels"]["app.kubernetes.io/part-of"] == "ipmasq"


def test_status_takes_the_flags_and_an_unreadable_kubeconfig_could_not_run(tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["status", "-n", "ops", "--kubeconfig", str(tmp_path / "none"), "--context", "x"]) == 3
    assert capsys.readouterr().err == (f"kubectl ipmasq status: {tmp_path / 'none'}: cannot read the kubeconfig: "
                                       "No such file or directory\n")


def test_the_krew_manifest() -> None:
    """The fields krew's index validates (krew.googlecontainertools.github.com/v1alpha2), and ours: the plugin's
    name is the command's, its version the package's, the binary the one installed on PATH."""
    manifest = yaml.safe_load((ROOT / "plugins" / "ipmasq.yaml").read_text())
    assert (manifest["apiVersion"], manifest["kind"]) == ("krew.googlecontainertools.github.com/v1alpha2", "Plugin")
    assert manifest["metadata"] == {"name": "ipmasq"}
    spec = manifest["spec"]
    assert spec["version"] == f"v{__version__}" and re.fullmatch(r"v\d+\.\d+\.\d+", spec["version"])
    assert spec["homepage"].startswith("https://") and spec["description"].strip()
    assert 0 < len(spec["shortDescription"]) <= 50 and "\n" not in spec["shortDescription"]
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'^kubectl-ipmasq = "ipmasq.kubectl_plugin:main"', pyproject, re.M)
    for platform in spec["platforms"]:
        (expression,) = platform["selector"]["matchExpressions"]
        assert expression["key"] == "os" and expression["operator"] == "In" and expression["values"]
        assert platform["uri"].startswith("https://") and spec["version"] in platform["uri"]
        assert platform["bin"] == "kubectl-ipmasq"
        assert any(f["from"] == platform["bin"] for f in platform["files"])
        # the digest is the archive's, built again here byte for byte
        built = subprocess.run([sys.executable, str(ROOT / "plugins" / "archive.py")], capture_output=True, text=True,
                               check=True, timeout=60).stdout.strip()
        assert platform["sha256"] == built, "plugins/ipmasq.yaml: set sha256 to what plugins/archive.py prints"


def test_the_krew_archives_launcher_runs_the_plugin(tmp_path: Path) -> None:
    archive = tmp_path / "kubectl-ipmasq.tar.gz"
    subprocess.run([sys.executable, str(ROOT / "plugins" / "archive.py"), str(archive)], check=True, timeout=60,
                   capture_output=True)
    installed = tmp_path / "installed"
    installed.mkdir()
    with tarfile.open(archive) as tar:
        assert tar.getnames() == ["LICENSE", "kubectl-ipmasq", "kubectl_complete-ipmasq"]
        for member in tar.getmembers():  # plain files at the top only (Debian 12's Python has no extraction filter)
            assert member.isfile() and "/" not in member.name, member.name
            extracted = tar.extractfile(member)
            assert extracted is not None
            (installed / member.name).write_bytes(extracted.read())
            (installed / member.name).chmod(member.mode)
    assert (installed / "LICENSE").read_bytes() == (ROOT / "LICENSE").read_bytes()
    launcher = installed / "kubectl-ipmasq"
    assert os.access(launcher, os.X_OK) and os.access(installed / "kubectl_complete-ipmasq", os.X_OK)
    done = subprocess.run([str(launcher), "--help"], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "IPMASQ_PYTHON": sys.executable, "PYTHONPATH": str(ROOT / "src")})
    assert done.returncode == 0 and done.stdout.startswith("usage: kubectl ipmasq COMMAND"), done


def test_uninstall_is_handed_to_the_fleet_uninstall(capsys: pytest.CaptureFixture[str],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    assert main(["uninstall", "--help"]) == 0
    assert "--dry-run" in capsys.readouterr().out
    for flags in (["--timeout", "-1"], ["--no-such-flag"], ["--timeout", "x"]):
        assert main(["uninstall", *flags]) == 2
        usage = capsys.readouterr().err.strip()
        assert usage.startswith("kubectl ipmasq uninstall: ") and "\n" not in usage, usage
    monkeypatch.setenv("KUBECONFIG", "/nonexistent/kubeconfig")  # no cluster: one line, could not run, no traceback
    assert main(["uninstall", "--dry-run"]) == 3
    err = capsys.readouterr().err.strip()
    assert err.startswith("kubectl ipmasq uninstall: ") and "\n" not in err
    assert main(["uninstall", "--dry-run", "--kubeconfig", "/nonexistent/other"]) == 3  # kubectl's flag, honoured
    assert "/nonexistent/other" in capsys.readouterr().err


def test_a_node_that_cannot_be_a_nodes_name_is_a_usage_error_before_kubectl_is_asked(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An empty name would leave the debug pod's nodeName empty, and the scheduler would run it on any node; a comma
    would add a field selector of its own."""
    for node in ("", "node-1,status.phase!=Running", "Node 1"):
        assert main(["check", node]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"kubectl ipmasq check: {node!r} is not a node's name: ") and err.count("\n") == 1


def test_a_pod_name_no_api_server_gives_never_reaches_kubectls_command_line() -> None:
    choice = choose_pod([ENFORCING], [_pod("--kubeconfig=/tmp/theirs", "uid-enforce")], "kube-system")
    assert choice.pod is None


def test_the_debug_pods_output_is_read_bounded_and_escaped(tmp_path: Path) -> None:
    """What the node printed comes from its kubelet: at most DEBUG_LOG_BYTES of it, each control character escaped
    before it reaches the terminal."""
    log = tmp_path / "calls.jsonl"
    script = tmp_path / "bin" / "kubectl"
    script.parent.mkdir()
    script.write_text(f"""#!{sys.executable}
import json, sys
args = sys.argv[1:]
with open({str(log)!r}, "a") as f:
    f.write(json.dumps(args) + "\\n")
words = [a for a in args if not a.startswith("--")]
if words[:2] in (["get", "daemonsets"], ["get", "pods"]):
    print(json.dumps({{"items": []}}))
elif words[:2] == ["get", "pod"]:
    print("Succeeded" if "phase" in args[-1] else "0", end="")
elif words[:1] == ["logs"]:
    print("in sync\\x1b]0;owned\\x07\\nsecond line")
elif words[:1] == ["apply"]:
    sys.stdin.read()
""")
    script.chmod(0o755)
    env = {**os.environ, "PATH": f"{script.parent}:{os.environ['PATH']}", "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run([*PLUGIN, "check", "node-1"], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "in sync\\x1b]0;owned\\x07\nsecond line\n"
    (logs,) = [c for c in map(json.loads, log.read_text().splitlines()) if "logs" in c]
    assert f"--limit-bytes={8 << 20}" in logs
