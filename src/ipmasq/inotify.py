"""inotify through libc, for the two things the agent watches: its config directory and the xtables lock file.

The standard library has no inotify; ctypes reaches libc's three calls. Everything here answers "unknown" (None)
rather than raising when inotify is not there, so each caller falls back to looking every time.
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Iterator

__all__ = ["IN_ATTRIB", "IN_CLOSE_NOWRITE", "IN_CLOSE_WRITE", "IN_CREATE", "IN_DELETE", "IN_DELETE_SELF",
           "IN_IGNORED", "IN_MODIFY", "IN_MOVED_FROM", "IN_MOVED_TO", "IN_MOVE_SELF", "IN_OPEN", "IN_Q_OVERFLOW",
           "Inotify", "event_masks"]

IN_MODIFY = 0x002
IN_ATTRIB = 0x004
IN_CLOSE_WRITE = 0x008
IN_CLOSE_NOWRITE = 0x010
IN_OPEN = 0x020
IN_MOVED_FROM = 0x040
IN_MOVED_TO = 0x080
IN_CREATE = 0x100
IN_DELETE = 0x200
IN_DELETE_SELF = 0x400
IN_MOVE_SELF = 0x800
IN_Q_OVERFLOW = 0x4000
IN_IGNORED = 0x8000
_EVENT_HEADER = 16  # struct inotify_event { int wd; uint32_t mask; uint32_t cookie; uint32_t len; char name[len]; }


def _libc() -> ctypes.CDLL | None:
    try:
        # the process's own symbols, libc's among them (glibc or musl): ctypes.util.find_library would import
        # shutil, tempfile and subprocess machinery (about 1 MiB resident) and run ldconfig for a name we do not need
        libc = ctypes.CDLL(None, use_errno=True)
        libc.inotify_init1.argtypes = [ctypes.c_int]
        libc.inotify_add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
        libc.inotify_rm_watch.argtypes = [ctypes.c_int, ctypes.c_int]
        return libc
    except (OSError, AttributeError):
        return None


class Inotify:
    """One non-blocking inotify descriptor (fd None: inotify is not available here)."""

    def __init__(self) -> None:
        self._libc = _libc()
        self.fd: int | None = None
        if self._libc is not None:
            fd = self._libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
            self.fd = fd if fd >= 0 else None

    def add_watch(self, path: str, mask: int) -> int | None:
        """The watch descriptor, or None when the path cannot be watched (missing, no permission, no inotify)."""
        if self.fd is None or self._libc is None:
            return None
        wd = self._libc.inotify_add_watch(self.fd, os.fsencode(path), mask)
        return wd if wd >= 0 else None

    def remove_watch(self, wd: int) -> None:
        if self.fd is not None and self._libc is not None:
            self._libc.inotify_rm_watch(self.fd, wd)  # an already removed watch (EINVAL) is fine

    def drain(self) -> bytes:
        """Every pending event's bytes (b"" when none): never blocks."""
        if self.fd is None:
            return b""
        chunks = []
        while True:
            try:
                data = os.read(self.fd, 65536)
            except BlockingIOError:
                break
            if not data:
                break
            chunks.append(data)
        return b"".join(chunks)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def event_masks(data: bytes) -> Iterator[int]:
    """The mask of each event in what Inotify.drain returned."""
    offset = 0
    while offset + _EVENT_HEADER <= len(data):
        yield int.from_bytes(data[offset + 4:offset + 8], sys.byteorder)
        offset += _EVENT_HEADER + int.from_bytes(data[offset + 12:offset + 16], sys.byteorder)
