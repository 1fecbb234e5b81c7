"""AdmissionReview over HTTPS: asyncio's server, TLS through ssl's memory BIOs and HTTP/1.1 through h11 (the parser
the rest of ipmasq uses), a thin, bounded layer around review.respond.

Each part is a public, documented API (asyncio's Protocol and create_server, ssl.SSLContext.wrap_bio, h11's
Connection), so what this module bounds it bounds itself, not through another server's private classes: uvicorn's
public API gives no deadline for a request's head or for a pipelined request, no say over a TLS connection's
buffers, and no count of connections from their accept.

What it does, because a hostile peer on the pod network can reach the port as well as the API server can:
- one deadline for every request, head, body and decision (REQUEST_SECONDS from its first byte, not per read),
  pipelined or not: a peer that trickles a byte every few seconds is cut off then, and so is a request that waited
  behind another in the same connection; a handshake has HANDSHAKE_SECONDS from the accept, an idle connection
  between requests KEEP_ALIVE_SECONDS;
- a connection limit that slow peers cannot exhaust: connections count from their accept, and at MAX_CONNECTIONS
  a new one closes one that is not waiting for its decision, the one that got least far (nothing sent, then a
  handshake under way, then secure but never answered), the first to get that far of those, so an ordinary review
  still gets in;
- TLS records read 16 KiB at a time into the connection's own small buffers (asyncio's TLS keeps 256 KiB per
  connection until a garbage collection);
- the body read whole before a decision slot is taken (a slow upload never holds one), bounded by MAX_BODY_BYTES
  whether framed by Content-Length or chunked (both at once is refused, as RFC 9112 says a server may: a proxy and
  this server could read two different bodies), and by BODY_BUDGET_BYTES for all bodies held at once;
- `workers` decisions at once, run in threads off the event loop, and as many again for small bodies (an ordinary
  review is a few KiB: reviews of thousands of rules never queue it), bodies over 1 MiB one at a time, and a body
  with more JSON values than a ConfigMap's review has refused before json.loads builds them (MAX_JSON_VALUES,
  counted by a linear scan). An `isolated` server (`ipmasq webhook`'s) decides in its threads only bodies up to
  ISOLATED_SMALL_BODY_BYTES whose checks stay under HANDOFF_STEPS, and every other in a process of its own, one at
  a time (ipmasq.webhook.worker): a decision in a thread holds the GIL, and took the event loop's turns from the
  ordinary reviews;
- new connections accepted ACCEPT_BATCH at a time, the open ones served between batches, and nothing made for a
  connection (TLS, HTTP) before its first byte: a flood of connections that say nothing costs the accept alone;
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
import json
import os
import re
import resource
import socket
import ssl
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import h11

from ipmasq.errors import Abandoned, DecisionFault, ReviewError, WebhookServerError, WorkOutgrown, one_line
from ipmasq.policy.budget import AbandonSignal
from ipmasq.webhook.review import AdmissionVerdict
from ipmasq.webhook.worker import DecisionWorker

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
TLS_READ_BYTES = 16 * 1024  # a TLS record's plaintext at most
KEEP_ALIVE_SECONDS = 30.0  # an idle connection between reviews (the API server keeps them for reuse)
MAX_CONNECTIONS = 128
BACKLOG = 1024
# New connections accepted each time the event loop finds the listener ready, before it turns to the connections it
# has: asyncio's create_server takes up to its backlog (1,024) at once, and under a flood the connections made of
# such a batch held the loop for hundreds of ms while kept-alive clients (the API server) waited for their answers.
# What is not taken waits in the listen queue (BACKLOG).
ACCEPT_BATCH = 16
_ACCEPT_RETRY_SECONDS = 1.0  # out of descriptors or memory: accepting pauses this long (as asyncio's own server)
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
# Bodies up to this have decision slots of their own: an ordinary review (a config of a few dozen lines) is a few
# KiB, and a config that takes its budget to review is usually far larger
SMALL_BODY_BYTES = 64 * 1024
# An `isolated` server decides on its event loop's process only bodies up to this (an ordinary review: a few KiB, a
# few ms), and only while their rules' checks stay under HANDOFF_STEPS (about 35 ms of a core): anything more is
# decided in the decision process (ipmasq.webhook.worker), where it cannot take the event loop's turns
ISOLATED_SMALL_BODY_BYTES = 16 * 1024
HANDOFF_STEPS = 20_000
LINGER_SECONDS = 2.0  # a closed connection's peer may still send this long (its bytes are dropped unread)
_WRITE_HIGH_BYTES = 256 * 1024  # answers a peer does not read: past this, its requests are not read either


class Respond(Protocol):
    """review.respond's shape. `handoff` is given only to a server's `isolated` respond (review.respond itself)."""

    def __call__(self, review: object, *, abandoned: AbandonSignal | None = None, handoff: int | None = None,
                 ) -> tuple[dict[str, Any], AdmissionVerdict]: ...


_Answer = tuple[int, bytes, str, "str | None"]  # status, payload, content type, the line to log (None: none)


class _Connection(asyncio.Protocol):
    """One accepted connection: TLS in memory BIOs, h11 for HTTP/1.1, one request at a time, each with its deadline.

    Every callback runs on the event loop; the decision runs in a thread of the server's executor, and learns that
    its connection is gone through `abandoned`."""

    def __init__(self, server: WebhookServer) -> None:
        self.server = server
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        # TLS's and HTTP's state are made at the first byte (`tls` set; nothing reads the others before): a
        # flood's connections, opened and dropped without a word, cost the accept alone (with them, about 0.1 ms
        # more of the event loop per connection)
        self.incoming: ssl.MemoryBIO
        self.outgoing: ssl.MemoryBIO
        self.http: h11.Connection
        self.tls: ssl.SSLObject | None = None
        self.handshaking = True
        self.heard = False  # a byte has come
        self.served = 0  # requests answered: one that has been is an ordinary client, evicted last
        self.level = 0  # progress() as the server last filed it
        self.timer: asyncio.TimerHandle | None = None
        self.in_request = False  # a request's first byte has come: its deadline runs
        self.request: h11.Request | None = None
        self.body: bytearray | None = None  # the body of a review being read
        self.body_bytes = 0  # of any request, for MAX_BODY_BYTES
        self.held = 0  # of the server's BODY_BUDGET_BYTES
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
        transport.set_write_buffer_limits(high=_WRITE_HIGH_BYTES)
        self.server.admit(self)
        self._arm(HANDSHAKE_SECONDS)

    def data_received(self, data: bytes) -> None:
        if self.closing:
            return
        if self.tls is None:  # the first byte: the handshake begins, with the context current now
            self.incoming, self.outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
            try:
                self.tls = self.server.tls_context().wrap_bio(self.incoming, self.outgoing, server_side=True)
            except (WebhookServerError, ssl.SSLError):
                self.abort()
                return
            self.http = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD_BYTES)
            self.heard = True
            self.server.advanced(self)
        self.incoming.write(data)
        if self.handshaking:
            try:
                self.tls.do_handshake()
            except ssl.SSLWantReadError:
                self._flush()
                return
            except (ssl.SSLError, OSError):  # not TLS (a port scan, a plain-text probe), or one we do not speak
                self._flush()  # the alert, for a client that wants to know
                self.abort()
                return
            self.handshaking = False
            self.server.advanced(self)
            self._arm(KEEP_ALIVE_SECONDS)
        plain = bytearray()
        ended = False
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
        self._flush()  # TLS 1.3 writes its session tickets after the handshake, on the first read
        if plain:
            if not self.in_request and self.decision is None:
                self._begin_request()
            self.http.receive_data(bytes(plain))
            if self.decision is not None:
                self.early += len(plain)
                if self.early > MAX_HEAD_BYTES:
                    self._pause()
        if ended:
            self.http.receive_data(b"")
        self._process()

    def eof_received(self) -> bool:
        if not self.closing and not self.handshaking:
            self.http.receive_data(b"")
            self._process()
        return False  # the transport closes itself

    def connection_lost(self, exc: Exception | None) -> None:
        self.closing = True
        if self.abandoned is not None:
            self.abandoned.set()  # a decision under way stops at its next step; one not begun never begins
        if self.decision is not None:
            self.decision.cancel()
        self._disarm()
        self._release()
        self.server.forget(self)

    def pause_writing(self) -> None:
        self.writable = False
        self._pause()

    def resume_writing(self) -> None:
        self.writable = True
        if self.decision is None:
            self._resume()
            self._process()

    # ---- the server's view ------------------------------------------------------------------------------------

    def progress(self) -> int:
        """How far it has got: 0 nothing received, 1 in its handshake, 2 secure, 3 a request answered."""
        return 3 if self.served else 2 if not self.handshaking else 1 if self.heard else 0

    def waiting(self) -> bool:
        """Whether it may be closed to make room: handshaking, reading a request, or idle between them."""
        return self.decision is None

    def evict(self) -> None:
        self.abort()

    def stop(self) -> None:
        """A shutdown: a connection between requests is dropped at once, one in a request finishes it."""
        if not self.in_request and self.decision is None:
            self.abort()

    def abort(self) -> None:
        if self.transport is not None:
            self.closing = True
            self.transport.abort()

    # ---- HTTP -------------------------------------------------------------------------------------------------

    def _process(self) -> None:
        """Handle h11's events until it needs more bytes, a decision is under way, or the connection ends."""
        while not self.closing and self.decision is None and self.writable:
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
        if not self.server.hold(len(data)):
            self._refuse(503, "too many large reviews at once")
            return
        self.held += len(data)
        self.body += data

    def _complete(self) -> None:
        request = self.request
        assert request is not None
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
            self.decision = self.loop.create_task(self._decide(body, self.abandoned))

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
            self._release()
        self.decision = None
        if answer is None or self.closing:
            return
        status, payload, content_type, logged = answer
        if logged is not None:
            self.server.log_line(logged)  # first, so that a client reading the log after its answer finds it
        self._answer(status, payload, content_type)

    def _answer(self, status: int, payload: bytes, content_type: str, *, close: bool = False) -> None:
        request = self.request
        headers = [(b"content-type", content_type.encode()), (b"content-length", str(len(payload)).encode())]
        if close:
            headers.append((b"connection", b"close"))
        try:
            data = self.http.send(h11.Response(status_code=status, headers=headers))
            if request is None or request.method != b"HEAD":
                data += self.http.send(h11.Data(data=payload))
            data += self.http.send(h11.EndOfMessage())
        except h11.LocalProtocolError:
            self.abort()  # nothing more can be said on this connection
            return
        self._write(data or b"")
        self.served += 1
        if self.served == 1:
            self.server.advanced(self)
        if close or self.http.our_state is h11.MUST_CLOSE or self.http.their_state is not h11.DONE:
            self._close()
            return
        self.http.start_next_cycle()
        self.request = None
        self.in_request = False
        self._resume()
        if self.http.trailing_data[0]:
            self._begin_request()  # pipelined: its deadline from now, not from whenever more bytes come
        else:
            self._arm(KEEP_ALIVE_SECONDS)
        self.loop.call_soon(self._process)

    def _refuse(self, status: int, why: str) -> None:
        if self.http.our_state in (h11.IDLE, h11.SEND_RESPONSE):
            self._answer(status, f"{why}\n".encode(), "text/plain", close=True)
        else:
            self._close()

    def _begin_request(self) -> None:
        self.in_request = True
        self._arm(REQUEST_SECONDS)

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
            self._arm(LINGER_SECONDS)  # then _expired aborts; the peer's close ends it sooner
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

    def _arm(self, seconds: float) -> None:
        self._disarm()
        self.timer = self.loop.call_later(seconds, self._expired)

    def _disarm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _expired(self) -> None:
        """The handshake, the request or the idle time is over: the connection ends, and its decision with it."""
        self.timer = None
        if self.abandoned is not None:
            self.abandoned.set()
        if self.decision is not None:
            self.decision.cancel()
            self.decision = None
        self.abort()

    def _release(self) -> None:
        if self.held:
            self.server.release(self.held)
            self.held = 0


class WebhookServer:
    """The webhook's HTTPS server: bound (and listening) when made, serving from serve() until shutdown()."""

    def __init__(self, address: tuple[str, int], respond: Respond, *, workers: int = 2, isolated: bool = False,
                 log: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True)) -> None:
        """`isolated`: the reviews that take real work are decided in a process of their own (see
        ipmasq.webhook.worker), which `respond` must then be picklable for (review.respond, or a partial of it)."""
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
        self._held_bytes = 0  # request bodies held now (changed on the event loop only)
        self._connections: dict[_Connection, None] = {}  # open ones, oldest first
        self._accepting = True
        self._connecting: set[asyncio.Task[None]] = set()  # accepted, their transport being made
        # the same, by how far they got (_Connection.progress), each in the order it got there: who makes room
        # is found in the first few of the lowest level, not by a look at all MAX_CONNECTIONS (that look, at every
        # accept past the limit, was a third of the event loop's time under a flood of new connections)
        self._levels: tuple[dict[_Connection, None], ...] = ({}, {}, {}, {})

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
        self.accepting.set()
        try:
            await self._stop.wait()
        finally:
            self._accepting = False
            loop.remove_reader(self._listener.fileno())  # no new connections
            for connection in list(self._connections):
                connection.stop()
            deadline = loop.time() + GRACE_SECONDS
            while self._connections and loop.time() < deadline:
                await asyncio.sleep(0.05)  # the requests in flight finish (bounded by GRACE_SECONDS)
            for connection in list(self._connections):
                connection.abort()

    def _accept(self) -> None:
        """The listener is ready: up to ACCEPT_BATCH new connections, each made a transport and a _Connection by
        asyncio (connect_accepted_socket), the connections already open served between batches."""
        loop = asyncio.get_running_loop()
        for _ in range(ACCEPT_BATCH):
            try:
                sock, _peer = self._listener.accept()
            except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                return
            except OSError as exc:  # EMFILE, ENFILE, ENOBUFS, ENOMEM: pause, or this callback spins
                self.log_line(f"cannot accept connections for now: {one_line(str(exc))[:200]}")
                loop.remove_reader(self._listener.fileno())
                loop.call_later(_ACCEPT_RETRY_SECONDS, self._resume_accepting)
                return
            task = loop.create_task(self._connect(sock))
            self._connecting.add(task)  # asyncio keeps only a weak reference to a task
            task.add_done_callback(self._connecting.discard)

    def _resume_accepting(self) -> None:
        if self._accepting:
            asyncio.get_running_loop().add_reader(self._listener.fileno(), self._accept)

    async def _connect(self, sock: socket.socket) -> None:
        try:
            await asyncio.get_running_loop().connect_accepted_socket(lambda: _Connection(self), sock)
        except OSError:  # the peer already gone (its reset before the transport was made)
            sock.close()

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

    def admit(self, connection: _Connection) -> None:
        """Count a connection from its accept; past MAX_CONNECTIONS close one that may be closed: the one that has
        got least far, the first to get there of those. A flood of new connections that say nothing (1,400 a
        second) then closes its own, not an ordinary client's in its handshake, nor the API server's kept between
        reviews: evicted by age alone, those failed 10-50% of ordinary reviews."""
        self._connections[connection] = None
        connection.level = 0
        self._levels[0][connection] = None
        if len(self._connections) <= MAX_CONNECTIONS:
            return
        victim = next((c for level in self._levels for c in level if c is not connection and c.waiting()), None)
        if victim is not None:
            self.forget(victim)
            victim.evict()

    def advanced(self, connection: _Connection) -> None:
        """`connection` got further (its first byte, its handshake done, its first answer)."""
        if connection not in self._connections:
            return  # already closed, or made room for another
        self._levels[connection.level].pop(connection, None)
        connection.level = connection.progress()
        self._levels[connection.level][connection] = None

    def forget(self, connection: _Connection) -> None:
        self._connections.pop(connection, None)
        self._levels[connection.level].pop(connection, None)

    def hold(self, size: int) -> bool:
        if self._held_bytes + size > BODY_BUDGET_BYTES:
            return False
        self._held_bytes += size
        return True

    def release(self, size: int) -> None:
        self._held_bytes -= size

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
