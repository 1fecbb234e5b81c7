"""The agent's log lines: one per event, to stderr, as text (klog-like, for `kubectl logs`) or JSON (for log pipelines).

    text   2024-05-01T10:00:00.123Z ipmasq agent: INFO config loaded from ...
    json   {"time": "2024-05-01T10:00:00.123Z", "level": "info", "logger": "ipmasq.agent", "msg": "config loaded ..."}

A JSON line is always one line: newlines inside a message (a tool's multi-line stderr) are escaped by json.dumps.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import TextIO

__all__ = ["LOG_FORMATS", "JsonFormatter", "configure_logging"]

LOG_FORMATS = ("text", "json")


def _timestamp(record: logging.LogRecord) -> str:
    # UTC with milliseconds and a Z: what log pipelines parse without a format string
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {"time": _timestamp(record), "level": record.levelname.lower(), "logger": record.name,
                 "msg": record.getMessage()}
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


class _TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return f"{_timestamp(record)} ipmasq agent: {record.levelname} {record.getMessage()}"


def configure_logging(log_format: str, *, stream: TextIO | None = None) -> logging.Logger:
    """The agent's logger, writing one line per record in `log_format` (one of LOG_FORMATS)."""
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else _TextFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    return logging.getLogger("ipmasq.agent")
