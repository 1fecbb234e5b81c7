"""The one reader of credential files: regular files only, bounded, with a deadline."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from ipmasq.errors import FileTooLarge, FileTooSlow, InputRefused, NotAFile, NoWriter
from ipmasq.input_files import read_regular


def test_a_regular_file_is_read_whole_up_to_its_bound(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_bytes(b"x" * 100)
    assert read_regular(str(token), limit=100) == b"x" * 100
    with pytest.raises(FileTooLarge, match="more than 99 bytes"):
        read_regular(str(token), limit=99)
    token.write_bytes(b"")
    assert read_regular(str(token), limit=10) == b""


def test_devices_fifos_sockets_and_directories_are_refused_without_reading(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(str(tmp_path / "socket"))
        refused = {"/dev/zero": "a character device", str(fifo): "a FIFO", str(tmp_path): "a directory",
                   str(tmp_path / "socket"): "a socket"}
        for path, kind in refused.items():
            with pytest.raises(NotAFile, match=kind):
                read_regular(path, limit=1 << 20)


def test_a_fifo_with_a_writer_is_refused_too_and_the_writer_is_not_waited_on(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    # a writer that holds the FIFO open (it waits for a reader: opened non-blocking for reading here first)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    writer = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
    try:
        os.write(writer, b"token")
        with pytest.raises(NotAFile, match="a FIFO"):
            read_regular(str(fifo), limit=1 << 20)
    finally:
        os.close(writer)
        os.close(reader)


def test_a_read_past_its_deadline_is_refused_between_reads(tmp_path: Path) -> None:
    big = tmp_path / "ca.crt"
    big.write_bytes(b"-" * (3 << 16))  # several reads
    with pytest.raises(FileTooSlow):
        read_regular(str(big), limit=1 << 20, seconds=-1.0)  # a deadline already passed: no wall clock involved


def test_a_missing_file_is_the_os_error_and_every_refusal_is_one_input_refused(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        read_regular(str(tmp_path / "absent"), limit=10)
    for kind in (NotAFile, NoWriter, FileTooLarge, FileTooSlow):
        assert issubclass(kind, InputRefused)

