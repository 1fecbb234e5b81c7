"""diff's OLD and NEW: a file never silently shadows a built-in set of the same name, nor the reverse."""

from __future__ import annotations

from pathlib import Path

import pytest

from ipmasq.cli import main
from ipmasq.diff.baselines import BASELINES, BUILTIN_PREFIX, builtin_set

CONFIG = "nonMasqueradeCIDRs: [10.0.0.0/8]\n"  # kubenet's one preserved range, without its link-local


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["diff", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize(("spec", "exists", "named"), [
    ("gke", False, "gke"),  # the README's `ipmasq diff kubenet gke`
    ("builtin:gke", False, "gke"),
    ("builtin:gke", True, "gke"),  # whatever the directory holds
    ("builtin:reference-all-reserved", False, "reference-all-reserved"),
    ("./gke", True, None),
    ("./gke", False, None),  # a path: the loader says it is missing (exit 1), not "no such set"
    ("configs/gke", True, None),
    ("my-config.yaml", True, None),
    ("-", False, None),
])
def test_what_a_spec_names(spec: str, exists: bool, named: str | None) -> None:
    assert builtin_set(spec, path_exists=exists) == named


@pytest.mark.parametrize(("spec", "exists", "words"), [
    ("gke", True, "'gke' is both a path here and a built-in set: write ./gke for the file or builtin:gke for the set"),
    ("builtin:gcp", False, "'builtin:gcp': no built-in set 'gcp' (sets: reference, reference-all-reserved, gke, "),
    ("builtin:", False, "no built-in set ''"),
    ("nosuch", False, "'nosuch' is neither a file nor a built-in set ("),
    ("builtin:" + "x" * 500, False, "\u2026"),  # clipped, not 500 characters
])
def test_ambiguous_or_unknown_specs(spec: str, exists: bool, words: str) -> None:
    with pytest.raises(ValueError) as raised:
        builtin_set(spec, path_exists=exists)
    assert words in str(raised.value) and len(str(raised.value)) < 300


def test_every_set_has_a_builtin_spelling() -> None:
    assert all(builtin_set(BUILTIN_PREFIX + name, path_exists=True) == name for name in BASELINES)


def test_a_file_named_like_a_set_is_a_usage_error_naming_both_spellings(
        capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "gke").write_text(CONFIG)
    assert run(capsys, "kubenet", "gke") == (
        2, "", "ipmasq diff: 'gke' is both a path here and a built-in set: write ./gke for the file or builtin:gke "
               "for the set\n")
    # either spelling says which one is meant
    code, out, _ = run(capsys, "kubenet", "./gke")
    assert (code, out.splitlines()[0]) == (0, "kubenet -> ./gke: 1 range(s) flip")  # only link-local
    code, out, _ = run(capsys, "kubenet", "builtin:gke", "--probe", "172.30.12.110")
    assert code == 1 and out.startswith("kubenet -> builtin:gke: 11 range(s) flip\n")
    code, out, _ = run(capsys, str(tmp_path / "gke"), "builtin:kubenet")
    assert (code, out.splitlines()[0]) == (0, f"{tmp_path / 'gke'} -> builtin:kubenet: 1 range(s) flip")


def test_a_directory_named_like_a_set_is_ambiguous_too(
        capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "kubenet").mkdir()
    (tmp_path / "kubenet" / "ip-masq-agent").write_text(CONFIG)
    code, _, err = run(capsys, "kubenet", "gke")
    assert code == 2 and "write ./kubenet for the file or builtin:kubenet for the set" in err
    assert run(capsys, "kubenet/", "builtin:kubenet")[0] == 0


def test_set_names_without_such_files_keep_working(
        capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    code, out, err = run(capsys, "kubenet", "gke", "--probe", "172.30.12.110")
    assert (code, err) == (1, "")
    assert out.endswith("probe 172.30.12.110: masquerade (final MASQUERADE) -> preserve (172.16.0.0/12 (default, "
                        "built-in)): FLIPS\n")


def test_exit_codes_for_names_and_paths(
        capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert run(capsys, "gke", "nosuch")[0] == 2  # a bare word that names nothing: usage
    assert run(capsys, "builtin:nosuch", "gke")[0] == 2
    code, _, err = run(capsys, "gke", "./nosuch")  # a path that is missing: the input is wrong
    assert (code, err) == (3, "ipmasq diff: ./nosuch: no such file or directory\n")
    # both arguments are checked before either is read
    (tmp_path / "bad").write_text("nonMasqueradeCIDRs: [10.0.0.1/8]\n")
    assert run(capsys, "./bad", "builtin:nosuch")[0] == 2
