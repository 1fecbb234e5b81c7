"""Lint a file: a raw config (YAML or JSON), or Kubernetes manifests holding the ip-masq-agent ConfigMap.

Manifests are multi-document YAML or `kind: List` (as `kubectl get -o yaml` prints it), also as JSON. The
config embedded in `data.config` is linted with the positions of the manifest file.
"""

from __future__ import annotations

import json
import re
from typing import Any

import yaml

from ipmasq.config.document import compose_yaml, yaml_error
from ipmasq.config.source import CONFIG_PREFIX
from ipmasq.config.validate import KNOWN_KEYS
from ipmasq.errors import ConfigError
from ipmasq.findings import Finding, Severity
from ipmasq.lint.config import Expectations, Placement, is_indentation_problem, lint_config
from ipmasq.lint.hints import lint_finding
from ipmasq.lint.text import scan_lookalikes
from ipmasq.options import PolicyOptions

__all__ = ["AGENT_CONFIGMAP", "AGENT_NAMESPACE", "configmap_config", "holds_agent_configmap", "lint_source",
           "nothing_to_lint"]

AGENT_CONFIGMAP = "ip-masq-agent"
AGENT_NAMESPACE = "kube-system"
CONFIG_KEY = "config"  # the upstream DaemonSet mounts data.config as /etc/config/ip-masq-agent

_BLOCK_HEADER = re.compile(r"[|>]([1-9])?[+-]?([1-9])?")


def lint_source(source: str, data: bytes, *, options: PolicyOptions | None = None,
                expect: Expectations | None = None) -> list[Finding]:
    """Every finding for one file's bytes, sorted by position; pure (no I/O), never raises on bad input."""
    options = options or PolicyOptions()
    expect = expect or Expectations()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        return [lint_finding(source, line, None, "yaml-syntax", Severity.ERROR,
                             f"not UTF-8 text (byte {exc.start}); the API server and the agent reject it")]
    if text.startswith("\ufeff"):
        text = text[1:]  # a leading byte-order mark is harmless; elsewhere it is a lookalike
    findings = scan_lookalikes(text, source)
    try:
        findings += _lint_text(text, source, options, expect)
    except RecursionError:
        findings.append(lint_finding(source, None, None, "yaml-syntax", Severity.ERROR,
                                     "nested too deeply to be a config or a ConfigMap"))
    return sorted(findings, key=Finding.sort_key)


def nothing_to_lint(directory: str, *, others: int) -> Finding:
    """The finding for a directory holding no config file: `lint DIR` reads it as the agent reads --config DIR."""
    held = f"it holds {others} other entr{'y' if others == 1 else 'ies'}" if others else "it is empty"
    return lint_finding(directory, None, None, "no-config-file", Severity.ERROR,
                        f"no {CONFIG_PREFIX}* file in this directory ({held}) and no manifest under it holds the "
                        "ip-masq-agent ConfigMap, so nothing was linted; as its config directory, the agent would run "
                        "with its built-in defaults")


def _lint_text(text: str, source: str, options: PolicyOptions, expect: Expectations) -> list[Finding]:
    if text.lstrip().startswith("{"):
        try:
            is_manifest = _is_object(json.loads(text))
        except (ValueError, RecursionError):
            is_manifest = False  # lint_config reports the JSON error (or the nesting) with its line
        if not is_manifest:
            return lint_config(text, source=source, options=options, expect=expect, whole_file=True)
    try:
        documents = compose_yaml(text, source)
    except yaml.YAMLError as exc:
        error = yaml_error(exc, text, source, lint=True)
        id_ = "indentation" if is_indentation_problem(error.message, text, error.line) else "yaml-syntax"
        return [lint_finding(source, error.line, error.column, id_, Severity.ERROR, error.message)]
    except ConfigError as exc:  # nested too deeply
        return [lint_finding(source, exc.line, exc.column, exc.code or "yaml-syntax", Severity.ERROR, exc.message)]
    if not any(_is_object(_plain(d)) for d in documents):
        return lint_config(text, source=source, options=options, expect=expect, whole_file=True)
    return _lint_manifests(documents, text, source, options, expect)


def holds_agent_configmap(data: bytes) -> bool:
    """Whether a manifest file (of a directory of manifests) is one lint reads: it holds an ip-masq-agent
    ConfigMap (named so, or holding the agent's keys), or it does not parse as YAML but names the agent (a broken
    ConfigMap is linted, never skipped)."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return b"masq" in data.lower()
    try:
        documents = compose_yaml(text, "<manifest>")
    except (yaml.YAMLError, ConfigError, RecursionError):
        return "masq" in text.lower()
    return any(_scalar((_get(obj, "kind") or (None, None))[1]) == "ConfigMap" and _is_candidate(obj)
               for d in documents for obj in _objects(d))


def configmap_config(text: str) -> str | None:
    """The config string of the ip-masq-agent ConfigMap when `text` is a manifest; None when it is a raw config.

    For `diff`, which gates a ConfigMap change: `lint` says whether the ConfigMap is applied at all.
    Raises ValueError when `text` is a manifest without exactly one usable ConfigMap.
    """
    head = text.lstrip()
    # a config file starts with its own keys: do not compose a 100,000-entry config only to find that out
    if head.startswith("{"):
        if '"kind"' not in text or '"apiVersion"' not in text:
            return None
    elif not head.startswith(("apiVersion", "kind", "---", "#", "items", "metadata", "data")):
        return None
    try:
        documents = compose_yaml(text, "<manifest>")
    except (yaml.YAMLError, ConfigError):
        return None  # not YAML we can navigate: the config loader reports the error with its line
    if not any(_is_object(_plain(d)) for d in documents):
        return None
    found: list[yaml.ScalarNode] = []
    for obj in (o for d in documents for o in _objects(d)):
        if _scalar((_get(obj, "kind") or (None, None))[1]) != "ConfigMap" or not _is_candidate(obj):
            continue
        value = _config_value(obj)
        if value is not None:
            found.append(value)
    # The same config twice is what `kubectl apply` makes of it too; two different ones leave the reader guessing
    # which one is meant (lint: duplicate-configmap)
    if len({v.value for v in found}) != 1:
        differing = " with different configs" if found else ""
        raise ValueError(f"a manifest with {len(found)} ip-masq-agent ConfigMaps holding data.{CONFIG_KEY}"
                         f"{differing}; run ipmasq lint on it")
    value = found[-1]  # kubectl applies them in turn: the last one stays, and its line numbers are reported
    # blank lines in front keep the loader's line numbers those of the manifest (literal blocks only)
    padding = "\n" * (value.start_mark.line + 1) if value.style == "|" else ""
    return padding + str(value.value)


def _config_value(obj: yaml.MappingNode) -> yaml.ScalarNode | None:
    """The string node of a ConfigMap's data.config; None when there is none (or it is not a string)."""
    data = _get(obj, "data")
    config = _get(data[1], CONFIG_KEY) if data else None
    return config[1] if config is not None and isinstance(config[1], yaml.ScalarNode) else None


# --- navigating composed YAML ------------------------------------------------------------------------------


def _is_object(value: Any) -> bool:
    """A Kubernetes object has a kind; an ip-masq-agent config never does."""
    return isinstance(value, dict) and "kind" in value and "apiVersion" in value


def _plain(node: yaml.Node) -> dict[str, Any] | None:
    """The top-level scalar fields of a mapping node, enough to tell a Kubernetes object from a config."""
    if not isinstance(node, yaml.MappingNode):
        return None
    return {k.value: v.value for k, v in node.value
            if isinstance(k, yaml.ScalarNode) and isinstance(v, yaml.ScalarNode)}


def _get(node: yaml.Node | None, key: str) -> tuple[yaml.Node, yaml.Node] | None:
    """(key node, value node) of `key` in a mapping node; the last one wins, as for the API server."""
    if not isinstance(node, yaml.MappingNode):
        return None
    found = None
    for k, v in node.value:
        if isinstance(k, yaml.ScalarNode) and k.value == key:
            found = (k, v)
    return found


def _scalar(node: yaml.Node | None) -> str | None:
    return node.value if isinstance(node, yaml.ScalarNode) and isinstance(node.value, str) else None


def _objects(node: yaml.Node, depth: int = 0) -> list[yaml.MappingNode]:
    """Objects in a document, with `kind: List` (and FooList) items flattened."""
    if not isinstance(node, yaml.MappingNode) or depth > 8:
        return []
    kind = _scalar(v[1]) if (v := _get(node, "kind")) else None
    items = _get(node, "items")
    if kind is not None and kind.endswith("List") and items and isinstance(items[1], yaml.SequenceNode):
        return [o for item in items[1].value for o in _objects(item, depth + 1)]
    return [node]


def _pos(node: yaml.Node) -> tuple[int, int]:
    return node.start_mark.line + 1, node.start_mark.column + 1


def _mentions_config(text: str) -> bool:
    lowered = text.lower()
    return any(key in lowered for key in KNOWN_KEYS)


def _is_candidate(obj: yaml.MappingNode) -> bool:
    """An ip-masq-agent ConfigMap, possibly misnamed: its name says masq, or its data looks like our config."""
    metadata = _get(obj, "metadata")
    name_entry = _get(metadata[1], "name") if metadata else None
    name = _scalar(name_entry[1]) if name_entry else None
    if name is not None and "masq" in name.lower():
        return True
    data = _get(obj, "data")
    if data is None or not isinstance(data[1], yaml.MappingNode):
        return False
    for k, v in data[1].value:
        if isinstance(k, yaml.ScalarNode) and k.value.lower() in KNOWN_KEYS:
            return True
        if isinstance(v, yaml.ScalarNode) and isinstance(v.value, str) and _mentions_config(v.value):
            return True
        if isinstance(v, yaml.MappingNode) and any(
                isinstance(kk, yaml.ScalarNode) and kk.value.lower() in KNOWN_KEYS for kk, _ in v.value):
            return True
    return False


# --- the ConfigMap checks ----------------------------------------------------------------------------------


def _lint_manifests(documents: list[yaml.Node], text: str, source: str, options: PolicyOptions,
                    expect: Expectations) -> list[Finding]:
    findings: list[Finding] = []
    configmaps = [o for d in documents for o in _objects(d) if _scalar((_get(o, "kind") or (None, None))[1])
                  == "ConfigMap"]
    candidates = [o for o in configmaps if _is_candidate(o)]
    if not candidates:
        looked = f"{len(configmaps)} ConfigMap(s)" if configmaps else "no ConfigMap at all"
        findings.append(lint_finding(source, 1, 1, "no-configmap", Severity.WARNING,
                                     f"no ip-masq-agent ConfigMap found ({looked}), so nothing was linted"))
    lines = text.splitlines()
    for obj in candidates:
        findings += _lint_configmap(obj, lines, source, options, expect)
    findings += _duplicate_configmaps(candidates, source)
    return findings


def _identity(obj: yaml.MappingNode) -> tuple[str | None, str | None, yaml.Node]:
    """(name, namespace, the node to report at) of an object."""
    metadata = _get(obj, "metadata")
    name_entry = _get(metadata[1], "name") if metadata else None
    namespace_entry = _get(metadata[1], "namespace") if metadata else None
    name = _scalar(name_entry[1]) if name_entry else None
    namespace = _scalar(namespace_entry[1]) if namespace_entry else None
    return name, namespace, name_entry[1] if name_entry else obj


def _duplicate_configmaps(candidates: list[yaml.MappingNode], source: str) -> list[Finding]:
    """The same ConfigMap (name and namespace) twice in one file: `kubectl apply` keeps the last one; the offline
    tools refuse to guess when their configs differ."""
    findings: list[Finding] = []
    first: dict[tuple[str | None, str | None], tuple[yaml.Node, str | None]] = {}
    for obj in candidates:
        name, namespace, at = _identity(obj)
        value = _config_value(obj)
        config = value.value if value is not None else None
        earlier = first.setdefault((name, namespace), (at, config))
        if earlier[0] is at:
            continue
        line, column = _pos(at)
        label = f"{namespace or '(no namespace)'}/{name or '(no name)'}"
        if earlier[1] == config:
            findings.append(lint_finding(source, line, column, "duplicate-configmap", Severity.WARNING,
                                         f"ConfigMap {label} repeats the one at line {_pos(earlier[0])[0]} with the "
                                         "same config"))
        else:
            findings.append(lint_finding(source, line, column, "duplicate-configmap", Severity.ERROR,
                                         f"ConfigMap {label} again, with a different config than the one at line "
                                         f"{_pos(earlier[0])[0]}: `kubectl apply` keeps only this last one, and "
                                         "render, explain, check and diff refuse the file"))
        first[(name, namespace)] = (at, config)
    return findings


def _lint_configmap(obj: yaml.MappingNode, lines: list[str], source: str, options: PolicyOptions,
                    expect: Expectations) -> list[Finding]:
    out: list[Finding] = []

    def add(id_: str, severity: Severity, message: str, node: yaml.Node) -> None:
        line, column = _pos(node)
        out.append(lint_finding(source, line, column, id_, severity, message))

    metadata = _get(obj, "metadata")
    name_entry = _get(metadata[1], "name") if metadata else None
    name = _scalar(name_entry[1]) if name_entry else None
    if name != AGENT_CONFIGMAP:
        shown = f"is named {name!r}" if name is not None else "has no metadata.name"
        add("configmap-name", Severity.ERROR,
            f"the ConfigMap {shown}; the agent reads only the ConfigMap named {AGENT_CONFIGMAP!r}, so this one is "
            "never applied", name_entry[1] if name_entry else (metadata[0] if metadata else obj))
    namespace_entry = _get(metadata[1], "namespace") if metadata else None
    namespace = _scalar(namespace_entry[1]) if namespace_entry else None
    label = name or "the ConfigMap"
    if namespace_entry is None:
        add("configmap-namespace", Severity.WARNING,
            f"{label} sets no namespace: it lands in whatever namespace kubectl or kustomize uses, and the agent "
            f"reads only {AGENT_NAMESPACE}", metadata[0] if metadata else obj)
    elif namespace != AGENT_NAMESPACE:
        add("configmap-namespace", Severity.ERROR,
            f"{label} is in namespace {namespace!r}; the agent reads only {AGENT_NAMESPACE!r}, so it is never "
            "applied", namespace_entry[1])
    data = _get(obj, "data")
    if data is None or not isinstance(data[1], yaml.MappingNode):
        add("missing-config-key", Severity.ERROR,
            f"{label} has no data: the agent finds no config and runs with its defaults",
            data[0] if data else obj)
        return out
    config = _get(data[1], CONFIG_KEY)
    stray = [(k, v) for k, v in data[1].value
             if isinstance(k, yaml.ScalarNode) and k.value != CONFIG_KEY and k.value.lower() in KNOWN_KEYS]
    for stray_key, _ in stray:
        if config is not None:
            add("indentation", Severity.ERROR,
                f"{stray_key.value!r} is a key of data, not of the config, so the agent never sees it: indent it "
                "to the level of the lines under `config: |`", stray_key)
        else:
            add("missing-config-key", Severity.ERROR,
                f"{stray_key.value!r} sits directly under data; the agent reads only data.{CONFIG_KEY}: write "
                "`config: |` and indent the config below it", stray_key)
    if config is None:
        if not stray:
            keys = ", ".join(repr(k.value) for k, _ in data[1].value if isinstance(k, yaml.ScalarNode)) or "none"
            add("missing-config-key", Severity.ERROR,
                f"{label} has no data.{CONFIG_KEY} (keys: {keys}); the agent finds no config and runs with its "
                "defaults", data[0])
        return out
    key_node, value = config
    if not isinstance(value, yaml.ScalarNode):
        add("missing-config-key", Severity.ERROR,
            f"data.{CONFIG_KEY} is written as a YAML {'map' if isinstance(value, yaml.MappingNode) else 'list'}, "
            "but a ConfigMap value must be a string: the API server rejects it. Write `config: |` and indent the "
            "config below it", key_node)
        return out
    if value.style == ">":
        add("block-style", Severity.WARNING,
            f"data.{CONFIG_KEY} is a folded block (`>`), which joins lines that are not indented deeper", value)
    out += lint_config(value.value, source=source, placement=_placement(key_node, value, lines), options=options,
                       expect=expect)
    return out


def _placement(key_node: yaml.Node, value: yaml.ScalarNode, lines: list[str]) -> Placement:
    anchor_line, anchor_column = _pos(key_node)
    start = value.start_mark.line  # 0-based line of the `|` indicator
    if value.style in ("|", ">"):
        header = _BLOCK_HEADER.match(lines[start], value.start_mark.column) if start < len(lines) else None
        explicit = header and (header.group(1) or header.group(2))
        if explicit:
            indent = key_node.start_mark.column + int(explicit)
        else:
            # the content's indentation is that of its first non-blank line, as YAML defines it
            content = [ln for ln in lines[start + 1: value.end_mark.line + 1] if ln.strip()]
            indent = len(content[0]) - len(content[0].lstrip(" ")) if content else 0
        # line 1 of the content is the line after the indicator
        return Placement(line_offset=start + 1, column_offset=indent, exact=value.style == "|",
                         anchor_line=anchor_line, anchor_column=anchor_column)
    single_line = value.start_mark.line == value.end_mark.line
    raw = lines[start] if start < len(lines) else ""
    if single_line and value.style is None:
        return Placement(line_offset=start, column_offset=value.start_mark.column, anchor_line=anchor_line,
                         anchor_column=anchor_column)
    if single_line and value.style == "'" and "''" not in raw:
        return Placement(line_offset=start, column_offset=value.start_mark.column + 1, anchor_line=anchor_line,
                         anchor_column=anchor_column)
    # a double-quoted string with escapes (kubectl -o json): positions inside it cannot be mapped back
    return Placement(exact=False, anchor_line=anchor_line, anchor_column=anchor_column)
