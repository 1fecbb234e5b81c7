"""Where a packet is in its walk through chains, for both tracers (iptables' trace.py, nftables' trace_nft.py).

The walk is the kernel's: rules in order, a jump pushes the place to come back to, a goto does not, a RETURN or
the chain's end resumes the last pushed place; a chain that ends with nowhere to resume (a built-in chain, or the
base chain the walk started in) hands the decision to its caller (the chain's policy). Every rule evaluated counts
against MAX_STEPS, so a table whose chains jump to the same chains over and over still ends in an answer.
"""

from __future__ import annotations

from collections.abc import Container, Mapping, Sequence
from typing import Generic, TypeVar

__all__ = ["MAX_STEPS", "ChainWalk"]

# Rules one trace may evaluate. Without loops a walk is finite, but a hand-written dump whose chains jump to the
# same chain many times over can make it exponential; past this budget the answer is "depth limit", not a hang.
MAX_STEPS = 1_000_000

K = TypeVar("K")  # how a chain is named
R = TypeVar("R")  # a rule


class ChainWalk(Generic[K, R]):
    """The chain being walked, the index of its next rule, the places RETURNs resume, the rules evaluated so far.
    `ends`: chains whose end (or a RETURN in them) never resumes an outer place (iptables' built-in chains);
    `evaluated`: rules an earlier walk of the same packet already evaluated (nftables walks each base chain)."""

    def __init__(self, chains: Mapping[K, Sequence[R]], start: K, *, ends: Container[K] = (),
                 evaluated: int = 0) -> None:
        self.chains = chains
        self.current = start
        self.index = 0
        self.stack: list[tuple[K, int]] = []
        self.evaluated = evaluated
        self._ends = ends

    def next_rule(self) -> R | None:
        """The next rule to evaluate, resuming outer places as chains end; None when the walk reached the end of a
        chain with nowhere to resume (that chain's policy decides)."""
        while self.index >= len(self.chains.get(self.current, ())):
            if not self.can_return():
                return None
            self.current, self.index = self.stack.pop()
        rule = self.chains[self.current][self.index]
        self.index += 1
        self.evaluated += 1
        return rule

    @property
    def exhausted(self) -> bool:
        """More than MAX_STEPS rules evaluated: the trace gives up on this packet."""
        return self.evaluated > MAX_STEPS

    def can_return(self) -> bool:
        return bool(self.stack) and self.current not in self._ends

    def return_(self) -> None:
        """A RETURN where can_return(): resume the last pushed place."""
        self.current, self.index = self.stack.pop()

    def enter(self, chain: K, *, goto: bool = False) -> None:
        """A jump (comes back here) or a goto (does not) to `chain`."""
        if not goto:
            self.stack.append((self.current, self.index))
        self.current, self.index = chain, 0
