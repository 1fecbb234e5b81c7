"""Opening a file that may be no regular file at all: a file named on the command line (a dump, a flow log), and
every credential file (a kubeconfig, a token, a CA, a client certificate and key).

A device (/dev/zero never ends), a socket or a directory is refused before it is read; a FIFO is opened without
waiting for a writer, and one that no process writes to is refused instead of read as an empty file. Pipes a
shell makes (`<(iptables-save -t nat)`, `<(zcat flows.gz)`) are FIFOs with a writer, and read as files do.

`read_regular` is the one reader of credential files: a regular file only (a FIFO is refused too: a token or a
certificate is never a pipe, and one would hang a request), at most `limit` bytes, within a deadline for the whole
read.
"""

from __future__ import annotations

import os
import stat
import time

from ipmasq.errors import FileTooLarge, FileTooSlow, NotAFile, NoWriter

__all__ = ["CREDENTIAL_SECONDS", "open_input", "read_regular"]

# A credential file is a few KiB on a local disk; a read that takes longer than this is a stalled network or FUSE
# file system, and the request that needs it is better failed with one line than hung.
CREDENTIAL_SECONDS = 5.0
_CHUNK = 1 << 16

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


def read_regular(path: str, *, limit: int, seconds: float = CREDENTIAL_SECONDS) -> bytes:
    """The bytes of the regular file at `path`, at most `limit` of them, read within `seconds` in all.

    Raises OSError (no such file, no permission), NotAFile (a device, socket, directory or FIFO: never opened for
    reading, so neither /dev/zero nor a FIFO nobody writes to costs more than a stat), FileTooLarge (more than
    `limit` bytes: nothing past the bound is kept) or FileTooSlow (the deadline passed between two reads)."""
    deadline = time.monotonic() + seconds
    _refuse_not_regular(os.stat(path).st_mode)
    # O_NONBLOCK: a FIFO swapped in after the stat is not waited on at open
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    try:
        _refuse_not_regular(os.fstat(fd).st_mode)  # swapped since the stat
        chunks: list[bytes] = []
        size = 0
        while chunk := os.read(fd, min(_CHUNK, limit + 1 - size)):
            size += len(chunk)
            if size > limit:
                raise FileTooLarge(f"more than {limit:,} bytes")
            chunks.append(chunk)
            if time.monotonic() > deadline:
                raise FileTooSlow(f"not read within {seconds:g} s")
        return b"".join(chunks)
    finally:
        os.close(fd)


def _refuse_not_regular(mode: int) -> None:
    _refuse_special(mode)
    if not stat.S_ISREG(mode):
        raise NotAFile("a FIFO" if stat.S_ISFIFO(mode) else "not a regular file")
