"""A work budget: how many steps an analysis may take, counted by the loops whose work grows with the rules.

The rules' checks (shadowed rules, rules without effect) are exact, and their work grows faster than the rules: a
config of 50 rules with sources, protocols, ports and node globs took 38 s. A caller that must answer within a bound
(the admission webhook, inside the API server's 5 s) gives them a budget; plain `ipmasq lint` gives none and checks
everything. Steps, not seconds: the same config is cut at the same rule on every machine, and tests count steps.

A budget may also be abandoned from another thread or process (the webhook's client went away): the next step raises
Abandoned, so no work goes on for nobody. And it may hand off: past `handoff` steps, WorkOutgrown, for a caller
that runs small checks in one place and large ones in another (the webhook: its event loop's process, a process of
their own), and learns which a check is only by running it.
"""

from __future__ import annotations

from typing import Protocol

from ipmasq.errors import Abandoned, WorkBudgetExhausted, WorkOutgrown

__all__ = ["AbandonSignal", "WorkBudget"]


class AbandonSignal(Protocol):
    """What says the work is abandoned: a threading.Event, or the decision process's shared flag."""

    def is_set(self) -> bool: ...


class WorkBudget:
    """`limit` steps; charge() past it raises WorkBudgetExhausted, and raises Abandoned once `abandoned` is set.
    `max_rules`: a config with more rules than this is not analysed rule by rule at all. `handoff`: past this many
    steps, WorkOutgrown (the check is to be run again elsewhere, with the same budget)."""

    __slots__ = ("_abandoned", "handoff", "limit", "max_rules", "spent")

    def __init__(self, limit: int, abandoned: AbandonSignal | None = None, *, max_rules: int | None = None,
                 handoff: int | None = None) -> None:
        self.limit = limit
        self.max_rules = max_rules
        self.handoff = handoff
        self.spent = 0
        self._abandoned = abandoned

    def charge(self, steps: int) -> None:
        self.spent += steps
        if self._abandoned is not None and self._abandoned.is_set():
            raise Abandoned("abandoned: its requester is gone")
        if self.handoff is not None and self.spent > self.handoff:
            raise WorkOutgrown(f"more than {self.handoff:,} steps: to be run where large checks run")
        if self.spent > self.limit:
            raise WorkBudgetExhausted(f"the work budget of {self.limit:,} steps is spent")

    @property
    def exhausted(self) -> bool:
        return self.spent > self.limit
