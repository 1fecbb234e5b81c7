"""Find and read config files: one file, a directory of `ip-masq*` files, or standard input.

A ConfigMap mounted by kubelet is a directory holding `..data` (a symlink to a timestamped directory) and one
symlink per key; reading through the key's symlink always sees one complete version.
"""

from __future__ import annotations

import gc
import os
import stat
import sys
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from ipmasq.config.document import parse_document
from ipmasq.config.model import MasqConfig
from ipmasq.config.rules import check_rules_with_flags
from ipmasq.config.validate import FileSettings, merge_settings, settings_from_document
from ipmasq.errors import ConfigError, InputUnreadable
from ipmasq.options import PolicyOptions
from ipmasq.sha256 import sha256

__all__ = [
    "CONFIG_PREFIX",
    "MAX_CONFIG_BYTES",
    "ConfigInput",
    "config_digest",
    "config_from_bytes",
    "load_config",
    "read_config_file",
    "read_config_input",
]

CONFIG_PREFIX = "ip-masq"
# A ConfigMap holds at most 1 MiB, so no real config file is larger; reading a bigger one (a 50 MB file, /dev/zero)
# would only cost the agent its memory. Larger policies come as a directory of several files.
MAX_CONFIG_BYTES = 1 << 20

_FILE_KINDS = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
               (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory"))


@dataclass(frozen=True, slots=True)
class ConfigInput:
    """The raw bytes of every config file found (empty: none found, so the reference's defaults apply)."""

    files: tuple[tuple[str, bytes], ...]
    # config_digest of the files' bytes, computed at most once per input: the follower that composes an input, the
    # loop's history and the reconciler that enforces it all ask, and the content is hashed once for them all
    _digest: str | None = field(default=None, compare=False, repr=False)

    def digest(self) -> str:
        if self._digest is None:
            object.__setattr__(self, "_digest", config_digest(tuple(data for _source, data in self.files)))
        assert self._digest is not None
        return self._digest


def config_digest(contents: tuple[bytes, ...]) -> str:
    """A digest of a config's content, whatever its files or ConfigMaps are named: equal for the mounted file and
    the ConfigMap it came from, so `ipmasq status` can tell whether a node enforces the ConfigMap's current content."""
    # ipmasq.sha256, not hashlib: the agent computes this for every config, and hashlib maps OpenSSL
    digest = sha256(expected_bytes=sum(8 + len(data) for data in contents))
    for data in contents:
        digest.update(len(data).to_bytes(8, "big"))
        digest.update(data)
    return digest.hexdigest()


def read_config_input(path: str, *, missing_ok: bool, directory_ok: bool = True) -> ConfigInput:
    """Read a config path: a file, a directory of `ip-masq*` files, or - (standard input).

    Missing (or a directory without an `ip-masq*` file): the defaults when missing_ok (the agent, like the
    reference), else an error (the offline tools, which would otherwise silently show the defaults).
    directory_ok False (an agent whose --config named a file when it started): a directory now at the path is an
    error, not an empty config directory, which would replace the last good config with the defaults.
    """
    if path == "-":
        return ConfigInput((("<stdin>", _bounded(sys.stdin.buffer.read(MAX_CONFIG_BYTES + 1), "<stdin>")),))
    try:
        if os.path.isdir(path):
            if not directory_ok:
                raise ConfigError("a directory, not a regular file: not read (--config named a file when the agent "
                                  "started)", source=path)
            names = sorted(n for n in os.listdir(path) if n.startswith(CONFIG_PREFIX))
            files = []
            for name in names:
                full = os.path.join(path, name)
                if os.path.isfile(full):  # follows kubelet's symlinks; skips ..data, directories, FIFOs, devices
                    files.append((full, read_config_file(full)))
            if not files and not missing_ok:
                raise ConfigError(f"no {CONFIG_PREFIX}* file in this directory (the agent would run with its "
                                  "defaults)", source=path)
            return ConfigInput(tuple(files))
        return ConfigInput(((path, read_config_file(path)),))
    except FileNotFoundError:
        if missing_ok:
            return ConfigInput(())
        raise InputUnreadable("no such file or directory", source=path) from None
    except OSError as exc:  # listing the directory
        raise InputUnreadable(f"cannot read: {exc.strerror}", source=path) from None


def read_config_file(path: str) -> bytes:
    """The bytes of one regular file of at most MAX_CONFIG_BYTES; ConfigError otherwise, never blocking.

    A FIFO or a device is refused by its stat, before it is opened (opening a FIFO blocks until a writer comes;
    opening some devices acts). O_NONBLOCK and a second stat of what was opened cover a swap in between.
    Raises FileNotFoundError for a missing path, so that callers decide whether that means the defaults.
    """
    try:
        _check_regular(os.stat(path).st_mode, path)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise InputUnreadable(f"cannot read: {exc.strerror}", source=path) from None
    try:
        status = os.fstat(fd)
        _check_regular(status.st_mode, path)
        if status.st_size > MAX_CONFIG_BYTES:
            raise _too_large(path, status.st_size)
        with os.fdopen(fd, "rb", closefd=False) as fh:
            return _bounded(fh.read(MAX_CONFIG_BYTES + 1), path)  # +1: a file that grew since its stat
    except OSError as exc:
        raise InputUnreadable(f"cannot read: {exc.strerror}", source=path) from None
    finally:
        os.close(fd)


def _check_regular(mode: int, path: str) -> None:
    if not stat.S_ISREG(mode):
        kind = next((name for test, name in _FILE_KINDS if test(mode)), "not a regular file")
        raise InputUnreadable(f"{kind}, not a regular file: not read (reading it could block or never end)",
                          source=path)


def _bounded(data: bytes, source: str) -> bytes:
    """`data`, read with a limit of one byte more than allowed: that byte means "too large"."""
    if len(data) > MAX_CONFIG_BYTES:
        raise _too_large(source, None)
    return data


def _too_large(source: str, size: int | None) -> ConfigError:
    shown = f"{size:,} bytes" if size is not None else f"more than {MAX_CONFIG_BYTES:,} bytes"
    return InputUnreadable(f"{shown}, too large: a config is at most 1 MiB (what a ConfigMap holds)", source=source)


def config_from_bytes(config_input: ConfigInput, options: PolicyOptions, *,
                      honoured: Collection[str] | None = None) -> MasqConfig:
    """Pure: bytes of the files -> a validated config (raises ConfigError). `honoured`: only these keys are read,
    as a provider's agent reads them (ipmasq.writers); None: all of ipmasq's."""
    with paused_gc():
        return _config_from_bytes(config_input, options, honoured)


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


def _config_from_bytes(config_input: ConfigInput, options: PolicyOptions,
                       honoured: Collection[str] | None) -> MasqConfig:
    settings: list[FileSettings] = []
    for source, data in config_input.files:
        doc = parse_document(data, source)
        if doc is None:
            continue  # an empty file means defaults, as in the reference
        # IPv6 CIDRs refused at once only when the flag said no; else merge_settings checks them against the
        # files' enableIPv6 (any file may set it)
        settings.append(settings_from_document(doc, enable_ipv6=options.enable_ipv6 is not False, honoured=honoured))
    config = merge_settings(settings, all_reserved=options.nomasq_all_reserved_ranges, enable_ipv6=options.enable_ipv6)
    check_rules_with_flags(config, options)
    return config


def load_config(path: str | None, options: PolicyOptions, *, missing_ok: bool = False) -> MasqConfig:
    """Read and validate; `path` None means no config at all (the built-in defaults)."""
    if path is None:
        return config_from_bytes(ConfigInput(()), options)
    return config_from_bytes(read_config_input(path, missing_ok=missing_ok), options)
