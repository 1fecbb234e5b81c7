"""HTTP/1.1 over one TLS connection, the part the API client needs: a request, then the status, the headers and the
body, by Content-Length, chunked, or up to the close; the body read whole (bounded) or line by line (a watch).

Written here instead of using http.client because http.client imports the email package for its header parsing,
0.7 MiB of the agent's 28 MiB budget with the API on (docs/measurements.md). Every connection is used for one request
(`Connection: close`): no pooling, no keep-alive state, nothing to go stale between a watch's minutes. The tests hold
it to a real API server (the Kubernetes lab, with lightkube as the oracle) and to Python's own http.server.
"""

from __future__ import annotations

import socket
import ssl
from collections.abc import Mapping

__all__ = ["HttpError", "Response", "request"]

MAX_HEADER_LINE = 64 * 1024
MAX_HEADERS = 100
_READ = 64 * 1024


class HttpError(Exception):
    """The peer's answer is not HTTP/1.1 as this reader takes it, or the connection failed (the message says)."""


class Response:
    """The status and headers of an answer, and its body as it arrives."""

    def __init__(self, sock: ssl.SSLSocket, reader: socket.SocketIO, status: int, headers: dict[str, str],
                 rest: bytes) -> None:
        """`rest`: the bytes read past the head, the body's start."""
        self._sock, self._reader = sock, reader
        self.status = status
        self.headers = headers
        self._buffer = bytearray()
        self._chunked = "chunked" in headers.get("transfer-encoding", "").lower()
        length = headers.get("content-length")
        try:
            self._remaining: int | None = int(length) if length is not None and not self._chunked else None
        except ValueError:
            raise HttpError(f"a Content-Length that is not a number: {str(length)[:40]!r}") from None
        self._ended = self._remaining == 0
        self._raw = bytearray()  # bytes read from the socket, not yet taken by the chunk decoder
        if self._chunked:
            self._raw += rest
        elif rest:
            self._take(rest)

    def close(self) -> None:
        self._reader.close()
        self._sock.close()

    def read(self, limit: int) -> bytes:
        """The whole body, or its first `limit` bytes and one more when it is longer (the caller refuses it)."""
        while not self._ended and len(self._buffer) <= limit:
            self._fill()
        data = bytes(self._buffer[:limit + 1])
        del self._buffer[:limit + 1]
        return data

    def readline(self, limit: int) -> bytes:
        """The next line of the body with its newline (the last may have none; b"" at the end); a line longer than
        `limit` comes back cut at limit + 1 bytes, which the caller refuses."""
        while True:
            end = self._buffer.find(b"\n")
            if end >= 0 and end < limit:
                line = bytes(self._buffer[:end + 1])
                del self._buffer[:end + 1]
                return line
            if len(self._buffer) > limit or self._ended:
                line = bytes(self._buffer[:limit + 1])
                del self._buffer[:limit + 1]
                return line
            self._fill()

    # ---- the body's framing ----------------------------------------------------------------------------------

    def _recv(self) -> bytes:
        try:
            return self._reader.read(_READ) or b""
        except TimeoutError:
            raise HttpError("no answer in time") from None
        except (OSError, ssl.SSLError) as exc:
            raise HttpError(getattr(exc, "strerror", None) or str(exc) or type(exc).__name__) from None

    def _fill(self) -> None:
        if self._chunked:
            self._fill_chunk()
            return
        data = self._recv()
        if not data:
            if self._remaining is not None:
                raise HttpError("the connection closed before the body's end")
            self._ended = True
        self._take(data)

    def _take(self, data: bytes) -> None:
        """Body bytes of an answer framed by Content-Length (or by the close)."""
        if self._remaining is not None:
            data = data[:self._remaining]
            self._remaining -= len(data)
            self._ended = self._remaining == 0
        self._buffer += data

    def _raw_line(self) -> bytes:
        while (end := self._raw.find(b"\r\n")) < 0:
            if len(self._raw) > MAX_HEADER_LINE:
                raise HttpError("a chunk header longer than 64 KiB")
            data = self._recv()
            if not data:
                raise HttpError("the connection closed inside a chunk")
            self._raw += data
        line = bytes(self._raw[:end])
        del self._raw[:end + 2]
        return line

    def _fill_chunk(self) -> None:
        """One chunk into the buffer (RFC 9112 7.1); the zero-length chunk ends the body."""
        size_field = self._raw_line().split(b";", 1)[0].strip()
        try:
            size = int(size_field, 16)
        except ValueError:
            raise HttpError(f"a chunk size that is not hexadecimal: {size_field[:20]!r}") from None
        if size == 0:
            self._ended = True
            return
        while len(self._raw) < size + 2:
            data = self._recv()
            if not data:
                raise HttpError("the connection closed inside a chunk")
            self._raw += data
        if self._raw[size:size + 2] != b"\r\n":
            raise HttpError("a chunk that does not end where its size says")
        self._buffer += self._raw[:size]
        del self._raw[:size + 2]


def request(context: ssl.SSLContext, host: str, port: int, verb: str, target: str, headers: Mapping[str, str],
            body: bytes | None, *, timeout: float) -> Response:
    """Send one request on a new TLS connection; the answer's status and headers, its body still to read."""
    try:
        raw = socket.create_connection((host, port), timeout=timeout)
    except TimeoutError:
        raise HttpError("no answer in time") from None
    except OSError as exc:
        raise HttpError(exc.strerror or str(exc)) from None
    try:
        sock = context.wrap_socket(raw, server_hostname=host)
    except TimeoutError:
        raw.close()
        raise HttpError("no answer in time (TLS)") from None
    except (OSError, ssl.SSLError) as exc:
        raw.close()
        raise HttpError(f"TLS: {getattr(exc, 'reason', None) or exc}") from None
    reader = socket.SocketIO(sock, "rb")
    try:
        lines = [f"{verb} {target} HTTP/1.1", f"Host: {host if ':' not in host else f'[{host}]'}:{port}",
                 "Connection: close", *(f"{name}: {value}" for name, value in headers.items())]
        if body is not None:
            lines.append(f"Content-Length: {len(body)}")
        sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + (body or b""))
        status, answer_headers, rest = _head(reader)
    except TimeoutError:
        reader.close()
        sock.close()
        raise HttpError("no answer in time") from None
    except (OSError, ssl.SSLError, HttpError) as exc:
        reader.close()
        sock.close()
        if isinstance(exc, HttpError):
            raise
        raise HttpError(getattr(exc, "strerror", None) or str(exc) or type(exc).__name__) from None
    return Response(sock, reader, status, answer_headers, rest)


def _head(reader: socket.SocketIO) -> tuple[int, dict[str, str], bytes]:
    """The status line and the headers; the bytes read past them."""
    data = bytearray()
    while (end := data.find(b"\r\n\r\n")) < 0:
        if len(data) > MAX_HEADER_LINE * 4:
            raise HttpError("an answer's head longer than 256 KiB")
        chunk = reader.read(_READ)
        if not chunk:
            raise HttpError("the connection closed before an answer")
        data += chunk
    head, rest = bytes(data[:end]), bytes(data[end + 4:])
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    parts = status_line.split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
        raise HttpError(f"not an HTTP/1.1 answer: {status_line[:60]!r}")
    if len(header_lines) > MAX_HEADERS:
        raise HttpError(f"more than {MAX_HEADERS} headers")
    headers: dict[str, str] = {}
    for line in header_lines:
        name, sep, value = line.partition(":")
        if not sep:
            raise HttpError(f"a header line without a colon: {line[:60]!r}")
        headers[name.strip().lower()] = value.strip()
    return int(parts[1]), headers, rest
