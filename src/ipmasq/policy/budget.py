"""A work budget: how many steps an analysis may take, counted by the loops whose work grows with the rules.

The rules' checks (shadowed rules, rules without effect) are exact, and their work grows faster than the rules: a
config of 50 rules with sources, protocols, ports and node globs took 38 s. A caller that must answer within a bound
(the admission webhook, inside the API server's 5 s) gives them a budget; plain `ipmasq lint` gives none and checks
everything. Steps, not seconds: the same config is cut at the same rule on every machine, and tests count steps.

A budget may also be abandoned from another thread (the webhook's client went away): the next step raises
Abandoned, so no work goes on for nobody.
"""

from __future__ import annotations

import threading

from ipmasq.errors import Abandoned, WorkBudgetExhausted

__all__ = ["WorkBudget"]


class WorkBudget:
    """`limit` steps; charge() past it raises WorkBudgetExhausted, and raises Abandoned once `abandoned` is set.
    `max_rules`: a config with more rules than this is not analysed rule by rule at all."""

    __slots__ = ("_abandoned", "limit", "max_rules", "spent")

    def __init__(self, limit: int, abandoned: threading.Event | None = None, *, max_rules: int | None = None) -> None:
        self.limit = limit
        self.max_rules = max_rules
        self.spent = 0
        self._abandoned = abandoned

    def charge(self, steps: int) -> None:
        self.spent += steps
        if self._abandoned is not None and self._abandoned.is_set():
            raise Abandoned("abandoned: its requester is gone")
        if self.spent > self.limit:
            raise WorkBudgetExhausted(f"the work budget of {self.limit:,} steps is spent")

    @property
    def exhausted(self) -> bool:
        return self.spent > self.limit
