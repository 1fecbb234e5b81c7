"""The one wait on a condition, for the lab and (through tests/eventually.py) the tests.

`until` returns the condition's first truthy value as soon as it holds, polling quickly at first and then every
`interval` at most, and raises `error` naming what it waited for once `timeout` has passed, or at once when `gone()`
says that what it waits on has ended (an agent or a server that exited cannot bring the condition about any more).
The timeout bounds a hang; it is never a measure of speed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from ipmasq.errors import LabError

__all__ = ["until"]

T = TypeVar("T")

_FIRST_PAUSE = 0.002


def until(condition: Callable[[], T], what: str | Callable[[], str], *, timeout: float, interval: float = 0.1,
          gone: Callable[[], str | None] | None = None, error: type[Exception] = LabError) -> T:
    """`condition()`'s first truthy value; `error("<what>: not within N s")` after `timeout` seconds, or
    `error("<what>: <why>")` as soon as `gone()` returns a reason. `what` may be a callable, asked only on failure
    (to show the state last seen)."""
    deadline = time.monotonic() + timeout
    pause = min(_FIRST_PAUSE, interval)
    while True:
        value = condition()
        if value:
            return value
        why = gone() if gone is not None else None
        left = deadline - time.monotonic()
        if why is not None or left <= 0:
            said = what() if callable(what) else what
            raise error(f"{said}: {why}" if why is not None else f"not within {timeout:g} s: {said}")
        time.sleep(min(pause, left))
        pause = min(pause * 2, interval)
