"""Opening a file named on the command line (a dump, a flow log) that may be no regular file at all.

A device (/dev/zero never ends), a socket or a directory is refused before it is read; a FIFO is opened without
waiting for a writer, and one that no process writes to is refused instead of read as an empty file. Pipes a
shell makes (`<(iptables-save -t nat)`, `<(zcat flows.gz)`) are FIFOs with a writer, and read as files do.
"""

from __future__ import annotations

import os
import stat

from ipmasq.errors import NotAFile, NoWriter

__all__ = ["open_input"]

_NOT_A_FILE = ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"),
               (stat.S_ISDIR, "a directory"))
_PROBE_BYTES = 1 << 16


def _refuse_special(mode: int) -> None:
    for test, kind in _NOT_A_FILE:
        if test(mode):
            raise NotAFile(kind)


def open_input(path: str) -> tuple[int, os.stat_result, bytes]:
    """(blocking fd, its status, bytes already read from it). Raises OSError, NotAFile or NoWriter.

    The bytes read are a FIFO's first ones: whether a writer is there is known only by reading (a FIFO whose writer
    never came reads as end of file, and select() does not report it); a regular file gives b"".
    """
    _refuse_special(os.stat(path).st_mode)
    # O_NONBLOCK: opening a FIFO waits for a writer otherwise; cleared below so that reads wait for data
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    try:
        status = os.fstat(fd)
        _refuse_special(status.st_mode)  # swapped since the stat
        first = b""
        if stat.S_ISFIFO(status.st_mode):
            try:
                first = os.read(fd, _PROBE_BYTES)
            except BlockingIOError:  # a writer, nothing written yet
                pass
            else:
                if not first:
                    raise NoWriter()
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd, status, first
