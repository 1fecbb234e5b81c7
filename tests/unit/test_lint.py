"""ipmasq lint: the corpus (one manifest per finding, id and line asserted), placement, output and exit codes."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from ipmasq.cli import main
from ipmasq.findings import Severity
from ipmasq.lint import HINTS, Expectations, lint_config, lint_source
from ipmasq.lint.manifest import configmap_config
from ipmasq.options import PolicyOptions
from ipmasq.prefix import parse_cidr
from tests.conftest import PYTHON, ROOT

CORPUS = ROOT / "tests" / "lint_corpus"
CASES = sorted(p for p in CORPUS.iterdir() if p.suffix in (".yaml", ".json"))


def _expected(path: Path) -> tuple[list[str], list[str]]:
    """`# expect: id@line ...` on line 1 (or NAME.expect beside a JSON file) and `# args: ...`."""
    text = path.read_text(encoding="utf-8")
    sidecar = path.with_name(path.name + ".expect")
    header = sidecar.read_text() if sidecar.exists() else text.splitlines()[0].removeprefix("# expect:")
    expected = [] if header.strip() == "none" else header.split()
    args = next((line.removeprefix("# args:").split() for line in text.splitlines() if line.startswith("# args:")), [])
    return sorted(expected), args


def _lint_args(args: list[str]) -> tuple[PolicyOptions, Expectations]:
    masq = [args[i + 1] for i, a in enumerate(args) if a == "--must-masquerade"]
    keep = [args[i + 1] for i, a in enumerate(args) if a == "--must-preserve"]
    return PolicyOptions(), Expectations(tuple(map(parse_cidr, masq)), tuple(map(parse_cidr, keep)))


@pytest.mark.parametrize("path", CASES, ids=[p.name for p in CASES])
def test_corpus(path: Path) -> None:
    expected, args = _expected(path)
    options, expect = _lint_args(args)
    findings = lint_source(path.name, path.read_bytes(), options=options, expect=expect)
    assert sorted(f"{f.id}@{f.line}" for f in findings) == expected, [f.as_text() for f in findings]


def test_corpus_covers_every_issue_id() -> None:
    wanted = {"configmap-name", "configmap-namespace", "missing-config-key", "yaml-syntax", "indentation",
              "invalid-cidr", "misaligned-cidr", "unknown-key", "key-case", "wrong-type", "duplicate-cidr",
              "shadowed-cidr", "too-many-cidrs", "ipv6-disabled", "bad-duration", "lookalike-character",
              "must-masquerade", "must-preserve"}
    covered = {item.split("@")[0] for path in CASES for item in _expected(path)[0]}
    assert wanted <= covered
    assert wanted <= set(HINTS)
    assert any(_expected(p)[0] == [] for p in CASES)


def test_positions_inside_the_embedded_config() -> None:
    path = CORPUS / "indentation-folded.yaml"
    [finding] = lint_source("f", path.read_bytes())
    assert (finding.line, finding.column) == (11, 9)  # the "- 172.16.0.0/12" folded into the item above
    assert "10.0.0.0/8 - 172.16.0.0/12" in finding.message
    [cidr] = lint_source("f", (CORPUS / "invalid-cidr.yaml").read_bytes())
    assert (cidr.line, cidr.column) == (11, 9)


def test_explicit_block_indentation_indicator() -> None:
    text = ("apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: ip-masq-agent\n  namespace: kube-system\n"
            "data:\n  config: |2\n      nonMasqueradeCIDRs: [10.0.0.1/8]\n")
    [finding] = lint_source("f", text.encode())
    assert (finding.id, finding.line) == ("misaligned-cidr", 8)


def test_lookalike_in_a_comment_is_a_warning_only() -> None:
    findings = lint_source("f", "nonMasqueradeCIDRs: [10.0.0.0/8]  # see the docs \u2013 ranges\n".encode())
    assert [(f.id, f.severity) for f in findings] == [("lookalike-character", Severity.WARNING)]


def test_unknown_key_without_a_near_miss_is_a_warning() -> None:
    [finding] = lint_config("colour: blue\n", source="f")
    assert (finding.id, finding.severity) == ("unknown-key", Severity.WARNING)


def test_configmap_without_namespace_and_no_configmap() -> None:
    text = "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: ip-masq-agent\ndata:\n  config: ''\n"
    [finding] = lint_source("f", text.encode())
    assert (finding.id, finding.severity, finding.line) == ("configmap-namespace", Severity.WARNING, 3)
    [none] = lint_source("f", b"apiVersion: v1\nkind: Service\nmetadata: {name: x}\n")
    assert (none.id, none.severity) == ("no-configmap", Severity.WARNING)


def test_must_masquerade_against_the_defaults_names_the_default_entry() -> None:
    # the GKE 1.14 upgrade: GKE's defaults preserve 172.16.0.0/12, which holds the AWS VPC 172.30.0.0/16
    findings = lint_config("", source="f", options=PolicyOptions(nomasq_all_reserved_ranges=True),
                           expect=Expectations(must_masquerade=(parse_cidr("172.30.0.0/16"),)))
    [finding] = findings
    assert finding.id == "must-masquerade" and "172.16.0.0/12 from the agent's default list" in finding.message


def test_must_masquerade_reports_each_responsible_entry() -> None:
    config = "nonMasqueradeCIDRs: [10.0.0.0/9, 10.128.0.0/9]\n"
    findings = lint_config(config, source="f", expect=Expectations(must_masquerade=(parse_cidr("10.0.0.0/8"),)))
    assert sorted(f.message.split("because of ")[1] for f in findings) == [
        "the nonMasqueradeCIDRs entry 10.0.0.0/9 (line 1)", "the nonMasqueradeCIDRs entry 10.128.0.0/9 (line 1)"]


def test_shadowing_respects_exceptions_in_between() -> None:
    config = "nonMasqueradeCIDRs: [10.0.0.0/8, 10.11.1.0/24]\nmasqueradeCIDRs: [10.11.0.0/16]\n"
    assert lint_config(config, source="f") == []


def test_configmap_config_extraction_keeps_manifest_lines() -> None:
    text = (CORPUS / "clean-configmap.yaml").read_text()
    embedded = configmap_config(text)
    assert embedded is not None and embedded.splitlines()[9].strip() == "- 10.0.0.0/8"  # line 10 of the file
    assert configmap_config("nonMasqueradeCIDRs: []\n") is None


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    return code, capsys.readouterr().out


def test_cli_json_and_exit_codes(capsys: pytest.CaptureFixture[str]) -> None:
    code, out = run_cli(capsys, "lint", str(CORPUS / "configmap-name.yaml"), "-o", "json")
    assert code == 1
    [item] = json.loads(out)
    assert {"file", "line", "column", "id", "severity", "message"} <= set(item)
    assert (item["id"], item["line"], item["severity"]) == ("configmap-name", 5, "error")
    assert run_cli(capsys, "lint", str(CORPUS / "key-case.yaml"))[0] == 0  # warnings only
    assert run_cli(capsys, "lint", str(CORPUS / "clean-configmap.yaml"), str(CORPUS / "clean-list.yaml"))[0] == 0
    assert run_cli(capsys, "lint", str(CORPUS / "missing.yaml"))[0] == 1


def test_cli_flags_and_usage(capsys: pytest.CaptureFixture[str]) -> None:
    path = str(CORPUS / "must-masquerade.yaml")
    assert run_cli(capsys, "lint", path)[0] == 0
    code, out = run_cli(capsys, "lint", path, "--must-masquerade", "172.30.0.0/16")
    assert code == 1 and "[must-masquerade]" in out
    assert run_cli(capsys, "lint", path, "--must-masquerade", "172.30.0.1/16") == (2, "")
    assert run_cli(capsys, "lint", str(CORPUS / "ipv6-disabled.yaml"), "--enable-ipv6")[0] == 0


def test_cli_stdin_and_one_line_errors() -> None:
    text = (CORPUS / "private-endpoint.yaml").read_text()
    result = subprocess.run([PYTHON, "-m", "ipmasq", "lint", "-"], input=text, capture_output=True, text=True)
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert result.stdout.startswith("<stdin>:6:3: error [indentation]")
    result = subprocess.run([PYTHON, "-m", "ipmasq", "lint", "-", "-o", "json"], input=b"\xff\xfe",
                            capture_output=True)
    assert result.returncode == 1 and json.loads(result.stdout)[0]["id"] == "yaml-syntax"

