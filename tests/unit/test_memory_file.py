"""Key material handed to ssl through memory only: the path reads back the bytes, and is gone after the block."""

from __future__ import annotations

import os

from ipmasq.memory_file import memory_file


def test_the_path_holds_the_data_in_memory_and_is_gone_after_the_block() -> None:
    with memory_file("-----BEGIN CERTIFICATE-----\n") as path, memory_file(b"\x00key") as other:
        assert path.startswith("/proc/self/fd/") and path != other
        with open(path, "rb") as file:
            assert file.read() == b"-----BEGIN CERTIFICATE-----\n"
        with open(other, "rb") as file:
            assert file.read() == b"\x00key"
        target = os.readlink(path)
        assert target.startswith("/memfd:ipmasq-tls")  # no file system holds it
    assert not os.path.exists(path) or not os.readlink(path).startswith("/memfd:ipmasq-tls")
