"""AdmissionReview over HTTPS: a thin, bounded layer around review.respond.

Bounded by construction, whatever the peer sends: a body over MAX_BODY_BYTES is refused before it is read, a peer
that stalls is dropped after IO_TIMEOUT, at most MAX_CONNECTIONS are open and at most `workers` decisions run at
once (the rest wait their turn, each still under the API server's own timeout). The certificate can be replaced while
serving (`use_certificate`): each new connection takes the context current when it arrives.
"""

from __future__ import annotations

import json
import os
import socket
import ssl
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from ipmasq.errors import IpmasqError, one_line
from ipmasq.webhook.review import ReviewError, Verdict

__all__ = ["MAX_BODY_BYTES", "VALIDATE_PATH", "WebhookServer"]

VALIDATE_PATH = "/validate"
# An AdmissionReview of an UPDATE carries the object and the old object, each at most 1 MiB of data that JSON may
# write six bytes a character ("<" is \u003c in Go's encoding): 16 MiB holds the worst a ConfigMap can be.
MAX_BODY_BYTES = 16 << 20
IO_TIMEOUT = 10.0
MAX_CONNECTIONS = 64

Respond = Callable[[object], tuple[dict[str, Any], Verdict]]


class ServerError(IpmasqError):
    """The webhook cannot serve (the address is taken, the certificate is unusable)."""


class WebhookServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], respond: Respond, *, workers: int = 2,
                 log: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True)) -> None:
        try:
            super().__init__(address, _Handler)
        except OSError as exc:
            raise ServerError(f"cannot listen on {address[0]}:{address[1]}: {exc.strerror}") from None
        self.respond = respond
        self.log = log
        self.decisions = threading.BoundedSemaphore(workers)
        self.connections = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self.context: ssl.SSLContext | None = None
        self.ready = threading.Event()

    def use_certificate(self, cert_pem: bytes, key_pem: bytes) -> None:
        """Serve this certificate from the next connection on (ssl reads a chain from files only)."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        with tempfile.TemporaryDirectory(prefix="ipmasq-webhook-") as directory:
            cert_path, key_path = os.path.join(directory, "tls.crt"), os.path.join(directory, "tls.key")
            with open(os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as fh:
                fh.write(key_pem)
            with open(cert_path, "wb") as fh:
                fh.write(cert_pem)
            try:
                context.load_cert_chain(cert_path, key_path)
            except (ssl.SSLError, OSError) as exc:
                raise ServerError(f"the serving certificate is unusable: {one_line(str(exc))}") from None
        self.context = context
        self.ready.set()

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self.connections.acquire(blocking=False):
            self.shutdown_request(request)  # the API server retries elsewhere or, failurePolicy Ignore, admits
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.connections.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            context = self.context
            if context is None:
                self.shutdown_request(request)
                return
            request.settimeout(IO_TIMEOUT)
            try:
                secure = context.wrap_socket(request, server_side=True)
            except (ssl.SSLError, OSError):
                request.close()  # a port scan, a health check without TLS, a peer that does not trust us
                return
            super().process_request_thread(secure, client_address)
        finally:
            self.connections.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        exc = sys.exc_info()[1]
        if isinstance(exc, (OSError, TimeoutError)):
            return  # the peer went away or stalled: nothing to answer
        self.log(f"webhook: unexpected error serving {client_address[0]}: {one_line(repr(exc))}")


class _Handler(BaseHTTPRequestHandler):
    server: WebhookServer
    protocol_version = "HTTP/1.1"  # the API server keeps connections open between reviews
    server_version = "ipmasq-webhook"
    sys_version = ""

    def log_message(self, format: str, *args: Any) -> None:
        pass  # one line per decision that matters is logged by do_POST; access logs would drown it

    def do_GET(self) -> None:
        if self.path in ("/healthz", "/readyz"):
            self._send(200, b"ok\n", "text/plain")
        else:
            self._send(404, b"not found\n", "text/plain")

    def do_POST(self) -> None:
        if self.path.split("?", 1)[0] != VALIDATE_PATH:
            self._send(404, b"not found\n", "text/plain")
            return
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            self._send(411, b"a Content-Length is required\n", "text/plain", close=True)
            return
        if int(length) > MAX_BODY_BYTES:
            self._send(413, b"too large for an AdmissionReview of a ConfigMap\n", "text/plain", close=True)
            return
        started = time.monotonic()
        with self.server.decisions:
            body = self.rfile.read(int(length))
            try:
                review = json.loads(body)
                del body
                answer, verdict = self.server.respond(review)
            except (ValueError, RecursionError, ReviewError) as exc:
                self._send(400, (one_line(f"not an AdmissionReview: {exc}")[:300] + "\n").encode(), "text/plain")
                return
        if verdict.reviewed:
            self.server.log(_decision_line(review["request"], verdict, time.monotonic() - started))
        self._send(200, json.dumps(answer).encode(), "application/json")

    def _send(self, code: int, payload: bytes, content_type: str, *, close: bool = False) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(payload)))
        if close:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        self.wfile.write(payload)


def _decision_line(request: dict[str, Any], verdict: Verdict, seconds: float) -> str:
    """One log line per ConfigMap of the agent's: what, who, the verdict, how long, and the first reason."""
    outcome = "admitted" if verdict.allowed else "denied"
    first = (verdict.message or "").splitlines()[1:2] or list(verdict.warnings[:1])
    user = (request.get("userInfo") or {}).get("username")
    # a CREATE's request may name no object (generateName): the object's own metadata does
    name = request.get("name") or ((request.get("object") or {}).get("metadata") or {}).get("name")
    return one_line(f"{outcome} {request.get('operation')} of ConfigMap {request.get('namespace')}/"
                    f"{name} (uid {request.get('uid')}, by {user}) in {seconds:.3f} s, "
                    f"{len(verdict.warnings)} warning(s){': ' + first[0][:200] if first else ''}")


def serve(server: WebhookServer) -> threading.Thread:
    """Serve in a thread (the command's main thread keeps the certificate)."""
    thread = threading.Thread(target=server.serve_forever, name="webhook-server", daemon=True)
    thread.start()
    return thread


def wait_listening(address: tuple[str, int], timeout: float = 5.0) -> bool:
    """Whether something accepts TCP connections at `address` within `timeout` (for tests and the command)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(address, timeout=0.5):
                return True
        except OSError:
            time.sleep(0.05)
    return False
