"""Wake the agent when its config may have changed: inotify on the config's directory, else polling.

kubelet updates a ConfigMap volume by writing a new timestamped directory and atomically renaming the
`..data` symlink; the key's own symlink never changes, so the file itself cannot be watched: the directory
holding it is. A missing directory (no ConfigMap volume yet) is watched by polling until it appears.
The watcher only says "look again"; the agent re-reads the config and compares bytes to decide.
"""

from __future__ import annotations

import os
import select
from collections.abc import Sequence

from ipmasq.inotify import (
    IN_ATTRIB,
    IN_CLOSE_WRITE,
    IN_CREATE,
    IN_DELETE,
    IN_DELETE_SELF,
    IN_IGNORED,
    IN_MODIFY,
    IN_MOVE_SELF,
    IN_MOVED_FROM,
    IN_MOVED_TO,
    Inotify,
    event_masks,
)

__all__ = ["ConfigWatcher"]

_MASK = (IN_MODIFY | IN_ATTRIB | IN_CLOSE_WRITE | IN_MOVED_FROM | IN_MOVED_TO | IN_CREATE | IN_DELETE
         | IN_DELETE_SELF | IN_MOVE_SELF)
# Without a watch (no inotify, or the directory does not exist yet) the agent looks again this often.
POLL_SECONDS = 1.0


class ConfigWatcher:
    """A file descriptor that becomes readable when the config directory changes (or None: poll)."""

    def __init__(self, config_path: str, *, use_inotify: bool = True) -> None:
        path = os.path.abspath(config_path)
        # a directory config is watched itself; a file config through the directory holding it
        self.directory = path if os.path.isdir(path) else os.path.dirname(path)
        self._inotify = Inotify() if use_inotify else None
        self._watching = False
        self._add_watch()

    @property
    def fds(self) -> Sequence[int]:
        return [self._inotify.fd] if self._inotify is not None and self._inotify.fd is not None else []

    @property
    def timeout(self) -> float | None:
        """How long the loop may sleep without looking at the config again (None: until an event)."""
        return None if self._watching else POLL_SECONDS

    @property
    def mode(self) -> str:
        return f"inotify on {self.directory}" if self._watching else f"polling {self.directory} every {POLL_SECONDS:g}s"

    def _add_watch(self) -> None:
        if self._inotify is None or self._watching:
            return
        self._watching = self._inotify.add_watch(self.directory, _MASK) is not None

    def drain(self) -> bool:
        """Consume pending events; True when any arrived. Re-arms the watch if the directory went or came."""
        data = self._inotify.drain() if self._inotify is not None else b""
        if any(mask & (IN_IGNORED | IN_DELETE_SELF | IN_MOVE_SELF) for mask in event_masks(data)):
            self._watching = False  # the directory itself was deleted or moved away
        changed = bool(data)
        self._add_watch()
        return changed

    def wait_quiet(self, seconds: float) -> None:
        """Let a burst of events (kubelet: mkdir, write, symlink, rename, rm) finish before reading."""
        while self.fds and select.select(self.fds, [], [], seconds)[0]:
            self.drain()

    def close(self) -> None:
        if self._inotify is not None:
            self._inotify.close()

