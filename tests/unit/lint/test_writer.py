"""`lint --writer`: the keys a provider's agent ignores, said at their line before the ConfigMap is applied."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ipmasq.cli import main
from ipmasq.findings import Severity
from ipmasq.lint.writer import writer_findings
from ipmasq.writers import WRITERS
from tests.conftest import ROOT

EXAMPLE = ROOT / "deploy" / "examples" / "vpn-range-inside-10-8.yaml"


def test_the_example_for_a_range_inside_10_8_needs_ipmasq_and_lint_says_so_at_its_line() -> None:
    (finding,) = writer_findings(str(EXAMPLE), EXAMPLE.read_bytes(), WRITERS["gke"])
    text = EXAMPLE.read_text().splitlines()
    assert finding.line is not None and text[finding.line - 1].strip() == "masqueradeCIDRs:"
    assert (finding.id, finding.severity, finding.file) == ("ignored-by-writer", Severity.ERROR, str(EXAMPLE))
    assert finding.message == ("GKE's managed agent ignores masqueradeCIDRs: 10.11.0.0/24 stays un-masqueraded; "
                               "enforce with ipmasq to use it")
    assert writer_findings("x", EXAMPLE.read_bytes(), WRITERS["reference"])[0].message.startswith(
        "The reference ip-masq-agent ignores masqueradeCIDRs")


def test_a_config_quoted_in_json_has_no_line_rather_than_a_wrong_one() -> None:
    manifest = json.dumps({"apiVersion": "v1", "kind": "ConfigMap",
                           "metadata": {"name": "ip-masq-agent", "namespace": "kube-system"},
                           "data": {"config": "nonMasqueradeCIDRs: [10.0.0.0/8]\nmasqueradeCIDRs: [10.11.0.0/24]\n"}})
    (finding,) = writer_findings("cm.json", manifest.encode(), WRITERS["gke"])
    assert finding.line is None and "10.11.0.0/24 stays un-masqueraded" in finding.message


def test_aks_reads_the_file_as_the_users_fragment() -> None:
    found = writer_findings("f", b"nonMasqueradeCIDRs: [10.0.0.0/8]\nresyncInterval: 30s\n", WRITERS["aks"])
    assert [(f.id, f.severity, f.line) for f in found] == [("ignored-by-writer", Severity.WARNING, 2)]


def test_nothing_for_a_file_lint_cannot_read_or_a_config_of_the_writers_keys_only() -> None:
    assert writer_findings("f", b"\xff\xfe", WRITERS["gke"]) == []
    assert writer_findings("f", b"nonMasqueradeCIDRs: [10.0.0.0/8]\nresyncInterval: 30s\n", WRITERS["gke"]) == []


def test_cli(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["lint", str(EXAMPLE)]) == 0  # for ipmasq itself the example is right
    capsys.readouterr()
    assert main(["lint", "--writer", "gke", str(EXAMPLE), "-o", "json"]) == 1
    (finding,) = json.loads(capsys.readouterr().out)["findings"]
    assert finding["id"] == "ignored-by-writer" and finding["destinations"] == ["10.11.0.0/24"]
    assert main(["lint", "--writer", "gke", "--masq-chain", "X", str(EXAMPLE)]) == 2
    assert "drop --masq-chain" in capsys.readouterr().err
    assert main(["lint", "--writer", "eks", str(EXAMPLE)]) == 2  # the VPC CNI reads no config file
