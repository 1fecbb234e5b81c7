"""The one way a test waits: on a condition, never on a sleep.

    eventually(lambda: agent.ready, "the agent ready")
    line = eventually(lambda: find(log, "applied"), lambda: f"'applied' in the log: {log.read_text()!r}")

`eventually` returns the condition's first truthy value as soon as it holds, and raises AssertionError naming what it
waited for once `timeout` has passed. The timeout is a hang guard for a loaded CI machine, never a speed bound: a test
that wants something to be fast measures it in a benchmark, not with a short timeout here. The condition's own
exceptions are not swallowed: a condition that can fail while the world settles says so itself (returns False).

The loop is the lab's (ipmasq.lab.wait.until: the package cannot import the tests, the tests can import the
package), so the lab and the tests wait the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from ipmasq.lab.wait import until

__all__ = ["TIMEOUT", "eventually"]

T = TypeVar("T")

TIMEOUT = 30.0  # the hang guard: far beyond what any wait here takes on an idle machine


def eventually(condition: Callable[[], T], what: str | Callable[[], str], *, timeout: float = TIMEOUT,
               interval: float = 0.05) -> T:
    """`condition()`'s first truthy value; AssertionError("not within ... s: <what>") after `timeout` seconds.
    `what` may be a callable, evaluated only on failure (to show the state the test saw last)."""
    return until(condition, what, timeout=timeout, interval=interval, error=AssertionError)
