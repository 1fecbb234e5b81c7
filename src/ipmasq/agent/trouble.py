"""The one "log once": a trouble said once per distinct line, and once more when it is over.

What keeps failing (the API server away, a tool that cannot run, a loop error) is logged when it starts and each time
its one line changes, never once per retry, and its end is logged once: the log of an agent that retried for an hour
is two lines. A reason is written as one line (ipmasq.errors.one_line): it often quotes what a server or a tool said,
and a newline in it must not forge a second log line. Not thread-safe: each thread that retries keeps its own, or
reports through `reporter(lock)`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from ipmasq.errors import one_line

__all__ = ["Trouble"]


class Trouble:
    def __init__(self, log: logging.Logger, *, said: str, over: str | None = None,
                 level: int = logging.WARNING) -> None:
        """`said`: a %-format with one %s, the trouble's line; `over`: what is logged when it ends (None: nothing)."""
        self.log, self.said, self.over, self.level = log, said, over, level
        self.current: str | None = None

    def __call__(self, why: str) -> bool:
        """Trouble now: logged when it is news (True)."""
        why = one_line(why)
        if why == self.current:
            return False
        self.current = why
        self.log.log(self.level, self.said, why)
        return True

    def ended(self) -> bool:
        """No trouble now: the end logged once (True when there was one)."""
        if self.current is None:
            return False
        self.current = None
        if self.over is not None:
            self.log.info("%s", self.over)
        return True

    def reporter(self, lock: threading.Lock) -> Callable[[str | None], None]:
        """One callable for a follower's thread: a reason (trouble now) or None (it ended), each under `lock`."""
        def said(why: str | None) -> None:
            with lock:
                if why is None:
                    self.ended()
                else:
                    self(why)
        return said
