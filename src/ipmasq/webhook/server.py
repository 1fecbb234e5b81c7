"""AdmissionReview over HTTPS: asyncio's server, TLS through ssl's memory BIOs and HTTP/1.1 through h11 (the parser
the rest of ipmasq uses), a thin, bounded layer around review.respond. Three rooms:
- this module, the server: the listener, the accepts, the decision slots and the certificate;
- ipmasq.webhook.wire, one connection on the wire (TLS, HTTP, one request at a time, the head and body bounds);
- ipmasq.webhook.answer, a review's answer made from its body (the JSON bounded before it is parsed, the log line).

Each part is a public, documented API (asyncio's Protocol and connect_accepted_socket, ssl.SSLContext.wrap_bio,
h11's Connection), so what is bounded is bounded here, not through another server's private classes.

Which connections it holds and for how long is decided by ipmasq.webhook.connections (a pure table, its clock the
server's): the deadlines (a whole first request within HANDSHAKE_SECONDS of the accept, the keep-alive grace only for
a connection that has been answered, a request and its decision within REQUEST_SECONDS of its first byte), the
connection budget shared between source addresses (a connection refused at its accept is closed there, before any
TLS), room made at the heaviest source, and the request bodies' budget. This module does what it says, and:
- every connection's socket read into one buffer (READ_BYTES) for all;
- `workers` decisions at once, run in threads off the event loop, and as many again for small bodies (an ordinary
  review is a few KiB: reviews of thousands of rules never queue it), bodies over 1 MiB one at a time. An
  `isolated` server (`ipmasq webhook`'s) decides in its threads only bodies up to ISOLATED_SMALL_BODY_BYTES whose
  checks stay under HANDOFF_STEPS, and every other in a process of its own, one at a time (ipmasq.webhook.worker):
  a decision in a thread holds the GIL, and took the event loop's turns from the ordinary reviews;
- new connections accepted ACCEPT_BATCH at a time, the open ones served between batches;
- a decision abandoned when its connection goes (or its deadline passes): one not begun is never begun, one under
  way stops at the next step of its work budget (ipmasq.policy.budget), and nothing is logged for a peer that left;
- a decision's log line written, then its answer (a log line that cannot be written is said on stderr, and never
  loses the answer).

The certificate can be replaced while serving (`use_certificate`): each new TLS handshake takes the context current
when it begins; key material goes to ssl through an in-memory file only (ipmasq.memory_file).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import ipaddress
import resource
import socket
import ssl
import struct
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ipmasq.errors import DecisionFault, WebhookServerError, one_line
from ipmasq.memory_file import memory_file
from ipmasq.webhook.answer import Answer, Outgrown, Respond, decision
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
from ipmasq.webhook.wire import MAX_BODY_BYTES, READ_BYTES, VALIDATE_PATH, ReviewConnection
from ipmasq.webhook.worker import DecisionWorker

__all__ = ["BACKLOG", "BODY_BUDGET_BYTES", "HANDSHAKE_SECONDS", "KEEP_ALIVE_SECONDS", "MAX_BODY_BYTES",
           "MAX_CONNECTIONS", "REQUEST_SECONDS", "VALIDATE_PATH", "WebhookServer", "serve", "wait_listening"]

BACKLOG = 1024
# New connections accepted each time the event loop finds the listener ready, before it turns to the connections it
# has: asyncio's create_server takes up to its backlog (1,024) at once, and under a flood the connections made of
# such a batch held the loop for hundreds of ms while kept-alive clients (the API server) waited for their answers.
# What is not taken waits in the listen queue (BACKLOG). Connections refused at their accept (their source holds
# its share) cost an accept and a close: up to REFUSED_BATCH of those besides.
ACCEPT_BATCH = 16
REFUSED_BATCH = 64
_ACCEPT_RETRY_SECONDS = 1.0  # out of descriptors or memory: accepting pauses this long (as asyncio's own server)
# How often the connections' deadlines are looked at: a deadline is kept to within this
TICK_SECONDS = 0.25
GRACE_SECONDS = 10.0  # a shutdown waits this long for the requests in flight
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
_LIMITS = ConnectionLimits()
_RESET = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: a refused connection is reset, leaving no TIME_WAIT here


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
        self.table: ConnectionTable[ReviewConnection] = ConnectionTable(limits)
        self.refused = 0  # connections refused at their accept (their source held its share)
        self._open: dict[ReviewConnection, None] = {}  # with a transport, for a shutdown
        self._accepting = True
        self._connecting: set[asyncio.Task[None]] = set()  # accepted, their transport being made

    # ---- the certificate ------------------------------------------------------------------------------------

    def use_certificate(self, cert_pem: bytes, key_pem: bytes) -> None:
        """Serve this certificate from the next TLS handshake on."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            with memory_file(cert_pem) as cert_path, memory_file(key_pem) as key_path:
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
        """The listener is ready: up to ACCEPT_BATCH new connections, each made a transport and a ReviewConnection by
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

    async def _connect(self, sock: socket.socket, held: Held[ReviewConnection]) -> None:
        try:
            await asyncio.get_running_loop().connect_accepted_socket(lambda: ReviewConnection(self, held), sock)
        except OSError:  # the peer already gone (its reset before the transport was made)
            sock.close()
            self.table.forget(held)

    def _tick(self) -> None:
        """The connections whose deadline came are closed; again in TICK_SECONDS."""
        self._end(self.table.expired(self.clock()))
        if self._accepting:
            asyncio.get_running_loop().call_later(TICK_SECONDS, self._tick)

    @staticmethod
    def _end(held: list[Held[ReviewConnection]]) -> None:
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

    def opened(self, connection: ReviewConnection) -> None:
        self._open[connection] = None

    def closed(self, connection: ReviewConnection) -> None:
        self._open.pop(connection, None)
        self.table.forget(connection.held)
        # a stale deadline keeps the table's entry until its time (30 s at most): not the connection's TLS state
        connection.held.owner = None

    def hold(self, connection: ReviewConnection, size: int) -> bool:
        """Whether `size` more bytes of `connection`'s body fit the bodies' budget (room made at the source holding
        most, see ipmasq.webhook.connections)."""
        fits, closed = self.table.hold(connection.held, size)
        self._end(closed)
        return fits

    async def decide(self, body: bytearray, started: float, abandoned: threading.Event) -> Answer | None:
        """The answer to a review's body, from a decision thread once a slot is free, or from the decision process
        (an isolated server's large reviews, and the small ones that outgrow HANDOFF_STEPS); None when it was
        abandoned."""
        if self._worker is not None and len(body) > ISOLATED_SMALL_BODY_BYTES:
            return await self._apart(body, started, abandoned)
        answer: Answer | Outgrown | None
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
        if isinstance(answer, Outgrown):
            return await self._apart(body, started, abandoned)
        return answer

    async def _apart(self, body: bytearray, started: float, abandoned: threading.Event) -> Answer | None:
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

def _raise_file_limit() -> None:
    """Up to the hard limit: every connection, and every TLS handshake in progress, holds a descriptor, and 1,024
    (the usual soft limit) is few enough for a peer to fill with unfinished handshakes."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = hard if hard != resource.RLIM_INFINITY else 1 << 16
    if soft != resource.RLIM_INFINITY and soft < wanted:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))




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
