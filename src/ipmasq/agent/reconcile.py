"""One reconcile pass, backend-agnostic: config -> Policy -> desired State -> compare -> apply once -> verify.

The Reconciler keeps the last good Policy: a bad config is logged once per change and makes the agent
not-ready, while the last good config keeps being enforced (drift repaired). Until a first good config is
seen the kernel is left untouched. It performs no I/O of its own beyond the injected backend and logger.

`others` are the backends not chosen: before its first write the Reconciler removes whatever they left (an agent
that ran with the other backend before), once, so that two sets of our rules never decide the same packet.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum

from ipmasq.backends.base import Backend, Removable
from ipmasq.config.model import DEFAULT_RESYNC_SECONDS
from ipmasq.config.source import ConfigInput, config_from_bytes
from ipmasq.errors import BackendError, ConfigError, IpmasqError
from ipmasq.options import PolicyOptions
from ipmasq.policy import Policy

__all__ = ["Outcome", "Reconciler"]


class Outcome(Enum):
    IN_SYNC = "in-sync"  # the kernel already matched: nothing written
    APPLIED = "applied"  # one transaction written per differing family, and verified
    NO_POLICY = "no-policy"  # no good config seen yet: nothing touched
    FAILED = "failed"  # a backend error: retry with backoff


@dataclass(frozen=True, slots=True)
class _Seen:
    """The last config input observed (or the error reading it), to act once per change."""

    config_input: ConfigInput | None
    read_error: str | None


class Reconciler:
    def __init__(self, backend: Backend, options: PolicyOptions, *, log: logging.Logger,
                 others: Sequence[Removable] = (),
                 on_policy_change: Callable[[Policy, Policy], None] | None = None) -> None:
        self.backend = backend
        # called after the kernel was verified to hold a new policy, with the one it replaced (conntrack cleanup)
        self.on_policy_change = on_policy_change
        self._enforced: Policy | None = None  # the policy the kernel was last verified to hold
        self.others = tuple(others)
        self._others_checked = not self.others
        self.options = options
        self.log = log
        self.policy: Policy | None = None  # the last good policy, enforced even while the config is bad
        self.config_error: str | None = None
        self.backend_error: str | None = None
        self.writes = 0
        self._seen: _Seen | None = None

    @property
    def ready(self) -> bool:
        """Ready: the current config is good and the kernel was verified to match it."""
        return self.policy is not None and self.config_error is None and self.backend_error is None

    @property
    def resync_interval(self) -> float:
        return self.policy.config.resync_interval if self.policy is not None else DEFAULT_RESYNC_SECONDS

    def observe(self, config_input: ConfigInput | ConfigError) -> bool:
        """Take a freshly read config (or the error reading it); returns True when it changed."""
        seen = (_Seen(None, config_input.located()) if isinstance(config_input, ConfigError)
                else _Seen(config_input, None))
        if seen == self._seen:
            return False
        self._seen = seen
        try:
            if isinstance(config_input, ConfigError):
                raise config_input
            config = config_from_bytes(config_input, self.options)
        except ConfigError as exc:
            self.config_error = exc.located()
            keeping = "keeping the last good config" if self.policy is not None else "leaving the rules untouched"
            self.log.error("config error: %s (%s; not ready)", self.config_error, keeping)
            return True
        for warning in config.warnings:
            self.log.warning("config warning: %s", warning)
        changed = self.policy is None or self.policy.config != config
        self.policy = Policy(config, self.options)
        if self.config_error is not None or changed:
            where = ", ".join(config.sources) if config.sources else "no config file: the built-in defaults"
            self.log.info("config loaded from %s: %d non-masquerade, %d masquerade CIDRs, resync every %gs",
                          where, len(config.non_masquerade), len(config.masquerade), config.resync_interval)
        self.config_error = None
        return True

    def reconcile(self) -> Outcome:
        """Make the kernel match the last good policy; write only where it differs, then read back and verify."""
        policy = self.policy
        if policy is None:
            return Outcome.NO_POLICY
        outcome = Outcome.IN_SYNC
        try:
            if not self._others_checked:
                self._remove_others()
            for family in policy.families:
                current = self.backend.read(family)
                want = self.backend.desired(policy, family)
                if current == want:
                    continue
                self.backend.apply(policy, family, current)
                self.writes += 1
                after = self.backend.read(family)
                if after != want:
                    raise BackendError(f"IPv{family.value} rules differ from the desired ones right after applying "
                                       f"them (someone else is writing, or the kernel rewrote a rule)")
                drift = self._enforced is not None and self._enforced.config == policy.config
                self.log.info("applied IPv%d rules with %s (%s)", family.value, self.backend.name,
                              _describe(current.objects, want.objects, drift=drift))
                outcome = Outcome.APPLIED
        except IpmasqError as exc:
            message = str(exc)
            if message != self.backend_error:
                self.log.error("%s: %s (will retry)", self.backend.name, message)
            self.backend_error = message
            return Outcome.FAILED
        if self.backend_error is not None:
            self.log.info("%s: recovered", self.backend.name)
        self.backend_error = None
        previous, self._enforced = self._enforced, policy
        if previous is not None and previous is not policy and self.on_policy_change is not None:
            self.on_policy_change(previous, policy)
        return outcome

    def _remove_others(self) -> None:
        for other in self.others:
            if other.present():
                other.remove_all()
                self.writes += 1
                self.log.info("removed the objects of %s left by an earlier run (this agent uses %s)", other.name,
                              self.backend.name)
        self._others_checked = True  # only once all are gone: a failure is retried with the next pass


def _describe(before: tuple[str, ...], after: tuple[str, ...], *, drift: bool) -> str:
    """drift: the kernel was verified to hold this config before, so someone else changed it (not a config change)."""
    if not before:
        return f"installed {len(after)} objects"
    gone = len(set(before) - set(after))
    new = len(set(after) - set(before))
    if not drift:
        return f"config change: {new} added, {gone} removed"
    if not gone and not new:
        return "repaired order"
    return f"repaired drift: {new} missing, {gone} unexpected"
