"""`ipmasq lint`'s inputs: a file, a config directory, a directory of manifests (recursively), --config, standard
input given or piped."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from ipmasq.cli import main

CONFIGMAP = """\
apiVersion: v1
kind: ConfigMap
metadata:
  name: ip-masq-agent
  namespace: kube-system
data:
  config: |
    nonMasqueradeCIDRs:
      - 10.0.0.0/33
"""
DEPLOYMENT = "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: web}\nspec: {}\n"


def lint(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, list[dict[str, object]], str]:
    code = main(["lint", *argv, "-o", "json"])
    captured = capsys.readouterr()
    return code, json.loads(captured.out)["findings"] if captured.out else [], captured.err


def test_a_directory_of_manifests_lints_each_agent_configmap_under_it(capsys: pytest.CaptureFixture[str],
                                                                     tmp_path: Path) -> None:
    (tmp_path / "apps").mkdir()
    (tmp_path / "apps" / "web.yaml").write_text(DEPLOYMENT)
    (tmp_path / "net" / "overlay").mkdir(parents=True)
    (tmp_path / "net" / "overlay" / "masq.yml").write_text(CONFIGMAP)
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "old.yaml").write_text(CONFIGMAP)  # hidden directories are not walked
    (tmp_path / "broken.yaml").write_text("kind: ConfigMap\nmetadata: {name: ip-masq-agent\n")  # names it: linted
    (tmp_path / "notes.txt").write_text(CONFIGMAP)  # not a manifest's name
    code, findings, _ = lint(capsys, str(tmp_path))
    assert code == 1
    assert sorted({str(f["file"]) for f in findings}) == [str(tmp_path / "broken.yaml"),
                                                          str(tmp_path / "net" / "overlay" / "masq.yml")]
    assert {f["id"] for f in findings} == {"invalid-cidr", "yaml-syntax"}


def test_a_directory_of_other_manifests_lints_nothing_and_says_so(capsys: pytest.CaptureFixture[str],
                                                                 tmp_path: Path) -> None:
    (tmp_path / "web.yaml").write_text(DEPLOYMENT)
    code, [finding], _ = lint(capsys, str(tmp_path))
    assert code == 1 and finding["id"] == "no-config-file"
    assert "no manifest under it holds the ip-masq-agent ConfigMap" in str(finding["message"])


def test_a_config_directory_is_still_read_as_the_agent_reads_it(capsys: pytest.CaptureFixture[str],
                                                                tmp_path: Path) -> None:
    (tmp_path / "ip-masq-agent").write_text("nonMasqueradeCIDRs: [10.0.0.0/8]\n")
    (tmp_path / "other.yaml").write_text(CONFIGMAP)  # not one of the agent's files: not read
    assert lint(capsys, str(tmp_path))[:2] == (0, [])


def test_config_flag_and_standard_input(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "cm.yaml"
    path.write_text(CONFIGMAP)
    code, findings, _ = lint(capsys, "--config", str(path))
    assert code == 1 and [f["id"] for f in findings] == ["invalid-cidr"]

    class Piped(io.TextIOWrapper):
        def isatty(self) -> bool:
            return False

    monkeypatch.setattr("sys.stdin", Piped(io.BytesIO(CONFIGMAP.encode())))
    code, findings, _ = lint(capsys)  # `ipmasq lint < FILE`
    assert code == 1 and [(f["file"], f["id"]) for f in findings] == [("<stdin>", "invalid-cidr")]

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr("sys.stdin", Terminal())
    code, findings, err = lint(capsys)
    assert code == 2 and "ipmasq lint - < FILE" in err and err.count("\n") == 1
