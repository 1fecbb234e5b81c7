"""Lint one ip-masq-agent config (a file, or the string embedded in a ConfigMap) with the agent's own rules.

The semantics come from config.document and config.validate, so lint and the agent can never disagree about
what is an error; lint adds what the agent accepts silently (unknown keys, shadowed entries, folded lists) and
keeps going after the first problem.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from difflib import get_close_matches

import yaml

from ipmasq.config.document import YAML_LOADER, Document, DocumentNode, Field, parse_document
from ipmasq.config.model import (
    DEFAULT_CIDR_LIMIT,
    DEFAULT_NON_MASQUERADE,
    LINK_LOCAL_V4,
    LINK_LOCAL_V6,
    RESERVED_NON_MASQUERADE,
    Entry,
    Origin,
)
from ipmasq.config.validate import (
    KNOWN_KEYS,
    cidr_entry,
    cidr_limit_message,
    configured_ipv6,
    field_errors,
    merge_settings,
    parse_go_duration,
    settings_from_document,
)
from ipmasq.errors import ConfigError, clip
from ipmasq.findings import Finding, Severity
from ipmasq.lint.hints import lint_finding
from ipmasq.lint.rules import lint_rules
from ipmasq.options import PolicyOptions
from ipmasq.policy.budget import WorkBudget
from ipmasq.policy.policy import Policy
from ipmasq.policy.ranges import cut_points, to_prefixes
from ipmasq.prefix import Family, Prefix, parse_cidr

__all__ = ["Expectations", "Placement", "is_indentation_problem", "lint_config"]

_CIDR_KEYS = ("nonMasqueradeCIDRs", "masqueradeCIDRs")
# PyYAML's words for a line that is indented less or more than the block it should belong to.
_INDENT_PROBLEMS = ("did not find expected key", "did not find expected '-' indicator", "expected <block end>",
                    "bad indentation")
_MAX_CULPRITS = 5  # per declared range: a /0 against 100,000 entries must not print 100,000 findings
# Below this, the agent's resync loop (re-reading the kernel's rules and repairing drift) runs all the time.
_SHORT_RESYNC_SECONDS = 1.0
# A line that starts or ends a YAML document; without one past the text's start there is a single document.
_DOCUMENT_MARKER = re.compile(r"^(?:---|\.\.\.)(?=[ \t\r\n]|$)", re.MULTILINE)
_COMMENTS_ONLY = re.compile(r"(?:[ \t]*(?:#[^\n]*)?\r?\n)*")


@dataclass(frozen=True, slots=True)
class Placement:
    """Where the config's text sits in the file being linted.

    Line n of the config is line n + line_offset of the file, column c is c + column_offset. When the text is
    a quoted string with escapes (`kubectl get -o json` output), positions cannot be mapped back: every finding
    is reported at the anchor, the line of the `config:` key.
    """

    line_offset: int = 0
    column_offset: int = 0
    exact: bool = True
    anchor_line: int = 1
    anchor_column: int | None = 1

    def map(self, line: int | None, column: int | None) -> tuple[int | None, int | None]:
        if line is None or not self.exact:
            return self.anchor_line, self.anchor_column
        return line + self.line_offset, None if column is None else column + self.column_offset

    def line(self, line: int | None) -> int | None:
        return self.map(line, None)[0]


@dataclass(frozen=True, slots=True)
class Expectations:
    """Ranges the operator declares must be masqueraded (a VPN peer that allows node IPs) or must keep the pod IP;
    the pod ranges (a snatTo there cannot work) and the node names (the fleet node-scoped rules are checked on)."""

    must_masquerade: tuple[Prefix, ...] = ()
    must_preserve: tuple[Prefix, ...] = ()
    pod_ranges: tuple[Prefix, ...] = ()
    node_names: tuple[str, ...] = ()


def is_indentation_problem(message: str, text: str, line: int | None) -> bool:
    """Whether a YAML syntax error is, in practice, a line indented wrongly (or with a tab)."""
    if any(problem in message for problem in _INDENT_PROBLEMS):
        return True
    if line is not None and "cannot start any token" in message:
        lines = text.splitlines()
        if 0 < line <= len(lines):
            raw = lines[line - 1]
            return "\t" in raw[: len(raw) - len(raw.lstrip())] or raw.lstrip().startswith("\t")
    return False


class _Linter:
    def __init__(self, text: str, source: str, placement: Placement, options: PolicyOptions) -> None:
        self.text = text
        self.lines = text.splitlines()
        self.source = source
        self.placement = placement
        self.options = options
        self.findings: list[Finding] = []
        self.columns: dict[int | None, int | None] = {}  # line -> column of CIDR entries, for must-* findings

    def add(self, id_: str, severity: Severity, message: str, line: int | None, column: int | None = None) -> None:
        mapped_line, mapped_column = self.placement.map(line, column)
        self.findings.append(lint_finding(self.source, mapped_line, mapped_column, id_, severity, message))

    def error(self, exc: ConfigError, fallback: str) -> None:
        self.add(exc.code or fallback, Severity.ERROR, exc.message, exc.line, exc.column)

    def where(self, line: int | None) -> str:
        mapped = self.placement.line(line)
        return "built-in" if mapped is None else f"line {mapped}"


def lint_config(text: str, *, source: str, placement: Placement | None = None,
                options: PolicyOptions | None = None, expect: Expectations | None = None,
                whole_file: bool = False, budget: WorkBudget | None = None) -> list[Finding]:
    """Every finding for one config text; pure (no I/O).

    budget: the work the rules' checks may do (ipmasq.policy.budget); the rules it leaves unchecked are named in a
    rules-not-checked finding. None (ipmasq lint): every rule is checked, however long that takes.

    whole_file: the text is a config file of its own (not a ConfigMap's data.config), so a file that sets nothing
    is reported: the agent would run with its built-in defaults, which is rarely what a file was written for.
    """
    linter = _Linter(text, source, placement or Placement(), options or PolicyOptions())
    try:
        doc = parse_document(text.encode("utf-8", "surrogatepass"), source)
    except ConfigError as exc:
        if exc.code == "yaml-syntax" and is_indentation_problem(exc.message, text, exc.line):
            exc.code = "indentation"
        linter.error(exc, "yaml-syntax")
        return linter.findings
    except RecursionError:
        linter.add("yaml-syntax", Severity.ERROR, "the config is nested too deeply to be an ip-masq-agent config",
                   None)
        return linter.findings
    # IPv6 as the agent would decide it: the flag when given, else this config's enableIPv6
    linter.options = linter.options.resolve_ipv6(configured_ipv6(doc))
    _check_documents(linter)
    if whole_file and (doc is None or not doc.fields):
        _report_empty(linter, doc)
    seen = _check_keys(linter, doc)
    _check_purpose(linter, doc, seen)
    lists, good_fields = _check_fields(linter, doc, seen) if doc is not None else ({}, [])
    _check_settings(linter, seen)
    _check_overlaps(linter, lists)
    _check_default_conflicts(linter, seen, lists)
    _check_limit(linter, seen, lists)
    policy = _lenient_policy(doc, good_fields, lists, linter.options)
    if policy is not None and expect is not None:
        _check_expectations(linter, policy, expect, seen)
    if policy is not None and policy.config.rules:
        expect = expect or Expectations()
        lint_rules(policy.config, policy, linter.add, linter.where, pod_ranges=expect.pod_ranges,
                   node_names=expect.node_names, budget=budget)
    return linter.findings


def _default_ranges(options: PolicyOptions) -> str:
    """The agent's default non-masquerade list, as the flags choose it."""
    if options.nomasq_all_reserved_ranges:
        return "RFC 1918 and the other reserved ranges of --nomasq-all-reserved-ranges"
    return ", ".join(DEFAULT_NON_MASQUERADE)


def _report_empty(linter: _Linter, doc: Document | None) -> None:
    what = "holds no settings (it is empty, only comments, or an empty first document)" if doc is None \
        else "is an empty mapping"
    linter.add("empty-config", Severity.WARNING,
               f"the file {what}: the agent runs with its built-in defaults ({_default_ranges(linter.options)} and "
               f"link-local {LINK_LOCAL_V4} keep the pod IP, everything else is masqueraded)", 1)


def _document_starts(text: str) -> list[tuple[int, bool]]:
    """(line, holds something) of each YAML document in the text; [] when it can only be one document.

    The loader, like go-yaml's Unmarshal in the reference, reads the first document only. The event parser runs
    only when a document marker follows the text's start: a 100,000-entry config is never parsed twice.
    """
    if text.lstrip().startswith("{"):
        return []  # JSON: one value
    markers = list(_DOCUMENT_MARKER.finditer(text))
    if not markers or (len(markers) == 1 and markers[0].group() == "---"
                       and _COMMENTS_ONLY.fullmatch(text, 0, markers[0].start())):
        return []
    starts: list[tuple[int, bool]] = []
    first_event = False
    try:
        for event in yaml.parse(text, Loader=YAML_LOADER):
            if isinstance(event, yaml.DocumentStartEvent):
                mark = event.start_mark
                starts.append((mark.line + 1 if mark is not None else 1, False))
                first_event = True
            elif first_event:
                first_event = False
                # an empty document is one plain, untagged, empty scalar (`---` followed by nothing or comments)
                empty = (isinstance(event, yaml.ScalarEvent) and event.value == "" and event.implicit[0]
                         and event.anchor is None)
                starts[-1] = (starts[-1][0], not empty)
    except yaml.YAMLError:
        return []  # not reached: the loader parsed this text already
    return starts


def _check_documents(linter: _Linter) -> None:
    starts = _document_starts(linter.text)
    ignored = [line for line, holds_something in starts[1:] if holds_something]
    if not ignored:
        return
    more = f" and {len(ignored) - 1} more after it are" if len(ignored) > 1 else " is"
    first = "" if starts[0][1] else " (the first document is empty, so the agent runs with its built-in defaults)"
    linter.add("ignored-document", Severity.WARNING,
               f"the agent reads only the first YAML document of its config; this document{more} ignored{first}",
               ignored[0])


def _is_empty_list(node: DocumentNode) -> bool:
    """`[]`, or `null` (nothing after the key), which the agent reads as an empty list."""
    if node.kind == "list":
        return not node.value
    return node.kind == "scalar" and node.value is None


def _check_settings(linter: _Linter, seen: dict[str, Field]) -> None:
    """Values the agent accepts that make it do something its reader rarely wants."""
    non_masq = seen.get("nonMasqueradeCIDRs")
    if non_masq is not None and _is_empty_list(non_masq.value):
        written = "[]" if non_masq.value.kind == "list" else "null"
        masq_link_local = seen.get("masqLinkLocal")
        kept = [] if masq_link_local is not None and masq_link_local.value.value is True else [str(LINK_LOCAL_V4)]
        masq_link_local_v6 = seen.get("masqLinkLocalIPv6")
        if linter.options.enable_ipv6 and not (masq_link_local_v6 is not None
                                               and masq_link_local_v6.value.value is True):
            kept.append(str(LINK_LOCAL_V6))
        but = f" but link-local {' and '.join(kept)}" if kept else ", link-local included,"
        linter.add("empty-non-masquerade", Severity.WARNING,
                   f"nonMasqueradeCIDRs is empty ({written}): every destination{but} is masqueraded. Only an absent "
                   f"key brings back the defaults ({_default_ranges(linter.options)})",
                   non_masq.line, non_masq.column)
    resync = seen.get("resyncInterval")
    if resync is not None and isinstance(resync.value.value, str) and resync.value.kind == "scalar":
        try:
            seconds = parse_go_duration(resync.value.value)
        except ValueError:
            return  # bad-duration, reported with the field's errors
        if 0 < seconds < _SHORT_RESYNC_SECONDS:
            linter.add("short-resync-interval", Severity.WARNING,
                       f"resyncInterval {clip(resync.value.value)} is under {_SHORT_RESYNC_SECONDS:g}s: the agent "
                       "re-reads and re-checks the kernel's rules continuously, spending a CPU on it",
                       resync.value.line, resync.value.column)


def _check_keys(linter: _Linter, doc: Document | None) -> dict[str, Field]:
    seen: dict[str, Field] = {}
    for f in doc.fields if doc is not None else []:
        canonical = KNOWN_KEYS.get(f.key.lower())
        if canonical is None:
            near = get_close_matches(f.key.lower(), list(KNOWN_KEYS), n=1, cutoff=0.75)
            if near:
                # a near miss is a typo: the setting the author meant is silently not applied
                linter.add("unknown-key", Severity.ERROR,
                           f"unknown key {f.key!r} is ignored by the agent; did you mean {KNOWN_KEYS[near[0]]!r}?",
                           f.line, f.column)
            else:
                linter.add("unknown-key", Severity.WARNING, f"unknown key {f.key!r} is ignored by the agent",
                           f.line, f.column)
            continue
        if f.key != canonical:
            linter.add("key-case", Severity.WARNING,
                       f"{f.key!r} works (the agent matches keys case-insensitively), but the documented spelling "
                       f"is {canonical!r}", f.line, f.column)
        if canonical in seen:
            first = seen[canonical]
            linter.add("duplicate-key", Severity.WARNING,
                       f"{f.key!r} repeats {first.key!r} from {linter.where(first.line)}; the agent uses only this "
                       "last one", f.line, f.column)
        seen[canonical] = f
    return seen


def _check_purpose(linter: _Linter, doc: Document | None, seen: dict[str, Field]) -> None:
    """A config whose keys are all unknown is some other file: `kubectl create configmap --from-file=config=FILE`
    takes whatever FILE was at hand, most often the ConfigMap's own manifest or a `kubectl get -o yaml` of it. The
    agent accepts it and runs with its built-in defaults, which cannot be what its author meant."""
    if doc is None or not doc.fields or seen:
        return
    if any(f.id == "unknown-key" and f.severity is Severity.ERROR for f in linter.findings):
        return  # a misspelt key of the agent's: that finding names the key meant
    keys = [f.key for f in doc.fields]
    # its unknown-key warnings say less than the one error below
    linter.findings = [f for f in linter.findings if f.id != "unknown-key" or f.severity is not Severity.WARNING]
    first = doc.fields[0]
    if "apiVersion" in keys and "kind" in keys:
        kind = next((f.value.value for f in doc.fields if f.key == "kind"), None)
        shown = f" (kind: {clip(kind)})" if isinstance(kind, str) else ""
        linter.add("config-is-manifest", Severity.ERROR,
                   f"the config is a Kubernetes manifest{shown}, not an ip-masq-agent config: the agent ignores "
                   f"{', '.join(clip(k) for k in keys[:4])} and runs with its built-in defaults "
                   f"({_default_ranges(linter.options)})", first.line, first.column)
        return
    shown = ", ".join(repr(clip(k)) for k in keys[:4]) + (f" and {len(keys) - 4} more" if len(keys) > 4 else "")
    linter.add("no-known-key", Severity.ERROR,
               f"none of the config's keys ({shown}) is one the agent reads, so it runs with its built-in defaults "
               f"({_default_ranges(linter.options)}): this is not an ip-masq-agent config", first.line, first.column)


def _folded_continuation(linter: _Linter, node: DocumentNode) -> int | None:
    """The line YAML folded into this plain scalar (a list item indented deeper than its siblings), if any."""
    value = node.value
    if node.quoted or node.line is None or not isinstance(value, str) or " " not in value:
        return None
    if not 0 < node.line <= len(linter.lines) or value in linter.lines[node.line - 1]:
        return None
    for number in range(node.line + 1, len(linter.lines) + 1):
        if linter.lines[number - 1].strip():
            return number
    return None


def _check_fields(linter: _Linter, doc: Document,
                  seen: dict[str, Field]) -> tuple[dict[str, list[tuple[Entry, DocumentNode]]], list[Field]]:
    lists: dict[str, list[tuple[Entry, DocumentNode]]] = {}
    good: list[Field] = []
    enable_ipv6 = bool(linter.options.enable_ipv6)  # resolved in lint_config
    for canonical, f in seen.items():
        if canonical in _CIDR_KEYS and f.value.kind == "list":
            valid: list[tuple[Entry, DocumentNode]] = []
            for item in f.value.value:
                folded = _folded_continuation(linter, item)
                if folded is not None:
                    raw = linter.lines[folded - 1]
                    linter.add("indentation", Severity.ERROR,
                               f"this line is indented deeper than the item above it, so YAML folds both into one "
                               f"value: {item.value!r}", folded, len(raw) - len(raw.lstrip()) + 1)
                    continue
                linter.columns[item.line] = item.column
                try:
                    valid.append((cidr_entry(doc, canonical, item, enable_ipv6=enable_ipv6), item))
                except ConfigError as exc:
                    linter.error(exc, "invalid-cidr")
            lists[canonical] = valid
            good.append(Field(f.key, f.line, DocumentNode([n for _, n in valid], f.value.line, kind="list"), f.column))
            continue
        errors = field_errors(doc, f, enable_ipv6=enable_ipv6)
        for problem in errors:
            linter.error(problem, "wrong-type")
        if not errors:
            good.append(f)
    return lists, good


def _check_overlaps(linter: _Linter, lists: dict[str, list[tuple[Entry, DocumentNode]]]) -> None:
    """Duplicates, entries inside another entry of the same list, and a prefix in both lists, in one sweep.

    An entry is redundant when the nearest entry enclosing it is of the same list: with longest-prefix-wins
    (and, without masqueradeCIDRs, with the reference's first match) that entry decides the same addresses the
    same way. An exception between them (nonMasq 10/8 > masq 10.11/16 > nonMasq 10.11.1/24) makes it count.
    """
    combined = [(e.prefix, order, key, e, node)
                for key, entries in lists.items() for order, (e, node) in enumerate(entries)]
    combined.sort(key=lambda t: (t[0].family, t[0].network, t[0].length, t[2], t[1]))
    stack: list[tuple[Prefix, str, Entry]] = []
    for prefix, _, key, entry, node in combined:
        while stack and (stack[-1][0].family != prefix.family or stack[-1][0].last < prefix.network):
            stack.pop()
        if stack:
            top_prefix, top_key, top_entry = stack[-1]
            if top_prefix == prefix:
                if top_key == key:
                    linter.add("duplicate-cidr", Severity.WARNING,
                               f"{prefix} repeats the entry at {linter.where(top_entry.line)}", node.line, node.column)
                else:
                    linter.add("conflicting-cidr", Severity.ERROR,
                               f"{prefix} is listed both in {top_key} ({linter.where(top_entry.line)}) and in {key}",
                               node.line, node.column)
                continue
            if top_key == key:
                linter.add("shadowed-cidr", Severity.WARNING,
                           f"{prefix} is inside {top_prefix} ({linter.where(top_entry.line)}) of the same list, so it "
                           "changes nothing", node.line, node.column)
        stack.append((prefix, key, entry))


def _default_prefixes(options: PolicyOptions) -> list[str]:
    return list(DEFAULT_NON_MASQUERADE + (RESERVED_NON_MASQUERADE if options.nomasq_all_reserved_ranges else ()))


def _check_default_conflicts(linter: _Linter, seen: dict[str, Field],
                             lists: dict[str, list[tuple[Entry, DocumentNode]]]) -> None:
    """Without nonMasqueradeCIDRs the agent's built-in list is the non-masquerade list, and a masqueradeCIDRs entry
    equal to one of its prefixes makes the agent refuse the whole config, as when both lists of the file hold it."""
    if "nonMasqueradeCIDRs" in seen:
        return
    defaults = {parse_cidr(text) for text in _default_prefixes(linter.options)}
    for entry, node in lists.get("masqueradeCIDRs", []):
        if entry.prefix in defaults:
            linter.add("conflicting-cidr", Severity.ERROR,
                       f"{entry.prefix} is listed in masqueradeCIDRs and is one of the built-in nonMasqueradeCIDRs "
                       "(this file sets none, so the agent's defaults apply): the agent refuses the config",
                       node.line, node.column)


def _check_limit(linter: _Linter, seen: dict[str, Field], lists: dict[str, list[tuple[Entry, DocumentNode]]]) -> None:
    non_masq_field = seen.get("nonMasqueradeCIDRs")
    if non_masq_field is None:
        # absent: the agent's defaults count
        non_masq = len(_default_prefixes(linter.options))
    else:
        non_masq = len(non_masq_field.value.value) if non_masq_field.value.kind == "list" else 0
    masq_field = seen.get("masqueradeCIDRs")
    masq = len(masq_field.value.value) if masq_field is not None and masq_field.value.kind == "list" else 0
    limit_field = seen.get("cidrLimit")
    limit = DEFAULT_CIDR_LIMIT
    if limit_field is not None and isinstance(limit_field.value.value, int) \
            and not isinstance(limit_field.value.value, bool) and not limit_field.value.quoted:
        limit = limit_field.value.value
    message = cidr_limit_message(non_masq, masq, limit)
    if message is not None:
        anchor = non_masq_field or masq_field or limit_field
        linter.add("too-many-cidrs", Severity.ERROR, message, anchor.line if anchor else None,
                   anchor.column if anchor else None)


def _lenient_policy(doc: Document | None, good: list[Field], lists: dict[str, list[tuple[Entry, DocumentNode]]],
                    options: PolicyOptions) -> Policy | None:
    """The policy the valid part of the config describes, so that must-* checks run despite other findings."""
    if doc is None:
        return Policy(merge_settings([], all_reserved=options.nomasq_all_reserved_ranges,
                                     enable_ipv6=options.enable_ipv6), options)
    try:
        settings = settings_from_document(Document(doc.source, good, doc.text),
                                          enable_ipv6=bool(options.enable_ipv6))
        if settings.masquerade:
            preserved = {e.prefix for e, _ in lists.get("nonMasqueradeCIDRs", [])}
            settings.masquerade = [e for e in settings.masquerade if e.prefix not in preserved]
        # too-many-cidrs is already reported: evaluate the rest as if cidrLimit were raised
        total = len(settings.non_masquerade or ()) + len(settings.masquerade or ()) + 16
        settings.cidr_limit = max(total, DEFAULT_CIDR_LIMIT)
        config = merge_settings([settings], all_reserved=options.nomasq_all_reserved_ranges,
                                enable_ipv6=options.enable_ipv6)
    except ConfigError:
        return None
    return Policy(config, options)


def _segments(policy: Policy, family: Family, first: int, last: int) -> Iterator[tuple[int, int, Entry | None]]:
    """first..last cut where the deciding entry changes; verdict boundaries only fall on prefix edges."""
    entries = policy.rule_entries(family) if family in policy.families else ()
    points = cut_points(first, last, [edge for e in entries for edge in (e.prefix.network, e.prefix.last + 1)])
    for i, start in enumerate(points):
        end = points[i + 1] - 1 if i + 1 < len(points) else last
        yield start, end, policy.verdict_for(family, start).entry


def _check_expectations(linter: _Linter, policy: Policy, expect: Expectations, seen: dict[str, Field]) -> None:
    for id_, declared, want_masquerade in (
        [("must-masquerade", p, True) for p in expect.must_masquerade]
        + [("must-preserve", p, False) for p in expect.must_preserve]
    ):
        family = declared.family
        if family not in policy.families:
            if want_masquerade:
                linter.add(id_, Severity.ERROR,
                           f"{declared} must be masqueraded, but without --enable-ipv6 the agent writes no IPv6 "
                           "rules and every pod IPv6 address leaves unchanged", None)
            continue
        wrong: dict[Entry | None, list[tuple[int, int]]] = {}
        for start, end, entry in _segments(policy, family, declared.first, declared.last):
            masquerade = True if entry is None else entry.masquerade
            if masquerade != want_masquerade:
                wrong.setdefault(entry, []).append((start, end))
        for count, (entry, pieces) in enumerate(wrong.items()):
            if count == _MAX_CULPRITS:
                linter.add(id_, Severity.ERROR, f"{declared}: and {len(wrong) - count} more entries like these", None)
                break
            _report_culprit(linter, id_, declared, entry, pieces, want_masquerade=want_masquerade, seen=seen)


def _report_culprit(linter: _Linter, id_: str, declared: Prefix, entry: Entry | None, pieces: list[tuple[int, int]],
                    *, want_masquerade: bool, seen: dict[str, Field]) -> None:
    covered = [p for first, last in pieces for p in to_prefixes(declared.family, first, last)]
    shown = ", ".join(str(p) for p in covered[:4]) + (f" and {len(covered) - 4} more" if len(covered) > 4 else "")
    wanted = "be masqueraded" if want_masquerade else "keep the pod IP"
    actual = "keeps the pod IP" if want_masquerade else "is masqueraded"
    line: int | None
    column: int | None = None
    if entry is None:
        anchor = seen.get("nonMasqueradeCIDRs")
        line, column = (anchor.line, anchor.column) if anchor else (None, None)
        because = "the final MASQUERADE rule (no nonMasqueradeCIDRs entry covers it)"
    elif entry.origin is Origin.DEFAULT:
        line = None
        because = f"{entry.prefix} from the agent's default list (the config sets no nonMasqueradeCIDRs)"
    elif entry.origin is Origin.LINK_LOCAL:
        anchor = seen.get("masqLinkLocal") if entry.prefix.family is Family.V4 else seen.get("masqLinkLocalIPv6")
        line, column = (anchor.line, anchor.column) if anchor else (None, None)
        because = f"the link-local rule for {entry.prefix} (masqLinkLocal is not set)"
    else:
        key = "masqueradeCIDRs" if entry.masquerade else "nonMasqueradeCIDRs"
        line, column = entry.line, linter.columns.get(entry.line)
        because = f"the {key} entry {entry.prefix} ({linter.where(entry.line)})"
    linter.add(id_, Severity.ERROR, f"{declared} must {wanted}, but {shown} {actual} because of {because}",
               line, column)
