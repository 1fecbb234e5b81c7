"""Document -> MasqConfig, with the reference agent's rules and our extensions (masqueradeCIDRs, config directories).

Every error names the file, the line where known, and the offending value, in one line. The `rules:` section is
checked by ipmasq.config.rules.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

from ipmasq.config.document import Document, DocumentNode, Field, clip, describe_node, node_error, show_value
from ipmasq.config.model import (
    DEFAULT_CIDR_LIMIT,
    DEFAULT_RESYNC_SECONDS,
    Entry,
    MasqConfig,
    Origin,
    Rule,
    default_entries,
)
from ipmasq.config.rules import rule_errors, rules_from_field
from ipmasq.errors import ConfigError, PrefixError
from ipmasq.prefix import Family, Prefix, parse_cidr

__all__ = [
    "KNOWN_KEYS",
    "FileSettings",
    "cidr_entry",
    "cidr_limit_message",
    "configured_ipv6",
    "field_errors",
    "merge_settings",
    "parse_go_duration",
    "settings_from_document",
]

# Documented spelling by lower-cased key: Go's encoding/json matches struct fields case-insensitively.
KNOWN_KEYS = {
    k.lower(): k
    for k in (
        "nonMasqueradeCIDRs",
        "masqueradeCIDRs",
        "cidrLimit",
        "masqLinkLocal",
        "masqLinkLocalIPv6",
        "resyncInterval",
        "rules",
        "enableIPv6",
    )
}


@dataclass
class FileSettings:
    """What one file set; None: not set there (the reference keeps its default for absent keys)."""

    source: str
    non_masquerade: list[Entry] | None = None
    masquerade: list[Entry] | None = None
    cidr_limit: int | None = None
    masq_link_local: bool | None = None
    masq_link_local_ipv6: bool | None = None
    resync_interval: float | None = None
    rules: list[Rule] | None = None
    enable_ipv6: bool | None = None
    lines: dict[str, int | None] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)


def settings_from_document(doc: Document, *, enable_ipv6: bool,
                           honoured: Collection[str] | None = None) -> FileSettings:
    """One file's settings; `enable_ipv6` False refuses IPv6 CIDRs here (the flag said no), True accepts them (the
    flag said yes, or the files' enableIPv6 decides once merged: merge_settings checks). `honoured`: the keys read
    (a provider's agent reads fewer than ipmasq: ipmasq.writers); the others are skipped unchecked, as that agent
    skips them (None: every known key)."""
    settings = FileSettings(doc.source)
    seen: dict[str, Field] = {}
    for f in doc.fields:
        canonical = KNOWN_KEYS.get(f.key.lower())
        if canonical is None:
            settings.warnings.append(f"{doc.source}:{f.line}: unknown key {clip(f.key)!r} ignored")
            continue
        if honoured is not None and canonical not in honoured:
            continue  # the writer's own finding (ignored-by-writer) says what that does
        if canonical in seen:
            settings.warnings.append(
                f"{doc.source}:{f.line}: {f.key!r} repeats {seen[canonical].key!r} (line {seen[canonical].line}); "
                "the last one wins"
            )
        seen[canonical] = f
    for canonical, f in seen.items():
        settings.lines[canonical] = f.line
        _apply_field(settings, canonical, f, doc, enable_ipv6=enable_ipv6)
    return settings


def field_errors(doc: Document, f: Field, *, enable_ipv6: bool) -> list[ConfigError]:
    """Every error the agent would raise for one known field, not only the first: `lint` reports them all."""
    canonical = KNOWN_KEYS[f.key.lower()]
    if canonical == "rules":
        return rule_errors(doc, f, enable_ipv6=enable_ipv6)
    if canonical in ("nonMasqueradeCIDRs", "masqueradeCIDRs") and f.value.kind == "list":
        errors = []
        for item in f.value.value:
            try:
                cidr_entry(doc, canonical, item, enable_ipv6=enable_ipv6)
            except ConfigError as exc:
                errors.append(exc)
        return errors
    try:
        _apply_field(FileSettings(doc.source), canonical, f, doc, enable_ipv6=enable_ipv6)
    except ConfigError as exc:
        return [exc]
    return []


def _apply_field(settings: FileSettings, key: str, f: Field, doc: Document, *, enable_ipv6: bool) -> None:
    node = f.value
    if key in ("nonMasqueradeCIDRs", "masqueradeCIDRs"):
        masquerade = key == "masqueradeCIDRs"
        entries = _cidr_list(doc, f, masquerade=masquerade, enable_ipv6=enable_ipv6)
        if masquerade:
            settings.masquerade = entries
        else:
            settings.non_masquerade = entries
    elif key == "cidrLimit":
        if node.value is None:
            return  # Go: null leaves the default in place
        if node.kind != "scalar" or isinstance(node.value, bool) or not isinstance(node.value, int) or node.quoted:
            raise node_error(doc, node, f.key, f"cidrLimit must be a whole number, got {describe_node(node)}",
                             "wrong-type")
        settings.cidr_limit = node.value
    elif key in ("masqLinkLocal", "masqLinkLocalIPv6"):
        if node.value is None:
            return
        if node.kind != "scalar" or not isinstance(node.value, bool) or node.quoted:
            raise node_error(doc, node, f.key, f"{key} must be true or false (unquoted), got {describe_node(node)}",
                             "wrong-type")
        if key == "masqLinkLocal":
            settings.masq_link_local = node.value
        else:
            settings.masq_link_local_ipv6 = node.value
    elif key == "resyncInterval":
        if node.kind != "scalar" or not isinstance(node.value, str):
            # The reference's own words (its Duration decoder accepts only JSON strings).
            if node.kind != "scalar":
                shown = node.kind
            else:
                shown = "null" if node.value is None else clip(json.dumps(node.value))
            if isinstance(node.value, bool):
                shown = str(node.value).lower()
            message = f'expected string value for unmarshal to field of type Duration, got "{shown}"'
            raise node_error(doc, node, f.key, f"resyncInterval: {message}", "wrong-type")
        try:
            seconds = parse_go_duration(node.value)
        except ValueError as exc:
            raise node_error(doc, node, node.value, f"resyncInterval: {exc}", "bad-duration") from None
        if seconds <= 0:
            raise node_error(doc, node, node.value, f'resyncInterval must be above zero, got "{clip(node.value)}" '
                             "(the reference would busy-loop)", "bad-duration")
        settings.resync_interval = seconds
    elif key == "rules":
        settings.rules = rules_from_field(doc, f, enable_ipv6=enable_ipv6)
    elif key == "enableIPv6":
        if node.value is None:
            return
        if node.kind != "scalar" or not isinstance(node.value, bool) or node.quoted:
            raise node_error(doc, node, f.key,
                             f"enableIPv6 must be true or false (unquoted), got {describe_node(node)}", "wrong-type")
        settings.enable_ipv6 = node.value


def configured_ipv6(doc: Document | None) -> bool | None:
    """A document's enableIPv6 when it is a valid true/false (the last one wins), else None: what the offline tools
    that read one document at a time take as the config's word on IPv6."""
    value: bool | None = None
    for f in doc.fields if doc is not None else ():
        node = f.value
        if f.key.lower() == "enableipv6" and node.kind == "scalar" and isinstance(node.value, bool) and not node.quoted:
            value = node.value
    return value


def _cidr_list(doc: Document, f: Field, *, masquerade: bool, enable_ipv6: bool) -> list[Entry]:
    node = f.value
    key = "masqueradeCIDRs" if masquerade else "nonMasqueradeCIDRs"
    if node.value is None and node.kind == "scalar":
        return []  # `null` is an empty list, as in Go
    if node.kind != "list":
        raise node_error(doc, node, f.key, f"{key} must be a list of CIDRs, got {describe_node(node)}", "wrong-type")
    items: Sequence[DocumentNode] = node.value
    return [cidr_entry(doc, key, item, enable_ipv6=enable_ipv6) for item in items]


def cidr_entry(doc: Document, key: str, item: DocumentNode, *, enable_ipv6: bool) -> Entry:
    """One item of nonMasqueradeCIDRs or masqueradeCIDRs (`key`), checked as the agent checks it."""
    text = item.value
    if item.kind != "scalar" or not isinstance(text, str):
        raise node_error(doc, item, str(text), f"{key}: each entry must be a CIDR string, got {describe_node(item)}",
                         "wrong-type")
    try:
        prefix = parse_cidr(text)
    except PrefixError as exc:
        code = "misaligned-cidr" if "not aligned" in str(exc) else "invalid-cidr"
        clipped = clip(text)
        message = str(exc) if clipped == text else str(exc).replace(text, clipped)
        raise node_error(doc, item, text, message, code) from None
    if prefix.family is Family.V6 and not enable_ipv6:
        raise node_error(doc, item, text,
                         f"ipv6 is not enabled, but ipv6 cidr {text} provided. "
                         "Enable ipv6 using --enable-ipv6 agent flag", "ipv6-disabled")
    masquerade = key == "masqueradeCIDRs"
    return Entry(prefix, masquerade, Origin.EXCEPTION if masquerade else Origin.CONFIG, doc.source, item.line)


# --- Go durations -------------------------------------------------------------------------------------------

_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_DURATION_PART = re.compile(r"(\d*\.?\d*)([^\d.]*)")
# Go's Duration is int64 nanoseconds: at most 2562047h47m16.854775807s (~292 years); longer is an overflow, which
# time.ParseDuration reports as an invalid duration (and Python's select() as an OverflowError, much later).
_MAX_DURATION_SECONDS = (2**63 - 1) / 1e9


def parse_go_duration(text: str) -> float:
    """Go's time.ParseDuration, in seconds; ValueError with Go's message otherwise."""
    quoted = show_value(text)
    s = text
    sign = 1.0
    if s[:1] in "+-" and s:
        sign = -1.0 if s[0] == "-" else 1.0
        s = s[1:]
    if s == "0":
        return 0.0
    if not s:
        raise ValueError(f"time: invalid duration {quoted}")
    total = 0.0
    pos = 0
    while pos < len(s):
        m = _DURATION_PART.match(s, pos)
        if m is None or not m.group(1) or m.group(1) == ".":
            raise ValueError(f"time: invalid duration {quoted}")
        number, unit = m.group(1), m.group(2)
        if not unit:
            raise ValueError(f"time: missing unit in duration {quoted}")
        if unit not in _UNITS:
            raise ValueError(f'time: unknown unit "{clip(unit)}" in duration {quoted}')
        total += float(number) * _UNITS[unit]
        pos = m.end()
    if not total <= _MAX_DURATION_SECONDS:  # `not`: also NaN-proof, and inf from a 400-digit number
        raise ValueError(f"time: invalid duration {quoted}")
    return sign * total


# --- merging files -----------------------------------------------------------------------------------------


def _scalar_from(files: list[FileSettings], attr: str, key: str, default: Any) -> Any:
    chosen: FileSettings | None = None
    for s in files:
        value = getattr(s, attr)
        if value is None:
            continue
        if chosen is not None and getattr(chosen, attr) != value:
            raise ConfigError(
                f"{key} conflicts: {chosen.source}:{chosen.lines.get(key)} sets {clip(repr(getattr(chosen, attr)))}, "
                f"{s.source}:{s.lines.get(key)} sets {clip(repr(value))}",
                source=s.source, line=s.lines.get(key),
            )
        chosen = s
    return default if chosen is None else getattr(chosen, attr)


def merge_settings(files: list[FileSettings], *, all_reserved: bool, enable_ipv6: bool | None) -> MasqConfig:
    """Merge the files of a config directory (one file: the reference's semantics exactly). `enable_ipv6`: the
    --enable-ipv6 flag (None: not given, the files' enableIPv6 decides); IPv6 CIDRs without IPv6 are an error."""
    non_masquerade: list[Entry] | None = None
    masquerade: list[Entry] = []
    for s in files:
        if s.non_masquerade is not None:
            non_masquerade = (non_masquerade or []) + s.non_masquerade
        if s.masquerade is not None:
            masquerade += s.masquerade
    non_masq = tuple(non_masquerade) if non_masquerade is not None else default_entries(all_reserved=all_reserved)
    cidr_limit = _scalar_from(files, "cidr_limit", "cidrLimit", DEFAULT_CIDR_LIMIT)
    message = cidr_limit_message(len(non_masq), len(masquerade), cidr_limit)
    if message is not None:
        holder = next((s for s in reversed(files) if s.non_masquerade is not None or s.masquerade), None)
        # the default list over a cidrLimit set too low: the file that set it is the one to change
        holder = holder or next((s for s in reversed(files) if s.cidr_limit is not None), None)
        where = holder.source if holder else None
        line = (holder.lines.get("nonMasqueradeCIDRs") or holder.lines.get("cidrLimit")) if holder else None
        raise ConfigError(message, source=where, line=line, code="too-many-cidrs")
    _check_conflicts(non_masq, masquerade)
    rules = _merged_rules(files)
    configured_v6: bool | None = _scalar_from(files, "enable_ipv6", "enableIPv6", None)
    _check_ipv6_enabled(non_masq + tuple(masquerade), rules,
                        enabled=configured_v6 is True if enable_ipv6 is None else enable_ipv6)
    warnings = [w for s in files for w in s.warnings]
    if enable_ipv6 is not None and configured_v6 is not None and configured_v6 != enable_ipv6:
        holder = next(s for s in reversed(files) if s.enable_ipv6 is not None)
        warnings.append(f"{holder.source}:{holder.lines.get('enableIPv6')}: enableIPv6: "
                        f"{str(configured_v6).lower()} is overridden by --enable-ipv6={str(enable_ipv6).lower()} "
                        "(the flag, when given, wins)")
    warnings += _duplicate_warnings(non_masq) + _duplicate_warnings(tuple(masquerade))
    return MasqConfig(
        non_masquerade=non_masq,
        masquerade=tuple(masquerade),
        cidr_limit=cidr_limit,
        masq_link_local=_scalar_from(files, "masq_link_local", "masqLinkLocal", False),
        masq_link_local_ipv6=_scalar_from(files, "masq_link_local_ipv6", "masqLinkLocalIPv6", False),
        resync_interval=_scalar_from(files, "resync_interval", "resyncInterval", DEFAULT_RESYNC_SECONDS),
        sources=tuple(s.source for s in files),
        rules=rules,
        enable_ipv6=configured_v6,
        warnings=tuple(warnings),
    )


def _check_ipv6_enabled(entries: tuple[Entry, ...], rules: tuple[Rule, ...], *, enabled: bool) -> None:
    """IPv6 CIDRs need IPv6 on (the flag, or the config's enableIPv6): the reference refuses them, never ignores."""
    if enabled:
        return
    for e in entries:
        if e.prefix.family is Family.V6:
            # the reference's words, exactly (enableIPv6: true is the other way: lint's hint says so)
            raise ConfigError(f"ipv6 is not enabled, but ipv6 cidr {e.prefix} provided. Enable ipv6 using "
                              "--enable-ipv6 agent flag", source=e.source, line=e.line,
                              code="ipv6-disabled")
    for rule in rules:
        if rule.family is Family.V6:
            raise ConfigError(f"rule {rule.name}: ipv6 cidr {rule.destinations[0]} needs IPv6 enabled "
                              "(--enable-ipv6 or enableIPv6: true)", source=rule.source, line=rule.line,
                              code="ipv6-disabled")


def _merged_rules(files: list[FileSettings]) -> tuple[Rule, ...]:
    """Every file's rules in file-name order (the order files are read); a name is unique across them all."""
    rules: list[Rule] = []
    names: dict[str, Rule] = {}
    for s in files:
        for rule in s.rules or ():
            first = names.setdefault(rule.name, rule)
            if first is not rule:
                raise ConfigError(f"rule name {show_value(rule.name)} is used in {first.where()} and in "
                                  f"{rule.where()}; names are unique across all config files",
                                  source=rule.source, line=rule.line, code="duplicate-rule")
            rules.append(rule)
    return tuple(rules)


def cidr_limit_message(non_masquerade: int, masquerade: int, cidr_limit: int) -> str | None:
    """The reference's complaint when the lists hold more than cidrLimit CIDRs (link-local not counted)."""
    total = non_masquerade + masquerade
    if total <= cidr_limit:
        return None
    counted = "CIDRs" if not masquerade else "CIDRs (nonMasqueradeCIDRs and masqueradeCIDRs together)"
    return (f"the daemon can only accept up to {cidr_limit} CIDRs (excluding link-local), "
            f"but got {total} {counted} (excluding link local); raise cidrLimit if this is intended")


def _check_conflicts(non_masq: tuple[Entry, ...], masquerade: list[Entry]) -> None:
    if not masquerade:
        return
    by_prefix: dict[Prefix, Entry] = {e.prefix: e for e in non_masq}
    for e in masquerade:
        other = by_prefix.get(e.prefix)
        if other is not None:
            raise ConfigError(
                f"{e.prefix} is listed both in masqueradeCIDRs ({e.where()}) and in nonMasqueradeCIDRs "
                f"({other.where()}); keep it in one list",
                source=e.source, line=e.line, code="conflicting-cidr",
            )


def _duplicate_warnings(entries: tuple[Entry, ...]) -> list[str]:
    seen: dict[Prefix, Entry] = {}
    warnings = []
    for e in entries:
        first = seen.setdefault(e.prefix, e)
        if first is not e:
            warnings.append(f"{e.where()}: duplicate CIDR {e.prefix} (first at {first.where()})")
    return warnings
