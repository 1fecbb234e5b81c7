"""A minimal HTTP/1.0 and HTTP/1.1 responder over `socket` and `select.poll`: GET and HEAD, one request per connection.

Why not http.server: importing it (with http.client, email, socketserver, mimetypes, html) costs the agent about
7 MiB of resident memory, almost as much as the whole rest of the agent; three fixed endpoints need none of it. The
request head is parsed by h11 through ipmasq.http11, the parser the API client and the health probe use too.

One thread, non-blocking sockets, one poll() over the listener, every connection and a wake pipe. Nothing a client
does can hold the loop: a request head must arrive whole within REQUEST_SECONDS (a slowloris client that trickles
one byte a second is cut off then, however long it keeps trickling), a response must be taken within
RESPONSE_SECONDS, a head is at most MAX_HEAD_BYTES with at most MAX_HEADERS header lines, and at most
MAX_CONNECTIONS are open at once (a new one evicts the oldest that has not finished its request: a probe still gets
in while idle connections pile up). So memory is bounded by MAX_CONNECTIONS x (MAX_HEAD_BYTES + one response).

Every response carries Connection: close; after it the server shuts its side and reads (and drops) what the client
still sends for up to LINGER_SECONDS before closing, so a client that sent more than a head (a body, a second
request) is not answered with a reset that could destroy the response it has not read yet.
"""

from __future__ import annotations

import select
import socket
import time
from collections.abc import Callable
from typing import NamedTuple

from ipmasq import http11

__all__ = ["MAX_CONNECTIONS", "MAX_HEADERS", "MAX_HEAD_BYTES", "REQUEST_SECONDS", "RESPONSE_SECONDS", "Responder",
           "Response", "parse_request_head"]

MAX_HEAD_BYTES = 8192  # request line and headers; Prometheus sends about 300 bytes, curl about 80
MAX_HEADERS = 64
MAX_CONNECTIONS = 32
REQUEST_SECONDS = 5.0  # the whole head, not per byte
RESPONSE_SECONDS = 5.0  # the whole response
LINGER_SECONDS = 1.0
LINGER_BYTES = 65536  # read and dropped after the response at most; more and the connection is closed anyway
RECV_BYTES = 4096

REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed", 408: "Request Timeout",
           414: "URI Too Long", 431: "Request Header Fields Too Large", 500: "Internal Server Error",
           503: "Service Unavailable", 505: "HTTP Version Not Supported"}
_DAYS = ("Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun")
_MONTHS = ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec")
_READ = select.POLLIN | select.POLLPRI
_GONE = select.POLLERR | select.POLLHUP | select.POLLNVAL


class Response(NamedTuple):
    status: int
    body: bytes
    content_type: str = "text/plain; charset=utf-8"


class Request(NamedTuple):
    method: str
    path: str  # without the query string


def parse_request_head(head: bytes) -> Request | Response:
    """The request line and headers (without the blank line ending them) -> the request, or the error to answer.
    Lines end in CRLF, or a bare LF (which RFC 9112 lets a server accept: a request typed into nc).

    h11 parses it (ipmasq.http11, the one HTTP/1.1 parser of ipmasq), strict where a lenient parse could be misread
    (RFC 9112): the request line's three parts, token methods and header names, Host on HTTP/1.1. What is served
    is decided here: GET and HEAD, an origin-form or absolute-form target, at most MAX_HEADERS header lines.
    """
    if head.count(b"\n") > MAX_HEADERS:
        return _error(431, f"more than {MAX_HEADERS} header lines")
    parsed = http11.parse_request_head(head.removesuffix(b"\r") + b"\r\n\r\n")
    if len(parsed) == 2:
        status, why = parsed
        return _error(status, why.split(":", 1)[0])  # h11's reason without the bytes it quotes
    method, target, version, _headers = parsed
    if version not in ("1.0", "1.1"):
        return _error(505, "HTTP/1.0 and HTTP/1.1 only")
    if target.startswith(("http://", "https://")):  # absolute form, as a proxy sends: the path is what follows
        slash = target.find("/", target.index("//") + 2)
        target = target[slash:] if slash >= 0 else "/"
    if not target.startswith("/"):
        return _error(400, "bad request target")
    if method not in ("GET", "HEAD"):
        return _error(405, f"method {method[:16]} not allowed: GET or HEAD")
    return Request(method, target.split("?", 1)[0])


def _end_of_head(data: bytearray) -> int:
    """Where the line end before the blank line ending a head is (-1: not yet), with CRLF or bare LF line ends."""
    ends = [i for i in (data.find(b"\n\r\n"), data.find(b"\n\n")) if i >= 0]
    return min(ends) if ends else -1


def _error(status: int, why: str) -> Response:
    return Response(status, why.encode() + b"\n")


def http_date(now: float) -> str:
    t = time.gmtime(now)
    return (f"{_DAYS[t.tm_wday]}, {t.tm_mday:02d} {_MONTHS[t.tm_mon - 1]} {t.tm_year} "
            f"{t.tm_hour:02d}:{t.tm_min:02d}:{t.tm_sec:02d} GMT")


def encode_response(response: Response, *, head_only: bool) -> bytes:
    headers = (f"HTTP/1.1 {response.status} {REASONS.get(response.status, 'Unknown')}\r\n"
               f"Date: {http_date(time.time())}\r\n"
               f"Content-Type: {response.content_type}\r\n"
               f"Content-Length: {len(response.body)}\r\n")
    if response.status == 405:
        headers += "Allow: GET, HEAD\r\n"
    headers += "Connection: close\r\n\r\n"
    return headers.encode("latin-1") + (b"" if head_only else response.body)


class _ProbeConnection:
    __slots__ = ("deadline", "dropped", "out", "read", "sock", "state")

    def __init__(self, sock: socket.socket, now: float) -> None:
        self.sock = sock
        self.read = bytearray()
        self.out = memoryview(b"")
        self.deadline = now + REQUEST_SECONDS
        self.dropped = 0  # bytes read and dropped after the response
        self.state = "head"  # head -> write -> linger


class Responder:
    """Serves `handle(path)` for GET and HEAD on `listener` until `wake_fd` is readable; run() is the loop."""

    def __init__(self, listener: socket.socket, handle: Callable[[str], Response], wake_fd: int) -> None:
        listener.setblocking(False)
        self.listener = listener
        self.handle = handle
        self.wake_fd = wake_fd
        self.connections: dict[int, _ProbeConnection] = {}
        self.poller = select.poll()

    def run(self) -> None:
        self.poller.register(self.listener, _READ)
        self.poller.register(self.wake_fd, _READ)
        try:
            while True:
                timeout_ms = None
                if self.connections:
                    soonest = min(c.deadline for c in self.connections.values())
                    timeout_ms = max(0, int((soonest - time.monotonic()) * 1000) + 1)
                events = self.poller.poll(timeout_ms)
                now = time.monotonic()
                for fd, event in events:
                    if fd == self.wake_fd:
                        return
                    if fd == self.listener.fileno():
                        self._accept(now)
                    elif fd in self.connections:
                        self._step(self.connections[fd], event, now)
                for connection in [c for c in self.connections.values() if c.deadline <= now]:
                    self._expire(connection, now)
        finally:
            for connection in list(self.connections.values()):
                self._close(connection)

    def _accept(self, now: float) -> None:
        for _ in range(MAX_CONNECTIONS):  # drain the backlog, but in bounded steps
            try:
                sock, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # ECONNABORTED, EMFILE...: nothing to serve this time; poll reports the rest again
                return
            sock.setblocking(False)
            if len(self.connections) >= MAX_CONNECTIONS:
                self._close(min(self.connections.values(), key=lambda c: (c.state != "head", c.deadline)))
            connection = _ProbeConnection(sock, now)
            self.connections[sock.fileno()] = connection
            self.poller.register(sock, _READ)

    def _step(self, connection: _ProbeConnection, event: int, now: float) -> None:
        if connection.state == "write":
            self._write(connection, now)
            return
        try:
            data = connection.sock.recv(RECV_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close(connection)
            return
        if connection.state == "linger":
            connection.dropped += len(data)
            if not data or event & _GONE or connection.dropped > LINGER_BYTES:
                self._close(connection)
            return
        if not data:  # the client went away before sending a whole head
            self._close(connection)
            return
        connection.read += data
        end = _end_of_head(connection.read)
        if end < 0:
            if len(connection.read) > MAX_HEAD_BYTES:
                line_ends = connection.read.find(b"\r\n")
                status = 414 if line_ends < 0 or line_ends > MAX_HEAD_BYTES else 431
                self._respond(connection, _error(status, f"request head over {MAX_HEAD_BYTES} bytes"), False, now)
            return
        if end > MAX_HEAD_BYTES:
            self._respond(connection, _error(431, f"request head over {MAX_HEAD_BYTES} bytes"), False, now)
            return
        request = parse_request_head(bytes(connection.read[:end]))
        if isinstance(request, Response):
            self._respond(connection, request, False, now)
            return
        try:
            response = self.handle(request.path)
        except Exception:  # a failing endpoint answers 500; the loop and the other connections go on
            response = _error(500, "internal error")
        self._respond(connection, response, request.method == "HEAD", now)

    def _respond(self, connection: _ProbeConnection, response: Response, head_only: bool, now: float) -> None:
        connection.read = bytearray()
        connection.out = memoryview(encode_response(response, head_only=head_only))
        connection.state = "write"
        connection.deadline = now + RESPONSE_SECONDS
        self.poller.modify(connection.sock, select.POLLOUT)
        self._write(connection, now)

    def _write(self, connection: _ProbeConnection, now: float) -> None:
        try:
            sent = connection.sock.send(connection.out)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close(connection)
            return
        connection.out = connection.out[sent:]
        if connection.out:
            return
        try:
            connection.sock.shutdown(socket.SHUT_WR)
        except OSError:
            self._close(connection)
            return
        connection.state = "linger"
        connection.deadline = now + LINGER_SECONDS
        connection.read = bytearray()
        self.poller.modify(connection.sock, _READ)

    def _expire(self, connection: _ProbeConnection, now: float) -> None:
        if connection.state == "head" and connection.read:  # it started a request: say why it is cut off
            self._respond(connection, _error(408, f"request head not received within {REQUEST_SECONDS:g}s"),
                          False, now)
            if connection.state == "write":  # what the socket did not take at once is not waited for
                self._close(connection)
            return
        self._close(connection)

    def _close(self, connection: _ProbeConnection) -> None:
        fd = connection.sock.fileno()
        if self.connections.get(fd) is connection:
            del self.connections[fd]
            self.poller.unregister(fd)  # every connection in the table is registered
        connection.sock.close()


def listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (IPv6 when the host has a colon); OSError as socket raises it."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart binds at once despite TIME_WAIT
        sock.bind((host, port))
        sock.listen(64)
    except OSError:
        sock.close()
        raise
    return sock
