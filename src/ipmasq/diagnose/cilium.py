"""Cilium's ip-masq-agent mode (and GKE Dataplane V2): its truth is a BPF LPM map, listed by
`cilium-dbg bpf ipmasq list` inside the Cilium pod. `check --from-dump` reads that listing and compares the map's
CIDRs with what the ConfigMap means to Cilium (ipmasq.writers.cilium_map_intent).

The listing, as cilium/cilium cilium-dbg/cmd/bpf_ipmasq_list.go prints it: a tabwriter table (helpers.go
TablePrinter: cells padded with spaces) with the header `IP PREFIX/ADDRESS` and one CIDR per line in map order; an
empty map prints `No entries found.` on stderr and nothing on stdout; `-o json` prints the list of CIDRs as a JSON
array (`null` when empty). The map is an LPM trie: a destination inside any entry keeps the pod's address, so two
listings are compared as address space, and entries that differ without changing any verdict are a warning.
Pure: text in, prefixes or findings out.
"""

from __future__ import annotations

import json

from ipmasq.diagnose.check_report import CheckReport, FindingId
from ipmasq.errors import IpmasqError, PrefixError, clip
from ipmasq.findings import Finding, Severity
from ipmasq.policy.ranges import subtract, to_prefixes, union_of_prefixes
from ipmasq.prefix import Family, Prefix, parse_cidr

__all__ = ["HEADER", "check_cilium_map", "is_ipmasq_list", "parse_ipmasq_list"]

HEADER = "IP PREFIX/ADDRESS"
EMPTY = "No entries found."
_QUOTED = 6


def is_ipmasq_list(text: str) -> bool:
    """A `cilium-dbg bpf ipmasq list` listing (table, empty, or -o json), not iptables-save or nft output."""
    head = text.lstrip()
    return head.startswith((HEADER, EMPTY, "[")) or head.rstrip() == "null"


def parse_ipmasq_list(text: str, shown: str) -> frozenset[Prefix]:
    """The map's CIDRs; an error names the file and line of anything the command does not print."""
    head = text.strip()
    if head.startswith("[") or head == "null":
        try:
            listed = json.loads(head)
        except ValueError as exc:
            raise IpmasqError(f"{shown}: not the JSON of `cilium-dbg bpf ipmasq list -o json`: {exc}") from None
        if listed is None:
            return frozenset()
        if not isinstance(listed, list) or not all(isinstance(item, str) for item in listed):
            raise IpmasqError(f"{shown}: `cilium-dbg bpf ipmasq list -o json` prints a list of CIDR strings")
        return frozenset(_prefix(item, shown, None) for item in listed)
    prefixes: set[Prefix] = set()
    header_seen = False
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line == EMPTY:
            continue
        if line == HEADER and not header_seen:
            header_seen = True
            continue
        if not header_seen:
            raise IpmasqError(f"{shown}:{number}: expected the header {HEADER!r} of `cilium-dbg bpf ipmasq list`, "
                              f"got {clip(line)!r}")
        prefixes.add(_prefix(line, shown, number))
    return frozenset(prefixes)


def _prefix(text: str, shown: str, line: int | None) -> Prefix:
    try:
        return parse_cidr(text)
    except PrefixError as exc:
        where = shown if line is None else f"{shown}:{line}"
        raise IpmasqError(f"{where}: {exc} (the map holds CIDRs in network form)") from None


def _spans(prefixes: frozenset[Prefix], family: Family) -> list[tuple[int, int]]:
    return union_of_prefixes((p for p in prefixes if p.family is family), family.bits)


def _shown(family: Family, spans: list[tuple[int, int]]) -> list[str]:
    return [str(p) for first, last in spans for p in to_prefixes(family, first, last)]


def _quote(items: list[str]) -> str:
    return ", ".join(items[:_QUOTED]) + (f" and {len(items) - _QUOTED} more" if len(items) > _QUOTED else "")


def check_cilium_map(intent: frozenset[Prefix], have: frozenset[Prefix], *, map_name: str) -> CheckReport:
    """The map's CIDRs against the ConfigMap's intent, as address space per family."""
    hint = ("Cilium applies the ConfigMap when the mounted file changes (fsnotify) and keeps the map when it does not "
            "parse: read the Cilium agent's log for \"ipmasq\", and check its ConfigMap is the one mounted")
    if intent and not have:
        return CheckReport((Finding(
            FindingId.CONFIG_NOT_APPLIED, Severity.ERROR,
            f"the map {map_name} is empty: every pod connection leaving the cluster is masqueraded, the config's "
            f"{len(intent)} non-masquerade CIDR(s) are not there", hint,
            missing=tuple(sorted(str(p) for p in intent))),))
    findings: list[Finding] = []
    for family in Family:
        want, got = _spans(intent, family), _spans(have, family)
        missing = _shown(family, subtract(want, got))
        extra = _shown(family, subtract(got, want))
        if missing:
            findings.append(Finding(
                FindingId.RULES_DIFFER, Severity.ERROR,
                f"the map {map_name} lacks {_quote(missing)}: pod traffic there is masqueraded, the config keeps "
                "the pod's address", hint, missing=tuple(missing)))
        if extra:
            findings.append(Finding(
                FindingId.RULES_DIFFER, Severity.ERROR,
                f"the map {map_name} also holds {_quote(extra)}: pod traffic there keeps the pod's address, the "
                "config masquerades it", hint, extra=tuple(extra)))
    if not findings and intent != have:
        differ = sorted(str(p) for p in intent ^ have)
        findings.append(Finding(
            FindingId.RULES_DIFFER, Severity.WARNING,
            f"the map {map_name} holds other entries than the config ({_quote(differ)}) covering the same addresses: "
            "every verdict is the same", "nothing to do; Cilium rewrites the map on its next config change"))
    return CheckReport(tuple(findings))
