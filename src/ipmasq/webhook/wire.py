"""One accepted connection of the webhook's, on the wire: TLS through ssl's memory BIOs, HTTP/1.1 through h11, one
request at a time. Which connections are held and for how long is the server's table (ipmasq.webhook.connections);
what a review's answer is, ipmasq.webhook.answer; this module moves the bytes between them, bounded:
- the socket read into the server's one buffer, its bytes given to ssl's memory BIOs TLS_FEED_BYTES at a time and read
  back a TLS record at a time (asyncio's TLS keeps 256 KiB per connection until a garbage collection); TLS state made
  at a connection's first byte, HTTP state at a request's and dropped between requests, so a connection held costs
  ssl's own state and little more (a flood of connections that say nothing costs the accept alone);
- a request head of at most MAX_HEAD_BYTES; the body read whole before a decision slot is asked for (a slow upload
  never holds one), bounded by MAX_BODY_BYTES whether framed by Content-Length or chunked (both at once is refused,
  as RFC 9112 says a server may: a proxy and this server could read two different bodies);
- answers a peer does not read stop its requests being read (_WRITE_HIGH_BYTES).
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import threading
import time
from typing import Protocol

import h11

from ipmasq.errors import WebhookServerError, one_line
from ipmasq.webhook.answer import Answer
from ipmasq.webhook.connections import ConnectionTable, Held

__all__ = ["MAX_BODY_BYTES", "MAX_HEAD_BYTES", "READ_BYTES", "VALIDATE_PATH", "Host", "ReviewConnection"]

VALIDATE_PATH = "/validate"
# An AdmissionReview of an UPDATE carries the object and the old object, each at most 1 MiB of data that JSON may
# write six bytes a character ("<" is \u003c in Go's encoding): 16 MiB holds the worst a ConfigMap can be.
MAX_BODY_BYTES = 16 << 20
TLS_READ_BYTES = 16 * 1024  # a TLS record's plaintext at most
READ_BYTES = 64 * 1024  # a socket read at most
TLS_FEED_BYTES = 2 * 1024  # given to ssl at once (see ReviewConnection.data_received)
# A request line and its headers: the API server's are a few hundred bytes. Small, because every held connection
# may buffer this much.
MAX_HEAD_BYTES = 8 * 1024
_WRITE_HIGH_BYTES = 256 * 1024  # answers a peer does not read: past this, its requests are not read either


class Host(Protocol):
    """What a connection asks of its server (ipmasq.webhook.server.WebhookServer)."""

    table: ConnectionTable[ReviewConnection]
    read_buffer: memoryview

    def clock(self) -> float: ...

    def loop(self) -> asyncio.AbstractEventLoop: ...

    def tls_context(self) -> ssl.SSLContext: ...

    def opened(self, connection: ReviewConnection) -> None: ...

    def closed(self, connection: ReviewConnection) -> None: ...

    def hold(self, connection: ReviewConnection, size: int) -> bool: ...

    async def decide(self, body: bytearray, started: float, abandoned: threading.Event) -> Answer | None: ...

    def log_line(self, line: str) -> None: ...


class ReviewConnection(asyncio.BufferedProtocol):
    """One accepted connection: TLS in memory BIOs, h11 for HTTP/1.1, one request at a time. Its place and its
    deadlines are its `held` entry in the server's table.

    Every callback runs on the event loop; the decision runs in a thread of the server's executor, and learns that
    its connection is gone through `abandoned`."""

    __slots__ = ("abandoned", "body", "body_bytes", "closing", "decision", "early", "handshaking", "held", "http",
                 "in_request", "incoming", "outgoing", "reading", "request", "server", "tls", "transport", "writable")

    def __init__(self, server: Host, held: Held[ReviewConnection]) -> None:
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
        if (request.method, request_path(request.target)) != (b"POST", VALIDATE_PATH.encode()):
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
        if request.method in (b"GET", b"HEAD") and request_path(request.target) in (b"/healthz", b"/readyz"):
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


def request_path(target: bytes) -> bytes:
    """A request target without its query: the API server calls /validate?timeout=5s."""
    return target.split(b"?", 1)[0]

