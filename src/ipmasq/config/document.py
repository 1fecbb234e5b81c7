"""bytes -> a mapping of keys to values that remember their line numbers.

The reference agent converts YAML to JSON (sigs.k8s.io/yaml, YAML 1.1 scalars) and then decodes JSON into its
struct; a file that starts with "{" is decoded as JSON directly. We do the same, but keep line numbers so that
every error can point at the line an operator has to change.

Hostile input is refused before it can hurt: nesting deeper than MAX_DEPTH is found before the recursive
composers see it (the C composer overflows the C stack on 100,000 levels), and YAML aliases may add at most
MAX_ALIAS_VALUES values (a 456-byte "billion laughs" would otherwise expand past a GiB). The size bound is the
reader's (config.source): bytes handed in directly, as benchmarks do, are not limited here.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, NamedTuple

import yaml

from ipmasq.errors import CLIP_CHARS, ConfigError, clip

__all__ = [
    "MAX_ALIAS_VALUES",
    "MAX_DEPTH",
    "MAX_VALUES",
    "YAML_LOADER",
    "Document",
    "DocumentNode",
    "Field",
    "clip",
    "compose_yaml",
    "describe_node",
    "node_error",
    "parse_document",
    "show_value",
    "yaml_error",
]

try:  # the C loader is much faster (docs/measurements.md); 100,000-entry configs depend on it
    _BASE_LOADER: Any = yaml.CSafeLoader
except AttributeError:  # pragma: no cover - PyYAML built without libyaml
    _BASE_LOADER = yaml.SafeLoader


class YAML_LOADER(_BASE_LOADER):  # type: ignore[misc]
    """The safe loader, with one shortcut in tag resolution, which runs in Python once per scalar: a scalar holding
    "/" (every CIDR) matches none of YAML 1.1's implicit types (bool, int, float, null, timestamp, merge, value: all
    anchored patterns without "/"), so it is a string without trying each of their patterns."""

    def resolve(self, kind: Any, value: Any, implicit: Any) -> Any:
        if kind is yaml.ScalarNode and "/" in value:
            return _STR
        return super().resolve(kind, value, implicit)

# A config is a mapping of lists (depth 2), a ConfigMap manifest in a `kind: List` about 6: 64 is far beyond any
# real input, and far below the nesting the recursive composers survive in Python frames.
MAX_DEPTH = 64
# go-yaml (the reference) refuses "excessive aliasing" by a ratio; we need no aliases at all in a config, so a flat
# budget: a few aliased lists pass, a bomb stops at ~10 MiB of nodes instead of GiBs.
MAX_ALIAS_VALUES = 100_000
# Every value (scalar, list, mapping) of a config, counted while parsing, before anything is built for it: each
# becomes a composed node and one of ours, about 400 bytes together, so 1 MiB of `[1,1,...]` (520,000 values) took
# 236 MiB. The largest configs measured (100,000 CIDRs in one list) have 100,000 and a few.
MAX_VALUES = 150_000
# An error message echoes at most CLIP_CHARS of a value (ipmasq.errors.clip): a CIDR is at most 43 characters; a
# 10 MB value must not become a 10 MB line in the agent's log.

_STR = "tag:yaml.org,2002:str"
_SEQ = "tag:yaml.org,2002:seq"
_MAP = "tag:yaml.org,2002:map"
_BOOL = "tag:yaml.org,2002:bool"
_INT = "tag:yaml.org,2002:int"
_FLOAT = "tag:yaml.org,2002:float"
_NULL = "tag:yaml.org,2002:null"
# go-yaml v2 (what the reference uses) also reads y/Y/n/N as booleans; PyYAML does not.
_GO_EXTRA_BOOLS = {"y": True, "Y": True, "n": False, "N": False}


class DocumentNode(NamedTuple):
    """A value with the 1-based line it starts on (None when unknown).

    A NamedTuple, not a dataclass: a 100,000-entry config makes this many, and a frozen dataclass is much slower.
    """

    value: Any  # None | bool | int | float | str | list[DocumentNode] | list[Field]
    line: int | None
    quoted: bool = False  # a quoted scalar is always a string: "true" is not a boolean
    kind: str = "scalar"  # scalar | list | map
    column: int | None = None  # 1-based; None for JSON, which carries no positions


class Field(NamedTuple):
    key: str
    line: int | None
    value: DocumentNode
    column: int | None = None


@dataclass(frozen=True, slots=True)
class Document:
    """Top-level fields in file order (duplicates kept: the last one wins, as in Go)."""

    source: str
    fields: list[Field]
    text: str

    def locate(self, node: DocumentNode, needle: str) -> int | None:
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
        raise ConfigError(f"not UTF-8 text (byte {exc.start})", source=source, line=data.count(b"\n", 0, exc.start) + 1,
                          code="yaml-syntax") from None
    if text.startswith("\ufeff"):
        text = text[1:]
    top = _parse_json(text, source) if text.lstrip().startswith("{") else _parse_yaml(text, source)
    if top is None or (top.kind == "scalar" and top.value is None):
        return None
    if top.kind != "map":
        what = "a list" if top.kind == "list" else f"the value {show_value(top.value)}"
        raise ConfigError(f"the config must be a mapping of keys (nonMasqueradeCIDRs: ...), got {what}",
                          source=source, line=top.line, column=top.column, code="wrong-type")
    return Document(source, top.value, text)


# --- showing values in one-line errors ---------------------------------------------------------------------


def show_value(value: object) -> str:
    """A value as error messages show it: a string quoted as JSON, anything else as Python prints it; clipped."""
    if isinstance(value, str):
        if len(value) <= CLIP_CHARS:
            return json.dumps(value)
        return json.dumps(value[:CLIP_CHARS])[:-1] + '\u2026"'  # the ellipsis inside the quotes: the value goes on
    return clip(repr(value))


def describe_node(node: DocumentNode) -> str:
    """A value as a message names its kind: "a list", "a mapping", "null", "the boolean true", "the string ..."."""
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


def node_error(doc: Document, node: DocumentNode, needle: str, message: str, code: str) -> ConfigError:
    """The error at `node`: its file, the line `needle` is on, its column; `code` names the mistake."""
    return ConfigError(message, source=doc.source, line=doc.locate(node, needle), column=node.column, code=code)


def _too_many(source: str, mark: Any) -> ConfigError:
    return ConfigError(f"more than {MAX_VALUES:,} values; a config is a mapping of lists of CIDRs",
                       source=source, line=mark.line + 1 if mark else None, column=mark.column + 1 if mark else None,
                       code="yaml-syntax")


def _too_deep(source: str, line: int | None, column: int | None) -> ConfigError:
    return ConfigError(f"nested deeper than {MAX_DEPTH} levels; a config is a mapping of lists", source=source,
                       line=line, column=column, code="yaml-syntax")


# --- YAML ---------------------------------------------------------------------------------------------------


def yaml_error(exc: yaml.YAMLError, text: str, source: str, *, lint: bool = False) -> ConfigError:
    """PyYAML's error as ours, located: the one translation, for the config loader and for lint.

    lint=True keeps lint's wording: a key that lacks its colon (`data` for `data:`) is reported at the key rather
    than on the next line, the column is a field of the finding rather than part of the message, and a
    character the reader refuses is reported in PyYAML's words.
    """
    if isinstance(exc, yaml.MarkedYAMLError):
        mark = exc.problem_mark or exc.context_mark
        if lint and exc.context == "while scanning a simple key" and exc.context_mark is not None:
            mark = exc.context_mark
        line = mark.line + 1 if mark is not None else None
        column = mark.column + 1 if mark is not None else None
        problem = clip(exc.problem or exc.context or "invalid YAML", 4 * CLIP_CHARS)
        if mark is not None and "tab" not in problem and _tab_at(text, mark.line, mark.column):
            problem += ": a tab in the indentation (YAML indents with spaces only: replace the tab with spaces)"
        where = "" if lint or column is None else f" (column {column})"
        return ConfigError(f"YAML syntax error: {problem}{where}", source=source, line=line, column=column,
                           code="yaml-syntax")
    if isinstance(exc, yaml.reader.ReaderError):
        line = text.count("\n", 0, exc.position) + 1
        if lint:
            return ConfigError(f"YAML error: {_first_line(exc)}", source=source, line=line, code="yaml-syntax")
        column = exc.position - (text.rfind("\n", 0, exc.position) + 1) + 1
        return ConfigError(f"YAML syntax error: unacceptable character #x{exc.character:04x} ({exc.reason})",
                           source=source, line=line, column=column, code="yaml-syntax")
    return ConfigError(f"YAML error: {_first_line(exc)}", source=source, code="yaml-syntax")


def _tab_at(text: str, line: int, column: int) -> bool:
    """Whether the character YAML stopped at (0-based line and column), or the indentation before it, is a tab."""
    lines = text.splitlines()
    if not 0 <= line < len(lines):
        return False
    raw = lines[line]
    indentation = raw[: len(raw) - len(raw.lstrip(" \t"))]
    return "\t" in indentation or raw[column:column + 1] == "\t"


def _first_line(exc: yaml.YAMLError) -> str:
    text = str(exc)
    return clip(text.splitlines()[0], 4 * CLIP_CHARS) if text else "invalid YAML"


def compose_yaml(text: str, source: str) -> list[yaml.Node]:
    """The non-empty documents of a YAML stream, composed by the C loader once their nesting is known to be safe.

    Raises yaml.YAMLError (turn it into ours with yaml_error) or ConfigError (nested deeper than MAX_DEPTH).
    Aliases come back shared, as the composer makes them: whoever expands them must budget (see _FromYaml).
    """
    if _depth_bound(text) > MAX_DEPTH or _values_bound(text) > MAX_VALUES:
        _check_yaml_events(text, source)
    return [d for d in yaml.compose_all(text, Loader=YAML_LOADER) if d is not None]


# What may precede a block collection on its line: indentation, then compact indicators (`- - a`, `? - a`,
# `: - b`), document markers and node properties (anchors, tags), which YAML rejects there but cost nothing here.
_BLOCK_PREFIX = re.compile(r"^[ ]*(?:(?:---|[-?:]|[&!][^ \t\n]*)[ \t]+)*", re.MULTILINE)


def _depth_bound(text: str) -> int:
    """An upper bound of the nesting depth, cheaper than the parser's events.

    A block collection nested in another starts at a greater column, except a sequence that is a mapping's value
    (same column; its own children are deeper again): block depth <= 2 x (the widest line prefix + 1). Every flow
    level opens with a bracket.
    """
    flow = text.count("[") + text.count("{")
    if flow > MAX_DEPTH:
        return flow
    return flow + 2 * (max(map(len, _BLOCK_PREFIX.findall(text)), default=0) + 1)


# Each value on a line after its first needs an indicator of its own before it: a separator (`,` `:`), an opening
# bracket, a block item (`-` `?`). YAML 1.1 breaks lines at NEL, LS and PS too.
_VALUE_MARKS = "\n\r\x85\u2028\u2029,:[{-?"


def _values_bound(text: str) -> int:
    """An upper bound of the values the composer would make (aliases aside: _FromYaml budgets those), from counts
    of single characters (linear, in C): a config of 10,000 CIDRs is far below MAX_VALUES without a parse."""
    return 1 + sum(map(text.count, _VALUE_MARKS))


def _check_yaml_events(text: str, source: str) -> None:
    """The exact depth and number of values, from the parser's events, one at a time (libyaml's parser keeps its
    own stack: no recursion, and nothing kept): refused before the composer builds a node."""
    depth = 0
    values = 0
    try:
        for event in yaml.parse(text, Loader=YAML_LOADER):
            if isinstance(event, yaml.NodeEvent):  # a scalar, an alias, the start of a list or mapping
                values += 1
                if values > MAX_VALUES:
                    raise _too_many(source, event.start_mark)
            if isinstance(event, yaml.CollectionStartEvent):
                depth += 1
                if depth > MAX_DEPTH:
                    mark = event.start_mark
                    raise _too_deep(source, mark.line + 1 if mark else None, mark.column + 1 if mark else None)
            elif isinstance(event, yaml.CollectionEndEvent):
                depth -= 1
    except yaml.MarkedYAMLError as exc:
        # libyaml 0.2.6 (PyYAML 6.0.4) has a nesting limit of its own, which its scanner, reading ahead through
        # `[[[[...`, reaches before the parser hands out the 65th level: the same verdict, where libyaml stopped
        if "nesting depth" not in (exc.problem or ""):
            raise
        mark = exc.problem_mark
        raise _too_deep(source, mark.line + 1 if mark else None, mark.column + 1 if mark else None) from None


def _parse_yaml(text: str, source: str) -> DocumentNode | None:
    try:
        documents = compose_yaml(text, source)
    except yaml.YAMLError as exc:
        raise yaml_error(exc, text, source) from None
    if not documents:
        return None
    # go-yaml decodes only the first document of a stream; so do we (lint reports the others)
    return _FromYaml(source).node(documents[0], 1)


class _FromYaml:
    """Composed YAML -> DocumentNode, expanding aliases within MAX_ALIAS_VALUES and MAX_DEPTH.

    The composer hands an alias back as the very node its anchor names, so a collection met a second time is an
    alias's copy: its values count against the budget. A collection met again while still open is an alias to
    the value that contains it, which would never end.
    """

    def __init__(self, source: str) -> None:
        self.source = source
        self.converted: set[int] = set()  # ids of the collections converted once (an alias's target)
        self.open: set[int] = set()
        self.alias_values = 0

    def node(self, node: yaml.Node, depth: int) -> DocumentNode:
        if node.__class__ is yaml.ScalarNode:
            return self._scalar_node(node)
        mark = node.start_mark
        line, column = mark.line + 1, mark.column + 1
        self._enter(node, depth, line, column)
        try:
            if isinstance(node, yaml.SequenceNode):
                return DocumentNode([_plain_string(item) or self.node(item, depth + 1) for item in node.value], line,
                                    kind="list", column=column)
            assert isinstance(node, yaml.MappingNode)
            return DocumentNode([self._field(key_node, value_node, depth) for key_node, value_node in node.value], line,
                                kind="map", column=column)
        finally:
            self.open.discard(id(node))

    def _enter(self, node: yaml.Node, depth: int, line: int, column: int) -> None:
        if depth > MAX_DEPTH:
            raise _too_deep(self.source, line, column)
        key = id(node)
        if key in self.open:
            raise ConfigError("a YAML alias refers to the value that contains it", source=self.source, line=line,
                              column=column, code="yaml-syntax")
        if key in self.converted:
            self.alias_values += len(node.value) * (2 if isinstance(node, yaml.MappingNode) else 1)
            if self.alias_values > MAX_ALIAS_VALUES:
                raise ConfigError(f"YAML aliases repeat this value past {MAX_ALIAS_VALUES:,} values; write the "
                                  "values out", source=self.source, line=line, column=column, code="yaml-syntax")
        self.converted.add(key)
        self.open.add(key)

    def _field(self, key_node: yaml.Node, value_node: yaml.Node, depth: int) -> Field:
        if not isinstance(key_node, yaml.ScalarNode):
            raise ConfigError("a key must be a plain word, not a list or mapping", source=self.source,
                              line=key_node.start_mark.line + 1, column=key_node.start_mark.column + 1,
                              code="wrong-type")
        return Field(without_lone_surrogates(str(key_node.value)), key_node.start_mark.line + 1,
                     self.node(value_node, depth + 1), key_node.start_mark.column + 1)

    def _scalar_node(self, node: yaml.ScalarNode) -> DocumentNode:
        if node.style == '"':
            node.value = without_lone_surrogates(node.value)
        return DocumentNode(_scalar(node, self.source), node.start_mark.line + 1,
                            quoted=node.style in ("'", '"', "|", ">"), column=node.start_mark.column + 1)


def _plain_string(node: yaml.Node) -> DocumentNode | None:
    """The common case of a CIDR list item, without the general path's calls (100,000-entry lists)."""
    if node.tag != _STR or node.__class__ is not yaml.ScalarNode:
        return None
    style = node.style
    if not style and node.value in _GO_EXTRA_BOOLS:
        return None
    mark = node.start_mark
    value = without_lone_surrogates(node.value) if style == '"' else node.value
    return DocumentNode(value, mark.line + 1, style in ("'", '"', "|", ">"), "scalar", mark.column + 1)


_SURROGATE = re.compile("[\ud800-\udfff]")


def without_lone_surrogates(text: str) -> str:
    """A "\\ud800" escape (JSON or double-quoted YAML) makes a lone surrogate, which no output can encode: it becomes
    U+FFFD, as Go's decoders make it in the reference; an escaped pair becomes the character it encodes."""
    if _SURROGATE.search(text) is None:
        return text
    return text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")


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
            return text  # e.g. an integer of more than 4,300 digits: Python refuses to convert it
    if tag.startswith("tag:yaml.org,2002:"):
        return text  # timestamps, binary, ...: go-yaml would hand these on as strings
    raise ConfigError(f"unsupported YAML tag {clip(tag)}", source=source, line=node.start_mark.line + 1,
                      column=node.start_mark.column + 1, code="wrong-type")


# --- JSON -------------------------------------------------------------------------------------------------

# A string (brackets inside it do not nest) or a bracket; unterminated strings fall apart into brackets, which
# only overestimates the depth of a file that is broken anyway.
_JSON_TOKEN = re.compile(r'"(?:[^"\\\n]|\\.)*"|[\[\]{}]')


def _parse_json(text: str, source: str) -> DocumentNode:
    _check_json_depth(text, source)
    try:
        raw = json.loads(text, object_pairs_hook=lambda pairs: ("__map__", pairs))
    except json.JSONDecodeError as exc:
        raise ConfigError(f"JSON syntax error: {exc.msg} (column {exc.colno})", source=source, line=exc.lineno,
                          column=exc.colno, code="yaml-syntax") from None
    except ValueError:  # a number of more than 4,300 digits: Python refuses to convert it (json has no position)
        digits = re.search(r"\d{4301,}", text)
        line = text.count("\n", 0, digits.start()) + 1 if digits else None
        raise ConfigError("JSON error: a number of more than 4,300 digits", source=source, line=line,
                          code="yaml-syntax") from None
    return _FromJson(source).node(raw, 1 if "\n" not in text.strip() else None)


def _check_json_depth(text: str, source: str) -> None:
    """Refuse deep nesting before json's recursive decoder and _FromJson meet it."""
    if text.count("[") + text.count("{") <= MAX_DEPTH:
        return  # every config: a mapping of short lists
    depth = 0
    for token in _JSON_TOKEN.finditer(text):
        bracket = token.group()
        if bracket == "[" or bracket == "{":
            depth += 1
            if depth > MAX_DEPTH:
                start = token.start()
                raise _too_deep(source, text.count("\n", 0, start) + 1, start - (text.rfind("\n", 0, start) + 1) + 1)
        elif bracket == "]" or bracket == "}":
            depth -= 1


class _FromJson:
    """json.loads' values -> DocumentNode, refused past MAX_VALUES before the DocumentNode of the value past it is
    made (json's own objects for 1 MiB of text are small: ints and empty strings it shares, a list of pointers)."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.values = 0

    def node(self, value: Any, line: int | None) -> DocumentNode:
        self.values += 1
        if self.values > MAX_VALUES:
            raise _too_many(self.source, None)
        # object_pairs_hook hands us ("__map__", pairs); JSON arrays are lists, so a tuple is always an object
        if isinstance(value, tuple):
            return DocumentNode([Field(without_lone_surrogates(k), line, self.node(v, line)) for k, v in value[1]],
                                line, kind="map")
        if isinstance(value, list):
            return DocumentNode([self.node(v, line) for v in value], line, kind="list")
        if isinstance(value, str):
            return DocumentNode(without_lone_surrogates(value), line, quoted=True)
        return DocumentNode(value, line, quoted=False)
