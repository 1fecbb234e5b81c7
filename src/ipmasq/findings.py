"""What lint and check report: a finding with a stable id, a severity, a message and a fix hint.

A lint finding sits at a place in a file (file, line, column). A check finding is about the node's rules, not a
file: it may quote the rule it is about, the rules or destinations that differ, and the destinations whose
outcome it changes. One model for both, so that scripts read the same keys and the CLI prints them one way.

Output is bounded by what a person can read, not by the input: `bounded` keeps the first SHOWN_PER_KIND findings of
each kind (file, id, severity) and counts the rest in one finding of that kind (`omitted`), and `named` names the
first few items of a list in a message and counts the rest. A 1 MiB env of junk is a screenful, not 400,000 lines.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import KW_ONLY, dataclass
from enum import Enum

from ipmasq.errors import one_line

__all__ = ["NAMED", "SHOWN_PER_KIND", "Finding", "Severity", "bounded", "count", "has_errors", "named"]

SHOWN_PER_KIND = 5  # findings of one kind shown before the rest are counted
NAMED = 6  # items a message names before "and N more"


class Severity(Enum):
    # lint: the agent rejects the config, never sees it, or does the opposite of what was declared;
    # check: pod traffic is (or may be) treated differently from the config
    ERROR = "error"
    # lint: it works, but not as the reader of the file probably thinks;
    # check: something to look at that does not change an outcome check could decide
    WARNING = "warning"
    # lint: correct, and changes nothing (a config rule whose action is what happens anyway)
    INFO = "info"


@dataclass(frozen=True, slots=True)
class Finding:
    id: str  # stable: scripts match on it; the message is not
    severity: Severity
    message: str
    hint: str  # how to fix it
    _: KW_ONLY
    file: str | None = None  # lint: where the finding is; None for a finding about the node's rules
    line: int | None = None
    column: int | None = None
    rule: str | None = None  # check: the rule the finding is about, quoted as iptables-save prints it
    missing: tuple[str, ...] = ()  # rules-differ: destinations (or rules) the config wants and the node lacks
    extra: tuple[str, ...] = ()  # rules-differ: what the node has and the config does not want
    destinations: tuple[str, ...] = ()  # the prefixes whose outcome the finding changes
    omitted: int = 0  # this finding stands for that many more of its kind, not shown (`bounded`)

    def as_dict(self) -> dict[str, object]:
        """The JSON object: file, line and column (all three, null when unknown) for a finding in a file, then id,
        severity, message and hint, then rule, missing, extra, destinations and omitted only when set."""
        out: dict[str, object] = {}
        if self.file is not None:
            out.update(file=self.file, line=self.line, column=self.column)
        out.update(id=str(self.id), severity=self.severity.value, message=self.message, hint=self.hint)
        if self.rule:
            out["rule"] = self.rule
        for name, values in (("missing", self.missing), ("extra", self.extra), ("destinations", self.destinations)):
            if values:
                out[name] = list(values)
        if self.omitted:
            out["omitted"] = self.omitted
        return out

    def as_text(self) -> str:
        """A finding in a file: one compiler-style line (`FILE:LINE:COL: severity [id] message (fix: hint)`) that
        editors and grep jump to. A finding about the node: the severity up front, the fix on its own line."""
        message = one_line(self.message)  # a value quoted from the input may hold a newline (a YAML scalar can)
        if self.file is None:
            return f"{self.severity.value.upper()} {self.id}: {message}\n    fix: {self.hint}"
        where = self.file
        if self.line is not None:
            where += f":{self.line}"
            if self.column is not None:
                where += f":{self.column}"
        return f"{where}: {self.severity.value} [{self.id}] {message} (fix: {self.hint})"

    def sort_key(self) -> tuple[str, int, int, str]:
        """Reading order: by file, line, column, then id."""
        return (self.file or "", self.line or 0, self.column or 0, str(self.id))


def count(findings: Iterable[Finding], severity: Severity) -> int:
    return sum(f.severity is severity for f in findings)


def has_errors(findings: Iterable[Finding]) -> bool:
    return any(f.severity is Severity.ERROR for f in findings)


def named(items: Sequence[str], shown: int = NAMED) -> str:
    """`a, b, c and 12,345 more`: the first `shown` items, the rest counted."""
    head = ", ".join(items[:shown])
    return head + (f" and {len(items) - shown:,} more" if len(items) > shown else "")


def bounded(findings: Iterable[Finding], per_kind: int = SHOWN_PER_KIND) -> list[Finding]:
    """The findings as shown: of each kind (file, id, severity) the first `per_kind` as they are, then one finding
    that counts the others (`omitted`), in their place. Counts and exit codes are the caller's, from all of them."""
    shown: list[Finding] = []
    seen: dict[tuple[str | None, str, Severity], int] = {}
    last: dict[tuple[str | None, str, Severity], int] = {}  # kind -> index in `shown` of its last one
    for finding in findings:
        kind = (finding.file, str(finding.id), finding.severity)
        seen[kind] = seen.get(kind, 0) + 1
        if seen[kind] <= per_kind:
            shown.append(finding)
            last[kind] = len(shown) - 1
    counted = {last[kind]: kind for kind, total in seen.items() if total > per_kind}
    out: list[Finding] = []
    for index, finding in enumerate(shown):
        out.append(finding)
        omitted_kind = counted.get(index)
        if omitted_kind is not None:
            more = seen[omitted_kind] - per_kind
            out.append(Finding(finding.id, finding.severity,
                               f"and {more:,} more {finding.severity.value}s [{finding.id}] like the above, not shown",
                               finding.hint, file=finding.file, omitted=more))
    return out
