"""HTTP/1.1 for all of ipmasq's own HTTP: h11 parses and frames every message, this module adds what a node agent
facing a hostile or broken peer needs on top of it, once.

- a Deadline for a whole exchange (connect, TLS, request, head and body), not for each read: a peer that sends one
  byte a second is cut off when the call's time is up, however long it keeps trickling;
- bounds checked as bytes arrive, before anything is kept: a head (h11's max_incomplete_event_size), a body, a
  line of a stream; h11 hands a chunk's data over as it arrives, so a chunk that announces 4 GiB costs no more than
  the bound it is refused at;
- lines split in linear time (each byte is searched for a newline once);
- one connection kept alive across exchanges when both sides agree (`reusable`).

Users: the API client (ipmasq.kube.client), the health probe's client (ipmasq.agent.health_probe) and the status
responder's request parsing (ipmasq.agent.responder). Errors are ipmasq.errors' HttpError (HttpTimeout, TooLarge),
also reachable here as http11.HttpError; each caller translates them at its seam.
"""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import h11

from ipmasq.errors import HttpError, HttpTimeout, TooLarge

if TYPE_CHECKING:  # ssl is imported by the callers that use TLS: the agent without the API maps no libssl
    import ssl

__all__ = ["MAX_HEAD_BYTES", "Connection", "Deadline", "Head", "HttpError", "HttpTimeout", "TooLarge",
           "connect", "parse_request_head"]

MAX_HEAD_BYTES = 64 * 1024  # a status line and headers; the API server's are well under 4 KiB
# h11 spends about 10 microseconds on each chunk, whatever its size: a server that sends 1-byte chunks costs seconds
# of CPU per MiB. The API server writes a chunk per watch event (100 bytes and more), so a body whose chunks average
# under MIN_MEAN_CHUNK bytes once it has sent CHUNKS_BEFORE_CHECK of them is refused as hostile.
CHUNKS_BEFORE_CHECK = 1024
MIN_MEAN_CHUNK = 16
_RECV = 64 * 1024


class Deadline:
    """A point in time an exchange must be done by; `left()` the seconds until then (HttpTimeout once passed)."""

    __slots__ = ("at",)

    def __init__(self, seconds: float) -> None:
        self.at = time.monotonic() + seconds

    def left(self) -> float:
        remaining = self.at - time.monotonic()
        if remaining <= 0:
            raise HttpTimeout("no answer in time")
        return remaining

    def passed(self) -> bool:
        return time.monotonic() >= self.at


@dataclass(frozen=True, slots=True)
class Head:
    """An answer's status and headers (names in lower case; a repeated header's values joined by ", ")."""

    status: int
    headers: Mapping[str, str]


def connect(host: str, port: int, deadline: Deadline, *, tls: ssl.SSLContext | None = None,
            server_hostname: str | None = None, proxy: tuple[str, int] | None = None) -> Connection:
    """A new connection to host:port (through an HTTP proxy's CONNECT tunnel when `proxy` is given), TLS when a
    context is given, verified against `server_hostname` (default: host)."""
    target = proxy or (host, port)
    try:
        raw = socket.create_connection(target, timeout=deadline.left())
    except TimeoutError:
        raise HttpTimeout(f"no connection to {_authority(*target)} in time") from None
    except OSError as exc:
        raise HttpError(f"{_authority(*target)}: {_describe(exc)}") from None
    try:
        if proxy is not None:
            _tunnel(raw, host, port, deadline)
        if tls is None:
            return Connection(raw)
        raw.settimeout(deadline.left())
        return Connection(tls.wrap_socket(raw, server_hostname=server_hostname or host))
    except TimeoutError:
        raw.close()
        raise HttpTimeout("no TLS handshake in time") from None
    except OSError as exc:
        raw.close()
        raise HttpError(_describe(exc)) from None
    except HttpError:
        raw.close()
        raise


def _tunnel(raw: socket.socket, host: str, port: int, deadline: Deadline) -> None:
    """Ask an HTTP proxy for a tunnel to host:port (RFC 9110 9.3.6); the TLS to the API server goes through it."""
    proxy = Connection(raw)
    authority = _authority(host, port)
    proxy.send_request("CONNECT", authority, {"Host": authority}, None, deadline)
    head = proxy.receive_head(deadline)
    if not 200 <= head.status < 300:
        raise HttpError(f"the proxy refused a tunnel to {authority}: HTTP {head.status}")


class Connection:
    """One client connection: send a request, take its answer's head, then its body whole or line by line."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._h11 = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEAD_BYTES)
        self._broken = False

    @property
    def reusable(self) -> bool:
        """Whether the last exchange ended cleanly and both sides keep the connection open for another."""
        return not self._broken and self._h11.our_state is h11.DONE and self._h11.their_state is h11.DONE

    def close(self) -> None:
        self._broken = True
        with contextlib.suppress(OSError):
            self.sock.close()

    def next_exchange(self) -> None:
        self._h11.start_next_cycle()

    def send_request(self, method: str, target: str, headers: Mapping[str, str], body: bytes | None,
                     deadline: Deadline) -> None:
        fields = [(name, value) for name, value in headers.items()]
        if body is not None:
            fields.append(("Content-Length", str(len(body))))
        try:
            data = self._h11.send(h11.Request(method=method, target=target, headers=fields))
            if body is not None:
                data = (data or b"") + (self._h11.send(h11.Data(data=body)) or b"")
            if method != "CONNECT":
                data = (data or b"") + (self._h11.send(h11.EndOfMessage()) or b"")
        except h11.LocalProtocolError as exc:
            self._broken = True
            raise HttpError(f"a request that cannot be sent: {exc}") from None
        self._io(lambda: self.sock.sendall(data or b""), deadline)

    def receive_head(self, deadline: Deadline) -> Head:
        """The answer's final status and headers (1xx interim answers are skipped)."""
        while True:
            event = self._next_event(deadline)
            if isinstance(event, h11.InformationalResponse):
                continue
            if isinstance(event, h11.Response):
                headers: dict[str, str] = {}
                for name, value in event.headers:
                    key, text = name.decode("latin-1"), value.decode("latin-1")
                    headers[key] = f"{headers[key]}, {text}" if key in headers else text
                return Head(event.status_code, headers)
            raise HttpError(f"an answer that is not HTTP/1.1 ({type(event).__name__})")

    def body(self, deadline: Deadline, limit: int) -> Iterator[bytes]:
        """The body's pieces as they arrive; TooLarge as soon as they add up to more than `limit` bytes."""
        total = chunks = 0
        while True:
            event = self._next_event(deadline)
            if isinstance(event, h11.Data):
                total += len(event.data)
                if total > limit:
                    self._broken = True
                    raise TooLarge(f"more than {limit:,} bytes")
                if event.chunk_start:
                    chunks += 1
                    if chunks >= CHUNKS_BEFORE_CHECK and total < chunks * MIN_MEAN_CHUNK:
                        self._broken = True
                        raise HttpError(f"{chunks:,} chunks of {total / chunks:.1f} bytes on average: not an "
                                        "answer any server sends but a hostile one")
                yield bytes(event.data)
            elif isinstance(event, h11.EndOfMessage):
                return
            else:
                self._broken = True
                raise HttpError(f"an answer that is not HTTP/1.1 ({type(event).__name__})")

    def read_body(self, deadline: Deadline, limit: int) -> bytes:
        return b"".join(self.body(deadline, limit))

    def lines(self, deadline: Deadline, limit: int) -> Iterator[bytes]:
        """The body's lines (without their newline; the last may have none), each at most `limit` bytes: a longer
        one is TooLarge before more than `limit` bytes of it are kept. Linear: every byte is searched once."""
        pending: list[bytes] = []
        pending_size = 0
        for piece in self.body(deadline, 1 << 62):
            start = 0
            while (end := piece.find(b"\n", start)) >= 0:
                if pending_size + end - start > limit:
                    self._broken = True
                    raise TooLarge(f"a line of more than {limit:,} bytes")
                pending.append(piece[start:end])
                yield b"".join(pending)
                pending.clear()
                pending_size = 0
                start = end + 1
            rest = piece[start:]
            pending_size += len(rest)
            if pending_size > limit:
                self._broken = True
                raise TooLarge(f"a line of more than {limit:,} bytes")
            if rest:
                pending.append(rest)
        if pending:
            yield b"".join(pending)

    # ---- the socket ----------------------------------------------------------------------------------------

    def _next_event(self, deadline: Deadline) -> object:
        while True:
            try:
                event = self._h11.next_event()
            except h11.RemoteProtocolError as exc:
                self._broken = True
                raise HttpError(f"an answer that is not HTTP/1.1: {exc}") from None
            if event is not h11.NEED_DATA:
                if event is h11.PAUSED:
                    self._broken = True
                    raise HttpError("the peer sent more than one answer")
                return event
            data = self._io(lambda: self.sock.recv(_RECV), deadline)
            if not data and self._h11.their_state is h11.SEND_RESPONSE:
                self._broken = True
                raise HttpError("the connection closed before an answer")
            self._h11.receive_data(data)

    def _io(self, action: Callable[[], object], deadline: Deadline) -> bytes:
        """`action` on the socket within what is left of `deadline` (its bytes, when it reads)."""
        try:
            self.sock.settimeout(deadline.left())
            result = action()
        except HttpTimeout:
            self._broken = True
            raise
        except TimeoutError:
            self._broken = True
            raise HttpTimeout("no answer in time") from None
        except OSError as exc:
            self._broken = True
            raise HttpError(_describe(exc)) from None
        return result if isinstance(result, bytes) else b""


def parse_request_head(head: bytes) -> tuple[str, str, str, dict[str, str]] | tuple[int, str]:
    """A server's view of a request head (the request line and headers with the blank line ending them) ->
    (method, target, HTTP version, headers) or (status, why) to answer when it is not HTTP/1.1 as RFC 9112 has it.
    h11 parses it (the one parser this module uses); the caller's server decides what it serves."""
    server = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD_BYTES)
    server.receive_data(head)
    try:
        event = server.next_event()
    except h11.RemoteProtocolError as exc:
        return exc.error_status_hint, str(exc)
    if not isinstance(event, h11.Request):
        return 400, "an incomplete request head"
    headers: dict[str, str] = {}
    for name, value in event.headers:
        headers[name.decode("latin-1")] = value.decode("latin-1")
    return (event.method.decode("ascii"), event.target.decode("ascii", "replace"),
            event.http_version.decode("ascii"), headers)


def _authority(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _describe(exc: BaseException) -> str:
    reason = getattr(exc, "reason", None)  # an ssl.SSLError's (CERTIFICATE_VERIFY_FAILED, ...)
    if isinstance(reason, str) and reason:
        return f"TLS: {reason}"
    return str(getattr(exc, "strerror", None) or str(exc) or type(exc).__name__)
