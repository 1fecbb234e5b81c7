"""The part every fake tool shares: the Runner protocol's streaming methods over a fake's one answer.

A fake answers a whole input with a whole output (`__call__`); `stream` joins the input's pieces and `read_lines`
hands the output's lines over once the program is done, which is all a test needs from them. `FakeRunner(answer)`
makes a Runner of a plain function, for a test that scripts one tool's answers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TypeVar

from ipmasq.backends.base import Result
from ipmasq.netfilter.lines import iter_lines

__all__ = ["FakeRunner"]

T = TypeVar("T")


class FakeRunner:
    """A Runner answering from `answer(argv, stdin)`, or from a subclass's `__call__`. `generation` counts the
    writes the fake took (a subclass bumps it), as nf_tables counts its transactions: FakeFingerprint reads it."""

    def __init__(self, answer: Callable[[Sequence[str], str | None], Result] | None = None) -> None:
        self._answer = answer
        self.generation = 0

    def __call__(self, argv: Sequence[str], stdin: str | None = None) -> Result:
        if self._answer is None:
            raise NotImplementedError("a FakeRunner answers from a function or a subclass's __call__")
        return self._answer(argv, stdin)

    def stream(self, argv: Sequence[str], chunks: Iterable[str]) -> Result:
        return self(argv, "".join(chunks))

    def read_lines(self, argv: Sequence[str], consume: Callable[[Iterator[str]], T]) -> tuple[Result, T | None]:
        result = self(argv, None)
        return result, consume(iter_lines(result.stdout)) if result.returncode == 0 else None
