"""One findings model for lint and check: the text and JSON forms scripts and editors read, to the byte."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ipmasq.cli import main
from ipmasq.diagnose.check import FindingId
from ipmasq.findings import SHOWN_PER_KIND, Finding, Severity, bounded, count, has_errors, named
from ipmasq.lint.hints import HINTS, lint_finding
from tests.conftest import ROOT

DUMPS = ROOT / "tests" / "dumps"


def test_a_finding_in_a_file_is_one_compiler_style_line() -> None:
    finding = lint_finding("cm.yaml", 11, 9, "invalid-cidr", Severity.ERROR, "10.0.0.0/33 is not a CIDR")
    assert finding.hint == HINTS["invalid-cidr"]
    assert finding.as_text() == ("cm.yaml:11:9: error [invalid-cidr] 10.0.0.0/33 is not a CIDR "
                                 "(fix: write an address and a prefix length, like 10.0.0.0/8)")
    no_column = lint_finding("cm.yaml", 3, None, "configmap-namespace", Severity.WARNING, "no namespace")
    assert no_column.as_text().startswith("cm.yaml:3: warning [configmap-namespace] no namespace (fix: ")
    nowhere = lint_finding("cm.yaml", None, 4, "yaml-syntax", Severity.ERROR, "nested too deeply")
    assert nowhere.as_text().startswith("cm.yaml: error [yaml-syntax] nested too deeply (fix: ")


def test_a_finding_in_a_file_has_lints_json_keys_in_order_even_when_unknown() -> None:
    finding = lint_finding("cm.yaml", None, None, "no-configmap", Severity.WARNING, "nothing linted")
    document = finding.as_dict()
    assert list(document) == ["file", "line", "column", "id", "severity", "message", "hint"]
    assert document == {"file": "cm.yaml", "line": None, "column": None, "id": "no-configmap",
                        "severity": "warning", "message": "nothing linted", "hint": HINTS["no-configmap"]}


def test_an_unknown_lint_id_fails_where_the_finding_is_made() -> None:
    with pytest.raises(KeyError):
        lint_finding("f", 1, 1, "no-such-id", Severity.ERROR, "m")


def test_a_finding_about_the_node_puts_severity_first_and_the_fix_on_its_own_line() -> None:
    finding = Finding(FindingId.JUMP_SHADOWED, Severity.ERROR, "decided before our chain", "move the jump",
                      rule="-A POSTROUTING -j ACCEPT", destinations=("172.30.0.0/16",))
    assert finding.as_text() == "ERROR jump-shadowed: decided before our chain\n    fix: move the jump"
    warning = Finding(FindingId.UNSUPPORTED, Severity.WARNING, "cannot decide", "read it by hand")
    assert warning.as_text() == "WARNING unsupported: cannot decide\n    fix: read it by hand"


def test_a_finding_about_the_node_has_checks_json_keys_optional_ones_only_when_set() -> None:
    bare = Finding(FindingId.CHAIN_MISSING, Severity.ERROR, "no chain", "run the agent")
    assert json.dumps(bare.as_dict()) == ('{"id": "chain-missing", "severity": "error", "message": "no chain", '
                                          '"hint": "run the agent"}')
    full = Finding(FindingId.RULES_DIFFER, Severity.ERROR, "differs", "wait", rule="-A X -j RETURN",
                   missing=("10.0.0.0/8",), extra=("172.16.0.0/12", "192.168.0.0/16"), destinations=("1.2.3.4/32",))
    document = full.as_dict()
    assert list(document) == ["id", "severity", "message", "hint", "rule", "missing", "extra", "destinations"]
    assert document["extra"] == ["172.16.0.0/12", "192.168.0.0/16"]
    assert type(document["id"]) is str  # a plain string in JSON, whatever enum the id came from
    assert list(Finding(FindingId.RULES_DIFFER, Severity.WARNING, "m", "h", extra=("x",)).as_dict()) == [
        "id", "severity", "message", "hint", "extra"]


def test_check_ids_are_strings_scripts_match_on() -> None:
    finding = Finding(FindingId.STALE_CHAIN, Severity.WARNING, "m", "h")
    assert finding.id == "stale-chain"
    assert finding.id is FindingId.STALE_CHAIN
    assert {f.value for f in FindingId} == {"chain-missing", "jump-missing", "config-not-applied", "rules-differ",
                                            "foreign-masquerade", "jump-shadowed", "stale-chain", "unsupported",
                                            "rule-missing", "rule-extra", "rule-edited", "rule-order",
                                            "ignored-by-writer"}


def test_counts_and_reading_order() -> None:
    findings = [lint_finding("b", 2, 1, "duplicate-cidr", Severity.WARNING, "m"),
                lint_finding("a", None, None, "yaml-syntax", Severity.ERROR, "m"),
                lint_finding("b", 1, 5, "invalid-cidr", Severity.ERROR, "m")]
    assert (count(findings, Severity.ERROR), count(findings, Severity.WARNING)) == (2, 1)
    assert has_errors(findings) and not has_errors(findings[:1]) and not has_errors([])
    assert [(f.file, f.line) for f in sorted(findings, key=Finding.sort_key)] == [("a", None), ("b", 1), ("b", 2)]


def test_check_cli_text(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["check", "--from-dump", str(DUMPS / "gke-kubenet.save"), "--masq-chain=IP-MASQ",
                 "--nomasq-all-reserved-ranges", "--random-fully=false"])
    lines = capsys.readouterr().out.splitlines()
    assert code == 1
    assert lines[0].startswith("ERROR foreign-masquerade: a rule outside IP-MASQ NATs pod traffic")
    assert lines[1].startswith("    fix: kubenet masquerades everything outside kubelet's --non-masquerade-cidr")
    assert lines[2:] == ["NOT OK"]
    assert main(["check", "--from-dump", str(DUMPS / "gke-1.14-aws-vpn.save"), "--masq-chain=IP-MASQ",
                 "--nomasq-all-reserved-ranges", "--random-fully=false"]) == 0
    assert capsys.readouterr().out == "ok: the node's rules match the config\n"


def test_lint_cli_text_and_summary(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("nonMasqueradeCIDRs:\n  - 10.0.0.0/8\n  - 10.0.0.0/8\n  - 10.0.0.1/8\n")
    assert main(["lint", str(path)]) == 1
    captured = capsys.readouterr()
    first, second = captured.out.splitlines()
    assert first == (f"{path}:3:5: warning [duplicate-cidr] 10.0.0.0/8 repeats the entry at line 2 "
                     "(fix: remove the repeated entry)")
    assert second.startswith(f'{path}:4:5: error [misaligned-cidr] CIDR "10.0.0.1/8"')
    assert second.endswith(" (fix: use the network address of the block (the host bits must be zero))")
    assert captured.err == "1 error(s), 1 warning(s)\n"


# --- output bounded by what a person reads: the first few of each kind, the rest counted -----------------------------

def warning(i: int, *, id: str = "unsupported", file: str | None = None) -> Finding:
    return Finding(id, Severity.WARNING, f"entry {i} is not a CIDR", "write it as a CIDR", file=file, line=i if file
                   else None)


def test_named_names_the_first_few_and_counts_the_rest() -> None:
    assert named([]) == ""
    assert named(["a", "b"]) == "a, b"
    assert named([str(i) for i in range(6)]) == "0, 1, 2, 3, 4, 5"
    assert named([str(i) for i in range(100_000)]) == "0, 1, 2, 3, 4, 5 and 99,994 more"


def test_the_first_of_each_kind_are_shown_and_the_rest_counted_in_their_place() -> None:
    error = Finding("rules-differ", Severity.ERROR, "differs", "fix it")
    findings = [*(warning(i) for i in range(200_000)), error, *(warning(i, id="rule-extra") for i in range(3))]
    shown = bounded(findings)
    assert shown[:SHOWN_PER_KIND] == findings[:SHOWN_PER_KIND]
    summary = shown[SHOWN_PER_KIND]
    assert (summary.id, summary.severity, summary.omitted) == ("unsupported", Severity.WARNING,
                                                              200_000 - SHOWN_PER_KIND)
    assert summary.message == f"and {200_000 - SHOWN_PER_KIND:,} more warnings [unsupported] like the above, not shown"
    assert shown[SHOWN_PER_KIND + 1:] == [error, *findings[-3:]]  # fewer than the bound: as they are
    assert summary.as_dict()["omitted"] == 200_000 - SHOWN_PER_KIND and "omitted" not in error.as_dict()
    assert bounded(findings[:SHOWN_PER_KIND]) == findings[:SHOWN_PER_KIND]


def test_a_kind_is_per_file_so_each_linted_file_shows_its_first_findings() -> None:
    findings = [warning(i, file=name) for name in ("a.yaml", "b.yaml") for i in range(1, 11)]
    shown = bounded(findings)
    assert [(f.file, f.omitted) for f in shown if f.omitted] == [("a.yaml", 5), ("b.yaml", 5)]
    assert len(shown) == 2 * (SHOWN_PER_KIND + 1)
