"""The agent's loop: wait for a trigger, re-read the config, reconcile; never exit on a bad config or a failing tool.

Triggers: a config change (ConfigWatcher), the resync timer (the last good config's resyncInterval, for drift
repair), SIGHUP (`resync_now`), and the retry timer after a backend error (exponential backoff). `stop` (set by
SIGTERM/SIGINT) ends the loop at once and leaves the rules in place: traffic keeps flowing during an upgrade.
Logs: one line per event, nothing per idle tick.

Nothing ends the loop but `stop`: an unexpected exception in an iteration (a bug, a tool printing what no parser
expected) is logged once per distinct error (type and message, no traceback), counted, makes the agent not ready,
and the iteration is retried with the same backoff as a failing tool.

Before the loop, `wait_for_node_lock` makes sure this agent is the node's only writer (ipmasq.agent.nodelock).
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol

from ipmasq.agent.memory import release_free_memory
from ipmasq.agent.nodelock import NodeLock
from ipmasq.agent.origin import FILE, ConfigOrigin
from ipmasq.agent.reports import ConfigReport, PassReport, SyncResult
from ipmasq.agent.trouble import Trouble
from ipmasq.agent.watch import ConfigWatcher
from ipmasq.backoff import Backoff
from ipmasq.config.source import ConfigInput, read_config_input
from ipmasq.errors import ConfigError, StopRequested

__all__ = [
    "LOCK_POLL_SECONDS",
    "Agent",
    "ConfigChooser",
    "Listeners",
    "LoopListener",
    "LoopSettings",
    "Passes",
    "Wakeup",
    "read_config",
    "wait_for_node_lock",
]

# How often a waiting agent tries the node lock: the takeover delay once the holder exits.
LOCK_POLL_SECONDS = 0.1


@dataclass(frozen=True, slots=True)
class LoopSettings:
    """Where the agent's config is, how it notices changes, and how it backs off after failures."""

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

    def request_look(self) -> None:
        """Look at the config again now (the API showed a new one); a pass follows only if it changed."""
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


class LoopListener(Protocol):
    """Told what the loop does (ipmasq.agent.metrics.AgentVitals: metrics, liveness, readiness); must not block.

    It gets the Reconciler's reports, values it may keep, and never the Reconciler: it can only read what happened.
    """

    def heartbeat(self) -> None: ...

    def took_config(self, report: ConfigReport) -> None: ...

    def reconciled(self, report: PassReport, seconds: float) -> None: ...

    def waiting(self, why: str) -> None: ...

    def failed(self, why: str) -> None: ...


class _NoListener:
    def heartbeat(self) -> None:
        pass

    def took_config(self, report: ConfigReport) -> None:
        pass

    def reconciled(self, report: PassReport, seconds: float) -> None:
        pass

    def waiting(self, why: str) -> None:
        pass

    def failed(self, why: str) -> None:
        pass


class Listeners:
    """Several listeners told the same, in order (the metrics first: they are what the probes read)."""

    def __init__(self, *listeners: LoopListener) -> None:
        self.listeners = listeners

    def heartbeat(self) -> None:
        for listener in self.listeners:
            listener.heartbeat()

    def took_config(self, report: ConfigReport) -> None:
        for listener in self.listeners:
            listener.took_config(report)

    def reconciled(self, report: PassReport, seconds: float) -> None:
        for listener in self.listeners:
            listener.reconciled(report, seconds)

    def waiting(self, why: str) -> None:
        for listener in self.listeners:
            listener.waiting(why)

    def failed(self, why: str) -> None:
        for listener in self.listeners:
            listener.failed(why)


class ConfigChooser(Protocol):
    """Picks the config to enforce given what the mounted file holds, and says where it came from
    (ipmasq.agent.api.config.ApiConfig: the API's ConfigMaps when they are newer)."""

    def choose(self, file_read: ConfigInput | ConfigError) -> tuple[ConfigInput | ConfigError, ConfigOrigin]: ...


class _Named(Protocol):
    @property
    def name(self) -> str: ...


class Passes(Protocol):
    """What the loop drives, one pass per wakeup that is due: the Reconciler (enforcing: ipmasq.agent.reconcile) or
    the Observer (observe mode: ipmasq.observe.observer, which never writes)."""

    @property
    def backend(self) -> _Named: ...

    def take_config(self, config_input: ConfigInput | ConfigError) -> ConfigReport: ...

    def reconcile(self) -> PassReport: ...


def wait_for_node_lock(lock: NodeLock, wakeup: Wakeup, *, log: logging.Logger,
                       listener: LoopListener | None = None, poll: float = LOCK_POLL_SECONDS,
                       announce: bool = False) -> bool:
    """Return once this process holds the node lock (True), or when stop was requested first (False).

    While waiting the agent writes nothing, stays alive (heartbeats) and not ready, and says for whom it waits.
    `announce`: say "took the node lock" also when it was free at once (`--once` keeps its output to the reference
    agent's lines).
    """
    watcher: LoopListener = listener if listener is not None else _NoListener()
    if lock.try_acquire():
        if announce:  # the long-running agent says it also when nobody held it: its log shows when it took over
            log.info("took the node lock %s: this agent now writes the node's rules", lock.path)
        return True
    announced: str | None = None  # the holder last logged
    while not wakeup.stop.is_set():
        holder = lock.holder()
        who = f"pid {holder}" if holder is not None else "another process"
        watcher.heartbeat()
        watcher.waiting(f"not ready: waiting for the node lock held by {who} ({lock.path}; another agent runs on "
                        "this node, e.g. during a rolling update)")
        if who != announced:
            log.info("waiting for the node lock %s held by %s: writing nothing until it exits", lock.path, who)
            announced = who
        select.select([wakeup.read_fd], [], [], poll)
        wakeup.drain()
        if lock.try_acquire():
            log.info("took the node lock %s: this agent now writes the node's rules", lock.path)
            return True
    return False


@dataclass
class _Schedule:
    """When the loop reconciles next: the resync timer, and the retry timer with its backoff after a failure (the
    kernel's tools, not a fleet's API server: not jittered)."""

    next_resync: float
    backoff: Backoff
    retry_at: float | None = None

    def failed(self, now: float) -> None:
        self.retry_at = now + self.backoff.next()

    def succeeded(self) -> None:
        self.retry_at = None
        self.backoff.reset()

    def deadline(self) -> float:
        return self.next_resync if self.retry_at is None else min(self.next_resync, self.retry_at)


def read_config(path: str, *, directory_ok: bool = True) -> ConfigInput | ConfigError:
    """The config's bytes (bounded, never blocking), or the error reading them: a bad config is a value here."""
    try:
        return read_config_input(path, missing_ok=True, directory_ok=directory_ok)
    except ConfigError as exc:
        return exc


class Agent:
    def __init__(self, reconciler: Passes, settings: LoopSettings, *, log: logging.Logger,
                 clock: Callable[[], float] = time.monotonic, listener: LoopListener | None = None,
                 api_config: ConfigChooser | None = None) -> None:
        self.reconciler = reconciler
        # the ConfigMaps followed through the API, beside the mounted file (None: the file only)
        self.api_config = api_config
        self.listener: LoopListener = listener if listener is not None else _NoListener()
        self.settings = settings
        self.log = log
        self.clock = clock
        # run() pins what --config named when the agent started, as its watcher does: a file config replaced by a
        # directory is a bad config, never an empty config directory (the defaults)
        self._directory_ok = True
        self._origin: ConfigOrigin = FILE  # where the content last found good came from: what a pass enforces

    def once(self) -> int:
        """One reconcile: 0 when the kernel now matches a good config, 1 otherwise."""
        self.reconciler.take_config(read_config(self.settings.config_path))
        report = self.reconciler.reconcile()
        return 0 if report.readiness.ok else 1

    def run(self, wakeup: Wakeup) -> None:
        watcher = ConfigWatcher(self.settings.config_path, use_inotify=self.settings.use_inotify)
        self._directory_ok = watcher.directory == os.path.abspath(self.settings.config_path)
        self.log.info("agent started: backend %s, config %s (%s)", self.reconciler.backend.name,
                      self.settings.config_path, watcher.mode)
        try:
            self._loop(watcher, wakeup)
        finally:
            watcher.close()
        self.log.info("agent stopping: rules left in place")

    def _loop(self, watcher: ConfigWatcher, wakeup: Wakeup) -> None:
        backoff = Backoff(self.settings.backoff_initial, self.settings.backoff_max, jitter=0.0)
        schedule = _Schedule(next_resync=self.clock(), backoff=backoff)  # the first pass at once
        trouble = Trouble(self.log, said="unexpected error in the agent loop: %s (not ready; will retry)",
                          level=logging.ERROR)
        while not wakeup.stop.is_set():
            try:
                if self._iteration(wakeup, schedule):
                    trouble.ended()  # a pass completed: the same error again is news again
                self._wait(watcher, wakeup, schedule)
            except StopRequested:
                return  # SIGTERM while a config was being parsed: stop now, nothing was written
            except Exception as exc:  # nothing but stop may end the loop
                error = f"{type(exc).__name__}: {exc}"
                trouble(error)
                schedule.failed(self.clock())
                self.listener.failed(f"not ready: unexpected error in the agent loop: {error}")
                # the backoff, woken only by stop: nothing here can raise what the iteration raised
                select.select([wakeup.read_fd], [], [], max(0.0, schedule.deadline() - self.clock()))
                wakeup.drain()

    def _iteration(self, wakeup: Wakeup, schedule: _Schedule) -> bool:
        """One wakeup: read the config, reconcile when due; True when a pass ran to its end."""
        self.listener.heartbeat()  # once per wakeup: at least once per resync interval, so liveness can tell
        read = read_config(self.settings.config_path, directory_ok=self._directory_ok)
        origin = FILE
        if self.api_config is not None:
            read, origin = self.api_config.choose(read)
        seen = replace(self.reconciler.take_config(read), origin=origin)
        if seen.config_error is None:  # this read is the last good config now: what the next pass enforces
            self._origin = origin
        self.listener.took_config(seen)
        now = self.clock()
        due = (seen.changed or now >= schedule.next_resync or wakeup.resync.is_set()
               or (schedule.retry_at is not None and now >= schedule.retry_at))
        if wakeup.resync.is_set():
            self.log.info("SIGHUP: resync now")
            wakeup.resync.clear()
        if not due:
            return False
        started = time.perf_counter()
        report = replace(self.reconciler.reconcile(), origin=self._origin)
        self.listener.reconciled(report, time.perf_counter() - started)
        now = self.clock()
        if seen.changed or report.writes:  # the passes that free the most (see ipmasq.agent.memory)
            release_free_memory()
        schedule.next_resync = now + report.resync_interval
        if report.result is SyncResult.FAILED:
            schedule.failed(now)
        else:
            schedule.succeeded()
        return True

    def _wait(self, watcher: ConfigWatcher, wakeup: Wakeup, schedule: _Schedule) -> None:
        timeout = max(0.0, schedule.deadline() - self.clock())
        if watcher.timeout is not None:
            timeout = min(timeout, watcher.timeout)
        ready, _, _ = select.select([*watcher.fds, wakeup.read_fd], [], [], timeout)
        wakeup.drain()
        if ready and watcher.drain():
            watcher.wait_quiet(self.settings.quiet_seconds)
