"""The config half of a pass, which the enforcing Reconciler (ipmasq.agent.reconcile) and the observing Observer
(ipmasq.observe.observer) both hold: a config input taken once per change, loaded and made a Policy, and the last
good one kept while a bad one is logged once (a bad config never replaces working rules with a guess). Pure but for
the log; parsing runs with SIGTERM/SIGINT able to interrupt it (StopRequested), leaving nothing half-written.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import FrameType

from ipmasq.config.model import DEFAULT_RESYNC_SECONDS, MasqConfig
from ipmasq.config.source import ConfigInput, config_from_bytes
from ipmasq.errors import ConfigError, StopRequested
from ipmasq.options import PolicyOptions
from ipmasq.policy.hash import policy_hash
from ipmasq.policy.policy import Policy

__all__ = ["LastGoodConfig"]

_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


@contextmanager
def _stop_signals_interrupt() -> Iterator[None]:
    """While inside, SIGTERM/SIGINT run the handler the process installed (the agent's requests the loop's stop) and
    then raise StopRequested where the main thread is. Parsing is pure: abandoning it midway leaves nothing
    half-written. Only the main thread can install handlers; with the default handler the signal kills the process
    anyway, so nothing is wrapped then."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {number: signal.getsignal(number) for number in _STOP_SIGNALS}

    def interrupt(number: int, frame: FrameType | None) -> None:
        handler = previous[signal.Signals(number)]
        if callable(handler):
            handler(number, frame)
        raise StopRequested(signal.Signals(number).name)

    wrapped = [number for number, handler in previous.items() if callable(handler)]
    for number in wrapped:
        signal.signal(number, interrupt)
    try:
        yield
    finally:
        for number in wrapped:
            signal.signal(number, previous[number])


@dataclass(frozen=True, slots=True)
class _Seen:
    """The last config input taken (or the error reading it), to act once per change."""

    config_input: ConfigInput | None
    read_error: str | None


class LastGoodConfig:
    """The last good config's Policy (enforced, or compared with, even while the config is bad), its hash and its
    content's digest, and the current config's error."""

    def __init__(self, options: PolicyOptions, *, log: logging.Logger,
                 load: Callable[[ConfigInput, PolicyOptions], MasqConfig] = config_from_bytes) -> None:
        self.options = options
        self.log = log
        # bytes -> validated config (config_from_bytes; a provider's reading in observe mode; tests' own)
        self.load = load
        self.policy: Policy | None = None
        self.policy_hash: str | None = None  # policy_hash(self.policy), computed once per policy
        self.config_digest: str | None = None  # the last good config's content digest (ConfigInput.digest)
        self.error: str | None = None  # the current config's error, one line with its place
        self._seen: _Seen | None = None

    @property
    def resync_interval(self) -> float:
        return self.policy.config.resync_interval if self.policy is not None else DEFAULT_RESYNC_SECONDS

    def take(self, config_input: ConfigInput | ConfigError) -> bool:
        """Take a freshly read config (or the error reading it); whether it differs from the one taken before."""
        seen = (_Seen(None, config_input.located()) if isinstance(config_input, ConfigError)
                else _Seen(config_input, None))
        if seen == self._seen:
            return False
        self._seen = seen
        try:
            if isinstance(config_input, ConfigError):
                raise config_input
            with _stop_signals_interrupt():
                config = self.load(config_input, self.options)
        except ConfigError as exc:
            self.error = exc.located()
            keeping = "keeping the last good config" if self.policy is not None else "leaving the rules untouched"
            self.log.error("config error: %s (%s; not ready)", self.error, keeping)
            return True
        except BaseException:
            # not a verdict on the config (a loader process that could not run): read it again at the next wakeup
            self._seen = None
            raise
        self.config_digest = config_input.digest()
        for warning in config.warnings:
            self.log.warning("config warning: %s", warning)
        changed = self.policy is None or self.policy.config != config
        if changed:  # an equal config keeps its Policy: verified once, it stays verified (and its caches warm)
            with _stop_signals_interrupt():
                policy = Policy(config, self.options)
                digest = policy_hash(policy)
            self.policy, self.policy_hash = policy, digest
        assert self.policy_hash is not None
        if self.error is not None or changed:
            where = ", ".join(config.sources) if config.sources else "no config file: the built-in defaults"
            self.log.info("config loaded from %s: %d non-masquerade, %d masquerade CIDRs, resync every %gs "
                          "(policy %s)", where, len(config.non_masquerade), len(config.masquerade),
                          config.resync_interval, self.policy_hash[:12])
        self.error = None
        return True
