"""A fake of the kernel's ruleset fingerprint (ipmasq.backends.generation.KernelFingerprint) over the fake tools."""

from __future__ import annotations

from ipmasq.testing.runner import FakeRunner

__all__ = ["FakeFingerprint"]


class FakeFingerprint:
    """A Fingerprint that behaves as the real one does: it moves with every write any of `tools` took (their
    `generation`), and with `changed()`, a write by a program the fakes did not see; while `readable` is False it
    answers None, as a kernel that cannot be read."""

    def __init__(self, *tools: FakeRunner) -> None:
        self.tools = tools
        self.readable = True
        self._unseen_writes = 0

    def changed(self) -> None:
        self._unseen_writes += 1

    def __call__(self) -> tuple[int, ...] | None:
        if not self.readable:
            return None
        return (*(tool.generation for tool in self.tools), self._unseen_writes)
