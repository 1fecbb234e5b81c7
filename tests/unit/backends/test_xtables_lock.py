"""The xtables lock watch: "quiet" only when the same lock file was watched since the last look and nobody opened
it; a watch set up now, a file replaced or gone, any open or close is "not quiet" (read the table in full)."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

import pytest

from ipmasq.backends.xtables_lock import DEFAULT_XTABLES_LOCK, XtablesLockWatch, xtables_lock_path


def test_quiet_only_when_nobody_opened_the_watched_lock_file(tmp_path: Path) -> None:
    lock = tmp_path / "xtables.lock"
    lock.touch()
    watch = XtablesLockWatch(str(lock))
    try:
        assert not watch.quiet()  # watched from now on: what happened before is unknown
        assert watch.quiet() and watch.quiet()
        with lock.open() as held:  # what iptables does: open, flock, write the table, close
            fcntl.flock(held, fcntl.LOCK_EX)
            assert not watch.quiet()  # the open
            assert watch.quiet()  # still held: the writer has not finished, nothing new happened
        assert not watch.quiet()  # the close: a full read from now on sees what the writer wrote
        assert watch.quiet()
        lock.unlink()
        assert not watch.quiet() and not watch.quiet()  # no file: nothing to watch, always unknown
        lock.touch()
        assert not watch.quiet()  # a new file is watched from now on
        assert watch.quiet()
        replacement = tmp_path / "new.lock"
        replacement.touch()
        os.replace(replacement, lock)  # another inode at the path: the old watch says nothing about it
        assert not watch.quiet()
        assert watch.quiet()
    finally:
        watch.close()


def test_a_closed_or_unwatchable_lock_is_never_quiet(tmp_path: Path) -> None:
    watch = XtablesLockWatch(str(tmp_path / "missing" / "xtables.lock"))
    assert not watch.quiet() and not watch.quiet()
    watch.close()
    lock = tmp_path / "xtables.lock"
    lock.touch()
    closed = XtablesLockWatch(str(lock))
    closed.close()  # no inotify descriptor: nothing can be watched
    assert not closed.quiet() and not closed.quiet()


def test_the_lock_path_is_iptables_own(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("XTABLES_LOCKFILE", raising=False)
    assert xtables_lock_path() == DEFAULT_XTABLES_LOCK == "/run/xtables.lock"
    monkeypatch.setenv("XTABLES_LOCKFILE", "/var/run/other.lock")
    assert xtables_lock_path() == "/var/run/other.lock"
