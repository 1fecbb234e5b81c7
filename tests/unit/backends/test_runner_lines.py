"""Lines as str.splitlines gives them, from pieces of text as a program prints them, and the runner reading a
program's output line by line: what it returns, its failures and cancellation."""

from __future__ import annotations

import random
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from ipmasq.backends.runner import SubprocessRunner
from ipmasq.errors import BackendError
from ipmasq.netfilter.lines import iter_lines, iter_lines_of_pieces
from tests.unit.backends.sleepers import cancel_once_asleep, killed_in_its_sleep, sleeper

BREAKS = "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"


def test_iter_lines_is_splitlines_whatever_the_pieces() -> None:
    pick = random.Random(7)
    for _ in range(20_000):
        text = "".join(pick.choice("ab " + BREAKS + "\r\n") for _ in range(pick.randrange(0, 14)))
        cuts = sorted(pick.sample(range(len(text) + 1), pick.randrange(0, min(4, len(text) + 1))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        assert list(iter_lines(text)) == text.splitlines(), repr(text)
        assert list(iter_lines_of_pieces(pieces)) == text.splitlines(), repr(pieces)


def count_lines(lines: Iterator[str]) -> tuple[int, str]:
    seen = list(lines)
    return len(seen), seen[-1] if seen else ""


def test_read_lines_hands_over_every_line() -> None:
    script = "import sys\nfor i in range(300_000): sys.stdout.write(f'-A C -d 10.{i % 250}.0.0/16 -j RETURN\\r\\n')"
    result, value = SubprocessRunner(timeout=30).read_lines([sys.executable, "-c", script], count_lines)
    assert result.returncode == 0
    assert value == (300_000, "-A C -d 10.249.0.0/16 -j RETURN")


def test_a_failing_program_is_its_failure_not_the_readers() -> None:
    def refuse(lines: Iterator[str]) -> int:
        next(lines)
        raise ValueError("the reader choked on a partial dump")

    script = "import sys; print('half a dump'); sys.stderr.write('table nat: no such table\\r\\n'); sys.exit(3)"
    result, value = SubprocessRunner().read_lines([sys.executable, "-c", script], refuse)
    assert (result.returncode, value, result.stderr) == (3, None, "table nat: no such table\n")
    with pytest.raises(ValueError, match="choked"):  # a program that succeeded: the reader's error is the error
        SubprocessRunner().read_lines([sys.executable, "-c", "print('x')"], refuse)


def test_a_reader_that_stops_early_does_not_hang_the_program() -> None:
    script = "import sys\nfor i in range(500_000): print(i)"
    result, value = SubprocessRunner(timeout=30).read_lines([sys.executable, "-c", script], next)
    assert result.returncode == 0 and value == "0"


def test_cancel_timeout_and_missing_program(tmp_path: Path) -> None:
    cancel = threading.Event()
    cancel_once_asleep(tmp_path / "a", cancel)
    with pytest.raises(BackendError, match="cancelled"):
        SubprocessRunner(cancel=cancel).read_lines([sys.executable, "-c", sleeper(tmp_path / "a")], count_lines)
    assert killed_in_its_sleep(tmp_path / "a")
    with pytest.raises(BackendError, match=r"timed out after 0s"):
        SubprocessRunner(timeout=0.3).read_lines([sys.executable, "-c", sleeper(tmp_path / "b")], count_lines)
    assert killed_in_its_sleep(tmp_path / "b")
    with pytest.raises(BackendError, match="cannot run"):
        SubprocessRunner().read_lines(["/nonexistent/program"], count_lines)
