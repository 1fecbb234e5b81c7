"""Has any program that writes iptables-legacy rules run since I last looked? Answered by watching the xtables lock.

x_tables keeps no change counter, so knowing that a legacy table did not change means copying it whole from the
kernel (a large part of an idle resync's cost: docs/measurements.md). But every program that writes
x_tables the supported way takes the xtables lock first: iptables, ip6tables, iptables-restore and
ip6tables-restore (legacy) open the lock file (XTABLES_LOCKFILE, default /run/xtables.lock), flock it, replace the
table and close it; kube-proxy, kubelet, Calico and the agent itself go through those tools, and the DaemonSet
mounts the host's lock file so they all share it. The lock exists because a replace that does not hold it can undo
another program's concurrent write (x_tables swaps the whole table), so the writers that matter take it.

inotify reports each open and close of that file. A writer's close comes after its write, so a full read started
after its close was seen sees its write: "no event since the last look" means "no lock-taking writer since". The
reader (ipmasq.backends.generation) still compares the table's GET_INFO (hooks, entry count, size) on every pass and
still reads in full every few passes (a writer that skips the lock is seen then, not never). Read-only programs that
open the lock (iptables -L) only cost a full read. When the file is missing, cannot be watched, or was replaced by
another file, the answer is "unknown": read in full, as without this watch.
"""

from __future__ import annotations

import os

from ipmasq.inotify import (
    IN_ATTRIB,
    IN_CLOSE_NOWRITE,
    IN_CLOSE_WRITE,
    IN_DELETE_SELF,
    IN_MODIFY,
    IN_MOVE_SELF,
    IN_OPEN,
    Inotify,
)

__all__ = ["DEFAULT_XTABLES_LOCK", "XtablesLockWatch", "xtables_lock_path"]

DEFAULT_XTABLES_LOCK = "/run/xtables.lock"  # iptables' own default (XT_LOCK_NAME)
_MASK = IN_OPEN | IN_CLOSE_WRITE | IN_CLOSE_NOWRITE | IN_MODIFY | IN_ATTRIB | IN_DELETE_SELF | IN_MOVE_SELF


def xtables_lock_path() -> str:
    """The lock file iptables in this process's environment would take."""
    return os.environ.get("XTABLES_LOCKFILE") or DEFAULT_XTABLES_LOCK


class XtablesLockWatch:
    """`quiet()`: True only when the lock file was watched since the last call and nobody opened it meanwhile."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._inotify = Inotify()
        self._watched: tuple[int, int, int] | None = None  # (watch descriptor, st_dev, st_ino) of the watched file

    def quiet(self) -> bool:
        """Drain the events; True when none arrived and the watched file is still the one at the path. A watch set
        up (or set up again) now answers False: what happened before it is unknown."""
        events = self._inotify.drain()
        try:
            status = os.stat(self.path)
        except OSError:
            self._forget()
            return False
        if self._watched is not None and (status.st_dev, status.st_ino) == self._watched[1:]:
            return not events
        self._forget()
        wd = self._inotify.add_watch(self.path, _MASK)
        if wd is not None:
            self._watched = (wd, status.st_dev, status.st_ino)
        return False

    def _forget(self) -> None:
        if self._watched is not None:
            self._inotify.remove_watch(self._watched[0])
            self._watched = None

    def close(self) -> None:
        self._inotify.close()
