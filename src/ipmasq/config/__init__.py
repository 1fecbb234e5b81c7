"""Config: files -> a validated MasqConfig (pure apart from reading the files).

The names below are loaded on first use (PEP 562): importing ipmasq.config.model or .source, as the node agent
does, must not load the document reader and with it PyYAML (see ipmasq.config.isolated).
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ipmasq.config.document import Document, parse_document
    from ipmasq.config.model import Entry, MasqConfig, Origin
    from ipmasq.config.source import ConfigInput, config_from_bytes, load_config, read_config_input
    from ipmasq.config.validate import KNOWN_KEYS, parse_go_duration

__all__ = [
    "KNOWN_KEYS",
    "ConfigInput",
    "Document",
    "Entry",
    "MasqConfig",
    "Origin",
    "config_from_bytes",
    "load_config",
    "parse_document",
    "parse_go_duration",
    "read_config_input",
]

_HOME = {"Document": "document", "parse_document": "document", "Entry": "model", "MasqConfig": "model",
         "Origin": "model", "ConfigInput": "source", "config_from_bytes": "source", "load_config": "source",
         "read_config_input": "source", "KNOWN_KEYS": "validate", "parse_go_duration": "validate"}


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"{__name__}.{_HOME[name]}"), name)
