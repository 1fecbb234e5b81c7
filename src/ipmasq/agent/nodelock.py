"""One writer per node: an exclusive flock on a lock file, held for the agent's whole life.

During a rolling update the old agent and the new one run side by side for a while. Without a lock both write:
the old one (another backend, another config) re-creates what the new one removed, and exits leaving it. With it,
the new agent waits, not ready and alive, until the old one exits; the kernel releases a flock when its holder's
last descriptor closes, on a clean exit and on SIGKILL alike, so a crashed agent never keeps the node locked.

The holder writes its pid into the file so the waiter can say whom it waits for. The default lock file is one per
network namespace (its nsfs inode in the name): the node's netfilter is per namespace, so agents of two throwaway
test namespaces never wait on each other, while two agent pods with hostNetwork on one node share one file.
"""

from __future__ import annotations

import fcntl
import os

from ipmasq.errors import IpmasqError

__all__ = ["DEFAULT_LOCK_DIRECTORY", "NodeLock", "default_lock_path"]

DEFAULT_LOCK_DIRECTORY = "/run/ip-masq-agent"


def default_lock_path(directory: str = DEFAULT_LOCK_DIRECTORY) -> str:
    """`DIR/agent.lock` in the host's namespace view, `DIR/agent-netns-INODE.lock` naming this network namespace."""
    try:
        inode = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        return os.path.join(directory, "agent.lock")  # no /proc: one lock for the machine
    return os.path.join(directory, f"agent-netns-{inode}.lock")


class NodeLock:
    """`try_acquire()` once per poll; `holder()` names who has it. Released when the process exits."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd: int | None = None
        self._held = False

    def _open(self) -> int:
        if self._fd is None:
            try:
                os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
                self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            except OSError as exc:
                raise IpmasqError(f"cannot open the node lock {self.path} (--lock-file): "
                                  f"{exc.strerror or exc}") from None
        return self._fd

    @property
    def held(self) -> bool:
        return self._held

    def try_acquire(self) -> bool:
        """Take the lock without waiting; True when this process now holds it (and wrote its pid there)."""
        if self._held:
            return True
        fd = self._open()
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        except OSError as exc:
            raise IpmasqError(f"cannot lock {self.path} (--lock-file): {exc.strerror or exc}") from None
        self._held = True
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return True

    def holder(self) -> int | None:
        """The pid the current holder wrote (None: unknown, e.g. it has not written it yet)."""
        try:
            text = os.pread(self._open(), 32, 0).decode(errors="replace").strip()
        except OSError:
            return None
        return int(text) if text.isdigit() else None

    def close(self) -> None:
        """Release (the kernel does the same when the process exits, however it exits)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
            self._held = False
