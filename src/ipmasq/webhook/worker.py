"""The decision process: where the webhook decides the reviews that take real work, apart from its event loop.

Why a process and not a thread: a decision is pure Python (the YAML parse, validation, lint), and a thread running
one holds the GIL for 5 ms at a time (sys.getswitchinterval) whenever the event loop's thread gives it up at a
socket read or write. Two reviews of 1,600 rules decided in threads took the event loop's turn so often that 14 of
200 ordinary reviews beside them waited over 1 s, for 0.4 s of work each. In a process of its own the same work
takes the other core, and the event loop's thread keeps its own.

One process, one decision at a time: its memory is what one decision needs (a body is at most MAX_BODY_BYTES, with
the JSON value count checked before json.loads), on top of the interpreter's ~30 MiB, and its address space is
bounded (WORKER_ADDRESS_BYTES) so that a decision that would need more fails alone (a 500). It is a fresh
interpreter (`python -m ipmasq.webhook.worker`), inheriting neither the server's threads nor their locks, and
started again when it ended. Not multiprocessing's: its spawn adds a resource tracker process (12 MiB) and runs
the parent's __main__ again.

A decision abandoned in the server (its connection gone, its deadline passed) is told to the process through 8 bytes
of shared memory (a memfd both map): the number of the decision abandoned. The decision's work budget reads it at
every step, as it checks the threading.Event in a thread, and one finished or not yet begun is never confused with
it.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import pickle
import resource
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection, Pipe
from typing import Any

from ipmasq.errors import DecisionFault

__all__ = ["ABANDONED_GRACE_SECONDS", "WORKER_ADDRESS_BYTES", "DecisionWorker"]

# The decision process's address space: the interpreter, its modules and the largest decision (two 14 MB reviews of
# 700,000 CIDRs peaked at 123 MiB resident in one process) with room to spare; past it a decision fails alone.
WORKER_ADDRESS_BYTES = 1 << 30
# How long the process may take to start and import what deciding needs (0.2-0.5 s of a core; minutes only on a
# machine far past its capacity) before it is taken for broken: ended, and the decision is a 500.
START_SECONDS = 60.0
# After an abandoned decision, how long the process may take to reach its next budget step (a YAML parse is not
# interruptible: 1 MiB of config, 2-3 s of a loaded core) before it is ended and started again.
ABANDONED_GRACE_SECONDS = 10.0
_NUMBER = 8  # bytes of the shared decision number

Decide = Callable[[bytearray, float, Any], Any]


class _Told:
    """What the budget checks (is_set) in the process: whether decision `number` was abandoned."""

    __slots__ = ("_number", "_shared")

    def __init__(self, shared: mmap.mmap, number: int) -> None:
        self._shared = shared
        self._number = number

    def is_set(self) -> bool:
        return int.from_bytes(self._shared[:_NUMBER], "little") == self._number


def _serve(conn: Connection, shared: mmap.mmap) -> None:
    """The process's loop: its decide function first, then (number, started) and a body in, ("answer", value) or
    ("fault", text) out, until the server's end of the pipe closes."""
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_AS, (WORKER_ADDRESS_BYTES, WORKER_ADDRESS_BYTES))
    try:
        decide: Decide = conn.recv()  # imports what deciding needs
        conn.send(("ready", None))
    except (EOFError, OSError):
        return
    while True:
        try:
            number, started = conn.recv()
            body = bytearray(conn.recv_bytes())
        except (EOFError, OSError):
            return
        try:
            reply: tuple[str, object] = ("answer", decide(body, started, _Told(shared, number)))
        except MemoryError:
            reply = ("fault", "MemoryError: more than the decision process's address space")
        except Exception as exc:
            reply = ("fault", repr(exc))
        del body
        try:
            conn.send(reply)
        except (OSError, ValueError):
            return


class DecisionWorker:
    """The server's handle on the decision process: started by start() or on first use, again after it ended.
    decide() blocks its calling thread, one decision at a time (the server calls it from a thread of its own)."""

    def __init__(self, decide: Decide) -> None:
        self._decide = pickle.dumps(decide)  # now: a respond that cannot be sent fails at the server's start
        self._memfd = os.memfd_create("ipmasq-webhook-abandoned", os.MFD_CLOEXEC)
        os.ftruncate(self._memfd, _NUMBER)
        self._shared = mmap.mmap(self._memfd, _NUMBER)
        self._process: subprocess.Popen[bytes] | None = None
        self._conn: Connection | None = None
        self._numbers = 0
        self._current: tuple[int, threading.Event | None] = (0, None)  # the decision under way, and its event
        self._lock = threading.Lock()

    def start(self) -> None:
        """Started ahead of the first decision, and returns once it can decide (an interpreter's start and imports:
        0.2-0.5 s of a core); raises DecisionFault."""
        with self._lock:
            self._started()

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def decide(self, body: bytearray, started: float, abandoned: threading.Event) -> object:
        """The decision's value as `decide` returned it in the process, None when abandoned; raises
        DecisionFault."""
        with self._lock:
            if abandoned.is_set():
                return None  # its connection went while it waited for its turn: never begun
            self._numbers += 1
            number = self._numbers
            self._current = (number, abandoned)
            try:
                conn = self._started()
                conn.send((number, started))
                conn.send_bytes(body)
                waited = 0.0
                while not conn.poll(1.0):
                    # bounded by the decision's budget and its body's size; once abandoned, by its next step
                    if abandoned.is_set():
                        self.abandon(abandoned)
                        waited += 1.0
                        if waited > ABANDONED_GRACE_SECONDS:
                            self._end()
                            return None
                kind, value = conn.recv()
            except (EOFError, OSError) as exc:
                self._end()
                raise DecisionFault(f"the decision process ended: {type(exc).__name__}") from None
            finally:
                self._current = (0, None)
            if kind == "fault":
                raise DecisionFault(str(value))
            return value

    def abandon(self, abandoned: threading.Event) -> None:
        """The decision of `abandoned` stops at its next budget step, if it is the one under way (one begun later is
        left alone; one not begun sees `abandoned` itself). From any thread."""
        number, event = self._current
        if event is abandoned:
            self._shared[:_NUMBER] = number.to_bytes(_NUMBER, "little")

    def close(self) -> None:
        with self._lock:
            self._end()

    def _started(self) -> Connection:
        if self._process is not None and self._process.poll() is None and self._conn is not None:
            return self._conn
        self._end()
        ours, theirs = Pipe()
        try:
            # the same modules as the server's: its sys.path, whatever put them there (an install, PYTHONPATH)
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
            self._process = subprocess.Popen(
                [sys.executable, "-m", "ipmasq.webhook.worker", str(theirs.fileno()), str(self._memfd)],
                pass_fds=(theirs.fileno(), self._memfd), stdin=subprocess.DEVNULL, env=env)
        finally:
            theirs.close()
        self._conn = ours
        ours.send_bytes(self._decide)
        if not ours.poll(START_SECONDS):  # EOF (it could not start) is readable: recv raises it
            self._end()
            raise DecisionFault(f"the decision process did not start within {START_SECONDS:g} s")
        try:
            ours.recv()  # ("ready", None)
        except (EOFError, OSError):
            self._end()
            raise DecisionFault("the decision process ended as it started (see its error above)") from None
        return ours

    def _end(self) -> None:
        process, conn = self._process, self._conn
        self._process = self._conn = None
        if conn is not None:
            conn.close()
        if process is not None:
            process.kill()
            process.wait(5)


def main(argv: list[str]) -> int:
    # the server ends this process (or its pipe's end does): a Ctrl-C meant for the server is not a traceback here
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    conn = Connection(int(argv[0]))
    memfd = int(argv[1])
    shared = mmap.mmap(memfd, _NUMBER)
    os.close(memfd)
    _serve(conn, shared)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
