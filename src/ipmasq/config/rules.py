"""The config's `rules:` section: an ordered list that is ours, so every key is known and every mistake is an error.

Each rule is checked field by field in the order the agent reports them (keys, name, destinations, sources,
protocol, ports, nodes, action); `rule_errors` gives lint every mistake, `rules_from_field` the agent the rules or the
first one, and `check_rules_with_flags` what the agent's flags make of them.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import TypeVar, cast

from ipmasq.config.document import Document, DocumentNode, Field, clip, describe_node, node_error, show_value
from ipmasq.config.model import MasqConfig, Rule, RuleAction
from ipmasq.errors import ConfigError, PrefixError
from ipmasq.options import PolicyOptions
from ipmasq.prefix import Family, Prefix, format_address, parse_address, parse_cidr

__all__ = ["PROTOCOLS_WITH_PORTS", "RULE_KEYS", "RULE_NAME", "RULE_PROTOCOLS", "check_rules_with_flags", "rule_errors",
           "rules_from_field"]

RULE_KEYS = ("name", "destinations", "sources", "protocol", "ports", "nodes", "action", "snatTo")
RULE_NAME = re.compile(r"[a-z0-9](?:[a-z0-9-]{0,38}[a-z0-9])?\Z")
RULE_PROTOCOLS = ("tcp", "udp", "sctp", "icmp", "icmpv6")
PROTOCOLS_WITH_PORTS = ("tcp", "udp", "sctp")
_PORT_TEXT = re.compile(r"(\d{1,5})(?:-(\d{1,5}))?\Z")


def rules_from_field(doc: Document, f: Field, *, enable_ipv6: bool) -> list[Rule]:
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
        return [], [node_error(doc, node, f.key,
                               f"rules must be a list of rules (- name: ...), got {describe_node(node)}", "wrong-type")]
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
            raise node_error(doc, item, "-", f"{self.label}: each rule must be a mapping (name: ..., destinations: "
                             f"...), got {describe_node(item)}", "wrong-type")
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
            raise self.error(node, key, f"{key} must be a string, got {describe_node(node)}")
        return node.value

    def items(self, key: str, node: DocumentNode) -> list[DocumentNode]:
        if node.kind != "list":
            raise self.error(node, key, f"{key} must be a list, got {describe_node(node)}")
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
                           f"Kubernetes' TCP, UDP, SCTP), got {describe_node(node)}")
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
                               f"got {describe_node(item)}")
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
                           f"{describe_node(node)}")
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
