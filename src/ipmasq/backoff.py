"""The one backoff: how long to wait after a failure before trying again, as client-go's reflector waits.

Every retry in ipmasq that waits on someone else (the API server refusing or away, a watch answering 410 again and
again, a backend tool failing) takes its waits from a Backoff: the first wait is `initial`, each failure doubles the
step up to `cap`, and each wait is jittered (drawn from [step * (1 - jitter), step]) so that a fleet cut off together
does not come back together. A success resets it. The defaults are client-go's for list and watch: 0.8 s doubling to
30 s. Unlike client-go, which jitters upwards (its waits at the cap are 30 to 60 s), the jitter here is below the
step, so the longest wait is the cap itself. Pure: the randomness is injected, there is no clock and no sleep here
(the caller waits on its own event).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

__all__ = ["Backoff"]


class Backoff:
    def __init__(self, initial: float = 0.8, cap: float = 30.0, *, factor: float = 2.0, jitter: float = 1.0,
                 uniform: Callable[[float, float], float] | None = None) -> None:
        # NaN fails every comparison: without isfinite a NaN initial or cap would pass, and each wait be NaN
        if (not all(map(math.isfinite, (initial, cap, factor, jitter))) or not 0.0 <= jitter <= 1.0
                or initial <= 0 or cap < initial or factor < 1.0):
            raise ValueError("Backoff: 0 < initial <= cap, factor >= 1, 0 <= jitter <= 1")
        self.initial, self.cap, self.factor, self.jitter = initial, cap, factor, jitter
        self.uniform = uniform  # None: random.uniform, looked up at each draw
        self.step = initial  # the next wait before jitter
        self.failures = 0  # in a row, since the last reset

    def next(self) -> float:
        """The wait after one more failure (and the step grows for the next)."""
        step = self.step
        self.failures += 1
        self.step = min(self.step * self.factor, self.cap)
        if not self.jitter:
            return step
        return (self.uniform or random.uniform)(step * (1.0 - self.jitter), step)

    def peek(self) -> float:
        """The step the next failure would wait (before jitter)."""
        return self.step

    def reset(self) -> None:
        self.step, self.failures = self.initial, 0
