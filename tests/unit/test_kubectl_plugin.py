"""kubectl ipmasq: kubectl's flags with kubectl's meaning, one error style, unique debug pods, a krew manifest.

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
    debug_pod_name,
    main,
    split_kubectl_flags,
)
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


def _fake_kubectl(tmp_path: Path, *, agent_pod: str | None) -> tuple[dict[str, str], Path]:
    """A `kubectl` on PATH that logs each call's arguments (one JSON list a line) and answers as kubectl does."""
    log = tmp_path / "calls.jsonl"
    items = [{"metadata": {"name": agent_pod}}] if agent_pod else []
    script = tmp_path / "bin" / "kubectl"
    script.parent.mkdir()
    script.write_text(f"""#!{sys.executable}
import json, sys
args = sys.argv[1:]
with open({str(log)!r}, "a") as f:
    f.write(json.dumps(args) + "\\n")
words = [a for a in args if not a.startswith("--")]
if words[:2] == ["get", "pods"]:
    print(json.dumps({{"items": {items!r}}}))
elif words[:1] == ["exec"]:
    print("ran on the node:", " ".join(args[args.index("--") + 1:]))
    sys.exit(1)
else:
    sys.exit(1)
""")
    script.chmod(0o755)
    env = {**os.environ, "PATH": f"{script.parent}:{os.environ['PATH']}", "PYTHONPATH": str(ROOT / "src")}
    return env, log


def test_check_asks_kubectl_with_the_same_cluster_user_and_namespace_and_keeps_the_exit_code(tmp_path: Path) -> None:
    env, log = _fake_kubectl(tmp_path, agent_pod="ip-masq-agent-x1")
    done = subprocess.run([*PLUGIN, "check", "node-1", "-n", "ops", "--context", "prod", "--kubeconfig", "/k",
                           "--masq-chain=IP-MASQ"], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, done.stderr  # ipmasq check's own exit code on the node
    assert done.stdout == "ran on the node: ipmasq check --masq-chain=IP-MASQ\n"
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert [c[3:5] for c in calls] == [["get", "pods"], ["exec", "ip-masq-agent-x1"]]
    assert all(c[:3] == ["--kubeconfig=/k", "--context=prod", "--namespace=ops"] for c in calls)


def test_a_failing_kubectl_is_one_line_and_could_not_run(tmp_path: Path) -> None:
    env, _ = _fake_kubectl(tmp_path, agent_pod=None)  # no agent: the daemonset's image, then the pod fails
    done = subprocess.run([*PLUGIN, "trace", "node-1", "8.8.8.8", "--source", "10.4.0.5"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 3, done.stderr
    lines = done.stderr.splitlines()
    assert re.fullmatch(r"kubectl ipmasq: no ipmasq agent on node-1: running in pod "
                        r"kube-system/ipmasq-debug-\d+-[0-9a-f]{8} \(\S*ipmasq/ipmasq:.*\)", lines[0]), lines
    assert lines[1:] == ["kubectl ipmasq trace: kubectl exited 1"]


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
    with tarfile.open(archive) as tar:
        assert tar.getnames() == ["kubectl-ipmasq"]
        tar.extractall(tmp_path / "installed", filter="data")
    launcher = tmp_path / "installed" / "kubectl-ipmasq"
    assert os.access(launcher, os.X_OK)
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
