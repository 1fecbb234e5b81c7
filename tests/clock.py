"""A clock for code that takes one (`clock: Callable[[], float]`): it moves only when the test moves it."""

from __future__ import annotations

__all__ = ["Clock"]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now
