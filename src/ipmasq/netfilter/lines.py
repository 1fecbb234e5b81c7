"""Splitting text into lines exactly as str.splitlines does, without a list of them: from one string, or from
pieces of text as a program prints them (a dump of 100,000 rules need never be held whole)."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

__all__ = ["iter_lines", "iter_lines_of_pieces"]

# Every line boundary str.splitlines knows, "\r\n" as one.
_LINE_BREAK = re.compile("\r\n|[\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029]")


def iter_lines(text: str) -> Iterator[str]:
    """text.splitlines(), one line at a time."""
    start = 0
    for match in _LINE_BREAK.finditer(text):
        yield text[start:match.start()]
        start = match.end()
    if start < len(text):
        yield text[start:]


def iter_lines_of_pieces(pieces: Iterable[str]) -> Iterator[str]:
    """"".join(pieces).splitlines(), one line at a time, as the pieces come."""
    rest = ""
    for piece in pieces:
        text = rest + piece if rest else piece
        start = 0
        for match in _LINE_BREAK.finditer(text):
            if match.end() == len(text) and match.group() == "\r":
                break  # a "\r" ending this piece may be the first half of a "\r\n" in the next
            yield text[start:match.start()]
            start = match.end()
        rest = text[start:]
    yield from iter_lines(rest)
