"""bytes -> a mapping of keys to values that remember their line numbers.

The reference agent converts YAML to JSON (sigs.k8s.io/yaml, YAML 1.1 scalars) and then decodes JSON into its
struct; a file that starts with "{" is decoded as JSON directly. We do the same, but keep line numbers so that
every error can point at the line an operator has to change.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, NamedTuple

import yaml

from ipmasq.errors import ConfigError

__all__ = ["Document", "Field", "Node", "parse_document"]

try:  # the C loader is ~10x faster; 100,000-entry configs depend on it
    _Loader: Any = yaml.CSafeLoader
except AttributeError:  # pragma: no cover - PyYAML built without libyaml
    _Loader = yaml.SafeLoader

_STR = "tag:yaml.org,2002:str"
_SEQ = "tag:yaml.org,2002:seq"
_MAP = "tag:yaml.org,2002:map"
_BOOL = "tag:yaml.org,2002:bool"
_INT = "tag:yaml.org,2002:int"
_FLOAT = "tag:yaml.org,2002:float"
_NULL = "tag:yaml.org,2002:null"
# go-yaml v2 (what the reference uses) also reads y/Y/n/N as booleans; PyYAML does not.
_GO_EXTRA_BOOLS = {"y": True, "Y": True, "n": False, "N": False}


class Node(NamedTuple):
    """A value with the 1-based line it starts on (None when unknown).

    A NamedTuple, not a dataclass: a 100,000-entry config makes this many, and a frozen dataclass is 3x slower.
    """

    value: Any  # None | bool | int | float | str | list[Node] | list[Field]
    line: int | None
    quoted: bool = False  # a quoted scalar is always a string: "true" is not a boolean
    kind: str = "scalar"  # scalar | list | map
    column: int | None = None  # 1-based; None for JSON, which carries no positions


class Field(NamedTuple):
    key: str
    line: int | None
    value: Node
    column: int | None = None


@dataclass(frozen=True, slots=True)
class Document:
    """Top-level fields in file order (duplicates kept: the last one wins, as in Go)."""

    source: str
    fields: list[Field]
    text: str

    def locate(self, node: Node, needle: str) -> int | None:
        """The node's line; for JSON, which carries no positions, the first line holding the text.

        Searched only when an error is reported, so that loading a 100,000-entry JSON file stays linear.
        """
        if node.line is not None:
            return node.line
        for number, line in enumerate(self.text.splitlines(), start=1):
            if needle in line:
                return number
        return None


def parse_document(data: bytes, source: str) -> Document | None:
    """Parse a config file; None for an empty file (the reference then uses its defaults)."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"not UTF-8 text (byte {exc.start})", source=source, code="yaml-syntax") from None
    if text.startswith("\ufeff"):
        text = text[1:]
    top = _parse_json(text, source) if text.lstrip().startswith("{") else _parse_yaml(text, source)
    if top is None or (top.kind == "scalar" and top.value is None):
        return None
    if top.kind != "map":
        what = "a list" if top.kind == "list" else f"the value {_show(top.value)}"
        raise ConfigError(f"the config must be a mapping of keys (nonMasqueradeCIDRs: ...), got {what}",
                          source=source, line=top.line, column=top.column, code="wrong-type")
    return Document(source, top.value, text)


def _show(value: object) -> str:
    return json.dumps(value) if isinstance(value, str) else repr(value)


# --- YAML -------------------------------------------------------------------------------------------------


def _parse_yaml(text: str, source: str) -> Node | None:
    try:
        documents = list(yaml.compose_all(text, Loader=_Loader))
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark is not None else None
        column = f" (column {mark.column + 1})" if mark is not None else ""
        problem = exc.problem or exc.context or "invalid YAML"
        raise ConfigError(f"YAML syntax error: {problem}{column}", source=source, line=line,
                          column=mark.column + 1 if mark is not None else None, code="yaml-syntax") from None
    except yaml.reader.ReaderError as exc:
        line = text.count("\n", 0, exc.position) + 1
        column_number = exc.position - (text.rfind("\n", 0, exc.position) + 1) + 1
        raise ConfigError(f"YAML syntax error: unacceptable character #x{exc.character:04x} ({exc.reason})",
                          source=source, line=line, column=column_number, code="yaml-syntax") from None
    except yaml.YAMLError as exc:
        first_line = str(exc).splitlines()[0] if str(exc) else "invalid YAML"
        raise ConfigError(f"YAML error: {first_line}", source=source, code="yaml-syntax") from None
    documents = [d for d in documents if d is not None]
    if not documents:
        return None
    # go-yaml decodes only the first document of a stream; so do we (lint reports the others)
    return _from_yaml(documents[0], source)


def _from_yaml(node: yaml.Node, source: str) -> Node:
    line = node.start_mark.line + 1
    if isinstance(node, yaml.SequenceNode):
        return Node([_plain_string(item) or _from_yaml(item, source) for item in node.value], line, kind="list",
                    column=node.start_mark.column + 1)
    if isinstance(node, yaml.MappingNode):
        fields = []
        for key_node, value_node in node.value:
            if isinstance(key_node, yaml.ScalarNode):
                key = str(key_node.value)
            else:
                raise ConfigError("a key must be a plain word, not a list or mapping", source=source,
                                  line=key_node.start_mark.line + 1, column=key_node.start_mark.column + 1,
                                  code="wrong-type")
            fields.append(Field(key, key_node.start_mark.line + 1, _from_yaml(value_node, source),
                                key_node.start_mark.column + 1))
        return Node(fields, line, kind="map", column=node.start_mark.column + 1)
    assert isinstance(node, yaml.ScalarNode)
    return Node(_scalar(node, source), line, quoted=node.style in ("'", '"', "|", ">"),
                column=node.start_mark.column + 1)


def _plain_string(node: yaml.Node) -> Node | None:
    """The common case of a CIDR list item, without the general path's calls (100,000-entry lists)."""
    if node.tag != _STR or node.__class__ is not yaml.ScalarNode:
        return None
    style = node.style
    if not style and node.value in _GO_EXTRA_BOOLS:
        return None
    mark = node.start_mark
    return Node(node.value, mark.line + 1, style in ("'", '"', "|", ">"), "scalar", mark.column + 1)


def _scalar(node: yaml.ScalarNode, source: str) -> Any:
    tag, text = node.tag, node.value
    if tag == _STR or node.style:
        if not node.style and text in _GO_EXTRA_BOOLS:
            return _GO_EXTRA_BOOLS[text]
        return text
    if tag == _NULL:
        return None
    if tag in (_BOOL, _INT, _FLOAT):
        try:
            return yaml.constructor.SafeConstructor().construct_object(node)
        except (ValueError, yaml.YAMLError):
            return text
    if tag.startswith("tag:yaml.org,2002:"):
        return text  # timestamps, binary, ...: go-yaml would hand these on as strings
    raise ConfigError(f"unsupported YAML tag {tag}", source=source, line=node.start_mark.line + 1,
                      column=node.start_mark.column + 1, code="wrong-type")


# --- JSON -------------------------------------------------------------------------------------------------


def _parse_json(text: str, source: str) -> Node:
    try:
        raw = json.loads(text, object_pairs_hook=lambda pairs: ("__map__", pairs))
    except json.JSONDecodeError as exc:
        raise ConfigError(f"JSON syntax error: {exc.msg} (column {exc.colno})", source=source, line=exc.lineno,
                          column=exc.colno, code="yaml-syntax") from None
    return _from_json(raw, 1 if "\n" not in text.strip() else None)


def _from_json(value: Any, line: int | None) -> Node:
    # object_pairs_hook hands us ("__map__", pairs); JSON arrays are lists, so a tuple is always an object
    if isinstance(value, tuple):
        return Node([Field(k, line, _from_json(v, line)) for k, v in value[1]], line, kind="map")
    if isinstance(value, list):
        return Node([_from_json(v, line) for v in value], line, kind="list")
    return Node(value, line, quoted=isinstance(value, str))
