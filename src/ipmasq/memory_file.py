"""Key material handed to ssl without touching a file system: ssl loads a certificate chain only from a path, so the
PEM goes into an anonymous in-memory file (memfd_create(2)) that ssl reads through /proc/self/fd, closed when the
block ends. The webhook's serving certificate and the API client's certificate both load this way."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

__all__ = ["memory_file"]


@contextlib.contextmanager
def memory_file(data: bytes | str, name: str = "ipmasq-tls") -> Iterator[str]:
    """A path ssl can read `data` from, backed by memory only (memfd), gone when the block ends."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    try:
        os.write(fd, data.encode() if isinstance(data, str) else data)
        yield f"/proc/self/fd/{fd}"
    finally:
        os.close(fd)
