"""The real subprocess Runner: whole input delivered to a slow reader, cancellation and timeouts as BackendError."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest

from ipmasq.backends.runner import SubprocessRunner
from ipmasq.errors import BackendError
from tests.unit.backends.sleepers import cancel_once_asleep, killed_in_its_sleep, sleeper

# reads its input line by line, slowly at first (like iptables-restore doing work per rule), then counts it
SLOW_READER = ("import sys, time\n"
               "n = 0\n"
               "for line in sys.stdin:\n"
               "    n += 1\n"
               "    if n < 50:\n"
               "        time.sleep(0.005)\n"
               "print(n)\n")


def test_a_large_input_reaches_a_slow_reader_whole() -> None:
    lines = 200_000  # far more than a pipe buffer, and still arriving after the first reads took 250 ms
    payload = "".join(f"-A CHAIN -d 10.{i % 256}.0.0/16 -j RETURN\n" for i in range(lines))
    result = SubprocessRunner(cancel=threading.Event(), timeout=30)([sys.executable, "-c", SLOW_READER], payload)
    assert result.returncode == 0 and result.stdout.strip() == str(lines)


def test_cancel_kills_the_program_promptly(tmp_path: Path) -> None:
    cancel = threading.Event()
    cancel_once_asleep(tmp_path / "marks", cancel)
    with pytest.raises(BackendError, match="cancelled"):
        SubprocessRunner(cancel=cancel)([sys.executable, "-c", sleeper(tmp_path / "marks")])
    assert killed_in_its_sleep(tmp_path / "marks")


def test_timeout_and_missing_program() -> None:
    with pytest.raises(BackendError, match="timed out after 1s"):
        SubprocessRunner(timeout=1)([sys.executable, "-c", "import time; time.sleep(30)"])
    with pytest.raises(BackendError, match="cannot run /nonexistent/tool"):
        SubprocessRunner()(["/nonexistent/tool"])
    assert SubprocessRunner()([sys.executable, "-c", "import sys; sys.exit(3)"]).returncode == 3
