"""What `check` reports: its stable finding ids (the documented names of what can be wrong with a node's nat rules)
and the report that carries the findings; `quote`, how a message names a list of rules or destinations."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from ipmasq.findings import Finding, has_errors

__all__ = ["CheckReport", "FindingId", "quote"]


# How many destinations a message quotes before "and N more" (the JSON field has them all).
_QUOTED = 6


class FindingId(StrEnum):
    """check's stable ids: Finding.id holds the member itself, so `f.id is FindingId.X` and `f.id == "x"` both hold."""

    CHAIN_MISSING = "chain-missing"
    JUMP_MISSING = "jump-missing"
    CONFIG_NOT_APPLIED = "config-not-applied"
    RULES_DIFFER = "rules-differ"
    FOREIGN_MASQUERADE = "foreign-masquerade"
    JUMP_SHADOWED = "jump-shadowed"
    STALE_CHAIN = "stale-chain"
    UNSUPPORTED = "unsupported"
    RULE_MISSING = "rule-missing"  # a config rule with no line on the node
    RULE_EXTRA = "rule-extra"  # lines of a rule (by its comment) the config does not have
    RULE_EDITED = "rule-edited"  # a config rule whose lines on the node differ from what it renders to
    RULE_ORDER = "rule-order"  # the config rules in another order, or not ahead of the CIDR entries
    IGNORED_BY_WRITER = "ignored-by-writer"  # a key the provider's agent does not read (ipmasq's extensions)



@dataclass(frozen=True, slots=True)
class CheckReport:
    findings: tuple[Finding, ...] = field(default=())

    @property
    def ok(self) -> bool:
        return not has_errors(self.findings)



def quote(items: list[str]) -> str:
    shown = ", ".join(items[:_QUOTED])
    return shown + (f" and {len(items) - _QUOTED} more" if len(items) > _QUOTED else "")
