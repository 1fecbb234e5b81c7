"""The documents `-o json` and `-o yaml` print: apiVersion and kind first, then the command's fields, on standard
output. Used by the commands and by the lab's own command, so it lives below them."""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping

__all__ = ["API_VERSION", "OUTPUTS", "document", "print_document", "print_json", "print_yaml"]

# Every JSON (and YAML) document a command prints names what it is, as a Kubernetes object does: the group and
# version of its shape, and its kind (docs/reference/json.md lists every kind and its fields).
API_VERSION = "ipmasq.io/v1"
OUTPUTS = ("text", "json", "yaml")


def document(kind: str, body: Mapping[str, object]) -> dict[str, object]:
    """The document `-o json`/`-o yaml` print: apiVersion and kind first, then the command's fields."""
    return {"apiVersion": API_VERSION, "kind": kind, **body}


def print_document(output: str, kind: str, body: Mapping[str, object], *, ensure_ascii: bool = True) -> None:
    """The command's document on standard output as JSON (indented) or YAML (block style, keys in order)."""
    doc = document(kind, body)
    if output == "yaml":
        print_yaml(doc)
    else:
        print_json(doc, ensure_ascii=ensure_ascii)


def print_json(document: object, *, ensure_ascii: bool = True) -> None:
    """The JSON document on standard output, indented, with a final newline."""
    json.dump(document, sys.stdout, indent=2, ensure_ascii=ensure_ascii)
    sys.stdout.write("\n")


def print_yaml(document: object) -> None:
    """The same document as YAML: what `-o yaml` prints wherever `-o json` exists."""
    import yaml

    yaml.safe_dump(document, sys.stdout, sort_keys=False, allow_unicode=True, default_flow_style=False, width=120)
