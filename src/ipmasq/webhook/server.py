"""AdmissionReview over HTTPS: asyncio's server, TLS through ssl's memory BIOs and HTTP/1.1 through h11 (the parser
the rest of ipmasq uses), a thin, bounded layer around review.respond.

Each part is a public, documented API (asyncio's Protocol and connect_accepted_socket, ssl.SSLContext.wrap_bio,
h11's Connection), so what this module bounds it bounds itself, not through another server's private classes.

Which connections it holds and for how long is decided by ipmasq.webhook.connections (a pure table, its clock the
server's): the deadlines (a whole first request within HANDSHAKE_SECONDS of the accept, the keep-alive grace only for
a connection that has been answered, a request and its decision within REQUEST_SECONDS of its first byte), the
connection budget shared between source addresses (a connection refused at its accept is closed there, before any
TLS), room made at the heaviest source, and the request bodies' budget. This module does what it says, and:
- sockets read into one buffer for all, their bytes given to ssl's memory BIOs 2 KiB at a time and read back 16
  KiB at a time (asyncio's TLS keeps 256 KiB per connection until a garbage collection); TLS state made at a
  connection's first byte, HTTP state at a request's and dropped between requests, so a connection held costs ssl's
  own state and little more (a flood of connections that say nothing costs the accept alone);
- a request head of at most MAX_HEAD_BYTES; the body read whole before a decision slot is taken (a slow upload never
  holds one), bounded by MAX_BODY_BYTES whether framed by Content-Length or chunked (both at once is refused, as RFC
  9112 says a server may: a proxy and this server could read two different bodies);
- `workers` decisions at once, run in threads off the event loop, and as many again for small bodies (an ordinary
  review is a few KiB: reviews of thousands of rules never queue it), bodies over 1 MiB one at a time, and a body
  with more JSON values than a ConfigMap's review has refused before json.loads builds them (MAX_JSON_VALUES,
  counted by a linear scan). An `isolated` server (`ipmasq webhook`'s) decides in its threads only bodies up to
  ISOLATED_SMALL_BODY_BYTES whose checks stay under HANDOFF_STEPS, and every other in a process of its own, one at
  a time (ipmasq.webhook.worker): a decision in a thread holds the GIL, and took the event loop's turns from the
  ordinary reviews;
- new connections accepted ACCEPT_BATCH at a time, the open ones served between batches;
- a decision abandoned when its connection goes (or its deadline passes): one not begun is never begun, one under
  way stops at the next step of its work budget (ipmasq.policy.budget), and nothing is logged for a peer that left;
- a decision's log line written, then its answer (a log line that cannot be written is said on stderr, and never
  loses the answer).

The certificate can be replaced while serving (`use_certificate`): each new TLS handshake takes the context current
when it begins; key material goes to ssl through an in-memory file only.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import ipaddress
import json
import os
import re
import resource
import socket
import ssl
import struct
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import h11

from ipmasq.errors import Abandoned, DecisionFault, ReviewError, WebhookServerError, WorkOutgrown, one_line
from ipmasq.policy.budget import AbandonSignal
from ipmasq.webhook.connections import (
    BODY_BUDGET_BYTES,
    HANDSHAKE_SECONDS,
    KEEP_ALIVE_SECONDS,
    MAX_CONNECTIONS,
    REQUEST_SECONDS,
    ConnectionLimits,
    ConnectionTable,
    Held,
)
from ipmasq.webhook.review import AdmissionResponseReview, AdmissionVerdict
from ipmasq.webhook.worker import DecisionWorker

__all__ = ["BACKLOG", "BODY_BUDGET_BYTES", "HANDSHAKE_SECONDS", "KEEP_ALIVE_SECONDS", "MAX_BODY_BYTES",
           "MAX_CONNECTIONS", "REQUEST_SECONDS", "VALIDATE_PATH", "WebhookServer", "serve", "wait_listening"]

VALIDATE_PATH = "/validate"
# An AdmissionReview of an UPDATE carries the object and the old object, each at most 1 MiB of data that JSON may
# write six bytes a character ("<" is \u003c in Go's encoding): 16 MiB holds the worst a ConfigMap can be.
MAX_BODY_BYTES = 16 << 20
TLS_READ_BYTES = 16 * 1024  # a TLS record's plaintext at most
READ_BYTES = 64 * 1024  # a socket read at most
TLS_FEED_BYTES = 2 * 1024  # given to ssl at once (see _Connection.data_received)
BACKLOG = 1024
# New connections accepted each time the event loop finds the listener ready, before it turns to the connections it
# has: asyncio's create_server takes up to its backlog (1,024) at once, and under a flood the connections made of
# such a batch held the loop for hundreds of ms while kept-alive clients (the API server) waited for their answers.
# What is not taken waits in the listen queue (BACKLOG). Connections refused at their accept (their source holds
# its share) cost an accept and a close: up to REFUSED_BATCH of those besides.
ACCEPT_BATCH = 16
REFUSED_BATCH = 64
_ACCEPT_RETRY_SECONDS = 1.0  # out of descriptors or memory: accepting pauses this long (as asyncio's own server)
# A request line and its headers: the API server's are a few hundred bytes. Small, because every held connection
# may buffer this much.
MAX_HEAD_BYTES = 8 * 1024
# How often the connections' deadlines are looked at: a deadline is kept to within this
TICK_SECONDS = 0.25
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
# Bodies up to this have decision slots of their own: an ordinary review (a config of a few dozen lines) is a few
# KiB, and a config that takes its budget to review is usually far larger
SMALL_BODY_BYTES = 64 * 1024
# An `isolated` server decides on its event loop's process only bodies up to this (an ordinary review: a few KiB, a
# few ms), and only while their rules' checks stay under HANDOFF_STEPS (about 35 ms of a core): anything more is
# decided in the decision process (ipmasq.webhook.worker), where it cannot take the event loop's turns
ISOLATED_SMALL_BODY_BYTES = 16 * 1024
HANDOFF_STEPS = 20_000
_WRITE_HIGH_BYTES = 256 * 1024  # answers a peer does not read: past this, its requests are not read either
_LIMITS = ConnectionLimits()
_RESET = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: a refused connection is reset, leaving no TIME_WAIT here


class Respond(Protocol):
    """review.respond's shape. `handoff` is given only to a server's `isolated` respond (review.respond itself)."""

    def __call__(self, review: object, *, abandoned: AbandonSignal | None = None, handoff: int | None = None,
                 ) -> tuple[AdmissionResponseReview, AdmissionVerdict]: ...


_Answer = tuple[int, bytes, str, "str | None"]  # status, payload, content type, the line to log (None: none)


class _Connection(asyncio.BufferedProtocol):
    """One accepted connection: TLS in memory BIOs, h11 for HTTP/1.1, one request at a time. Its place and its
    deadlines are its `held` entry in the server's table.

    Every callback runs on the event loop; the decision runs in a thread of the server's executor, and learns that
    its connection is gone through `abandoned`."""

    __slots__ = ("abandoned", "body", "body_bytes", "closing", "decision", "early", "handshaking", "held", "http",
                 "in_request", "incoming", "outgoing", "reading", "request", "server", "tls", "transport", "writable")

    def __init__(self, server: WebhookServer, held: Held[_Connection]) -> None:
        self.server = server
        self.held = held
        held.owner = self
        self.transport: asyncio.Transport | None = None
        # TLS's state is made at the first byte (`tls` set; nothing reads the BIOs before), HTTP's at a request's
        # first byte, and dropped between requests: a connection held costs little more than ssl's own state
        self.incoming: ssl.MemoryBIO | None = None
        self.outgoing: ssl.MemoryBIO | None = None
        self.tls: ssl.SSLObject | None = None
        self.http: h11.Connection | None = None
        self.handshaking = True
        self.in_request = False  # a request's first byte has come
        self.request: h11.Request | None = None
        self.body: bytearray | None = None  # the body of a review being read
        self.body_bytes = 0  # of any request, for MAX_BODY_BYTES
        self.decision: asyncio.Task[None] | None = None
        self.early = 0  # bytes come while a decision is made (a pipelined request)
        self.abandoned: threading.Event | None = None  # made with its first decision (60 us a connection)
        self.closing = False
        self.reading = True
        self.writable = True

    # ---- asyncio's callbacks ----------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        if self.held.gone or self.closing:  # closed to make room, or at its deadline, before its transport was made
            self.closing = True
            transport.abort()
            return
        transport.set_write_buffer_limits(high=_WRITE_HIGH_BYTES)
        self.server.opened(self)

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.server.read_buffer  # one for every connection: what comes is taken whole at once, below

    def buffer_updated(self, nbytes: int) -> None:
        self.data_received(self.server.read_buffer[:nbytes])

    def data_received(self, data: bytes | memoryview) -> None:
        if self.closing:
            return
        if self.tls is None:  # the first byte: the handshake begins, with the context current now
            try:
                context = self.server.tls_context()
            except WebhookServerError:
                self.abort()
                return
            self.incoming, self.outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
            try:
                self.tls = context.wrap_bio(self.incoming, self.outgoing, server_side=True)
            except ssl.SSLError:
                self.abort()
                return
        assert self.incoming is not None and self.tls is not None
        plain = bytearray()
        ended = False
        # given to ssl a piece at a time: its memory BIO keeps the room of the largest write it had, and a peer that
        # leaves a TLS record unfinished kept 16 KiB more that way for as long as its connection
        for start in range(0, len(data), TLS_FEED_BYTES):
            self.incoming.write(data[start:start + TLS_FEED_BYTES])
            if self.handshaking:
                try:
                    self.tls.do_handshake()
                except ssl.SSLWantReadError:
                    continue
                except (ssl.SSLError, OSError):  # not TLS (a port scan, a plain-text probe), or one we do not speak
                    self._flush()  # the alert, for a client that wants to know
                    self.abort()
                    return
                self.handshaking = False  # its deadline is still the one from the accept: a whole request within it
            while True:
                try:
                    chunk = self.tls.read(TLS_READ_BYTES)
                except ssl.SSLWantReadError:
                    break
                except ssl.SSLZeroReturnError:  # the peer's close_notify
                    ended = True
                    break
                except (ssl.SSLError, OSError):
                    self.abort()
                    return
                if not chunk:
                    ended = True
                    break
                plain += chunk
            if ended:
                break
        self._flush()  # the handshake's; TLS 1.3 writes its session tickets after the handshake, on the first read
        if plain:
            if self.http is None:
                self.http = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD_BYTES)
            if not self.in_request and self.decision is None:
                self._begin_request()
            self.http.receive_data(bytes(plain))
            if self.decision is not None:
                self.early += len(plain)
                if self.early > MAX_HEAD_BYTES:
                    self._pause()
        if ended:
            self._peer_ended()
        self._process()

    def eof_received(self) -> bool:
        if not self.closing and not self.handshaking:
            self._peer_ended()
            self._process()
        return False  # the transport closes itself

    def connection_lost(self, exc: Exception | None) -> None:
        self.closing = True
        if self.abandoned is not None:
            self.abandoned.set()  # a decision under way stops at its next step; one not begun never begins
        if self.decision is not None:
            self.decision.cancel()
        self.server.closed(self)

    def pause_writing(self) -> None:
        self.writable = False
        self._pause()

    def resume_writing(self) -> None:
        self.writable = True
        if self.decision is None:
            self._resume()
            self._process()

    # ---- the server's view ------------------------------------------------------------------------------------

    def stop(self) -> None:
        """A shutdown: a connection between requests is dropped at once, one in a request finishes it."""
        if not self.in_request and self.decision is None:
            self.abort()

    def expire(self) -> None:
        """Its deadline came, or its place was given to another: it ends, and its decision with it."""
        if self.abandoned is not None:
            self.abandoned.set()
        if self.decision is not None:
            self.decision.cancel()
            self.decision = None
        self.abort()

    def abort(self) -> None:
        self.closing = True
        if self.transport is not None:
            self.transport.abort()

    # ---- HTTP -------------------------------------------------------------------------------------------------

    def _peer_ended(self) -> None:
        """The peer's close_notify or its FIN: the end of its requests."""
        if self.http is None:  # between requests, nothing said: closed at once
            self._close()
        else:
            self.http.receive_data(b"")

    def _process(self) -> None:
        """Handle h11's events until it needs more bytes, a decision is under way, or the connection ends."""
        while not self.closing and self.decision is None and self.writable and self.http is not None:
            try:
                event = self.http.next_event()
            except h11.RemoteProtocolError as exc:
                self._refuse(exc.error_status_hint, "a malformed request")
                return
            if event is h11.NEED_DATA or event is h11.PAUSED:
                return
            if isinstance(event, h11.Request):
                self._start(event)
            elif isinstance(event, h11.Data):
                self._take(event.data)
            elif isinstance(event, h11.EndOfMessage):
                self._complete()
            elif isinstance(event, h11.ConnectionClosed):
                self._close()
                return

    def _start(self, request: h11.Request) -> None:
        self.request = request
        self.body = None
        self.body_bytes = 0
        headers = {name: value for name, value in request.headers}
        if b"transfer-encoding" in headers and b"content-length" in headers:
            self._refuse(400, "a request framed both by Content-Length and chunked")
            return
        if (request.method, _path(request.target)) != (b"POST", VALIDATE_PATH.encode()):
            return  # answered when it is complete
        length = headers.get(b"content-length")
        if length is None and b"transfer-encoding" not in headers:
            self._refuse(411, "a Content-Length is required")
        elif length is not None and int(length) > MAX_BODY_BYTES:  # h11 has checked it is all digits
            self._refuse(413, "too large for an AdmissionReview of a ConfigMap")
        else:
            self.body = bytearray()  # json.loads reads it as it is: one copy of the body, not chunks and their join

    def _take(self, data: bytes) -> None:
        self.body_bytes += len(data)
        if self.body_bytes > MAX_BODY_BYTES:  # a chunked body says its size only as it goes
            self._refuse(413, "too large for an AdmissionReview of a ConfigMap")
            return
        if self.body is None:
            return  # the body of a request answered 404: counted, not kept
        if not self.server.hold(self, len(data)):
            self._refuse(503, "too many large reviews at once")
            return
        self.body += data

    def _complete(self) -> None:
        request = self.request
        assert request is not None
        self.server.table.complete(self.held, self.server.clock())
        if request.method in (b"GET", b"HEAD") and _path(request.target) in (b"/healthz", b"/readyz"):
            self._answer(200, b"ok\n", "text/plain")
        elif self.body is None:
            self._answer(404, b"not found\n", "text/plain")
        else:
            body, self.body = self.body, None
            # reading goes on, so that a client that leaves is seen leaving (and its decision abandoned); what it
            # sends meanwhile waits in h11, up to MAX_HEAD_BYTES, then in the kernel
            self.early = 0
            if self.abandoned is None:
                self.abandoned = threading.Event()
            self.decision = self.server.loop().create_task(self._decide(body, self.abandoned))

    async def _decide(self, body: bytearray, abandoned: threading.Event) -> None:
        started = time.monotonic()
        try:
            answer = await self.server.decide(body, started, abandoned)
        except asyncio.CancelledError:
            return  # the connection went: nobody to answer
        except Exception as exc:  # a fault of the decision's own: one line, and the client told so
            self.server.log_line(f"a review could not be decided: {one_line(repr(exc))[:200]}")
            answer = 500, b"the review could not be decided\n", "text/plain", None
        finally:
            del body
            self.server.table.release(self.held)
        self.decision = None
        if answer is None or self.closing:
            return
        status, payload, content_type, logged = answer
        if logged is not None:
            self.server.log_line(logged)  # first, so that a client reading the log after its answer finds it
        self._answer(status, payload, content_type)

    def _answer(self, status: int, payload: bytes, content_type: str, *, close: bool = False) -> None:
        request, http = self.request, self.http
        assert http is not None
        headers = [(b"content-type", content_type.encode()), (b"content-length", str(len(payload)).encode())]
        if close:
            headers.append((b"connection", b"close"))
        try:
            data = http.send(h11.Response(status_code=status, headers=headers))
            if request is None or request.method != b"HEAD":
                data += http.send(h11.Data(data=payload))
            data += http.send(h11.EndOfMessage())
        except h11.LocalProtocolError:
            self.abort()  # nothing more can be said on this connection
            return
        if close or http.our_state is h11.MUST_CLOSE or http.their_state is not h11.DONE:
            self._write(data or b"")
            self._close()
            return
        http.start_next_cycle()
        self.request = None
        more, ended = http.trailing_data
        # answered: the keep-alive grace, or a pipelined request's deadline from now (not from whenever more bytes
        # come); told to the table before the peer can see its answer
        self.server.table.answered(self.held, self.server.clock(), pipelined=bool(more))
        self.in_request = bool(more)
        self._write(data or b"")
        self._resume()
        if not more and not ended:
            self.http = None  # made again at the next request's first byte
            return
        self.server.loop().call_soon(self._process)

    def _refuse(self, status: int, why: str) -> None:
        if self.http is not None and self.http.our_state in (h11.IDLE, h11.SEND_RESPONSE):
            self._answer(status, f"{why}\n".encode(), "text/plain", close=True)
        else:
            self._close()

    def _begin_request(self) -> None:
        self.in_request = True
        self.server.table.began(self.held, self.server.clock())

    # ---- TLS and the transport ----------------------------------------------------------------------------------

    def _write(self, plain: bytes) -> None:
        if self.tls is None or self.closing:
            return
        try:
            self.tls.write(plain)
        except (ssl.SSLError, OSError):
            self.abort()
            return
        self._flush()

    def _flush(self) -> None:
        assert self.outgoing is not None
        data = self.outgoing.read()
        if data and self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    def _close(self) -> None:
        """Said and done: TLS's close_notify and the end of what this side writes, then what the peer still sends
        is read and dropped for LINGER_SECONDS at most. Closed at once, a socket with unread bytes (the rest of a
        body refused 413) answers them with a reset, and the peer's kernel may drop the answer unread."""
        if self.closing or self.transport is None:
            return
        self.closing = True
        if self.tls is not None and not self.handshaking:
            with contextlib.suppress(ssl.SSLError, OSError):
                self.tls.unwrap()  # writes close_notify; the peer's own is not awaited
            self._flush()
        self._resume_for_linger()
        if self.transport.can_write_eof():
            self.transport.write_eof()
            self.server.table.closing(self.held, self.server.clock())  # aborted then; the peer's close ends it sooner
        else:
            self.transport.close()

    def _resume_for_linger(self) -> None:
        if not self.reading and self.transport is not None:
            self.reading = True
            self.transport.resume_reading()

    def _pause(self) -> None:
        if self.reading and self.transport is not None and not self.closing:
            self.reading = False
            self.transport.pause_reading()

    def _resume(self) -> None:
        if not self.reading and self.writable and self.transport is not None and not self.closing:
            self.reading = True
            self.transport.resume_reading()


class WebhookServer:
    """The webhook's HTTPS server: bound (and listening) when made, serving from serve() until shutdown()."""

    def __init__(self, address: tuple[str, int], respond: Respond, *, workers: int = 2, isolated: bool = False,
                 log: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True),
                 limits: ConnectionLimits = _LIMITS, clock: Callable[[], float] = time.monotonic) -> None:
        """`isolated`: the reviews that take real work are decided in a process of their own (see
        ipmasq.webhook.worker), which `respond` must then be picklable for (review.respond, or a partial of it).
        `limits` and `clock`: the connections' budget and deadlines, and the clock they are kept by (a test's may
        stand still)."""
        family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        try:
            self._listener = socket.create_server(address, family=family, backlog=BACKLOG)
        except OSError as exc:
            raise WebhookServerError(f"cannot listen on {address[0]}:{address[1]}: {exc.strerror}") from None
        self.server_address: tuple[str, int] = self._listener.getsockname()[:2]
        self.respond = respond
        self.log = log
        self.workers = workers
        self.context: ssl.SSLContext | None = None
        self.ready = threading.Event()
        self.accepting = threading.Event()  # serving: the decision process (isolated) started, the listener read
        self._thread: threading.Thread | None = None
        self._executor = ThreadPoolExecutor(max_workers=2 * workers, thread_name_prefix="webhook-decision")
        self._worker: DecisionWorker | None = None
        self._worker_executor: ThreadPoolExecutor | None = None  # one thread: the decision process's queue
        if isolated:
            self._worker = DecisionWorker(functools.partial(decision, respond))
            self._worker_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="webhook-apart")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._stopped = threading.Event()
        # asyncio's primitives bind to the loop that first waits on them (the server's)
        self._decisions = asyncio.Semaphore(workers)
        self._small_decisions = asyncio.Semaphore(workers)
        self._large = asyncio.Lock()
        self.clock = clock
        # what every connection's socket is read into (asyncio's own reads allocate 256 KiB each time, and the
        # heap kept the pieces: a held connection cost a third more)
        self.read_buffer = memoryview(bytearray(READ_BYTES))
        # which connections are held, and until when (changed on the event loop only)
        self.table: ConnectionTable[_Connection] = ConnectionTable(limits)
        self.refused = 0  # connections refused at their accept (their source held its share)
        self._open: dict[_Connection, None] = {}  # with a transport, for a shutdown
        self._accepting = True
        self._connecting: set[asyncio.Task[None]] = set()  # accepted, their transport being made

    # ---- the certificate ------------------------------------------------------------------------------------

    def use_certificate(self, cert_pem: bytes, key_pem: bytes) -> None:
        """Serve this certificate from the next TLS handshake on."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            with _memory_file(cert_pem) as cert_path, _memory_file(key_pem) as key_path:
                context.load_cert_chain(cert_path, key_path)
        except (ssl.SSLError, OSError) as exc:
            raise WebhookServerError(f"the serving certificate is unusable: {one_line(str(exc))}") from None
        self.context = context
        self.ready.set()

    def tls_context(self) -> ssl.SSLContext:
        if self.context is None:
            raise WebhookServerError("no serving certificate")
        return self.context

    # ---- serving --------------------------------------------------------------------------------------------

    def serve_forever(self) -> None:
        _raise_file_limit()
        if self._worker is not None:
            try:
                self._worker.start()  # before the first accept: a review never waits for the process's imports
            except DecisionFault as exc:
                self.log_line(f"{exc}; started again at the next large review")
        try:
            asyncio.run(self._serve())
        finally:
            self._stopped.set()

    async def _serve(self) -> None:
        loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        self._loop = loop
        loop.set_exception_handler(self._loop_error)
        self._listener.setblocking(False)
        loop.add_reader(self._listener.fileno(), self._accept)
        loop.call_later(TICK_SECONDS, self._tick)
        self.accepting.set()
        try:
            await self._stop.wait()
        finally:
            self._accepting = False  # and no more ticks
            loop.remove_reader(self._listener.fileno())  # no new connections
            for connection in list(self._open):
                connection.stop()
            deadline = loop.time() + GRACE_SECONDS
            while self._open and loop.time() < deadline:
                await asyncio.sleep(0.05)  # the requests in flight finish (bounded by GRACE_SECONDS)
            for connection in list(self._open):
                connection.abort()

    def _accept(self) -> None:
        """The listener is ready: up to ACCEPT_BATCH new connections, each made a transport and a _Connection by
        asyncio (connect_accepted_socket), the connections already open served between batches; and up to
        REFUSED_BATCH refused (the table's say: their source holds its share), closed at once."""
        loop = asyncio.get_running_loop()
        admitted = refused = 0
        while admitted < ACCEPT_BATCH and refused < REFUSED_BATCH:
            try:
                sock, peer = self._listener.accept()
            except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                return
            except OSError as exc:  # EMFILE, ENFILE, ENOBUFS, ENOMEM: pause, or this callback spins
                self.log_line(f"cannot accept connections for now: {one_line(str(exc))[:200]}")
                loop.remove_reader(self._listener.fileno())
                loop.call_later(_ACCEPT_RETRY_SECONDS, self._resume_accepting)
                return
            held, closed = self.table.admit(source_address(peer), self.clock())
            self._end(closed)
            if held is None:
                refused += 1
                self.refused += 1
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET)
                sock.close()
                continue
            admitted += 1
            task = loop.create_task(self._connect(sock, held))
            self._connecting.add(task)  # asyncio keeps only a weak reference to a task
            task.add_done_callback(self._connecting.discard)

    def _resume_accepting(self) -> None:
        if self._accepting:
            asyncio.get_running_loop().add_reader(self._listener.fileno(), self._accept)

    async def _connect(self, sock: socket.socket, held: Held[_Connection]) -> None:
        try:
            await asyncio.get_running_loop().connect_accepted_socket(lambda: _Connection(self, held), sock)
        except OSError:  # the peer already gone (its reset before the transport was made)
            sock.close()
            self.table.forget(held)

    def _tick(self) -> None:
        """The connections whose deadline came are closed; again in TICK_SECONDS."""
        self._end(self.table.expired(self.clock()))
        if self._accepting:
            asyncio.get_running_loop().call_later(TICK_SECONDS, self._tick)

    @staticmethod
    def _end(held: list[Held[_Connection]]) -> None:
        for entry in held:
            if entry.owner is not None:
                entry.owner.expire()

    def _loop_error(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        """What asyncio would log with a traceback (a callback that raised): one line. The connection concerned is
        closed by asyncio (a fault in data_received) or by its deadline."""
        fault = context.get("exception")
        what = repr(fault) if fault is not None else str(context.get("message"))
        self.log_line(f"an internal error: {one_line(what)[:200]}")

    def shutdown(self) -> None:
        """Stop accepting, finish the requests in flight (GRACE_SECONDS at most), stop."""
        loop, stop = self._loop, self._stop
        if loop is not None and stop is not None:
            with contextlib.suppress(RuntimeError):  # the loop has already ended
                loop.call_soon_threadsafe(stop.set)
        if self._thread is not None:
            self._thread.join(GRACE_SECONDS + 5)
        self._executor.shutdown(wait=False)
        if self._worker_executor is not None:
            self._worker_executor.shutdown(wait=False, cancel_futures=True)
        if self._worker is not None:
            self._worker.close()

    @property
    def decision_pid(self) -> int | None:
        """The decision process's, while it runs (an `isolated` server's)."""
        return self._worker.pid if self._worker is not None else None

    def server_close(self) -> None:
        self._listener.close()

    # ---- what the connections share (on the event loop) ---------------------------------------------------

    def loop(self) -> asyncio.AbstractEventLoop:
        assert self._loop is not None
        return self._loop

    def opened(self, connection: _Connection) -> None:
        self._open[connection] = None

    def closed(self, connection: _Connection) -> None:
        self._open.pop(connection, None)
        self.table.forget(connection.held)
        # a stale deadline keeps the table's entry until its time (30 s at most): not the connection's TLS state
        connection.held.owner = None

    def hold(self, connection: _Connection, size: int) -> bool:
        """Whether `size` more bytes of `connection`'s body fit the bodies' budget (room made at the source holding
        most, see ipmasq.webhook.connections)."""
        fits, closed = self.table.hold(connection.held, size)
        self._end(closed)
        return fits

    async def decide(self, body: bytearray, started: float, abandoned: threading.Event) -> _Answer | None:
        """The answer to a review's body, from a decision thread once a slot is free, or from the decision process
        (an isolated server's large reviews, and the small ones that outgrow HANDOFF_STEPS); None when it was
        abandoned."""
        if self._worker is not None and len(body) > ISOLATED_SMALL_BODY_BYTES:
            return await self._apart(body, started, abandoned)
        answer: _Answer | _Outgrown | None
        async with contextlib.AsyncExitStack() as slots:
            if len(body) > LARGE_BODY_BYTES:
                await slots.enter_async_context(self._large)
            small = len(body) <= SMALL_BODY_BYTES
            await slots.enter_async_context(self._small_decisions if small else self._decisions)
            if abandoned.is_set():
                return None
            loop = asyncio.get_running_loop()
            handoff = HANDOFF_STEPS if self._worker is not None else None
            answer = await loop.run_in_executor(self._executor, decision, self.respond, body, started, abandoned,
                                                handoff)
        if isinstance(answer, _Outgrown):
            return await self._apart(body, started, abandoned)
        return answer

    async def _apart(self, body: bytearray, started: float, abandoned: threading.Event) -> _Answer | None:
        """In the decision process, one at a time, in their order (one whose connection went before its turn is
        never sent); raises DecisionFault."""
        assert self._worker is not None and self._worker_executor is not None
        loop = asyncio.get_running_loop()
        try:
            answer = await loop.run_in_executor(self._worker_executor, self._worker.decide, body, started, abandoned)
        except asyncio.CancelledError:
            self._worker.abandon(abandoned)  # at once, not at the waiting thread's next look
            raise
        return answer  # type: ignore[return-value]  # what decision() returned in the process

    def log_line(self, line: str) -> None:
        try:
            self.log(line)
        except Exception as exc:
            with contextlib.suppress(Exception):
                print(f"ipmasq webhook: a decision's log line failed: {one_line(repr(exc))[:200]}",
                      file=sys.stderr, flush=True)



class _Outgrown:
    """decision()'s answer when a small review's checks passed their handoff: it is decided again apart."""


def decision(respond: Respond, body: bytearray, started: float, abandoned: AbandonSignal,
             handoff: int | None = None) -> _Answer | _Outgrown | None:
    """In a decision thread or the decision process: the answer, or None when its connection went while it was
    being made."""
    if _json_values(body) >= MAX_JSON_VALUES:
        return 400, b"not an AdmissionReview: more JSON values than a ConfigMap's review has\n", \
            "text/plain", None
    try:
        review = json.loads(body)
        del body
        answer, verdict = (respond(review, abandoned=abandoned) if handoff is None else
                           respond(review, abandoned=abandoned, handoff=handoff))
    except (ValueError, RecursionError, ReviewError) as exc:
        return 400, (one_line(f"not an AdmissionReview: {exc}")[:300] + "\n").encode(), "text/plain", None
    except Abandoned:
        return None
    except WorkOutgrown:
        return _Outgrown()
    payload = json.dumps(answer).encode()
    logged = None
    if verdict.reviewed:
        try:
            logged = decision_line(review["request"], verdict, time.monotonic() - started)
        except Exception as exc:
            logged = f"{'admitted' if verdict.allowed else 'denied'} a review (its log line failed: " \
                     f"{one_line(repr(exc))[:120]})"
    return 200, payload, "application/json", logged


def source_address(peer: Any) -> str:
    """Whom a connection counts against: its peer's IPv4 address (also when a dual-stack listener gives it mapped
    into IPv6), or its IPv6 address's /64: one host holds a whole /64 (SLAAC, a node's pod range), and counting its
    addresses one by one would give it as many shares as it cares to use."""
    address = str(peer[0]) if isinstance(peer, tuple) else str(peer)
    try:
        parsed = ipaddress.ip_address(address.partition("%")[0])
    except ValueError:
        return address
    if isinstance(parsed, ipaddress.IPv6Address) and parsed.ipv4_mapped is not None:
        return str(parsed.ipv4_mapped)
    if isinstance(parsed, ipaddress.IPv6Address):
        return str(ipaddress.IPv6Network((int(parsed) >> 64 << 64, 64)))
    return str(parsed)


def _path(target: bytes) -> bytes:
    """A request target without its query: the API server calls /validate?timeout=5s."""
    return target.split(b"?", 1)[0]


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


def _field(value: object, key: str) -> object:
    return value.get(key) if isinstance(value, dict) else None


def decision_line(request: object, verdict: AdmissionVerdict, seconds: float) -> str:
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
