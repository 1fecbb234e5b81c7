"""The real Runner: runs a program with subprocess, cancellable so that SIGTERM never waits on a tool."""

from __future__ import annotations

import codecs
import locale
import subprocess
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import IO, Any, TypeVar

from ipmasq.backends.base import Result
from ipmasq.errors import BackendError
from ipmasq.netfilter.lines import iter_lines_of_pieces

__all__ = ["SubprocessRunner"]

_POLL_SECONDS = 0.05
_PIECE = 1 << 16
T = TypeVar("T")


class SubprocessRunner:
    """`run(argv, stdin) -> Result`. A set `cancel` event kills the running program and raises BackendError."""

    def __init__(self, *, cancel: threading.Event | None = None, timeout: float = 60.0,
                 env: Mapping[str, str] | None = None) -> None:
        self._cancel = cancel
        self._timeout = timeout
        self._env = dict(env) if env is not None else None

    def __call__(self, argv: Sequence[str], stdin: str | None = None) -> Result:
        if stdin is not None:
            return self.stream(argv, (stdin,))
        return self._communicate(argv, self._start(argv, stdin=subprocess.DEVNULL, text=True))

    def stream(self, argv: Sequence[str], chunks: Iterable[str]) -> Result:
        """Like a call with stdin, the input written as `chunks` come (from a generator): a 100,000-rule restore is
        never one string in this process, let alone two (the text and its encoding). Written from a thread while
        this one reads the output, so neither side can fill a pipe and wait on the other (and a slow reader, like
        iptables-restore on 10,000 rules, is never left waiting for input that communicate() stopped writing after a
        timeout)."""
        proc = self._start(argv, stdin=subprocess.PIPE, text=True)
        stdin, proc.stdin = proc.stdin, None  # ours to write and close: communicate() must not touch it
        assert stdin is not None
        writer = threading.Thread(target=_write_all, args=(stdin, chunks), daemon=True)
        writer.start()
        try:
            return self._communicate(argv, proc)
        finally:
            writer.join()  # the program exited (or was killed): a blocked write has failed with a broken pipe

    def _start(self, argv: Sequence[str], *, stdin: int, text: bool) -> subprocess.Popen[Any]:
        try:
            return subprocess.Popen(list(argv), stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=text, env=self._env)
        except OSError as exc:
            raise BackendError(f"cannot run {argv[0]}: {exc.strerror}", argv=tuple(argv)) from None

    def _communicate(self, argv: Sequence[str], proc: subprocess.Popen[str]) -> Result:
        """Wait for the program's whole output (its input, if any, is written by the caller's thread), killing it on
        cancel or timeout."""
        done = threading.Event()
        cancelled = threading.Event()
        watcher = None
        if self._cancel is not None:  # the timeout is communicate()'s own here
            watcher = threading.Thread(target=self._watch, args=(proc, done, cancelled, None), daemon=True)
            watcher.start()
        try:
            out, err = proc.communicate(None, timeout=self._timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            raise _timed_out(argv, self._timeout) from None
        finally:
            done.set()
            if watcher is not None:
                watcher.join()
        if cancelled.is_set():
            raise _cancelled(argv)
        return Result(proc.returncode, out, err)

    def read_lines(self, argv: Sequence[str], consume: Callable[[Iterator[str]], T]) -> tuple[Result, T | None]:
        """Run a program with no input and hand its output to `consume` line by line (str.splitlines' lines) as it
        prints them: a 100,000-rule iptables-save is never one string here. (Result without stdout, what `consume`
        returned); when the program fails, what `consume` returned or raised is dropped (the failure says more)."""
        proc = self._start(argv, stdin=subprocess.DEVNULL, text=False)
        assert proc.stdout is not None and proc.stderr is not None
        stderr: list[bytes] = []
        drain = threading.Thread(target=_read_into, args=(proc.stderr, stderr), daemon=True)
        drain.start()
        done = threading.Event()
        cancelled = threading.Event()
        timed_out = threading.Event()
        watcher = threading.Thread(target=self._watch, args=(proc, done, cancelled, timed_out), daemon=True)
        watcher.start()
        value: T | None = None
        failure: BaseException | None = None
        try:
            value = consume(iter_lines_of_pieces(_decoded(proc.stdout)))
        except Exception as exc:  # kept until the exit status says whether the program or the reader was wrong
            failure = exc
        finally:
            while proc.stdout.read(_PIECE):  # the rest, unread, so that the program can finish
                pass
            proc.wait()
            done.set()
            watcher.join()
            drain.join()
        if cancelled.is_set():
            raise _cancelled(argv)
        if timed_out.is_set():
            raise _timed_out(argv, self._timeout)
        err = _decode_all(b"".join(stderr))
        result = Result(proc.returncode, "", err)
        if proc.returncode != 0:
            return result, None
        if failure is not None:
            raise failure
        return result, value

    def _watch(self, proc: subprocess.Popen[Any], done: threading.Event, cancelled: threading.Event,
               timed_out: threading.Event | None) -> None:
        """Kill the program on cancel, and when it outlives the timeout if `timed_out` is given (a reader of its
        output then sees the end of it)."""
        waited = 0.0
        while not done.wait(_POLL_SECONDS):
            waited += _POLL_SECONDS
            if self._cancel is not None and self._cancel.is_set():
                cancelled.set()
                proc.kill()
                return
            if timed_out is not None and waited >= self._timeout:
                timed_out.set()
                proc.kill()
                return


def _cancelled(argv: Sequence[str]) -> BackendError:
    return BackendError(f"{argv[0]} cancelled", argv=tuple(argv))


def _timed_out(argv: Sequence[str], timeout: float) -> BackendError:
    return BackendError(f"{argv[0]} timed out after {timeout:.0f}s", argv=tuple(argv))


def _write_all(stdin: IO[str], chunks: Iterable[str]) -> None:
    """Write every chunk, then close: the program sees the end of its input. A program that exits early (it
    rejected a line) breaks the pipe: the rest is dropped, its exit status and stderr tell what happened."""
    try:
        for chunk in chunks:
            stdin.write(chunk)
        stdin.close()
    except (BrokenPipeError, ValueError, OSError):
        pass


def _read_into(stream: IO[bytes], into: list[bytes]) -> None:
    into.append(stream.read())


def _decoded(stream: IO[bytes]) -> Iterator[str]:
    """The stream's text, piece by piece, decoded as text=True decodes a program's output (the locale's encoding)."""
    decoder = codecs.getincrementaldecoder(locale.getpreferredencoding(False))()
    while piece := stream.read(_PIECE):
        yield decoder.decode(piece)
    yield decoder.decode(b"", final=True)


def _decode_all(data: bytes) -> str:
    text = data.decode(locale.getpreferredencoding(False))
    return text.replace("\r\n", "\n").replace("\r", "\n")  # as text=True's communicate() gives it
