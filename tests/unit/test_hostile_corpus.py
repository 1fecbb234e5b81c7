"""Every hostile input of tests/hostile, through every command that reads its kind, as a process of its own.

Configs go through render, explain, lint, diff and check --config; dumps through check --from-dump and trace --dump;
flow logs through audit; each regular file (and /dev/zero) once more as standard input (`-`). A refused input ends
with exit 1 (a config read and found invalid) or 3 (an input that could not be read: not a regular file, too large,
a dump or flow log of no format the command reads) and exactly one line naming the file (and the line, where there
is one), never a traceback; an input
that is valid gives the command's own answer. Every run ends within SECONDS and below PEAK_MIB of memory, even a
50 MB file, a 200 MB gzip of one line, a FIFO nobody writes to or /dev/zero.

The runs are forked from one process that has imported the CLI once (tests/hostile/runner.py): hundreds of them
take seconds, where as many fresh interpreters would take minutes.
"""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT
from tests.eventually import eventually
from tests.hostile import generated

HOSTILE = ROOT / "tests" / "hostile"
POD = "10.44.14.15"
POD_RANGE = "10.44.0.0/14"
VALID_DUMP = ROOT / "tests" / "dumps" / "gke-kubenet.save"
SECONDS = 20
PEAK_MIB = 150  # the forked child shares the runner's ~17 MiB; a 50 MB dump read whole costs ~66 MiB
STDIN = "<stdin>"

Argv = Callable[[str], list[str]]
COMMANDS: dict[str, dict[str, Argv]] = {
    "config": {
        "render": lambda p: ["render", "--config", p],
        "explain": lambda p: ["explain", "--config", p, "8.8.8.8"],
        "lint": lambda p: ["lint", p],
        "diff": lambda p: ["diff", "builtin:reference", p],
        "check": lambda p: ["check", "--config", p, "--from-dump", str(VALID_DUMP)],
    },
    "dumps": {
        "check": lambda p: ["check", "--from-dump", p],
        "trace": lambda p: ["trace", "--source", POD, "--dump", p, "8.8.8.8"],
    },
    "flowlogs": {
        "audit": lambda p: ["audit", "--pod-range", POD_RANGE, p],
    },
}


@dataclass(frozen=True)
class Refused:
    """Exit 1 or 3 (`refused_code`), one line naming the input, holding `words` (or `stdin_words` when read from
    `-`), and `PATH:LINE:` when the error has a line (lint may name one where the others cannot: `lint_line`)."""

    words: str
    line: int | None = None
    stdin_words: str | None = None
    lint_line: int | None = None


@dataclass(frozen=True)
class Answered:
    """A valid input (or one the command reads and judges): each command's exit code and words of its output;
    standard error holds at most warnings naming the input."""

    codes: dict[str, int]
    output: dict[str, str]


VALID_CONFIG = Answered({"render": 0, "explain": 0, "lint": 0, "diff": 0, "check": 1},
                        {"render": "-A IP-MASQ-AGENT", "explain": "8.8.8.8: MASQUERADED", "lint": "",
                         "diff": "range(s) flip", "check": "NOT OK"})  # check: the dump is another node's
LOOPING_DUMP = Answered({"check": 1, "trace": 1}, {"check": "ERROR chain-missing", "trace": "CANNOT DECIDE: loop: "})
NOT_UTF8 = "not UTF-8 text"
NESTED = "nested deeper than 64 levels"
GCP_RECORD = "not a GCP VPC flow log JSON record"
LONG_FLOW_LINE = "a line longer than 1,048,576 characters"
CONFIG_TOO_LARGE = "too large: a config is at most 1 MiB"
NO_WRITER = "a FIFO that no process writes to"

EXPECTED: dict[str, dict[str, Refused | Answered]] = {
    "config": {
        "alias-bomb.yaml": Refused("YAML aliases repeat this value past 100,000 values", 1),
        "alias-to-itself.yaml": Refused("a YAML alias refers to the value that contains it", 1),
        "binary-garbage.bin": Refused(NOT_UTF8, 1),
        "bom.yaml": VALID_CONFIG,
        "crlf.yaml": VALID_CONFIG,
        "duplicate-keys.yaml": VALID_CONFIG,  # the last one wins, as in the reference; a warning names line 2
        "invalid-utf8.yaml": Refused(NOT_UTF8, 3),
        "json-huge-number.json": Refused("a number of more than 4,300 digits", 1),
        "json-nested-1000.json": Refused(NESTED, 1),
        "lone-surrogate.json": Refused('CIDR "\ufffd" could not be parsed', 1),  # U+FFFD, as Go decodes it
        "nul-byte.yaml": Refused("unacceptable character #x0000", 2),
        "resync-1ns.yaml": VALID_CONFIG,
        "resync-negative.yaml": Refused("resyncInterval must be above zero", 2),
        "resync-overflow.yaml": Refused('invalid duration "1000000000h"', 2),
        "tabs.yaml": Refused("found character that cannot start any token", 2),
        "two-configmaps.yaml": Refused("ConfigMap", None, lint_line=15),
        "two-documents.yaml": VALID_CONFIG,  # the agent reads the first; lint warns
        "unterminated-string.yaml": Refused("found unexpected end of stream", 2),
        "utf16.yaml": Refused(NOT_UTF8, 1),
        "yaml-nested-400.yaml": Refused(NESTED, 1),
        # the tag is never acted on: its argument list is read as the CIDR list it stands in
        "yaml-python-tag.yaml": Refused('CIDR "true" could not be parsed', 1),
        "config-50mb": Refused("50,000,000 bytes, " + CONFIG_TOO_LARGE, stdin_words=CONFIG_TOO_LARGE),
        "config-fifo": Refused("a FIFO, not a regular file: not read"),
        "config-socket": Refused("a socket, not a regular file: not read"),
        "config-dev-zero-symlink": Refused("a character device, not a regular file: not read",
                                           stdin_words=CONFIG_TOO_LARGE),
        "config-directory-in-place": Refused("no ip-masq* file in this directory"),
        "config-dir-symlink-loop": Refused("no ip-masq* file in this directory"),
        "config-symlink-loop": Refused("Too many levels of symbolic links"),
        "config-yaml-100000": Refused(NESTED, 1),
        "config-json-100000": Refused(NESTED, 2),
        "config-10mb-value": Refused("10,000,023 bytes, " + CONFIG_TOO_LARGE, stdin_words=CONFIG_TOO_LARGE),
    },
    "dumps": {
        "binary-garbage.bin": Refused("control character", 1),
        "empty.save": Refused("no *nat table found"),
        "invalid-utf8.save": Refused("not a text file (byte 126 is no UTF-8", 6),
        "loop-goto.save": LOOPING_DUMP,
        "loop-jump.save": LOOPING_DUMP,
        "loop-self.save": LOOPING_DUMP,
        "nft-missing-fields.json": Refused("an object without a name string"),
        "nft-null.json": Refused('"nftables" holds null, not a list of objects'),
        "nft-nulls-inside.json": Refused("object 1 of the listing is not {KIND: {...}}: null"),
        "nft-strings.json": Refused('object 1 of the listing is not {KIND: {...}}: "table"'),
        "nft-truncated.json": Refused("not an nftables JSON listing"),
        "nft-wrong-types.json": Refused("a V4 set holds an element we cannot read"),
        "no-commit.save": Refused("the *nat table has no COMMIT", 1),
        "no-nat-table.save": Refused("no *nat table found"),
        "nul-byte.save": Refused("control character '\\x00' (U+0000)", 6),
        "undeclared-chain.save": Refused("a rule of chain NOWHERE, which the dump never declares", 7),
        "unparseable-rule.save": Refused("line 6: cannot read rule"),
        "dump-50mb": Refused("control character '\\x00' (U+0000)", 1),
        "dump-fifo": Refused(NO_WRITER),
        "dump-socket": Refused("a socket, not a dump file: not read"),
        "dump-dev-zero-symlink": Refused("a character device, not a dump file: not read",
                                         stdin_words="more than 67,108,864 bytes, too large"),
        "dump-directory": Refused("a directory, not a dump file: not read"),
        # followed to its end: deep, but no loop and far from the walk's budget
        "dump-jump-chain-5000": Answered({"check": 1, "trace": 0},
                                         {"check": "ERROR chain-missing", "trace": "decided by: C5000:1"}),
        "dump-10mb-line": Refused("a line of 10,000,052 characters", 6),
        "dump-nft-100000": Refused("not an nftables JSON listing"),
        "dump-nft-10mb-string": Refused("a name of 10,000,000 characters (nft allows 255)"),
    },
    "flowlogs": {
        "aws-wrong-field-count.log": Refused("not an AWS flow log record", 1),
        "binary-garbage.bin": Refused("not an AWS flow log record", 1),
        "gcp-not-an-object.jsonl": Refused(GCP_RECORD, 2),
        "gcp-null-connection.jsonl": Refused(GCP_RECORD, 2),
        "gcp-src-ip-number.jsonl": Refused(GCP_RECORD, 2),
        "gzip-garbage.gz": Refused("cannot read: Unknown compression method"),
        "nul-byte.jsonl": Refused(GCP_RECORD, 2),
        "truncated.jsonl.gz": Refused("cannot read: Compressed file ended before the end-of-stream marker"),
        "flowlog-10mb-line": Refused(LONG_FLOW_LINE, 2),
        "flowlog-50mb": Refused(LONG_FLOW_LINE, 1),
        "flowlog-fifo": Refused(NO_WRITER),
        "flowlog-socket": Refused("a socket, not a flow log file: not read"),
        "flowlog-dev-zero-symlink": Refused("a character device, not a flow log file: not read",
                                            stdin_words=LONG_FLOW_LINE),
        "flowlog-directory": Refused("a directory, not a flow log file: not read"),
        "flowlog-gzip-one-line-200mb": Refused(LONG_FLOW_LINE, 1),
    },
}

# a config's words that say it was never read (InputUnreadable), where the others say what is wrong in it
_NOT_READ = ("not a regular file", "too large", "Too many levels of symbolic links")


def refused_code(kind: str, words: str) -> int:
    """1: a config the command read and judges invalid (what a CI step gates on); 3: could not run, because an
    input could not be read: a config that is no file or too large, a dump or flow log it cannot parse."""
    if kind != "config":
        return 3
    return 3 if any(w in words for w in _NOT_READ) else 1


_GENERATED_KIND = {"config": "config", "dump": "dumps", "flowlog": "flowlogs"}


def _kind_of_generated(name: str) -> str:
    return _GENERATED_KIND[name.split("-", 1)[0]]


# what a shell can redirect to standard input without the redirection itself blocking: regular files and /dev/zero
GENERATED_AS_STDIN = frozenset({
    "config-50mb", "config-dev-zero-symlink", "config-yaml-100000", "config-json-100000", "config-10mb-value",
    "dump-50mb", "dump-dev-zero-symlink", "dump-jump-chain-5000", "dump-10mb-line", "dump-nft-100000",
    "dump-nft-10mb-string", "flowlog-10mb-line", "flowlog-50mb", "flowlog-dev-zero-symlink",
    "flowlog-gzip-one-line-200mb"})


def _readable_as_stdin(name: str) -> bool:
    return name not in generated.GENERATED or name in GENERATED_AS_STDIN


def _matrix() -> Iterator[Any]:
    for kind, cases in EXPECTED.items():
        for case in sorted(cases):
            for command in COMMANDS[kind]:
                for from_stdin in (False, True):
                    if from_stdin and not _readable_as_stdin(case):
                        continue
                    yield pytest.param(kind, case, command, from_stdin,
                                       id=f"{kind}/{case}/{command}{'/stdin' if from_stdin else ''}")


class Runner:
    """The client of tests/hostile/runner.py: one request, one answer."""

    def __init__(self) -> None:
        self.process = subprocess.Popen([sys.executable, "-m", "tests.hostile.runner"], cwd=ROOT,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def run(self, argv: list[str], stdin: Path | None = None) -> dict[str, Any]:
        assert self.process.stdin is not None and self.process.stdout is not None
        request = {"argv": argv, "stdin": None if stdin is None else str(stdin), "timeout": SECONDS}
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        answer: dict[str, Any] = json.loads(self.process.stdout.readline())
        return answer

    def close(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()
        self.process.wait(timeout=SECONDS)


@pytest.fixture(scope="module")
def runner() -> Iterator[Runner]:
    started = Runner()
    yield started
    started.close()


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hostile")
    return {name: generated.make(name, root) for name in generated.GENERATED}


def _path_of(kind: str, case: str, made: dict[str, Path]) -> Path:
    return made[case] if case in generated.GENERATED else generated.corpus_file(kind, case)


def test_the_expectations_cover_the_corpus_exactly() -> None:
    for kind in COMMANDS:
        on_disk = {p.name for p in (HOSTILE / kind).iterdir()}
        made_here = {name for name in generated.GENERATED if _kind_of_generated(name) == kind}
        assert set(EXPECTED[kind]) == on_disk | made_here, kind


def _naming_lines(text: str, shown: str) -> list[str]:
    return [line for line in text.splitlines() if shown in line]


@pytest.mark.parametrize(("kind", "case", "command", "from_stdin"), list(_matrix()))
def test_hostile_input(runner: Runner, made: dict[str, Path], kind: str, case: str, command: str,
                       from_stdin: bool) -> None:
    path = _path_of(kind, case, made)
    shown = STDIN if from_stdin else str(path)
    argv = COMMANDS[kind][command]("-" if from_stdin else str(path))
    result = runner.run(argv, path if from_stdin else None)
    code, out, err = result["code"], result["stdout"], result["stderr"]
    context = f"{argv}: exit {code}\nstdout: {out[-1500:]}\nstderr: {err[-1500:]}"
    assert not result["timed_out"], f"still running after {SECONDS} s: {context}"
    assert "Traceback" not in err and "Traceback" not in out, context
    assert result["peak_kib"] < PEAK_MIB * 1024, f"{result['peak_kib'] / 1024:.0f} MiB: {context}"
    expected = EXPECTED[kind][case]
    if isinstance(expected, Answered):
        assert code == expected.codes[command], context
        assert expected.output[command] in out, context
        # what stderr holds besides: lint's count, and warnings that name the input and its line
        for line in err.splitlines():
            assert line.endswith("warning(s)") or line.startswith(f"ipmasq {command}: warning: {shown}:"), context
        return
    words = expected.stdin_words if from_stdin and expected.stdin_words is not None else expected.words
    assert code == refused_code(kind, words), context
    if command == "lint" and code == 1:
        # lint reports what it read and refused as one finding on stdout, and what it could not read on stderr;
        # its count closes stderr either way
        assert err.splitlines()[-1].endswith("warning(s)"), context
        lines = _naming_lines(out + err, shown)
        line = expected.lint_line if expected.lint_line is not None else expected.line
    else:
        assert out == "", context
        lines = err.splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"ipmasq {command}: "), context
        line = expected.line
    # the line's own words are short; the input's name is as long as where the repository is cloned
    assert len(lines) == 1 and len(lines[0].replace(shown, "")) < 400, context
    assert words in lines[0], context
    if line is not None and not (from_stdin and expected.stdin_words is not None):
        assert f"{shown}:{line}:" in lines[0], context
    else:
        assert f"{shown}:" in lines[0] or f"{shown} " in lines[0], context


# --- a FIFO with a writer, as a shell's `<(...)` makes one: read as the file it stands for --------------------------

def _waiting_reader(inode: int) -> bool:
    """Whether another process holds the pipe `inode` open and sleeps: it waits for the pipe's data."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            if any(os.readlink(f"/proc/{pid}/fd/{fd}") == f"pipe:[{inode}]" for fd in os.listdir(f"/proc/{pid}/fd")):
                return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "S"
        except OSError:  # a process that ended meanwhile
            continue
    return False


@contextmanager
def _late_writer(data: bytes) -> Iterator[str]:
    """A pipe this process writes `data` to only once the command has opened it and waits for it, named as /proc
    gives it to others (a shell's `<(cmd)` is such a path): the runner's child opens it while the write end is held
    here, and finds nothing in it until it waits."""
    read_end, write_end = os.pipe()
    inode = os.fstat(read_end).st_ino
    failed: list[AssertionError] = []

    def write() -> None:
        try:
            eventually(lambda: _waiting_reader(inode), "the command waiting on the pipe")
        except AssertionError as exc:
            failed.append(exc)
        with os.fdopen(write_end, "wb") as pipe:
            pipe.write(data)

    writer = threading.Thread(target=write)
    writer.start()
    try:
        yield f"/proc/{os.getpid()}/fd/{read_end}"
    finally:
        writer.join()
        os.close(read_end)
    if failed:
        raise failed[0]


def test_a_dump_through_a_pipe_whose_writer_is_slow_is_read_whole(runner: Runner) -> None:
    with _late_writer(VALID_DUMP.read_bytes()) as path:
        from_pipe = runner.run(["check", "--from-dump", path])
    from_file = runner.run(["check", "--from-dump", str(VALID_DUMP)])
    assert (from_pipe["code"], from_pipe["stdout"]) == (from_file["code"], from_file["stdout"])
    assert "NOT OK" in from_pipe["stdout"] and from_pipe["stderr"] == "", from_pipe


def test_a_gzipped_flow_log_through_a_pipe_whose_writer_is_slow_is_read_whole(runner: Runner) -> None:
    record = (HOSTILE / "flowlogs" / "gcp-null-connection.jsonl").read_bytes().splitlines(keepends=True)[0]
    with _late_writer(gzip.compress(record * 3)) as path:
        result = runner.run(["audit", "--pod-range", POD_RANGE, path])
    assert result["code"] == 1 and result["stderr"] == "", result
    assert result["stdout"].startswith("3 flow records (0 without addresses skipped); 3 from pod addresses"), result
