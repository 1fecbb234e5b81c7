"""The real Runner: runs a program with subprocess, cancellable so that SIGTERM never waits on a tool."""

from __future__ import annotations

import subprocess
import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import IO

from ipmasq.backends.base import Result
from ipmasq.errors import BackendError

__all__ = ["SubprocessRunner"]

_POLL_SECONDS = 0.05


class SubprocessRunner:
    """`run(argv, stdin) -> Result`. A set `cancel` event kills the running program and raises BackendError."""

    def __init__(self, *, cancel: threading.Event | None = None, timeout: float = 60.0,
                 env: Mapping[str, str] | None = None) -> None:
        self._cancel = cancel
        self._timeout = timeout
        self._env = dict(env) if env is not None else None

    def __call__(self, argv: Sequence[str], stdin: str | None = None) -> Result:
        try:
            proc = subprocess.Popen(list(argv), stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=self._env)
        except OSError as exc:
            raise BackendError(f"cannot run {argv[0]}: {exc.strerror}", argv=tuple(argv)) from None
        done = threading.Event()
        cancelled = threading.Event()
        watcher = None
        if self._cancel is not None:
            watcher = threading.Thread(target=self._watch, args=(proc, done, cancelled), daemon=True)
            watcher.start()
        # One communicate() call with the whole input: a retried communicate(None) after a timeout stops writing
        # stdin (CPython registers stdin only when input is passed), which stalls a tool that reads slowly, like
        # iptables-restore on 10,000 rules. Cancellation is therefore watched from a thread.
        try:
            out, err = proc.communicate(stdin, timeout=self._timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            raise BackendError(f"{argv[0]} timed out after {self._timeout:.0f}s", argv=tuple(argv)) from None
        finally:
            done.set()
            if watcher is not None:
                watcher.join()
        if cancelled.is_set():
            raise BackendError(f"{argv[0]} cancelled", argv=tuple(argv))
        return Result(proc.returncode, out, err)

    def stream(self, argv: Sequence[str], chunks: Iterable[str]) -> Result:
        """Like a call with stdin, the input written as `chunks` come (from a generator): a 100,000-rule restore is
        never one string in this process, let alone two (the text and its encoding). Written from a thread while
        this one reads the output, so neither side can fill a pipe and wait on the other."""
        try:
            proc = subprocess.Popen(list(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True, env=self._env)
        except OSError as exc:
            raise BackendError(f"cannot run {argv[0]}: {exc.strerror}", argv=tuple(argv)) from None
        stdin, proc.stdin = proc.stdin, None  # ours to write and close: communicate() must not touch it
        assert stdin is not None
        writer = threading.Thread(target=_write_all, args=(stdin, chunks), daemon=True)
        writer.start()
        done = threading.Event()
        cancelled = threading.Event()
        watcher = None
        if self._cancel is not None:
            watcher = threading.Thread(target=self._watch, args=(proc, done, cancelled), daemon=True)
            watcher.start()
        try:
            out, err = proc.communicate(None, timeout=self._timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            raise BackendError(f"{argv[0]} timed out after {self._timeout:.0f}s", argv=tuple(argv)) from None
        finally:
            done.set()
            if watcher is not None:
                watcher.join()
            writer.join()  # the program exited (or was killed): a blocked write has failed with a broken pipe
        if cancelled.is_set():
            raise BackendError(f"{argv[0]} cancelled", argv=tuple(argv))
        return Result(proc.returncode, out, err)

    def _watch(self, proc: subprocess.Popen[str], done: threading.Event, cancelled: threading.Event) -> None:
        assert self._cancel is not None
        while not done.wait(_POLL_SECONDS):
            if self._cancel.is_set():
                cancelled.set()
                proc.kill()
                return


def _write_all(stdin: IO[str], chunks: Iterable[str]) -> None:
    """Write every chunk, then close: the program sees the end of its input. A program that exits early (it
    rejected a line) breaks the pipe: the rest is dropped, its exit status and stderr tell what happened."""
    try:
        for chunk in chunks:
            stdin.write(chunk)
        stdin.close()
    except (BrokenPipeError, ValueError, OSError):
        pass
