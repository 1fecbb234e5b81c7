"""Character-level checks on the raw text: lookalikes that copy-pasted documentation carries."""

from __future__ import annotations

import unicodedata

from ipmasq.findings import Finding, Severity
from ipmasq.lint.hints import lint_finding

__all__ = ["LOOKALIKES", "scan_lookalikes"]

# Lookalike -> the ASCII character the author meant. A dash lookalike as a list marker turns the list into one
# folded string; a curly quote is part of the value; a no-break space is not indentation to YAML.
LOOKALIKES: dict[str, str] = {
    "\u2010": "-",  # hyphen
    "\u2011": "-",  # non-breaking hyphen
    "\u2012": "-",  # figure dash
    "\u2013": "-",  # en dash (word processors turn " - " into it)
    "\u2014": "-",  # em dash
    "\u2015": "-",  # horizontal bar
    "\u2212": "-",  # minus sign
    "\ufe58": "-",  # small em dash
    "\ufe63": "-",  # small hyphen-minus
    "\uff0d": "-",  # fullwidth hyphen-minus
    "\u2018": "'",
    "\u2019": "'",
    "\u201a": "'",
    "\u201b": "'",
    "\u2032": "'",
    "\u201c": '"',
    "\u201d": '"',
    "\u201e": '"',
    "\u201f": '"',
    "\u2033": '"',
    "\u00a0": " ",  # no-break space
    "\u2007": " ",  # figure space
    "\u202f": " ",  # narrow no-break space
    "\u3000": " ",  # ideographic space
    "\u200b": "",  # zero-width space
    "\u200c": "",  # zero-width non-joiner
    "\u200d": "",  # zero-width joiner
    "\u2060": "",  # word joiner
    "\ufeff": "",  # a byte-order mark inside the text
    "\uff1a": ":",  # fullwidth colon
    "\uff0f": "/",  # fullwidth solidus
    "\u2044": "/",  # fraction slash
    "\uff0e": ".",  # fullwidth full stop
}


def _in_comment(line: str, index: int) -> bool:
    """True when position `index` follows a YAML comment marker (a # at the start or after a space)."""
    head = line[:index]
    return head.lstrip().startswith("#") or " #" in head or "\t#" in head


def scan_lookalikes(text: str, source: str, *, first_line: int = 1) -> list[Finding]:
    findings: list[Finding] = []
    if text.isascii():
        return findings  # the common case, decided in C
    for number, line in enumerate(text.splitlines(), start=first_line):
        if line.isascii():
            continue
        for index, char in enumerate(line):
            meant = LOOKALIKES.get(char)
            if meant is None:
                continue
            name = unicodedata.name(char, f"U+{ord(char):04X}")
            comment = _in_comment(line, index)
            where = " in a comment" if comment else ""
            if meant:
                message = (f"{name} (U+{ord(char):04X}){where} looks like '{meant}' but is not: "
                           "YAML and the agent read a different character")
            else:
                message = f"invisible {name} (U+{ord(char):04X}){where}: delete it, it becomes part of the value"
            findings.append(lint_finding(source, number, index + 1, "lookalike-character",
                                         Severity.WARNING if comment else Severity.ERROR, message))
    return findings
