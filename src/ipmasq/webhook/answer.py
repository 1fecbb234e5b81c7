"""A review's answer, made from its body: the JSON's size bounded before it is parsed, review.respond's answer
encoded, and the one log line per decision. Runs in a decision thread or in the decision process
(ipmasq.webhook.worker); it knows nothing of connections.
"""

from __future__ import annotations

import json
import re
import time
from typing import Protocol

from ipmasq.errors import Abandoned, ReviewError, WorkOutgrown, one_line
from ipmasq.policy.budget import AbandonSignal
from ipmasq.webhook.review import AdmissionResponseReview, AdmissionVerdict

__all__ = ["MAX_JSON_VALUES", "Answer", "Outgrown", "Respond", "decision", "decision_line", "json_values"]

# json.loads builds a Python object of 30 to 60 bytes for every value, whatever its text: 16 MiB of "[1.5,1.5,..."
# would be 4 million floats, 150 MiB. Outside its strings, a JSON text has a comma, a colon, a bracket or a brace for
# every value but one, so counting those and the strings bounds the objects before any is made (an overestimate). An
# AdmissionReview of a ConfigMap has a few hundred (an UPDATE of 10,000 keys of data: 80,000); its config is one
# string.
MAX_JSON_VALUES = 200_000
# A string, or one never closed up to the end of the body (broken JSON, refused by json.loads). Taking the unclosed
# one whole keeps the scan linear: a scan that gave up on it and went on from its next byte would start a string at
# every escaped quote and read the rest again from there (80 KB of `"\"\"...` cost 21 s). Possessive: the regex
# engine keeps no backtracking state per escape (a config of 700,000 lines, each ending in \n, cost 94 MiB with the
# plain form).
_JSON_STRING = re.compile(rb'"[^"\\]*+(?:\\.[^"\\]*+)*+(?:"|\\?\Z)', re.DOTALL)


class Respond(Protocol):
    """review.respond's shape. `handoff` is given only to a server's `isolated` respond (review.respond itself)."""

    def __call__(self, review: object, *, abandoned: AbandonSignal | None = None, handoff: int | None = None,
                 ) -> tuple[AdmissionResponseReview, AdmissionVerdict]: ...


Answer = tuple[int, bytes, str, "str | None"]  # status, payload, content type, the line to log (None: none)


class Outgrown:
    """decision()'s answer when a small review's checks passed their handoff: it is decided again apart."""


def decision(respond: Respond, body: bytearray, started: float, abandoned: AbandonSignal,
             handoff: int | None = None) -> Answer | Outgrown | None:
    """In a decision thread or the decision process: the answer, or None when its connection went while it was
    being made."""
    if json_values(body) >= MAX_JSON_VALUES:
        return 400, b"not an AdmissionReview: more JSON values than a ConfigMap's review has\n", \
            "text/plain", None
    try:
        review = json.loads(body)
        del body
        answer, verdict = (respond(review, abandoned=abandoned) if handoff is None else
                           respond(review, abandoned=abandoned, handoff=handoff))
    except (ValueError, RecursionError, ReviewError) as exc:
        return 400, (one_line(f"not an AdmissionReview: {exc}")[:300] + "\n").encode(), "text/plain", None
    except Abandoned:
        return None
    except WorkOutgrown:
        return Outgrown()
    payload = json.dumps(answer).encode()
    logged = None
    if verdict.reviewed:
        try:
            logged = decision_line(review["request"], verdict, time.monotonic() - started)
        except Exception as exc:
            logged = f"{'admitted' if verdict.allowed else 'denied'} a review (its log line failed: " \
                     f"{one_line(repr(exc))[:120]})"
    return 200, payload, "application/json", logged

def json_values(body: bytearray) -> int:
    """At least the number of values json.loads would make of `body`, up to MAX_JSON_VALUES: each string one, and
    one for each comma, colon, bracket and brace between them. Nothing is copied; 0.1 s for a 14 MB review whose
    config is one string."""
    values, start = 1, 0
    for string in _JSON_STRING.finditer(body):
        values += 1 + _separators(body, start, string.start())
        start = string.end()
        if values >= MAX_JSON_VALUES:
            return values
    return values + _separators(body, start, len(body))


def _separators(body: bytearray, start: int, end: int) -> int:
    return sum(body.count(mark, start, end) for mark in (b",", b":", b"[", b"{"))


def _field(value: object, key: str) -> object:
    return value.get(key) if isinstance(value, dict) else None


def decision_line(request: object, verdict: AdmissionVerdict, seconds: float) -> str:
    """One log line per ConfigMap of the agent's: what, who, the verdict, how long, and the first reason. Any
    member may be missing or of the wrong type (the request is the peer's): it is shown as None."""
    outcome = "admitted" if verdict.allowed else "denied"
    first = (verdict.message or "").splitlines()[1:2] or list(verdict.warnings[:1])
    user = _field(_field(request, "userInfo"), "username")
    # a CREATE's request may name no object (generateName): the object's own metadata does
    name = _field(request, "name") or _field(_field(_field(request, "object"), "metadata"), "name")
    return one_line(f"{outcome} {_field(request, 'operation')} of ConfigMap {_field(request, 'namespace')}/"
                    f"{name} (uid {_field(request, 'uid')}, by {user}) in {seconds:.3f} s, "
                    f"{len(verdict.warnings)} warning(s){': ' + first[0][:200] if first else ''}")
