"""The agent's HTTP endpoints (/metrics, /healthz, /readyz) and the client `ipmasq health` uses to query them.

The DaemonSet runs with hostNetwork, so the port is the node's: it listens on loopback by default and the
kubelet's probes are exec probes (`ipmasq health`) run inside the pod, which shares that loopback.

    /healthz   200 while the loop is alive: its heartbeat is recent (a wedged loop fails though this thread answers)
    /readyz    200 while the kernel matches the current config; 503 while the config is bad (the last good config
               is still enforced) or the backend fails
    /metrics   Prometheus text format 0.0.4 (ipmasq.agent.exposition: no library needed)

Bodies are one line, the reason, so `ipmasq health` can print it as is.
"""

from __future__ import annotations

import errno
import http.client
import logging
import os
import select
import selectors
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from ipmasq.agent.exposition import CONTENT_TYPE
from ipmasq.agent.metrics import AgentStatus, Check, render_metrics
from ipmasq.errors import IpmasqError, UsageError

__all__ = ["DEFAULT_METRICS_ADDRESS", "StatusServer", "parse_listen_address", "query"]

# Not 9253 (NodeLocal DNSCache's metrics port on every GKE node, also php-fpm_exporter's), nor 9100 (node-exporter),
# 9099 (calico), 9153 (CoreDNS), 9808 (CSI livenessprobe), 9962-9965 (cilium), 10248-10259 (kubelet, kube-proxy).
DEFAULT_METRICS_ADDRESS = "127.0.0.1:9847"
# A port in use (the agent being replaced still serves it during a rolling update) is tried again this often.
BIND_RETRY_SECONDS = 1.0


def parse_listen_address(text: str) -> tuple[str, int]:
    """HOST:PORT, [V6]:PORT or :PORT (all addresses) -> (host, port); a UsageError names what is wrong."""
    host, sep, port_text = text.rpartition(":")
    if not sep or not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise UsageError(f"invalid address {text!r}: expected HOST:PORT, e.g. {DEFAULT_METRICS_ADDRESS}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port_text)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    status: AgentStatus


class _Server6(_Server):
    address_family = socket.AF_INET6


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.0"  # one request per connection: nothing to keep track of
    timeout = 5.0  # a client that connects and stays silent does not keep a thread forever

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path == "/healthz":
            self._check(self.server.status.liveness())
        elif path == "/readyz":
            self._check(self.server.status.readiness())
        elif path == "/metrics":
            self._send(200, render_metrics(self.server.status), content_type=CONTENT_TYPE)
        else:
            self._send(404, "not found: try /metrics, /healthz or /readyz\n")

    def _check(self, check: Check) -> None:
        self._send(200 if check.ok else 503, check.why + "\n")

    def _send(self, code: int, body: str | bytes, *, content_type: str = "text/plain; charset=utf-8") -> None:
        data = body.encode() if isinstance(body, str) else body
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        pass  # a probe every 10 s is not an event: nothing per request in the agent's log


class StatusServer:
    """The endpoints on a daemon thread; `start()` binds (raising IpmasqError when it cannot) and serves.

    With `wait_if_in_use`, a port another process holds (the old agent, during a rolling update on a hostNetwork
    node) is not fatal: the thread tries again every BIND_RETRY_SECONDS until it binds or the server is stopped.
    """

    def __init__(self, status: AgentStatus, address: str) -> None:
        self.status = status
        self.address = address
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC)

    def _bind(self) -> _Server:
        host, port = parse_listen_address(self.address)
        server = (_Server6 if ":" in host else _Server)((host, port), _Handler)
        server.status = self.status
        return server

    def start(self, *, wait_if_in_use: bool = False, log: logging.Logger | None = None) -> None:
        try:
            server = self._bind()
        except OSError as exc:
            if not (wait_if_in_use and exc.errno == errno.EADDRINUSE):
                raise IpmasqError(f"cannot listen on {self.address} (--metrics-address): "
                                  f"{exc.strerror or exc}") from None
            if log is not None:
                log.warning("cannot listen on %s (--metrics-address): %s (another agent during an update?); "
                            "trying again every %gs", self.address, exc.strerror or exc, BIND_RETRY_SECONDS)
            self._thread = threading.Thread(target=self._bind_later, args=(log,), name="ipmasq-status", daemon=True)
            self._thread.start()
            return
        self._server = server
        self._thread = threading.Thread(target=self._serve, args=(server,), name="ipmasq-status", daemon=True)
        self._thread.start()

    def _bind_later(self, log: logging.Logger | None) -> None:
        while not select.select([self._wake_r], [], [], BIND_RETRY_SECONDS)[0]:
            try:
                server = self._bind()
            except OSError:
                continue
            self._server = server
            if log is not None:
                log.info("serving /metrics, /healthz and /readyz on %s", self.address)
            self._serve(server)
            return

    def _serve(self, server: _Server) -> None:
        # Not serve_forever: it wakes every poll_interval to check for shutdown (an idle agent should not wake at
        # all) and shutdown() waits up to that long (SIGTERM must exit at once). A pipe wakes this select instead.
        with selectors.DefaultSelector() as selector:
            selector.register(server, selectors.EVENT_READ)
            selector.register(self._wake_r, selectors.EVENT_READ)
            while True:
                for key, _ in selector.select():
                    if key.fileobj == self._wake_r:
                        return
                    server.handle_request()  # the listening socket is readable: accepts without blocking

    @property
    def port(self) -> int:
        assert self._server is not None
        return int(self._server.server_address[1])

    @property
    def serving(self) -> bool:
        return self._server is not None

    def stop(self) -> None:
        if self._thread is not None:
            os.write(self._wake_w, b"x")
            self._thread.join(5)
            self._thread = None
        if self._server is not None:
            self._server.server_close()
            self._server = None
        os.close(self._wake_r)
        os.close(self._wake_w)


def query(address: str, path: str, *, timeout: float = 3.0) -> Check:
    """GET one endpoint of a running agent: ok when it answered 200; `why` is its one-line answer or the failure."""
    host, port = parse_listen_address(address)
    connection = http.client.HTTPConnection(host or "127.0.0.1", port, timeout=timeout)
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        body = response.read().decode(errors="replace").strip()
    except (OSError, http.client.HTTPException) as exc:
        reason = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
        return Check(False, f"cannot reach the agent at {address}: {reason}")
    finally:
        connection.close()
    line = body.splitlines()[0] if body else f"HTTP {response.status}"
    return Check(response.status == 200, line)
