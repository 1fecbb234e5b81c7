"""The agent's loop: wait for a trigger, re-read the config, reconcile; never exit on a bad config or a failing tool.

Triggers: a config change (ConfigWatcher), the resync timer (the last good config's resyncInterval, for drift
repair), SIGHUP (`resync_now`), and the retry timer after a backend error (exponential backoff). `stop` (set by
SIGTERM/SIGINT) ends the loop at once and leaves the rules in place: traffic keeps flowing during an upgrade.
Logs: one line per event, nothing per idle tick.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from ipmasq.agent.reconcile import ConfigReport, PassReport, Reconciler, SyncResult
from ipmasq.agent.watch import ConfigWatcher
from ipmasq.config.source import ConfigInput, read_config_input
from ipmasq.errors import ConfigError

__all__ = ["Agent", "LoopObserver", "LoopSettings", "Wakeup"]


@dataclass(frozen=True, slots=True)
class LoopSettings:
    config_path: str
    use_inotify: bool = True
    quiet_seconds: float = 0.005  # coalesce the handful of events one kubelet update makes
    backoff_initial: float = 0.1
    backoff_max: float = 5.0


class Wakeup:
    """A self-pipe: signal handlers (and tests) set a flag and wake the loop's select at once."""

    def __init__(self) -> None:
        self.read_fd, self.write_fd = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.stop = threading.Event()
        self.resync = threading.Event()

    def request_stop(self) -> None:
        self.stop.set()
        self._poke()

    def request_resync(self) -> None:
        self.resync.set()
        self._poke()

    def _poke(self) -> None:
        with contextlib.suppress(BlockingIOError):  # full pipe: the loop is already being woken
            os.write(self.write_fd, b"x")

    def drain(self) -> None:
        try:
            while os.read(self.read_fd, 4096):
                pass
        except BlockingIOError:
            pass

    def close(self) -> None:
        os.close(self.read_fd)
        os.close(self.write_fd)


class LoopObserver(Protocol):
    """Told what the loop does (ipmasq.agent.metrics.AgentStatus: metrics, liveness, readiness); must not block.

    It gets the Reconciler's reports, values it may keep, and never the Reconciler: it can only read what happened.
    """

    def heartbeat(self) -> None: ...

    def observed(self, report: ConfigReport) -> None: ...

    def reconciled(self, report: PassReport, seconds: float) -> None: ...


class _Unobserved:
    def heartbeat(self) -> None:
        pass

    def observed(self, report: ConfigReport) -> None:
        pass

    def reconciled(self, report: PassReport, seconds: float) -> None:
        pass


def _read(path: str) -> ConfigInput | ConfigError:
    try:
        return read_config_input(path, missing_ok=True)
    except ConfigError as exc:
        return exc


class Agent:
    def __init__(self, reconciler: Reconciler, settings: LoopSettings, *, log: logging.Logger,
                 clock: Callable[[], float] = time.monotonic, observer: LoopObserver | None = None) -> None:
        self.reconciler = reconciler
        self.observer: LoopObserver = observer if observer is not None else _Unobserved()
        self.settings = settings
        self.log = log
        self.clock = clock

    def once(self) -> int:
        """One reconcile: 0 when the kernel now matches a good config, 1 otherwise."""
        self.reconciler.observe(_read(self.settings.config_path))
        report = self.reconciler.reconcile()
        return 0 if report.readiness.ready else 1

    def run(self, wakeup: Wakeup) -> None:
        watcher = ConfigWatcher(self.settings.config_path, use_inotify=self.settings.use_inotify)
        self.log.info("agent started: backend %s, config %s (%s)", self.reconciler.backend.name,
                      self.settings.config_path, watcher.mode)
        try:
            self._loop(watcher, wakeup)
        finally:
            watcher.close()
        self.log.info("agent stopping: rules left in place")

    def _loop(self, watcher: ConfigWatcher, wakeup: Wakeup) -> None:
        backoff = self.settings.backoff_initial
        retry_at: float | None = None
        next_resync = self.clock()  # the first pass happens at once
        while not wakeup.stop.is_set():
            self.observer.heartbeat()  # once per wakeup: at least once per resync interval, so liveness can tell
            seen = self.reconciler.observe(_read(self.settings.config_path))
            self.observer.observed(seen)
            now = self.clock()
            due = (seen.changed or now >= next_resync or wakeup.resync.is_set()
                   or (retry_at is not None and now >= retry_at))
            if wakeup.resync.is_set():
                self.log.info("SIGHUP: resync now")
                wakeup.resync.clear()
            if due:
                started = time.perf_counter()
                report = self.reconciler.reconcile()
                self.observer.reconciled(report, time.perf_counter() - started)
                now = self.clock()
                next_resync = now + report.resync_interval
                if report.result is SyncResult.FAILED:
                    retry_at = now + backoff
                    backoff = min(backoff * 2, self.settings.backoff_max)
                else:
                    retry_at, backoff = None, self.settings.backoff_initial
            deadline = next_resync if retry_at is None else min(next_resync, retry_at)
            timeout = max(0.0, deadline - self.clock())
            if watcher.timeout is not None:
                timeout = min(timeout, watcher.timeout)
            ready, _, _ = select.select([*watcher.fds, wakeup.read_fd], [], [], timeout)
            wakeup.drain()
            if ready and watcher.drain():
                watcher.wait_quiet(self.settings.quiet_seconds)
