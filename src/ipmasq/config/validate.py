"""Document -> MasqConfig, with the reference agent's rules and our extensions (masqueradeCIDRs, config directories).

Every error names the file, the line where known, and the offending value, in one line.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

from ipmasq.config.document import Document, DocumentNode, Field, clip, show_value
from ipmasq.config.model import (
    DEFAULT_CIDR_LIMIT,
    DEFAULT_RESYNC_SECONDS,
    Entry,
    MasqConfig,
    Origin,
    Rule,
    RuleAction,
    default_entries,
)
from ipmasq.errors import ConfigError, PrefixError
from ipmasq.options import PolicyOptions
from ipmasq.policy.prefix import Family, Prefix, format_address, parse_address, parse_cidr

__all__ = [
    "KNOWN_KEYS",
    "FileSettings",
    "check_rules_with_flags",
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


def _error(doc: Document, node: DocumentNode, needle: str, message: str, code: str) -> ConfigError:
    return ConfigError(message, source=doc.source, line=doc.locate(node, needle), column=node.column, code=code)


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


def _describe(node: DocumentNode) -> str:
    if node.kind == "list":
        return "a list"
    if node.kind == "map":
        return "a mapping"
    v = node.value
    if v is None:
        return "null"
    if isinstance(v, bool):
        return f"the boolean {str(v).lower()}"
    if isinstance(v, int | float):
        return f"the number {clip(str(v))}"
    return f"the string {show_value(v)}"


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
            raise _error(doc, node, f.key, f"cidrLimit must be a whole number, got {_describe(node)}", "wrong-type")
        settings.cidr_limit = node.value
    elif key in ("masqLinkLocal", "masqLinkLocalIPv6"):
        if node.value is None:
            return
        if node.kind != "scalar" or not isinstance(node.value, bool) or node.quoted:
            raise _error(doc, node, f.key, f"{key} must be true or false (unquoted), got {_describe(node)}",
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
            raise _error(doc, node, f.key, f"resyncInterval: {message}", "wrong-type")
        try:
            seconds = parse_go_duration(node.value)
        except ValueError as exc:
            raise _error(doc, node, node.value, f"resyncInterval: {exc}", "bad-duration") from None
        if seconds <= 0:
            raise _error(doc, node, node.value,
                         f'resyncInterval must be above zero, got "{clip(node.value)}" (the reference would busy-loop)',
                         "bad-duration")
        settings.resync_interval = seconds
    elif key == "rules":
        settings.rules = _rules(doc, f, enable_ipv6=enable_ipv6)
    elif key == "enableIPv6":
        if node.value is None:
            return
        if node.kind != "scalar" or not isinstance(node.value, bool) or node.quoted:
            raise _error(doc, node, f.key, f"enableIPv6 must be true or false (unquoted), got {_describe(node)}",
                         "wrong-type")
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
        raise _error(doc, node, f.key, f"{key} must be a list of CIDRs, got {_describe(node)}", "wrong-type")
    items: Sequence[DocumentNode] = node.value
    return [cidr_entry(doc, key, item, enable_ipv6=enable_ipv6) for item in items]


def cidr_entry(doc: Document, key: str, item: DocumentNode, *, enable_ipv6: bool) -> Entry:
    """One item of nonMasqueradeCIDRs or masqueradeCIDRs (`key`), checked as the agent checks it."""
    text = item.value
    if item.kind != "scalar" or not isinstance(text, str):
        raise _error(doc, item, str(text), f"{key}: each entry must be a CIDR string, got {_describe(item)}",
                     "wrong-type")
    try:
        prefix = parse_cidr(text)
    except PrefixError as exc:
        code = "misaligned-cidr" if "not aligned" in str(exc) else "invalid-cidr"
        clipped = clip(text)
        message = str(exc) if clipped == text else str(exc).replace(text, clipped)
        raise _error(doc, item, text, message, code) from None
    if prefix.family is Family.V6 and not enable_ipv6:
        raise _error(doc, item, text,
                     f"ipv6 is not enabled, but ipv6 cidr {text} provided. "
                     "Enable ipv6 using --enable-ipv6 agent flag", "ipv6-disabled")
    masquerade = key == "masqueradeCIDRs"
    return Entry(prefix, masquerade, Origin.EXCEPTION if masquerade else Origin.CONFIG, doc.source, item.line)


# --- rules: an ordered list that is ours, so every key is known and every mistake is an error -----------------

RULE_KEYS = ("name", "destinations", "sources", "protocol", "ports", "nodes", "action", "snatTo")
RULE_NAME = re.compile(r"[a-z0-9](?:[a-z0-9-]{0,38}[a-z0-9])?\Z")
RULE_PROTOCOLS = ("tcp", "udp", "sctp", "icmp", "icmpv6")
PROTOCOLS_WITH_PORTS = ("tcp", "udp", "sctp")
_PORT_TEXT = re.compile(r"(\d{1,5})(?:-(\d{1,5}))?\Z")


def _rules(doc: Document, f: Field, *, enable_ipv6: bool) -> list[Rule]:
    """The rules, or the first mistake of them as the agent reports it (`rule_errors` has every one)."""
    rules, errors = _checked_rules(doc, f, enable_ipv6=enable_ipv6)
    if errors:
        raise errors[0]
    return rules


def rule_errors(doc: Document, f: Field, *, enable_ipv6: bool) -> list[ConfigError]:
    """Every mistake of the `rules` list, each rule's every mistake in the order the agent checks them."""
    return _checked_rules(doc, f, enable_ipv6=enable_ipv6)[1]


def _checked_rules(doc: Document, f: Field, *, enable_ipv6: bool) -> tuple[list[Rule], list[ConfigError]]:
    node = f.value
    if node.value is None and node.kind == "scalar":
        return [], []
    if node.kind != "list":
        return [], [_error(doc, node, f.key, f"rules must be a list of rules (- name: ...), got {_describe(node)}",
                           "wrong-type")]
    rules: list[Rule] = []
    errors: list[ConfigError] = []
    names: dict[str, Rule] = {}
    for index, item in enumerate(node.value):
        rule = _rule(doc, index, item, errors, enable_ipv6=enable_ipv6)
        if rule is None:
            continue
        first = names.setdefault(rule.name, rule)
        if first is not rule:
            errors.append(ConfigError(f"rules[{index}]: name {show_value(rule.name)} is used twice (first at "
                                      f"{first.where()})", source=doc.source, line=rule.line, code="duplicate-rule"))
        rules.append(rule)
    return rules, errors


class _RuleFields:
    """One rule's fields by key, and the way to report a problem with one of them. Unknown and repeated keys are
    in `errors`, not raised: every mistake of a rule is reported, not the first."""

    def __init__(self, doc: Document, index: int, item: DocumentNode) -> None:
        self.doc = doc
        self.item = item
        self.label = f"rules[{index}]"
        self.fields: dict[str, Field] = {}
        self.errors: list[ConfigError] = []
        if item.kind != "map":
            raise _error(doc, item, "-", f"{self.label}: each rule must be a mapping (name: ..., destinations: ...), "
                         f"got {_describe(item)}", "wrong-type")
        name = next((f.value.value for f in item.value if f.key == "name"), None)
        if isinstance(name, str) and RULE_NAME.match(name):
            self.label = f"rules[{index}] ({name})"  # a rule is known by its name; the index is for a bad one
        for field_ in item.value:
            if field_.key not in RULE_KEYS:
                self.errors.append(self.error(field_.value, field_.key, f"unknown key {show_value(field_.key)} "
                                              f"(known: {', '.join(RULE_KEYS)})", line=field_.line))
            elif field_.key in self.fields:
                self.errors.append(self.error(field_.value, field_.key, f"{field_.key} is given twice (first on "
                                              f"line {self.fields[field_.key].line})", line=field_.line))
            else:
                self.fields[field_.key] = field_

    def error(self, node: DocumentNode, needle: str, message: str, *, line: int | None = None) -> ConfigError:
        where = line if line is not None else self.doc.locate(node, needle)
        return ConfigError(f"{self.label}: {message}", source=self.doc.source, line=where, column=node.column,
                           code="invalid-rule")

    def get(self, key: str) -> DocumentNode | None:
        field_ = self.fields.get(key)
        if field_ is None or (field_.value.kind == "scalar" and field_.value.value is None):
            return None
        return field_.value

    def string(self, key: str, node: DocumentNode) -> str:
        if node.kind != "scalar" or not isinstance(node.value, str):
            raise self.error(node, key, f"{key} must be a string, got {_describe(node)}")
        return node.value

    def items(self, key: str, node: DocumentNode) -> list[DocumentNode]:
        if node.kind != "list":
            raise self.error(node, key, f"{key} must be a list, got {_describe(node)}")
        items: list[DocumentNode] = node.value
        if not items:
            raise self.error(node, key, f"{key} is an empty list (leave the key out to mean any)")
        return items

    def each(self, key: str, node: DocumentNode, check: Callable[[DocumentNode], T]) -> list[T]:
        """`check` of every item of a list: the good ones' values; each bad one's error kept in `errors`."""
        values = []
        for item in self.items(key, node):
            try:
                values.append(check(item))
            except ConfigError as exc:
                self.errors.append(exc)
        return values


T = TypeVar("T")
_FAILED = object()  # a field whose check failed: what depends on it is not checked again


def _rule(doc: Document, index: int, item: DocumentNode, errors: list[ConfigError], *,
          enable_ipv6: bool) -> Rule | None:
    """The rule, or None with every one of its mistakes appended to `errors` (lint reports them all; the agent
    reports the first, in this order: keys, name, destinations, sources, protocol, ports, nodes, action)."""
    try:
        fields = _RuleFields(doc, index, item)
    except ConfigError as exc:
        errors.append(exc)
        return None

    def attempt(check: Callable[[], T]) -> T | object:
        try:
            return check()
        except ConfigError as exc:
            fields.errors.append(exc)
        except _Said:
            pass
        return _FAILED

    name = attempt(lambda: _rule_name(fields, item))
    line = fields.fields["name"].line if item.line is None and "name" in fields.fields else item.line
    destinations = attempt(lambda: _required_cidrs(fields, item, enable_ipv6=enable_ipv6))
    family = destinations[0].family if isinstance(destinations, tuple) and destinations else None
    sources = attempt(lambda: _rule_sources(fields, family, enable_ipv6=enable_ipv6))
    protocol = attempt(lambda: _rule_protocol(fields, family))
    ports = attempt(lambda: _rule_ports(fields, None if protocol is _FAILED else cast(str | None, protocol),
                                        protocol_known=protocol is not _FAILED))
    nodes = attempt(lambda: _rule_nodes(fields))
    action = attempt(lambda: _rule_action(fields, family, item))
    errors.extend(fields.errors)
    if fields.errors:
        return None
    # no check failed: each value is what its check returned
    rule_action, snat_to = cast(tuple[RuleAction, str | None], action)
    return Rule(cast(str, name), cast(Family, family), cast(tuple[Prefix, ...], destinations), rule_action,
                cast(tuple[Prefix, ...], sources), cast(str | None, protocol), cast(tuple[tuple[int, int], ...], ports),
                cast(tuple[str, ...], nodes), snat_to, doc.source, line)


def _rule_name(fields: _RuleFields, item: DocumentNode) -> str:
    name_node = fields.get("name")
    if name_node is None:
        raise fields.error(item, "name", "name is required")
    name = fields.string("name", name_node)
    if RULE_NAME.match(name) is None:
        raise fields.error(name_node, name, f"name {show_value(name)} must be 1-40 lower-case letters, digits and "
                           "'-', starting and ending with a letter or digit")
    return name


def _required_cidrs(fields: _RuleFields, item: DocumentNode, *, enable_ipv6: bool) -> tuple[Prefix, ...]:
    destinations_node = fields.get("destinations")
    if destinations_node is None:
        raise fields.error(item, "destinations", "destinations is required (a list of CIDRs)")
    destinations = _rule_cidrs(fields, "destinations", destinations_node, enable_ipv6=enable_ipv6)
    if not destinations:  # every entry was wrong, each said already
        raise _Said()
    return destinations


class _Said(Exception):  # control flow inside this module (not in errors.py): never leaves it, never reported
    """A field whose every problem is in the rule's errors already: the field failed, nothing more to say."""


def _rule_sources(fields: _RuleFields, family: Family | None, *, enable_ipv6: bool) -> tuple[Prefix, ...]:
    sources_node = fields.get("sources")
    if sources_node is None:
        return ()
    sources = _rule_cidrs(fields, "sources", sources_node, enable_ipv6=enable_ipv6)
    for prefix in sources:
        if family is not None and prefix.family is not family:
            raise fields.error(sources_node, str(prefix), f"sources: {prefix} is IPv{prefix.family.value} and "
                               f"destinations are IPv{family.value}: one family per rule")
    return sources


def _rule_cidrs(fields: _RuleFields, key: str, node: DocumentNode, *, enable_ipv6: bool) -> tuple[Prefix, ...]:
    prefixes: list[Prefix] = []

    def check(item: DocumentNode) -> Prefix:
        text = fields.string(key, item)
        try:
            prefix = parse_cidr(text)
        except PrefixError as exc:
            clipped = clip(text)
            message = str(exc) if clipped == text else str(exc).replace(text, clipped)
            raise fields.error(item, text, f"{key}: {message}") from None
        if prefix.family is Family.V6 and not enable_ipv6:
            raise fields.error(item, text, f"{key}: ipv6 cidr {text} needs IPv6 enabled (--enable-ipv6)")
        if prefixes and prefix.family is not prefixes[0].family:
            raise fields.error(item, text, f"{key}: {text} is IPv{prefix.family.value} and {prefixes[0]} "
                               f"IPv{prefixes[0].family.value}: one family per rule")
        prefixes.append(prefix)
        return prefix

    fields.each(key, node, check)
    return tuple(prefixes)


def _rule_protocol(fields: _RuleFields, family: Family | None) -> str | None:
    """The protocol, lower-case: `tcp` as the reference's iptables spells it, or `TCP` as Kubernetes writes it (a
    Service's or a NetworkPolicy's protocol); both render the same rule."""
    node = fields.get("protocol")
    if node is None:
        return None
    text = fields.string("protocol", node) if node.kind == "scalar" and isinstance(node.value, str) else None
    protocol = text.lower() if text is not None else None
    if protocol not in RULE_PROTOCOLS:
        raise fields.error(node, str(node.value), f"protocol must be one of {', '.join(RULE_PROTOCOLS)} (or "
                           f"Kubernetes' TCP, UDP, SCTP), got {_describe(node)}")
    if (protocol == "icmp" and family is Family.V6) or (protocol == "icmpv6" and family is Family.V4):
        raise fields.error(node, str(text), f"protocol {protocol} is not an IPv{family.value} protocol (the "
                           "destinations are)")
    return protocol


def _rule_ports(fields: _RuleFields, protocol: str | None, *,
                protocol_known: bool = True) -> tuple[tuple[int, int], ...]:
    node = fields.get("ports")
    if node is None:
        return ()
    if protocol_known and protocol not in PROTOCOLS_WITH_PORTS:
        fields.errors.append(fields.error(node, "ports", f"ports need protocol tcp, udp or sctp, got "
                                          f"{'no protocol' if protocol is None else 'protocol ' + protocol}"))

    def check(item: DocumentNode) -> tuple[int, int]:
        value = item.value
        if item.kind == "scalar" and isinstance(value, int) and not isinstance(value, bool) and not item.quoted:
            low = high = value
        elif item.kind == "scalar" and isinstance(value, str) and (m := _PORT_TEXT.match(value)) is not None:
            low, high = int(m.group(1)), int(m.group(2) or m.group(1))
        else:
            raise fields.error(item, str(value), "ports: each entry must be a port (443) or a range ('8000-8080'), "
                               f"got {_describe(item)}")
        if not 1 <= low <= high <= 65535:
            raise fields.error(item, str(value), f"ports: {show_value(str(value))} must be ports between 1 and "
                               "65535, low before high")
        return low, high

    return tuple(fields.each("ports", node, check))


def _rule_nodes(fields: _RuleFields) -> tuple[str, ...]:
    node = fields.get("nodes")
    if node is None:
        return ()

    def check(item: DocumentNode) -> str:
        text = fields.string("nodes", item)
        if not text or any(c.isspace() for c in text):
            raise fields.error(item, text or "nodes", f"nodes: {show_value(text)} is not a node-name glob")
        return text

    return tuple(fields.each("nodes", node, check))


def _rule_action(fields: _RuleFields, family: Family | None, item: DocumentNode) -> tuple[RuleAction, str | None]:
    node = fields.get("action")
    if node is None:
        raise fields.error(item, "action", "action is required (masquerade, preserve or snat)")
    text = node.value if node.kind == "scalar" and isinstance(node.value, str) else None
    action = next((a for a in RuleAction if a.value == text), None)
    if action is None:
        raise fields.error(node, str(node.value), f"action must be masquerade, preserve or snat, got "
                           f"{_describe(node)}")
    snat_node = fields.get("snatTo")
    if action is not RuleAction.SNAT:
        if snat_node is not None:
            raise fields.error(snat_node, "snatTo", f"snatTo is only for action snat (this rule's action is "
                               f"{action.value})")
        return action, None
    if snat_node is None:
        raise fields.error(node, "snat", "action snat needs snatTo (the address the destination sees)")
    address_text = fields.string("snatTo", snat_node)
    try:
        if "/" in address_text or address_text != address_text.strip():
            raise ValueError(address_text)
        snat_family, address = parse_address(address_text)
    except ValueError:
        message = f"snatTo: {show_value(address_text)} is not an IP address"
        raise fields.error(snat_node, address_text, message) from None
    if family is not None and snat_family is not family:
        raise fields.error(snat_node, address_text, f"snatTo: {address_text} is IPv{snat_family.value} and the "
                           f"destinations are IPv{family.value}")
    return action, format_address(snat_family, address)


def check_rules_with_flags(config: MasqConfig, options: PolicyOptions) -> None:
    """What the flags make of the rules: a rule that exists only on some nodes needs this node's name (never a
    silent skip), and --to-ports is not applied to a rule's own MASQUERADE or SNAT yet (never silently dropped)."""
    for rule in config.rules:
        if options.to_ports and rule.action is not RuleAction.PRESERVE:
            raise ConfigError(f"rule {rule.name}: action {rule.action.value} with --to-ports is not supported yet "
                              "(only action preserve is)", source=rule.source, line=rule.line,
                              code="unsupported-rule")
        if rule.nodes and options.node_name is None:
            raise ConfigError(f"rule {rule.name} applies only on nodes {', '.join(show_value(n) for n in rule.nodes)}"
                              ", but the node name is unknown (give --node-name, or set NODE_NAME)",
                              source=rule.source, line=rule.line, code="node-name-unknown")


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
