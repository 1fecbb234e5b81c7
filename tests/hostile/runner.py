"""Runs ipmasq's command line many times, each run in a process of its own, without paying the imports each time.

`python -m tests.hostile.runner` imports the CLI once, then, for each request read from its standard input (a JSON
line: argv, the file to give as standard input or null, a timeout in seconds), forks a child that runs exactly
what `python -m ipmasq ARGV` runs (`raise SystemExit(main())`) with its own standard input, output and error, and
answers one JSON line: exit code (or the signal that ended it), what it printed, its peak RSS (os.wait4's ru_maxrss),
its wall time, and whether it ran past the timeout (then it was killed). A fork costs milliseconds where a fresh
interpreter costs ~0.2 s of imports: hundreds of hostile cases stay fast on a busy machine.

The child's ru_maxrss includes the pages it shares with this small server (its imports, ~40 MiB), never those of
the test process that started the server.
"""

from __future__ import annotations

import io
import json
import os
import signal
import sys
import tempfile
import time
import traceback
from typing import Any

# the CLI, and what its commands import lazily, imported here once so that no child pays for it
import ipmasq.audit
import ipmasq.cli
import ipmasq.commands.audit
import ipmasq.commands.check
import ipmasq.commands.diff
import ipmasq.commands.explain
import ipmasq.commands.lint
import ipmasq.commands.render
import ipmasq.commands.trace
import ipmasq.diagnose.sources
from ipmasq.lab.wait import until

OUTPUT_KEPT = 1 << 20  # what a reply carries of each stream: enough to see a runaway, never all of one


def _child(argv: list[str], stdin_path: str | None, out_fd: int, err_fd: int) -> None:
    """In the forked child: the streams of a fresh `python -m ipmasq`, then main(), then _exit (no cleanup of the
    server's state)."""
    try:
        in_fd = os.open(stdin_path if stdin_path is not None else os.devnull, os.O_RDONLY)
        os.dup2(in_fd, 0)
        os.dup2(out_fd, 1)
        os.dup2(err_fd, 2)
        encoding, errors = sys.stdout.encoding, sys.stdout.errors
        sys.stdin = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)), encoding=encoding,
                                     errors=sys.stdin.errors)
        sys.stdout = io.TextIOWrapper(io.BufferedWriter(io.FileIO(1, "w", closefd=False)), encoding=encoding,
                                      errors=errors, line_buffering=False)
        sys.stderr = io.TextIOWrapper(io.BufferedWriter(io.FileIO(2, "w", closefd=False)), encoding=encoding,
                                      errors="backslashreplace", line_buffering=True)
        sys.argv = ["ipmasq", *argv]
        try:
            code: Any = ipmasq.cli.main(argv)
        except SystemExit as exc:
            code = exc.code
        if code is None:
            code = 0
        elif not isinstance(code, int):  # SystemExit("message"): printed, exit 1, as the interpreter does
            print(code, file=sys.stderr)
            code = 1
    except BaseException:  # what the interpreter would print for an uncaught exception, and its exit code
        traceback.print_exc()
        code = 1
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def _read(fd: int) -> str:
    os.lseek(fd, 0, os.SEEK_SET)
    return os.read(fd, OUTPUT_KEPT).decode("utf-8", "backslashreplace")


def run_one(argv: list[str], stdin_path: str | None, timeout: float) -> dict[str, Any]:
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        started = time.monotonic()
        pid = os.fork()
        if pid == 0:
            _child(argv, stdin_path, out.fileno(), err.fileno())
        timed_out = False

        def ended() -> tuple[int, int, Any] | None:
            reaped = os.wait4(pid, os.WNOHANG)
            return reaped if reaped[0] else None

        try:
            _, status, usage = until(ended, "the child's exit", timeout=timeout, interval=0.002, error=TimeoutError)
        except TimeoutError:
            timed_out = True
            os.kill(pid, signal.SIGKILL)
            _, status, usage = os.wait4(pid, 0)
        seconds = time.monotonic() - started
        code = os.waitstatus_to_exitcode(status)
        return {"code": code, "stdout": _read(out.fileno()), "stderr": _read(err.fileno()),
                "peak_kib": usage.ru_maxrss, "seconds": seconds, "timed_out": timed_out}


def serve() -> None:
    requests = io.TextIOWrapper(io.FileIO(os.dup(0), "r"), encoding="utf-8")
    replies = io.TextIOWrapper(io.FileIO(os.dup(1), "w"), encoding="utf-8", line_buffering=True)
    null = os.open(os.devnull, os.O_RDWR)  # the protocol's pipes stay out of the children's fds 0 and 1
    os.dup2(null, 0)
    os.dup2(null, 1)
    for line in requests:
        request = json.loads(line)
        replies.write(json.dumps(run_one(request["argv"], request["stdin"], request["timeout"])) + "\n")


if __name__ == "__main__":
    serve()
