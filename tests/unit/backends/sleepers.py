"""A program that sleeps 30 s and marks in a file that it started and that it woke: a runner that kills it (cancel,
timeout) leaves the first mark and never the second, whatever the time each step took on a busy machine."""

from __future__ import annotations

import os
import threading
from pathlib import Path

from tests.eventually import eventually


def sleeper(marks: Path) -> str:
    """Python source: write 'asleep <pid>' to `marks`, sleep 30 s, then append 'awake'."""
    return (f"import os, time\n"
            f"with open({str(marks)!r}, 'w') as f: f.write(f'asleep {{os.getpid()}}\\n')\n"
            f"time.sleep(30)\n"
            f"with open({str(marks)!r}, 'a') as f: f.write('awake\\n')\n")


def cancel_once_asleep(marks: Path, cancel: threading.Event, timeout: float = 30.0) -> threading.Thread:
    """Set `cancel` once the sleeper has marked that it sleeps (a condition wait: `timeout` bounds a hang only)."""
    def watch() -> None:
        try:
            eventually(marks.exists, "the sleeper's first mark", timeout=timeout)
        finally:
            cancel.set()  # asleep, or never: a test that waits on the runner must not hang either way
    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def killed_in_its_sleep(marks: Path) -> bool:
    """Whether the sleeper is gone (exited and reaped) without having woken: it was killed before its sleep ended.
    A sleeper killed before it could write its first mark is gone too, with nothing to show."""
    if not marks.exists():
        return True
    lines = marks.read_text().splitlines()
    if not lines:
        return True  # killed between opening its file and writing to it
    if len(lines) != 1 or not lines[0].startswith("asleep "):
        return False  # it woke: nothing cut its sleep short
    try:
        os.kill(int(lines[0].split()[1]), 0)
    except ProcessLookupError:
        return True
    return False  # still there: the runner returned without ending it
