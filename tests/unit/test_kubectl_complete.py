"""`kubectl_complete-ipmasq`: kubectl's own plugin completion (`kubectl __complete ipmasq ...`, what the shell asks)
gets the plugin's subcommands, flags and the cluster's names, and never a name a shell would act on."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ipmasq.kubectl_complete import DIRECTIVE_DEFAULT, DIRECTIVE_NO_FILES, candidates
from ipmasq.kubectl_plugin import SUBCOMMANDS
from tests.tools import KUBECTL, need


def _shims(tmp_path: Path, kubectl_lines: str | None = None) -> Path:
    """kubectl-ipmasq and kubectl_complete-ipmasq on PATH as pip installs them (this interpreter); with
    `kubectl_lines`, a kubectl that prints them for any `get` (the cluster's names)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(parents=True)
    for name, module in (("kubectl-ipmasq", "ipmasq.kubectl_plugin"),
                         ("kubectl_complete-ipmasq", "ipmasq.kubectl_complete")):
        (bin_dir / name).write_text(f"#!/bin/sh\nexec {sys.executable} -m {module} \"$@\"\n")
        (bin_dir / name).chmod(0o755)
    if kubectl_lines is not None:
        (bin_dir / "kubectl").write_text(f"#!/bin/sh\necho \"$*\" >>{tmp_path}/asked\ncat <<'END'\n"
                                         f"{kubectl_lines}END\n")
        (bin_dir / "kubectl").chmod(0o755)
    return bin_dir


def _kubectl_complete(tmp_path: Path, *words: str) -> list[str]:
    kubectl = need("kubectl", KUBECTL)
    env = {**os.environ, "PATH": f"{_shims(tmp_path)}:{os.environ['PATH']}",
           "KUBECONFIG": str(tmp_path / "no-such-kubeconfig"), "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([kubectl, "__complete", "ipmasq", *words], capture_output=True, text=True, env=env,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def test_kubectl_completes_the_subcommands_through_the_executable(tmp_path: Path) -> None:
    lines = _kubectl_complete(tmp_path, "")
    assert lines[-1] == f":{DIRECTIVE_NO_FILES}", lines
    assert set(SUBCOMMANDS) <= {line.split("\t")[0] for line in lines}
    assert {line.split("\t")[0] for line in _kubectl_complete(tmp_path / "2", "ch")} >= {"check"}


def test_kubectl_completes_a_node_commands_flags(tmp_path: Path) -> None:
    names = {line.split("\t")[0] for line in _kubectl_complete(tmp_path, "check", "node-a", "--from")}
    assert "--from-dump" in names and "--context" not in names


def test_names_come_from_kubectl_with_the_flags_typed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bin_dir = _shims(tmp_path, "node/node-a\nnode/node-b\nnode/$(touch pwned)\nnode/a;b\nnode/\x1b[31mred\n")
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    found, directive = candidates(["--context", "lab", "trace", "node-"])
    assert found == ["node-a", "node-b"] and directive == DIRECTIVE_NO_FILES
    assert (tmp_path / "asked").read_text().splitlines() == ["--context=lab get nodes -o name"]
    found, _ = candidates(["status", "-n", ""])
    assert found == ["node-a", "node-b"]  # the fake prints the same names for namespaces


def test_what_completes_where(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(_shims(tmp_path, "")))  # a kubectl with nothing to say
    assert candidates(["status", "-o", ""]) == (["text", "json", "yaml"], DIRECTIVE_NO_FILES)
    assert candidates(["--kubeconfig", ""]) == ([], DIRECTIVE_DEFAULT)  # files
    assert "--dry-run" in candidates(["uninstall", "--"])[0]
    assert candidates(["check", "node-a", "--config", ""])[1] == DIRECTIVE_DEFAULT
    assert candidates(["no-such-command", ""]) == ([], DIRECTIVE_NO_FILES)
    assert "--version" in candidates(["--v"])[0]


def test_a_failing_kubectl_completes_nothing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "kubectl").write_text("#!/bin/sh\necho 'error: no cluster' >&2\nexit 1\n")
    (bin_dir / "kubectl").chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))
    assert candidates(["check", ""]) == ([], DIRECTIVE_NO_FILES)


def test_kubectl_ipmasq_version(capsys: pytest.CaptureFixture[str]) -> None:
    from ipmasq import __version__
    from ipmasq.kubectl_plugin import main

    assert main(["--version"]) == 0
    assert capsys.readouterr().out.startswith(f"ipmasq {__version__}")
