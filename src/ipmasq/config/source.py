"""Find and read config files: one file, a directory of `ip-masq*` files, or standard input.

A ConfigMap mounted by kubelet is a directory holding `..data` (a symlink to a timestamped directory) and one
symlink per key; reading through the key's symlink always sees one complete version.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from ipmasq.config.document import parse_document
from ipmasq.config.model import MasqConfig
from ipmasq.config.validate import FileSettings, merge_settings, settings_from_document
from ipmasq.errors import ConfigError
from ipmasq.options import PolicyOptions

__all__ = ["CONFIG_PREFIX", "ConfigInput", "config_from_bytes", "load_config", "read_config_input"]

CONFIG_PREFIX = "ip-masq"


@dataclass(frozen=True, slots=True)
class ConfigInput:
    """The raw bytes of every config file found (empty: none found, so the reference's defaults apply)."""

    files: tuple[tuple[str, bytes], ...]


def read_config_input(path: str, *, missing_ok: bool) -> ConfigInput:
    """Read a config path. Missing: defaults when missing_ok (the agent, like the reference), else an error."""
    if path == "-":
        import sys

        return ConfigInput((("<stdin>", sys.stdin.buffer.read()),))
    try:
        if os.path.isdir(path):
            names = sorted(n for n in os.listdir(path) if n.startswith(CONFIG_PREFIX))
            files = []
            for name in names:
                full = os.path.join(path, name)
                if os.path.isfile(full):  # follows kubelet's symlinks; skips ..data and directories
                    with open(full, "rb") as fh:
                        files.append((full, fh.read()))
            return ConfigInput(tuple(files))
        with open(path, "rb") as fh:
            return ConfigInput(((path, fh.read()),))
    except FileNotFoundError:
        if missing_ok:
            return ConfigInput(())
        raise ConfigError("no such file or directory", source=path) from None
    except OSError as exc:
        raise ConfigError(f"cannot read: {exc.strerror}", source=path) from None


def config_from_bytes(config_input: ConfigInput, options: PolicyOptions) -> MasqConfig:
    """Pure: bytes of the files -> a validated config (raises ConfigError)."""
    with paused_gc():
        return _config_from_bytes(config_input, options)


@contextmanager
def paused_gc() -> Iterator[None]:
    """Loading allocates an object per entry and nothing cyclic: the cyclic GC would only rescan them (~40%)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _config_from_bytes(config_input: ConfigInput, options: PolicyOptions) -> MasqConfig:
    settings: list[FileSettings] = []
    for source, data in config_input.files:
        doc = parse_document(data, source)
        if doc is None:
            continue  # an empty file means defaults, as in the reference
        settings.append(settings_from_document(doc, enable_ipv6=options.enable_ipv6))
    return merge_settings(settings, all_reserved=options.nomasq_all_reserved_ranges, enable_ipv6=options.enable_ipv6)


def load_config(path: str | None, options: PolicyOptions, *, missing_ok: bool = False) -> MasqConfig:
    """Read and validate; `path` None means no config at all (the built-in defaults)."""
    if path is None:
        return config_from_bytes(ConfigInput(()), options)
    return config_from_bytes(read_config_input(path, missing_ok=missing_ok), options)
