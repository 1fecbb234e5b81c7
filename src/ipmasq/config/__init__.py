"""Config: files -> a validated MasqConfig (pure apart from reading the files)."""

from __future__ import annotations

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
