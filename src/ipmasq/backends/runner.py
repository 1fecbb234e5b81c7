"""The real Runner: runs a program with subprocess, cancellable so that SIGTERM never waits on a tool."""

from __future__ import annotations

import subprocess
import threading
from collections.abc import Mapping, Sequence

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
        waited = 0.0
        pending = stdin
        while True:
            try:
                out, err = proc.communicate(pending, timeout=_POLL_SECONDS)
                return Result(proc.returncode, out, err)
            except subprocess.TimeoutExpired:
                pending = None  # communicate already sent stdin; a retry must not send it again
                waited += _POLL_SECONDS
                if (self._cancel is not None and self._cancel.is_set()) or waited >= self._timeout:
                    proc.kill()
                    proc.communicate()
                    why = "cancelled" if waited < self._timeout else f"timed out after {self._timeout:.0f}s"
                    raise BackendError(f"{argv[0]} {why}", argv=tuple(argv)) from None
