"""Wake the agent when its config may have changed: inotify on the config's directory, else polling.

kubelet updates a ConfigMap volume by writing a new timestamped directory and atomically renaming the
`..data` symlink; the key's own symlink never changes, so the file itself cannot be watched: the directory
holding it is. A missing directory (no ConfigMap volume yet) is watched by polling until it appears.
The watcher only says "look again"; the agent re-reads the config and compares bytes to decide.
"""

from __future__ import annotations

import ctypes
import os
import select
import sys
from collections.abc import Sequence

__all__ = ["ConfigWatcher"]

IN_MODIFY = 0x002
IN_ATTRIB = 0x004
IN_CLOSE_WRITE = 0x008
IN_MOVED_FROM = 0x040
IN_MOVED_TO = 0x080
IN_CREATE = 0x100
IN_DELETE = 0x200
IN_DELETE_SELF = 0x400
IN_MOVE_SELF = 0x800
IN_IGNORED = 0x8000
IN_NONBLOCK = os.O_NONBLOCK
IN_CLOEXEC = os.O_CLOEXEC
_MASK = (IN_MODIFY | IN_ATTRIB | IN_CLOSE_WRITE | IN_MOVED_FROM | IN_MOVED_TO | IN_CREATE | IN_DELETE
         | IN_DELETE_SELF | IN_MOVE_SELF)
# Without a watch (no inotify, or the directory does not exist yet) the agent looks again this often.
POLL_SECONDS = 1.0


def _libc() -> ctypes.CDLL | None:
    try:
        # the process's own symbols, libc's among them (glibc or musl): ctypes.util.find_library would import
        # shutil, tempfile and subprocess machinery (about 1 MiB resident) and run ldconfig for a name we do not need
        libc = ctypes.CDLL(None, use_errno=True)
        libc.inotify_init1.argtypes = [ctypes.c_int]
        libc.inotify_add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
        return libc
    except (OSError, AttributeError):
        return None


class ConfigWatcher:
    """A file descriptor that becomes readable when the config directory changes (or None: poll)."""

    def __init__(self, config_path: str, *, use_inotify: bool = True) -> None:
        path = os.path.abspath(config_path)
        # a directory config is watched itself; a file config through the directory holding it
        self.directory = path if os.path.isdir(path) else os.path.dirname(path)
        self._libc = _libc() if use_inotify else None
        self._fd: int | None = None
        self._watching = False
        if self._libc is not None:
            fd = self._libc.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
            self._fd = fd if fd >= 0 else None
        self._add_watch()

    @property
    def fds(self) -> Sequence[int]:
        return [self._fd] if self._fd is not None else []

    @property
    def timeout(self) -> float | None:
        """How long the loop may sleep without looking at the config again (None: until an event)."""
        return None if self._watching else POLL_SECONDS

    @property
    def mode(self) -> str:
        return f"inotify on {self.directory}" if self._watching else f"polling {self.directory} every {POLL_SECONDS:g}s"

    def _add_watch(self) -> None:
        if self._fd is None or self._libc is None or self._watching:
            return
        wd = self._libc.inotify_add_watch(self._fd, os.fsencode(self.directory), _MASK)
        self._watching = wd >= 0

    def drain(self) -> bool:
        """Consume pending events; True when any arrived. Re-arms the watch if the directory went or came."""
        changed = False
        if self._fd is not None:
            while True:
                try:
                    data = os.read(self._fd, 65536)
                except BlockingIOError:
                    break
                if not data:
                    break
                changed = True
                if _has_ignored(data):
                    self._watching = False  # the directory itself was deleted or moved away
        self._add_watch()
        return changed

    def wait_quiet(self, seconds: float) -> None:
        """Let a burst of events (kubelet: mkdir, write, symlink, rename, rm) finish before reading."""
        while self._fd is not None and select.select([self._fd], [], [], seconds)[0]:
            self.drain()

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _has_ignored(data: bytes) -> bool:
    # struct inotify_event { int wd; uint32_t mask; uint32_t cookie; uint32_t len; char name[len]; }
    offset = 0
    while offset + 16 <= len(data):
        mask = int.from_bytes(data[offset + 4:offset + 8], sys.byteorder)
        length = int.from_bytes(data[offset + 12:offset + 16], sys.byteorder)
        if mask & (IN_IGNORED | IN_DELETE_SELF | IN_MOVE_SELF):
            return True
        offset += 16 + length
    return False
