"""AdmissionReview over HTTPS: an ASGI app on uvicorn (its h11 protocol, the HTTP parser the rest of ipmasq uses too),
a thin, bounded layer around review.respond.

What uvicorn gives: an asyncio server (a slow peer costs a socket and its buffers, not a thread), HTTP/1.1
keep-alive as the API server uses it, a listen backlog of BACKLOG, reading paused past 64 KiB until the app asks for
more, and a graceful shutdown that lets the requests in flight finish.

What this module adds, because a hostile peer on the pod network can reach the port as well as the API server can:
- a deadline on the whole request, head and body (REQUEST_SECONDS from its first byte, not per read): a peer that
  trickles a byte every few seconds is cut off then;
- a connection limit that slow peers cannot exhaust: connections count from their accept, and at MAX_CONNECTIONS a
  new one closes the oldest that is not waiting for its decision (a TLS handshake that does not come, a slow
  request, an idle keep-alive), so an ordinary review still gets in; a handshake has HANDSHAKE_SECONDS;
- the body read whole before a decision slot is taken (a slow upload never holds one), bounded by its
  Content-Length (MAX_BODY_BYTES at most) and by BODY_BUDGET_BYTES for all bodies held at once;
- `workers` decisions at once, run in threads off the event loop (a large review does not stall the others' I/O),
  bodies over 1 MiB one at a time, and a body with more JSON values than a ConfigMap's review has refused before
  json.loads builds them (MAX_JSON_VALUES);
- the decision answered first, logged after (a log line that cannot be written never loses the answer).

The certificate can be replaced while serving (`use_certificate`): each new TLS handshake takes the context current
when it begins; key material goes to ssl through an in-memory file only.
"""

from __future__ import annotations

import asyncio
import asyncio.sslproto
import contextlib
import gc
import json
import logging
import os
import re
import resource
import socket
import ssl
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from ipmasq.errors import IpmasqError, one_line
from ipmasq.webhook.review import ReviewError, Verdict

__all__ = ["BACKLOG", "MAX_BODY_BYTES", "MAX_CONNECTIONS", "REQUEST_SECONDS", "VALIDATE_PATH", "WebhookServer",
           "serve", "wait_listening"]

VALIDATE_PATH = "/validate"
# An AdmissionReview of an UPDATE carries the object and the old object, each at most 1 MiB of data that JSON may
# write six bytes a character ("<" is \u003c in Go's encoding): 16 MiB holds the worst a ConfigMap can be.
MAX_BODY_BYTES = 16 << 20
# All request bodies held at once (read, or waiting for their decision): two of the largest and room for the rest.
BODY_BUDGET_BYTES = 48 << 20
REQUEST_SECONDS = 10.0  # the whole request from its first byte: the API server gives a review at most 30 s
HANDSHAKE_SECONDS = 5.0  # a TLS handshake from the connection's accept
TLS_READ_BYTES = 16 * 1024 + 256  # a TLS record's plaintext at most, and room for its header
GC_EVERY_CONNECTIONS = 256
KEEP_ALIVE_SECONDS = 30.0  # an idle connection between reviews (the API server keeps them for reuse)
# asyncio's TLS keeps a 256 KiB buffer per connection: 128 of them are 32 MiB, and the API server keeps a few
MAX_CONNECTIONS = 128
BACKLOG = 1024
MAX_HEAD_BYTES = 64 * 1024
GRACE_SECONDS = 10.0  # a shutdown waits this long for the requests in flight
# json.loads builds a Python object of 30 to 60 bytes for every value, whatever its text: 16 MiB of "[1.5,1.5,..."
# would be 4 million floats, 150 MiB. Outside its strings, a JSON text has a comma, a colon, a bracket or a brace for
# every value but one, so counting those and the strings bounds the objects before any is made (an overestimate). An
# AdmissionReview of a ConfigMap has a few hundred (an UPDATE of 10,000 keys of data: 80,000); its config is one
# string.
MAX_JSON_VALUES = 200_000
# A string, or one never closed up to the end of the body (broken JSON, refused by json.loads). Taking the unclosed
# one whole keeps the scan linear: a scan that gave up on it and went on from its next byte would start a string at
# every escaped quote and read the rest again from there (80 KB of `"\"\"...` cost 21 s). Possessive: the regex
# engine keeps no backtracking state per escape (a config of 700,000 lines, each ending in \n, cost 94 MiB with the
# plain form).
_JSON_STRING = re.compile(rb'"[^"\\]*+(?:\\.[^"\\]*+)*+(?:"|\\?\Z)', re.DOTALL)
# Bodies over this are decided one at a time (their parse is the memory that counts)
LARGE_BODY_BYTES = 1 << 20

Respond = Callable[[object], tuple[dict[str, Any], Verdict]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
Receive = Callable[[], Awaitable[dict[str, Any]]]


class ServerError(IpmasqError):
    """The webhook cannot serve (the address is taken, the certificate is unusable)."""


class _Config(uvicorn.Config):
    """uvicorn's settings, and what the connections of one WebhookServer share: the open ones (handshaking or
    served) and the TLS context of the moment."""

    connections: set[_Gate]
    tls_context: Callable[[], ssl.SSLContext]
    ended = 0  # connections ended since the last garbage collection


class _Gate(asyncio.Protocol):
    """What uvicorn makes for each accepted connection. It counts the connection from its accept (a TLS handshake
    that never comes still holds 256 KiB of asyncio's buffers), closes the oldest waiting one when MAX_CONNECTIONS
    are open, and makes the TLS handshake itself (HANDSHAKE_SECONDS at most, the context current at that moment);
    then the HTTP protocol takes over the TLS transport."""

    def __init__(self, config: _Config, server_state: Any, app_state: dict[str, Any],
                 _loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.config = config
        self.loop = _loop or asyncio.get_event_loop()
        self.http = _GuardedH11Protocol(config, server_state, app_state, _loop)
        self.http.gate = self
        self.since = self.loop.time()
        self.handshaking = True
        self.raw: asyncio.Transport | None = None
        self._task: asyncio.Task[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        transport.pause_reading()  # nothing is read before TLS takes over the transport
        self.raw = transport
        open_now = self.config.connections
        open_now.add(self)
        if len(open_now) > MAX_CONNECTIONS:
            waiting = [gate for gate in open_now if gate is not self and gate.waiting()]
            if waiting:
                min(waiting, key=lambda gate: gate.since).cut()
        self._task = self.loop.create_task(self._handshake(transport))

    async def _handshake(self, transport: asyncio.Transport) -> None:
        secure = None
        try:
            secure = await self.loop.start_tls(transport, self.http, self.config.tls_context(), server_side=True,
                                               ssl_handshake_timeout=HANDSHAKE_SECONDS)
        except OSError:  # no TLS (a port scan, a plain-text probe), or none in time (TimeoutError is an OSError)
            pass
        finally:  # cancelled too (cut to make room)
            if secure is None or self.http.lost_early:
                transport.abort()
                self.done()
        if secure is not None and not self.http.lost_early:
            self.handshaking = False
            self.http.connection_made(secure)

    def connection_lost(self, exc: Exception | None) -> None:
        self.done()  # gone before its handshake began

    def data_received(self, data: bytes) -> None:
        pass  # not reached: reading is paused until TLS takes over

    def done(self) -> None:
        if self not in self.config.connections:
            return
        self.config.connections.discard(self)
        # an ended connection's transport, TLS objects and protocols are a reference cycle of about 45 KiB that only
        # the cyclic collector frees, and its full passes are rare: a peer opening and dropping connections as fast
        # as it can grew the process by 45 MiB a thousand. Collected every GC_EVERY_CONNECTIONS (~10 ms each).
        self.config.ended += 1
        if self.config.ended >= GC_EVERY_CONNECTIONS:
            self.config.ended = 0
            gc.collect()

    def waiting(self) -> bool:
        """Whether it may be closed to make room: still handshaking, reading a request, or idle between them."""
        return self.handshaking or not self.http.deciding()

    def cut(self) -> None:
        self.done()  # at once: the next eviction picks another, whenever this one's transport reports its end
        if not self.handshaking:
            self.http.cut()
            return
        if self._task is not None:
            self._task.cancel()
        if self.raw is not None:
            self.raw.abort()


class _GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on each whole request.

    asyncio's start_tls may hand it the first bytes of the request, or the connection's end, in the same step as the
    handshake's, before the gate can call connection_made: those are kept and replayed, or end it before it starts.
    """

    gate: _Gate
    _deadline: asyncio.TimerHandle | None = None
    _early: list[bytes] | None = None
    lost_early = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()
        early, self._early = self._early, None
        for data in early or ():
            self.data_received(data)

    def data_received(self, data: bytes) -> None:
        if self.transport is None:  # before connection_made (see the class's docstring)
            self._early = [*(self._early or ()), data]
            return
        if self._deadline is None:
            self._arm()  # the first byte of the next request on a kept-alive connection
        super().data_received(data)

    def on_response_complete(self) -> None:
        self._disarm()
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self.gate.done()
        if self.transport is None:  # before connection_made (see the class's docstring)
            self.lost_early = True
            return
        super().connection_lost(exc)

    def shutdown(self) -> None:
        """uvicorn's graceful shutdown; a connection between requests is dropped at once (a TLS close would wait
        for a peer that may never answer), one in a request finishes it first."""
        idle = self.cycle is None or self.cycle.response_complete
        try:
            super().shutdown()
        except h11.LocalProtocolError:  # a request cut off half-way: nothing to finish
            idle = True
        if idle:
            self.transport.abort()

    def deciding(self) -> bool:
        """Whether its request is in whole and waits for (or is in) its decision: never evicted."""
        cycle = self.cycle
        return cycle is not None and not cycle.more_body and not cycle.response_complete

    def _arm(self) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(REQUEST_SECONDS, self.cut)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def cut(self) -> None:
        self._deadline = None
        if not self.transport.is_closing():
            with contextlib.suppress(h11.LocalProtocolError):
                self.conn.send(h11.ConnectionClosed())
            self.transport.close()


class WebhookServer:
    """The webhook's HTTPS server: bound (and listening) when made, serving from serve() until shutdown()."""

    def __init__(self, address: tuple[str, int], respond: Respond, *, workers: int = 2,
                 log: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True)) -> None:
        family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        try:
            self._listener = socket.create_server(address, family=family, backlog=BACKLOG)
        except OSError as exc:
            raise ServerError(f"cannot listen on {address[0]}:{address[1]}: {exc.strerror}") from None
        self.server_address: tuple[str, int] = self._listener.getsockname()[:2]
        self.respond = respond
        self.log = log
        self.workers = workers
        self.context: ssl.SSLContext | None = None
        self.ready = threading.Event()
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="webhook-decision")
        # asyncio's primitives bind to the loop that first waits on them (the server's)
        self._decisions = asyncio.Semaphore(workers)
        self._large = asyncio.Lock()
        self._held_bytes = 0  # request bodies held now (changed on the event loop only)

    # ---- the certificate ------------------------------------------------------------------------------------

    def use_certificate(self, cert_pem: bytes, key_pem: bytes) -> None:
        """Serve this certificate from the next TLS handshake on."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            with _memory_file(cert_pem) as cert_path, _memory_file(key_pem) as key_path:
                context.load_cert_chain(cert_path, key_path)
        except (ssl.SSLError, OSError) as exc:
            raise ServerError(f"the serving certificate is unusable: {one_line(str(exc))}") from None
        self.context = context
        self.ready.set()

    # ---- serving --------------------------------------------------------------------------------------------

    def serve_forever(self) -> None:
        # no ssl for uvicorn: each connection's _Gate makes the TLS handshake itself, counted and with a deadline
        config = _Config(self._app, interface="asgi3", proxy_headers=False, lifespan="off", log_config=None,
                         access_log=False, http=_Gate, backlog=BACKLOG, timeout_keep_alive=int(KEEP_ALIVE_SECONDS),
                         timeout_graceful_shutdown=int(GRACE_SECONDS), h11_max_incomplete_event_size=MAX_HEAD_BYTES,
                         server_header=False, date_header=False)
        config.connections = set()
        config.tls_context = self._tls
        # a hostile peer's garbage is answered 400 by uvicorn; a warning line for each would flood the log
        logging.getLogger("uvicorn.error").setLevel(logging.ERROR)
        _raise_file_limit()
        # asyncio gives each TLS connection a 256 KiB read buffer, kept until a garbage collection breaks the
        # connection's reference cycle: 2,000 connections opened and closed by a peer left 300 MiB resident. A TLS
        # record is at most 16 KiB, so a buffer of that size reads as well (this process serves only the webhook).
        asyncio.sslproto.SSLProtocol.max_size = TLS_READ_BYTES
        self._server = uvicorn.Server(config)
        self._server.run(sockets=[self._listener])

    def _tls(self) -> ssl.SSLContext:
        if self.context is None:
            raise ServerError("no serving certificate")
        return self.context

    def shutdown(self) -> None:
        """Stop accepting, finish the requests in flight (GRACE_SECONDS at most), stop."""
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(GRACE_SECONDS + 5)
        self._executor.shutdown(wait=False)

    def server_close(self) -> None:
        self._listener.close()

    # ---- the app --------------------------------------------------------------------------------------------

    async def _app(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        method, path = scope["method"], scope["path"]
        if method in ("GET", "HEAD") and path in ("/healthz", "/readyz"):
            await _send(send, 200, b"ok\n", "text/plain")
            return
        if path != VALIDATE_PATH or method != "POST":
            await _send(send, 404, b"not found\n", "text/plain")
            return
        length = dict(scope["headers"]).get(b"content-length", b"")
        if not length.isdigit():
            await _send(send, 411, b"a Content-Length is required\n", "text/plain", close=True)
            return
        if int(length) > MAX_BODY_BYTES:
            await _send(send, 413, b"too large for an AdmissionReview of a ConfigMap\n", "text/plain", close=True)
            return
        started = time.monotonic()
        held = 0
        try:
            body = bytearray()  # json.loads reads it as it is: one copy of the body, not chunks and their join
            while True:  # the whole body before any decision slot: a slow upload holds only its own connection
                message = await receive()
                if message["type"] != "http.request":
                    return  # the peer went away, or its request's deadline cut it off
                chunk = message.get("body", b"")
                if self._held_bytes + len(chunk) > BODY_BUDGET_BYTES:
                    await _send(send, 503, b"too many large reviews at once\n", "text/plain", close=True)
                    return
                self._held_bytes += len(chunk)
                held += len(chunk)
                body += chunk
                if not message.get("more_body", False):
                    break
            async with contextlib.AsyncExitStack() as slots:
                if len(body) > LARGE_BODY_BYTES:
                    await slots.enter_async_context(self._large)
                await slots.enter_async_context(self._decisions)
                loop = asyncio.get_running_loop()
                status, payload, content_type, logged = await loop.run_in_executor(self._executor, self._decide,
                                                                                   body, started)
            del body
            await _send(send, status, payload, content_type)
        finally:
            self._held_bytes -= held
        if logged is not None:
            try:
                self.log(logged)
            except Exception as exc:
                with contextlib.suppress(Exception):
                    print(f"ipmasq webhook: a decision's log line failed: {one_line(repr(exc))[:200]}",
                          file=sys.stderr, flush=True)

    def _decide(self, body: bytearray, started: float) -> tuple[int, bytes, str, str | None]:
        """In a decision thread: the status, the answer, its type, and the line to log (None: none)."""
        if _json_values(body) >= MAX_JSON_VALUES:
            return 400, b"not an AdmissionReview: more JSON values than a ConfigMap's review has\n", \
                "text/plain", None
        try:
            review = json.loads(body)
            del body
            answer, verdict = self.respond(review)
        except (ValueError, RecursionError, ReviewError) as exc:
            return 400, (one_line(f"not an AdmissionReview: {exc}")[:300] + "\n").encode(), "text/plain", None
        payload = json.dumps(answer).encode()
        logged = None
        if verdict.reviewed:
            try:
                logged = decision_line(review["request"], verdict, time.monotonic() - started)
            except Exception as exc:
                logged = f"{'admitted' if verdict.allowed else 'denied'} a review (its log line failed: " \
                         f"{one_line(repr(exc))[:120]})"
        return 200, payload, "application/json", logged


def _json_values(body: bytearray) -> int:
    """At least the number of values json.loads would make of `body`, up to MAX_JSON_VALUES: each string one, and
    one for each comma, colon, bracket and brace between them. Nothing is copied; 0.1 s for a 14 MB review whose
    config is one string."""
    values, start = 1, 0
    for string in _JSON_STRING.finditer(body):
        values += 1 + _separators(body, start, string.start())
        start = string.end()
        if values >= MAX_JSON_VALUES:
            return values
    return values + _separators(body, start, len(body))


def _separators(body: bytearray, start: int, end: int) -> int:
    return sum(body.count(mark, start, end) for mark in (b",", b":", b"[", b"{"))


async def _send(send: Send, status: int, payload: bytes, content_type: str, *, close: bool = False) -> None:
    headers = [(b"content-type", content_type.encode()), (b"content-length", str(len(payload)).encode())]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})


def _field(value: object, key: str) -> object:
    return value.get(key) if isinstance(value, dict) else None


def decision_line(request: object, verdict: Verdict, seconds: float) -> str:
    """One log line per ConfigMap of the agent's: what, who, the verdict, how long, and the first reason. Any
    member may be missing or of the wrong type (the request is the peer's): it is shown as None."""
    outcome = "admitted" if verdict.allowed else "denied"
    first = (verdict.message or "").splitlines()[1:2] or list(verdict.warnings[:1])
    user = _field(_field(request, "userInfo"), "username")
    # a CREATE's request may name no object (generateName): the object's own metadata does
    name = _field(request, "name") or _field(_field(_field(request, "object"), "metadata"), "name")
    return one_line(f"{outcome} {_field(request, 'operation')} of ConfigMap {_field(request, 'namespace')}/"
                    f"{name} (uid {_field(request, 'uid')}, by {user}) in {seconds:.3f} s, "
                    f"{len(verdict.warnings)} warning(s){': ' + first[0][:200] if first else ''}")


def _raise_file_limit() -> None:
    """Up to the hard limit: every connection, and every TLS handshake in progress, holds a descriptor, and 1,024
    (the usual soft limit) is few enough for a peer to fill with unfinished handshakes."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = hard if hard != resource.RLIM_INFINITY else 1 << 16
    if soft != resource.RLIM_INFINITY and soft < wanted:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))


@contextlib.contextmanager
def _memory_file(data: bytes) -> Iterator[str]:
    """A path ssl can read `data` from, backed by memory only (memfd), gone when the block ends."""
    fd = os.memfd_create("ipmasq-webhook-tls", os.MFD_CLOEXEC)
    try:
        os.write(fd, data)
        yield f"/proc/self/fd/{fd}"
    finally:
        os.close(fd)


def serve(server: WebhookServer) -> threading.Thread:
    """Serve in a thread (the command's main thread keeps the certificate)."""
    thread = threading.Thread(target=server.serve_forever, name="webhook-server", daemon=True)
    server._thread = thread
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
