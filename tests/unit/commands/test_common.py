"""`-` is standard input wherever one input may come from it, the same as naming the file; at most one per command.

Each command runs as a process, as a pipeline runs it (`kubectl get configmap ... -o yaml | ipmasq render --config
-`): its output from standard input equals its output from the file, with the file's name read as <stdin>.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.conftest import PYTHON, ROOT

CORPUS = ROOT / "tests" / "lint_corpus"
DUMPS = ROOT / "tests" / "dumps"
CONFIGMAP = CORPUS / "clean-configmap.yaml"
DUMP = DUMPS / "gke-kubenet.save"


def ipmasq(*argv: str, stdin: bytes = b"") -> tuple[int, str, str]:
    done = subprocess.run([PYTHON, "-m", "ipmasq", *argv], input=stdin, capture_output=True, timeout=60, check=False)
    return done.returncode, done.stdout.decode(), done.stderr.decode()


def same_from_stdin(path: Path, argv_with_file: list[str]) -> tuple[int, str, str]:
    """Run with the file, then with `-` in its place and the file on stdin; both results must agree."""
    code, out, err = ipmasq(*argv_with_file)
    argv = ["-" if a == str(path) else a for a in argv_with_file]
    code_stdin, out_stdin, err_stdin = ipmasq(*argv, stdin=path.read_bytes())
    assert (code_stdin, out_stdin, err_stdin) == (code, out.replace(str(path), "<stdin>"),
                                                  err.replace(str(path), "<stdin>"))
    return code, out, err


LINTED = CORPUS / "must-masquerade.yaml"


@pytest.mark.parametrize(("path", "argv"), [
    (CONFIGMAP, ["render", "--config", str(CONFIGMAP)]),
    (CONFIGMAP, ["render", "--config", str(CONFIGMAP), "--print-hash"]),
    (CONFIGMAP, ["explain", "10.2.1.100", "172.30.12.110", "--config", str(CONFIGMAP), "-o", "json"]),
    (CONFIGMAP, ["check", "--config", str(CONFIGMAP), "--from-dump", str(DUMP), "-o", "json"]),
    (DUMP, ["check", "--config", str(CONFIGMAP), "--from-dump", str(DUMP)]),
    (DUMP, ["trace", "8.8.8.8", "--source", "10.4.0.5", "--dump", str(DUMP)]),
    (LINTED, ["lint", str(LINTED), "--must-masquerade", "172.30.0.0/16"]),
    (LINTED, ["lint", str(LINTED), str(CONFIGMAP), "-o", "json"]),
    (CONFIGMAP, ["diff", str(CONFIGMAP), "gke", "--probe", "172.30.12.110"]),
    (CONFIGMAP, ["diff", "kubenet", str(CONFIGMAP), "--probe", "172.30.12.110", "-o", "json"]),
], ids=lambda v: v.name if isinstance(v, Path) else " ".join(v[:1]))
def test_stdin_reads_as_the_file_does(path: Path, argv: list[str]) -> None:
    same_from_stdin(path, argv)


def test_check_reads_the_dump_from_stdin() -> None:
    code, out, _ = same_from_stdin(DUMP, ["check", "--config", str(CONFIGMAP), "--from-dump", str(DUMP)])
    assert code == 1 and "NOT OK" in out  # kubenet's rules, not the config's: the dump was read


def test_diff_names_stdin_in_its_report() -> None:
    code, out, _ = ipmasq("diff", "-", "gke", stdin=b"nonMasqueradeCIDRs: [10.0.0.0/8]\n")
    assert code == 0 and out.startswith("<stdin> -> gke: 10 range(s) flip\n")
    code, out, _ = ipmasq("diff", "builtin:gke", "-", stdin=b"nonMasqueradeCIDRs: [10.0.0.0/8]\n")
    assert code == 0 and out.startswith("builtin:gke -> <stdin>: 10 range(s) flip\n")


@pytest.mark.parametrize(("argv", "message"), [
    (["check", "--from-dump", "-", "--config", "-"],
     "ipmasq check: - (standard input) can be given once: --config and --from-dump both ask for it\n"),
    (["check", "--config=-", "--from-dump=-", "-o", "json"],
     "ipmasq check: - (standard input) can be given once: --config and --from-dump both ask for it\n"),
    (["diff", "-", "-"], "ipmasq diff: - (standard input) can be given once: OLD and NEW both ask for it\n"),
    (["lint", "-", "-"], "ipmasq lint: - (standard input) can be given once\n"),
    (["lint", "-", str(CONFIGMAP), "-"], "ipmasq lint: - (standard input) can be given once\n"),
    (["audit", "-", "--config", "-", "--pod-range", "10.44.0.0/14"],
     "ipmasq audit: - (standard input) can be given once: FLOWLOG and --config both ask for it\n"),
])
def test_two_inputs_from_stdin_are_a_usage_error(argv: list[str], message: str) -> None:
    # before anything is read: the first reader would leave the second an empty input, an error in the wrong place
    assert ipmasq(*argv, stdin=CONFIGMAP.read_bytes()) == (2, "", message)


@pytest.mark.parametrize(("argv", "stdin", "error"), [
    (["render", "--config", "-"], b"nonMasqueradeCIDRs: [10.0.0.1/8]\n",
     'ipmasq render: config error: <stdin>:1: CIDR "10.0.0.1/8" is not aligned'),
    (["explain", "8.8.8.8", "--config", "-"], b"resyncInterval: 0s\n",
     "ipmasq explain: config error: <stdin>:1: resyncInterval must be above zero"),
    (["check", "--from-dump", "-"], b"\xff\xfe",
     "ipmasq check: <stdin>:1: not a text file (byte 0 is no UTF-8; expected iptables-save or nft -j output)"),
    (["check", "--from-dump", "-"], b"",
     "ipmasq check: <stdin>: no *nat table found"),
    (["check", "--config", "-", "--from-dump", str(DUMP)], b"a: *undefined\n",
     "ipmasq check: config error: <stdin>:1: YAML syntax error: found undefined alias"),
    (["trace", "8.8.8.8", "--source", "10.4.0.5", "--dump", "-"], b"\xff\xfe",
     "ipmasq trace: <stdin>:1: not a text file (byte 0 is no UTF-8; expected iptables-save or nft -j output)"),
    (["diff", "-", "gke"], b"\x00\xff",
     "ipmasq diff: config error: <stdin>:1: not UTF-8 text (byte 1)"),
])
def test_errors_in_stdin_name_it_stdin_in_one_line(argv: list[str], stdin: bytes, error: str) -> None:
    code, out, err = ipmasq(*argv, stdin=stdin)
    # an invalid config is a finding (1); a dump that is none could not be read (3)
    assert (code, out) == (1 if "config error" in error else 3, ""), err
    assert err.startswith(error) and err.count("\n") == 1, err


def test_an_empty_config_on_stdin_is_the_defaults_and_lint_says_so() -> None:
    code, out, _ = ipmasq("render", "--config", "-")
    assert code == 0 and "-d 192.168.0.0/16 -j RETURN" in out
    code, out, err = ipmasq("lint", "-")
    assert code == 0 and out.startswith("<stdin>:1: warning [empty-config]") and err == "0 error(s), 1 warning(s)\n"


def test_the_dump_is_read_bytes_first_whatever_the_locale() -> None:
    # with a strict stdin decoder, sys.stdin.read() would raise UnicodeDecodeError before any of our messages
    done = subprocess.run([PYTHON, "-m", "ipmasq", "check", "--from-dump", "-"], input=b"\xff",
                          capture_output=True, timeout=60, check=False, env={"PYTHONIOENCODING": "utf-8:strict"})
    assert done.returncode == 3 and b"Traceback" not in done.stderr
    assert done.stderr == (b"ipmasq check: <stdin>:1: not a text file (byte 0 is no UTF-8; expected iptables-save or "
                           b"nft -j output)\n")
