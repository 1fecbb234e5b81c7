"""The probe servers kernel tests start in their namespaces: a test talks to one only once it said it listens."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from ipmasq.lab.netns import Namespace

__all__ = ["LAB_PROBE", "serving", "start_server", "stop_server"]

LAB_PROBE = (sys.executable, "-m", "ipmasq.lab.probe")  # `serve PORT... [ADDRESS]`: the lab's own probe server


def start_server(namespace: Namespace, argv: Sequence[str]) -> subprocess.Popen[str]:
    """Run the server `argv` in the namespace and return once it printed "ready" (it listens then)."""
    server = namespace.popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    assert server.stdout is not None
    if server.stdout.readline().strip() != "ready":
        stop_server(server)
        raise AssertionError(f"the server {' '.join(argv)} did not start")
    return server


def stop_server(server: subprocess.Popen[str]) -> None:
    server.kill()
    server.wait()


@contextmanager
def serving(namespace: Namespace, argv: Sequence[str]) -> Iterator[subprocess.Popen[str]]:
    """start_server for the duration of a with block."""
    server = start_server(namespace, argv)
    try:
        yield server
    finally:
        stop_server(server)
