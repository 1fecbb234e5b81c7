"""The client side of the agent's endpoints: the listen address format and the GET `ipmasq health` sends.

Kept apart from ipmasq.agent.health (the server) so that `ipmasq health`, which the DaemonSet's exec probes run
every few seconds inside the agent's container, imports neither the agent nor an HTTP library: a plain socket.
"""

from __future__ import annotations

import errno
import socket
import time
from typing import NamedTuple

from ipmasq.errors import UsageError

__all__ = ["DEFAULT_METRICS_ADDRESS", "Answer", "parse_listen_address", "query"]

# Not 9253 (NodeLocal DNSCache's metrics port on every GKE node, also php-fpm_exporter's), nor 9100 (node-exporter),
# 9099 (calico), 9153 (CoreDNS), 9808 (CSI livenessprobe), 9962-9965 (cilium), 10248-10259 (kubelet, kube-proxy).
DEFAULT_METRICS_ADDRESS = "127.0.0.1:9847"


class Answer(NamedTuple):
    """What an endpoint said: ok when it answered 200; `why` is its one-line body, or why it could not be asked."""

    ok: bool
    why: str


def parse_listen_address(text: str) -> tuple[str, int]:
    """HOST:PORT, [V6]:PORT or :PORT (all addresses) -> (host, port); a UsageError names what is wrong."""
    host, sep, port_text = text.rpartition(":")
    if not sep or not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise UsageError(f"invalid address {text!r}: expected HOST:PORT, e.g. {DEFAULT_METRICS_ADDRESS}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port_text)


def query(address: str, path: str, *, timeout: float = 3.0) -> Answer:
    """GET one endpoint of a running agent: ok when it answered 200; `why` is its one-line answer or the failure.

    A plain socket, not http.client: the exec probes run this every few seconds inside the agent's container."""
    host, port = parse_listen_address(address)
    host = host or "127.0.0.1"
    authority = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.sendall(f"GET {path} HTTP/1.1\r\nHost: {authority}\r\nConnection: close\r\n\r\n".encode())
            answer = _read_all(sock, timeout)
    except OSError as exc:
        reason = exc.strerror or str(exc) or type(exc).__name__
        return Answer(False, f"cannot reach the agent at {address}: {reason}")
    head, _, body = answer.partition(b"\r\n\r\n")
    status_line = head.split(b"\r\n", 1)[0].split(b" ")
    if len(status_line) < 2 or not status_line[0].startswith(b"HTTP/") or not status_line[1].isdigit():
        return Answer(False, f"cannot reach the agent at {address}: not an HTTP answer: {answer[:40]!r}")
    status = int(status_line[1])
    text = body.decode(errors="replace").strip()
    line = text.splitlines()[0] if text else f"HTTP {status}"
    return Answer(status == 200, line)


QUERY_MAX_BYTES = 1 << 20  # an endpoint's answer is a line; /metrics a few KiB


def _read_all(sock: socket.socket, timeout: float) -> bytes:
    """Until the server closes (it always sends Connection: close), within `timeout` in all and QUERY_MAX_BYTES."""
    chunks: list[bytes] = []
    size = 0
    deadline = time.monotonic() + timeout
    while size < QUERY_MAX_BYTES:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(errno.ETIMEDOUT, "timed out")
        sock.settimeout(left)
        chunk = sock.recv(65536)
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)
