"""ipmasq lint: the corpus (one manifest per finding, id and line asserted), placement, output and exit codes."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ipmasq.cli import main
from ipmasq.config.source import ConfigInput, config_from_bytes
from ipmasq.errors import ConfigError
from ipmasq.findings import Finding, Severity
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
    def values(flag: str) -> list[str]:
        return [args[i + 1] for i, a in enumerate(args) if a == flag]

    return PolicyOptions(enable_ipv6="--enable-ipv6" in args), Expectations(
        tuple(map(parse_cidr, values("--must-masquerade"))), tuple(map(parse_cidr, values("--must-preserve"))),
        tuple(map(parse_cidr, values("--pod-range"))), tuple(values("--node-name")))


@pytest.mark.parametrize("path", CASES, ids=[p.name for p in CASES])
def test_corpus(path: Path) -> None:
    expected, args = _expected(path)
    options, expect = _lint_args(args)
    findings = lint_source(path.name, path.read_bytes(), options=options, expect=expect)
    assert sorted(f"{f.id}@{f.line}" for f in findings) == expected, [f.as_text() for f in findings]


def test_corpus_covers_every_finding_id() -> None:
    wanted = {"configmap-name", "configmap-namespace", "missing-config-key", "yaml-syntax", "indentation",
              "invalid-cidr", "misaligned-cidr", "unknown-key", "key-case", "wrong-type", "duplicate-cidr",
              "shadowed-cidr", "too-many-cidrs", "ipv6-disabled", "bad-duration", "lookalike-character",
              "must-masquerade", "must-preserve", "duplicate-configmap", "ignored-document", "empty-config",
              "empty-non-masquerade", "short-resync-interval", "invalid-rule", "shadowed-rule", "rule-no-effect",
              "snat-to-pod-address", "snat-to-destination", "rule-nodes-match-none", "config-is-manifest",
              "no-known-key"}
    covered = {item.split("@")[0] for path in CASES for item in _expected(path)[0]}
    assert wanted <= covered
    assert wanted <= set(HINTS)
    assert any(_expected(p)[0] == [] for p in CASES)


def test_every_finding_id_has_a_kebab_case_name_and_a_hint() -> None:
    for id_, hint in HINTS.items():
        assert re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", id_) and hint, id_


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
    [finding] = lint_config("nonMasqueradeCIDRs: [10.0.0.0/8]\ncolour: blue\n", source="f")
    assert (finding.id, finding.severity) == ("unknown-key", Severity.WARNING)


def test_a_config_of_unknown_keys_only_is_an_error_the_agent_would_accept() -> None:
    [finding] = lint_config("colour: blue\n", source="f")
    assert (finding.id, finding.severity) == ("no-known-key", Severity.ERROR)
    [manifest] = lint_config('{"apiVersion": "v1", "kind": "ConfigMap", "data": {}}', source="f")
    assert (manifest.id, manifest.severity, manifest.line) == ("config-is-manifest", Severity.ERROR, 1)
    assert "kind: ConfigMap" in manifest.message


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
    document = json.loads(out)
    assert (document["apiVersion"], document["kind"], document["unreadable"]) == ("ipmasq.io/v1", "LintReport", [])
    [item] = document["findings"]
    assert {"file", "line", "column", "id", "severity", "message"} <= set(item)
    assert (item["id"], item["line"], item["severity"]) == ("configmap-name", 5, "error")
    assert run_cli(capsys, "lint", str(CORPUS / "key-case.yaml"))[0] == 0  # warnings only
    assert run_cli(capsys, "lint", str(CORPUS / "clean-configmap.yaml"), str(CORPUS / "clean-list.yaml"))[0] == 0
    # a file that cannot be read is not "0 errors": could not run (3), and the one line names it
    code = main(["lint", str(CORPUS / "missing.yaml")])
    captured = capsys.readouterr()
    assert (code, captured.out) == (3, "")
    assert captured.err == f"ipmasq lint: {CORPUS / 'missing.yaml'}: cannot read: No such file or directory\n"
    code = main(["lint", str(CORPUS / "missing.yaml"), str(CORPUS / "configmap-name.yaml")])
    captured = capsys.readouterr()
    assert code == 3 and "[configmap-name]" in captured.out  # what could be read is still linted
    missing = f"ipmasq lint: {CORPUS / 'missing.yaml'}: cannot read: No such file or directory"
    assert captured.err.splitlines() == ["1 error(s), 0 warning(s) in the 1 input(s) read", missing]


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
    assert result.returncode == 1 and json.loads(result.stdout)["findings"][0]["id"] == "yaml-syntax"



# --- what lint used to pass silently: two ConfigMaps, ignored documents, empty configs, busy resyncs ----------

CONFIGMAP = ("apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: ip-masq-agent\n  namespace: kube-system\n"
             "data:\n  config: |\n    nonMasqueradeCIDRs: [{cidrs}]\n")


def test_two_configmaps_with_different_configs_are_an_error_as_render_refuses_them(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "cm.yaml"
    path.write_text(CONFIGMAP.format(cidrs="10.0.0.0/8") + "---\n"
                    + CONFIGMAP.format(cidrs="10.0.0.0/8, 100.64.0.0/10"))
    [finding] = lint_source("cm.yaml", path.read_bytes())
    assert (finding.id, finding.severity, finding.line, finding.column) == (
        "duplicate-configmap", Severity.ERROR, 13, 9)
    assert "kube-system/ip-masq-agent" in finding.message and "line 4" in finding.message
    assert run_cli(capsys, "lint", str(path))[0] == 1
    assert main(["render", "--config", str(path)]) == 1
    assert "with different configs" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"2 ip-masq-agent ConfigMaps holding data\.config with different configs"):
        configmap_config(path.read_text())


def test_the_same_configmap_twice_is_a_warning_and_the_tools_read_it(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "cm.yaml"
    path.write_text(CONFIGMAP.format(cidrs="10.0.0.0/8") + "---\n" + CONFIGMAP.format(cidrs="10.0.0.0/8"))
    [finding] = lint_source("cm.yaml", path.read_bytes())
    assert (finding.id, finding.severity, finding.line) == ("duplicate-configmap", Severity.WARNING, 13)
    embedded = configmap_config(path.read_text())
    # the last one's lines (its config starts on line 17), as `kubectl apply` keeps the last one
    assert embedded is not None and embedded.splitlines()[16] == "nonMasqueradeCIDRs: [10.0.0.0/8]"
    assert main(["render", "--config", str(path)]) == 0
    assert "-d 10.0.0.0/8 -j RETURN" in capsys.readouterr().out


def test_configmaps_of_other_names_or_namespaces_are_not_duplicates() -> None:
    other = CONFIGMAP.format(cidrs="10.0.0.0/8").replace("kube-system", "default")
    findings = lint_source("f", (CONFIGMAP.format(cidrs="10.0.0.0/8") + "---\n" + other).encode())
    assert [f.id for f in findings] == ["configmap-namespace"]


def test_ignored_documents() -> None:
    config = "nonMasqueradeCIDRs: [10.0.0.0/8]\n---\nnonMasqueradeCIDRs: [11.0.0.0/8]\n---\ncidrLimit: 3\n"
    [finding] = lint_config(config, source="f")
    assert (finding.id, finding.severity, finding.line) == ("ignored-document", Severity.WARNING, 2)
    assert "this document and 1 more after it are ignored" in finding.message
    # a leading marker, a trailing one, an end marker and an empty or comment-only document are one document
    for one in ("---\nnonMasqueradeCIDRs: [10.0.0.0/8]\n", "nonMasqueradeCIDRs: [10.0.0.0/8]\n---\n",
                "# head\n---\nnonMasqueradeCIDRs: [10.0.0.0/8]\n...\n",
                "nonMasqueradeCIDRs: [10.0.0.0/8]\n---\n# nothing here\n"):
        assert "ignored-document" not in [f.id for f in lint_config(one, source="f")], one
    findings = lint_config("---\n---\nnonMasqueradeCIDRs: [10.0.0.0/8]\n", source="f", whole_file=True)
    [empty_first, ignored] = sorted(findings, key=Finding.sort_key)
    assert (empty_first.id, ignored.id, ignored.line) == ("empty-config", "ignored-document", 2)
    assert "the first document is empty, so the agent runs with its built-in defaults" in ignored.message


def test_ignored_document_inside_a_configmap_is_placed_in_the_manifest() -> None:
    text = CONFIGMAP.format(cidrs="10.0.0.0/8") + "    ---\n    nonMasqueradeCIDRs: [11.0.0.0/8]\n"
    [finding] = lint_source("f", text.encode())
    assert (finding.id, finding.line) == ("ignored-document", 9)


def test_a_file_that_sets_nothing_runs_the_defaults() -> None:
    for text, what in (("", "it is empty"), ("# just a comment\n", "only comments"), ("{}\n", "an empty mapping"),
                       ("\n\n", "it is empty")):
        [finding] = lint_source("f", text.encode())
        assert (finding.id, finding.severity, finding.line) == ("empty-config", Severity.WARNING, 1), text
        assert what in finding.message
        assert "10.0.0.0/8, 172.16.0.0/12, 192.168.0.0/16 and link-local 169.254.0.0/16 keep the pod IP" in \
            finding.message
    [gke] = lint_source("f", b"", options=PolicyOptions(nomasq_all_reserved_ranges=True))
    assert "RFC 1918 and the other reserved ranges of --nomasq-all-reserved-ranges" in gke.message
    # inside a ConfigMap, `config: ''` is written on purpose: no finding (see the namespace test above)
    assert lint_config("", source="f") == []


def test_an_empty_non_masquerade_list_says_what_is_masqueraded() -> None:
    [null] = lint_config("nonMasqueradeCIDRs:\n", source="f")
    assert (null.id, null.severity, null.line, null.column) == ("empty-non-masquerade", Severity.WARNING, 1, 1)
    assert "(null): every destination but link-local 169.254.0.0/16 is masqueraded" in null.message
    [listed] = lint_config("nonMasqueradeCIDRs: []\nmasqLinkLocal: true\n", source="f")
    assert "([]): every destination, link-local included, is masqueraded" in listed.message
    [v6] = lint_config("nonMasqueradeCIDRs: []\n", source="f", options=PolicyOptions(enable_ipv6=True))
    assert "but link-local 169.254.0.0/16 and fe80::/10 is masqueraded" in v6.message
    # one entry is not empty, even a bad one; the key absent means the defaults
    assert [f.id for f in lint_config("nonMasqueradeCIDRs: [10.0.0.1/8]\n", source="f")] == ["misaligned-cidr"]
    assert lint_config("masqLinkLocal: true\n", source="f") == []


@pytest.mark.parametrize(("interval", "ids"), [
    ("1ns", ["short-resync-interval"]), ("999ms", ["short-resync-interval"]), ("0.5s", ["short-resync-interval"]),
    ("1s", []), ("60s", []), ("0s", ["bad-duration"]), ("-1ns", ["bad-duration"]), ("1 ns", ["bad-duration"]),
])
def test_resync_interval_below_a_second(interval: str, ids: list[str]) -> None:
    findings = lint_config(f"resyncInterval: {interval}\n", source="f")
    assert [f.id for f in findings] == ids
    if ids == ["short-resync-interval"]:
        assert findings[0].severity is Severity.WARNING and "continuously" in findings[0].message
        assert "60s" in findings[0].hint


def test_lint_reads_a_directory_as_the_agent_does(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    (tmp_path / "ip-masq-agent").write_text("nonMasqueradeCIDRs: [10.0.0.1/8]\n")
    (tmp_path / "notes.yaml").write_text("not: [a, config\n")  # the agent never reads it, nor does lint
    code, out = run_cli(capsys, "lint", str(tmp_path), "-o", "json")
    assert code == 1 and [(f["file"], f["id"]) for f in json.loads(out)["findings"]] == [
        (str(tmp_path / "ip-masq-agent"), "misaligned-cidr")]


def test_lint_of_a_directory_without_a_config_file_lints_nothing_and_says_so(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    (tmp_path / "config.yaml").write_text("nonMasqueradeCIDRs: [10.0.0.0/8]\n")  # not named ip-masq*
    (tmp_path / "ip-masq-agent").mkdir()  # not a file
    code, out = run_cli(capsys, "lint", str(tmp_path), "-o", "json")
    [finding] = json.loads(out)["findings"]
    assert code == 1
    assert (finding["file"], finding["line"], finding["id"], finding["severity"]) == (
        str(tmp_path), None, "no-config-file", "error")
    assert "holds 2 other entries" in finding["message"] and "built-in defaults" in finding["message"]
    empty = tmp_path / "empty"
    empty.mkdir()
    code = main(["lint", str(empty)])
    captured = capsys.readouterr()
    assert code == 1 and captured.out.startswith(f"{empty}: error [no-config-file] no ip-masq* file in this directory "
                                                 "(it is empty) and no manifest under it holds the ip-masq-agent "
                                                 "ConfigMap, so nothing was linted")
    assert captured.err == "1 error(s), 0 warning(s)\n"


_LISTED = st.sampled_from(["10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10", "10.11.0.0/16",
                           "198.18.0.0/15", "203.0.113.0/24", "8.8.8.0/24"])


@settings(max_examples=200, deadline=None)
@given(masquerade=st.lists(_LISTED, max_size=3, unique=True),
       non_masquerade=st.none() | st.lists(_LISTED, max_size=3, unique=True), all_reserved=st.booleans())
def test_a_list_config_the_agent_refuses_is_an_error_of_lint(masquerade: list[str], non_masquerade: list[str] | None,
                                                            all_reserved: bool) -> None:
    """lint says before apply what the agent would say on the node: a masqueradeCIDRs entry that is one of the
    built-in nonMasqueradeCIDRs (the file lists none) makes the agent refuse the config, and lint too."""
    text = f"masqueradeCIDRs: {json.dumps(masquerade)}\n"
    text += "" if non_masquerade is None else f"nonMasqueradeCIDRs: {json.dumps(non_masquerade)}\n"
    options = PolicyOptions(nomasq_all_reserved_ranges=all_reserved)
    try:
        config_from_bytes(ConfigInput((("c", text.encode()),)), options)
        refused = False
    except ConfigError:
        refused = True
    errors = [f for f in lint_config(text, source="c", options=options) if f.severity is Severity.ERROR]
    assert refused == bool(errors), (text, errors)
