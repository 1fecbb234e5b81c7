"""ipmasq.http11 against real peers on loopback sockets: well-formed exchanges, bounds checked before anything is kept,
one deadline for the whole call however the peer trickles, and a malformed answer as one HttpError line."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable, Iterator

import h11
import pytest

from ipmasq import http11
from ipmasq.http11 import Deadline, HttpError, HttpTimeout, TooLarge

Serve = Callable[[socket.socket, "Peer"], None]


class Peer:
    """A server on 127.0.0.1 that runs `serve` on each connection it accepts, in its own thread; `stop` ends
    whatever it is still trickling, and the test's end closes everything."""

    def __init__(self, serve: Serve) -> None:
        self.serve = serve
        self.stop = threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.requests: list[bytes] = []  # each request head the peer read
        self.errors: list[BaseException] = []
        self.sockets: list[socket.socket] = []
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.sockets.append(conn)
            threading.Thread(target=self._run, args=(conn,), daemon=True).start()

    def _run(self, conn: socket.socket) -> None:
        try:
            self.serve(conn, self)
        except OSError:
            pass  # the client went away first: what several tests do on purpose
        except BaseException as exc:  # an assertion in the peer: reported by the test's end
            self.errors.append(exc)
        finally:
            with contextlib.suppress(OSError):
                conn.close()  # serve returned: the peer hangs up

    def read_head(self, conn: socket.socket) -> bytes:
        data = b""
        while b"\r\n\r\n" not in data:
            piece = conn.recv(65536)
            if not piece:
                break
            data += piece
        head = data.split(b"\r\n\r\n", 1)[0] + b"\r\n\r\n"
        self.requests.append(head)
        return head

    def trickle(self, conn: socket.socket, data: bytes, every: float = 0.01) -> None:
        """`data` a byte at a time, then one more byte every `every` seconds until the client or the test stops."""
        for i in range(len(data)):
            if self.stop.wait(every):
                return
            conn.sendall(data[i:i + 1])
        while not self.stop.wait(every):
            conn.sendall(b"x")

    def close(self) -> None:
        self.stop.set()
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)  # wakes the accept (a close alone would not, on Linux)
        self.listener.close()
        for conn in self.sockets:
            with contextlib.suppress(OSError):
                conn.close()
        self.thread.join(30)


@pytest.fixture
def peer() -> Iterator[Callable[[Serve], Peer]]:
    peers: list[Peer] = []

    def start(serve: Serve) -> Peer:
        peers.append(Peer(serve))
        return peers[-1]

    yield start
    for each in peers:
        each.close()
    for each in peers:
        assert not each.errors, each.errors


def replying(*answers: bytes, hold: bool = False) -> Serve:
    """A peer that reads one request head per answer and sends the answer; `hold`: then keeps the connection open,
    saying nothing more (a client that read past what it was sent would wait for its deadline)."""
    def serve(conn: socket.socket, me: Peer) -> None:
        for answer in answers:
            me.read_head(conn)
            conn.sendall(answer)
        if hold:
            me.stop.wait(30)
    return serve


def get(port: int, seconds: float = 10.0, target: str = "/x") -> tuple[http11.Connection, http11.Head, Deadline]:
    deadline = Deadline(seconds)
    connection = http11.connect("127.0.0.1", port, deadline)
    connection.send_request("GET", target, {"Host": "api", "Accept": "application/json"}, None, deadline)
    return connection, connection.receive_head(deadline), deadline


def chunked(*pieces: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(piece), piece) for piece in pieces) + b"0\r\n\r\n"


OK_CHUNKED = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"


# ---- well-formed exchanges -------------------------------------------------------------------------------------

def test_an_exchange_its_head_and_body_and_the_request_the_peer_read(peer) -> None:  # type: ignore[no-untyped-def]
    server = peer(replying(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nX-Thing: a\r\nx-thing: b\r\n"
                           b"Content-Type: text/plain\r\n\r\nhello"))
    connection, head, deadline = get(server.port)
    assert head.status == 200
    assert head.headers == {"content-length": "5", "x-thing": "a, b", "content-type": "text/plain"}
    assert connection.read_body(deadline, 100) == b"hello"
    method, target, version, headers = http11.parse_request_head(server.requests[0])  # type: ignore[misc]
    assert (method, target, version) == ("GET", "/x", "1.1")
    assert headers == {"host": "api", "accept": "application/json"}
    connection.close()


def test_a_body_is_sent_with_its_length(peer) -> None:  # type: ignore[no-untyped-def]
    bodies: list[bytes] = []

    def serve(conn: socket.socket, me: Peer) -> None:
        server = h11.Connection(h11.SERVER)
        while True:
            event = server.next_event()
            if event is h11.NEED_DATA:
                server.receive_data(conn.recv(65536))
            elif isinstance(event, h11.Data):
                bodies.append(bytes(event.data))
            elif isinstance(event, h11.EndOfMessage):
                break
        conn.sendall(b"HTTP/1.1 201 Created\r\nContent-Length: 0\r\n\r\n")

    server = peer(serve)
    deadline = Deadline(10)
    connection = http11.connect("127.0.0.1", server.port, deadline)
    connection.send_request("POST", "/api/v1/events", {"Host": "api"}, b'{"kind": "Event"}', deadline)
    assert connection.receive_head(deadline).status == 201
    assert connection.read_body(deadline, 10) == b""
    assert b"".join(bodies) == b'{"kind": "Event"}'


def test_one_connection_serves_exchange_after_exchange_when_both_keep_it(peer) -> None:  # type: ignore[no-untyped-def]
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
    server = peer(replying(answer, answer, answer, hold=True))
    connection, _, deadline = get(server.port)
    assert connection.read_body(deadline, 10) == b"ok" and connection.reusable
    for _ in range(2):
        connection.next_exchange()
        connection.send_request("GET", "/again", {"Host": "api"}, None, deadline)
        assert connection.receive_head(deadline).status == 200
        assert connection.read_body(deadline, 10) == b"ok" and connection.reusable
    assert len(server.sockets) == 1 and len(server.requests) == 3


def test_a_peer_that_closes_after_its_answer_is_not_reused(peer) -> None:  # type: ignore[no-untyped-def]
    server = peer(replying(b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok"))
    connection, head, deadline = get(server.port)
    assert head.headers["connection"] == "close"
    assert connection.read_body(deadline, 10) == b"ok"
    assert not connection.reusable


def test_interim_answers_are_skipped_for_the_final_one(peer) -> None:  # type: ignore[no-untyped-def]
    server = peer(replying(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n"
                           b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n"))
    _, head, _ = get(server.port)
    assert head.status == 404 and "link" not in head.headers


def test_lines_are_split_across_chunks_and_the_last_may_have_no_newline(peer) -> None:  # type: ignore[no-untyped-def]
    body = chunked(b'{"type":"ADDED"}\n{"ty', b'pe":"MODIFIED"}\n', b"\n", b"a\nb\nc", b"d")
    server = peer(replying(OK_CHUNKED + body))
    connection, _, deadline = get(server.port)
    assert list(connection.lines(deadline, 100)) == [b'{"type":"ADDED"}', b'{"type":"MODIFIED"}', b"", b"a", b"b",
                                                     b"cd"]
    assert connection.reusable


def test_a_line_exactly_at_its_bound_is_read(peer) -> None:  # type: ignore[no-untyped-def]
    server = peer(replying(OK_CHUNKED + chunked(b"x" * 50, b"y" * 50 + b"\n", b"z" * 100)))
    connection, _, deadline = get(server.port)
    assert list(connection.lines(deadline, 100)) == [b"x" * 50 + b"y" * 50, b"z" * 100]


# ---- bounds ------------------------------------------------------------------------------------------------------

def test_a_head_larger_than_its_bound_is_refused(peer) -> None:  # type: ignore[no-untyped-def]
    huge = b"HTTP/1.1 200 OK\r\nX-Padding: " + b"p" * (http11.MAX_HEAD_BYTES + 1024)
    server = peer(replying(huge, hold=True))  # the head never ends: only its bound stops the read
    with pytest.raises(HttpError, match=r"not HTTP/1\.1") as refused:
        get(server.port)
    assert not isinstance(refused.value, HttpTimeout)


def test_a_body_over_its_bound_is_refused_before_the_rest_arrives(peer) -> None:  # type: ignore[no-untyped-def]
    # 10 MiB announced, 2 KiB sent, then nothing: a reader that wanted more than its bound would time out instead
    server = peer(replying(b"HTTP/1.1 200 OK\r\nContent-Length: 10485760\r\n\r\n" + b"b" * 2048, hold=True))
    connection, _, deadline = get(server.port)
    with pytest.raises(TooLarge, match="more than 1,024 bytes"):
        connection.read_body(deadline, 1024)
    assert not connection.reusable


def test_a_chunk_that_announces_4_gib_costs_only_its_bound(peer) -> None:  # type: ignore[no-untyped-def]
    server = peer(replying(OK_CHUNKED + b"100000000\r\n" + b"c" * 4096, hold=True))
    connection, _, deadline = get(server.port)
    with pytest.raises(TooLarge):
        connection.read_body(deadline, 1024)


def test_a_line_over_its_bound_is_refused_without_waiting_for_its_end(peer) -> None:  # type: ignore[no-untyped-def]
    for pieces in ([b"a" * 4096], [b"a" * 60, b"a" * 60], [b"ok\n", b"a" * 101]):
        server = peer(replying(OK_CHUNKED + b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces), hold=True))
        connection, _, deadline = get(server.port)
        with pytest.raises(TooLarge, match="a line of more than 100 bytes"):
            list(connection.lines(deadline, 100))
        assert not connection.reusable


def test_a_body_of_one_byte_chunks_is_refused_as_hostile(peer) -> None:  # type: ignore[no-untyped-def]
    server = peer(replying(OK_CHUNKED + b"1\r\nx\r\n" * (http11.CHUNKS_BEFORE_CHECK + 10), hold=True))
    connection, _, deadline = get(server.port)
    with pytest.raises(HttpError, match="hostile"):
        connection.read_body(deadline, 1 << 20)


def test_chunks_the_api_server_would_send_are_not_refused(peer) -> None:  # type: ignore[no-untyped-def]
    events = [b'{"type":"BOOKMARK","object":{"metadata":{"resourceVersion":"%d"}}}\n' % i for i in range(3000)]
    server = peer(replying(OK_CHUNKED + chunked(*events)))
    connection, _, deadline = get(server.port)
    assert len(list(connection.lines(deadline, 1024))) == 3000


# ---- deadlines -----------------------------------------------------------------------------------------------------

def test_a_peer_that_never_answers_ends_the_call_at_its_deadline(peer) -> None:  # type: ignore[no-untyped-def]
    server = peer(replying(b"", hold=True))
    with pytest.raises(HttpTimeout):
        get(server.port, seconds=0.3)


@pytest.mark.parametrize("prefix", [b"", b"HTTP/1.1 200 OK\r\n"], ids=["status line", "headers"])
def test_a_head_trickled_a_byte_at_a_time_ends_at_the_calls_deadline(peer, prefix: bytes) -> None:  # type: ignore[no-untyped-def]
    # every byte comes well inside any per-read timeout: only a deadline for the whole call ends it
    def serve(conn: socket.socket, me: Peer) -> None:
        me.read_head(conn)
        conn.sendall(prefix)
        me.trickle(conn, b"X-Slow: " if prefix else b"HTTP/1.1 ")

    server = peer(serve)
    with pytest.raises(HttpTimeout):
        get(server.port, seconds=0.5)


def test_a_body_and_its_lines_trickled_end_at_the_calls_deadline(peer) -> None:  # type: ignore[no-untyped-def]
    def serve(conn: socket.socket, me: Peer) -> None:
        me.read_head(conn)
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n")
        me.trickle(conn, b"")

    for read in (lambda c, d: c.read_body(d, 1 << 20), lambda c, d: list(c.lines(d, 1 << 20))):
        server = peer(serve)
        connection, _, _ = get(server.port)
        with pytest.raises(HttpTimeout):
            read(connection, Deadline(0.5))
        assert not connection.reusable


def test_a_deadline_already_passed_connects_to_nothing(peer) -> None:  # type: ignore[no-untyped-def]
    server = peer(replying(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"))
    with pytest.raises(HttpTimeout):
        http11.connect("127.0.0.1", server.port, Deadline(0))
    assert server.requests == []


def test_a_deadline_counts_down_and_then_refuses() -> None:
    later = Deadline(3600)
    assert 0 < later.left() <= 3600 and not later.passed()
    gone = Deadline(-1)
    assert gone.passed()
    with pytest.raises(HttpTimeout, match="no answer in time"):
        gone.left()


# ---- malformed answers and hostile peers ------------------------------------------------------------------------

@pytest.mark.parametrize("answer", [
    b"HELLO\r\n\r\n",
    b"HTTP/1.1 OK\r\n\r\n",
    b"HTTP/1.1 2000 OK\r\nContent-Length: 0\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nContent-Length: 1, 2\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\nhello!",
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nX: a\r\n\x00Y: b\r\n\r\n",
    b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 64,  # TLS where HTTP was expected
], ids=["garbage", "no code", "code of 4 digits", "header without colon", "negative length", "two lengths",
        "conflicting lengths", "unknown coding", "NUL in header", "TLS"])
def test_an_answer_that_is_not_http_is_one_line(peer, answer: bytes) -> None:  # type: ignore[no-untyped-def]
    server = peer(replying(answer))
    with pytest.raises(HttpError) as refused:
        connection, _, deadline = get(server.port)
        connection.read_body(deadline, 1024)
    assert "\n" not in str(refused.value) and not isinstance(refused.value, (HttpTimeout, TooLarge))


@pytest.mark.parametrize("body", [b"zz\r\nxx\r\n0\r\n\r\n", b"5\r\nabcdefgh\r\n0\r\n\r\n", b"-1\r\n"],
                         ids=["chunk size not hex", "chunk longer than its size", "negative chunk size"])
def test_a_chunked_body_that_breaks_its_framing_is_one_line(peer, body: bytes) -> None:  # type: ignore[no-untyped-def]
    server = peer(replying(OK_CHUNKED + body, hold=True))
    connection, _, deadline = get(server.port)
    with pytest.raises(HttpError, match=r"not HTTP/1\.1"):
        connection.read_body(deadline, 1024)
    assert not connection.reusable


def test_a_peer_that_closes_before_its_answer_or_midway_is_one_line(peer) -> None:  # type: ignore[no-untyped-def]
    server = peer(replying(b""))  # reads the request, closes
    with pytest.raises(HttpError, match="closed before an answer"):
        get(server.port)
    server = peer(replying(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nshort"))
    connection, _, deadline = get(server.port)
    with pytest.raises(HttpError):
        connection.read_body(deadline, 1024)
    assert not connection.reusable


def test_nothing_listening_is_one_line() -> None:
    with socket.create_server(("127.0.0.1", 0)) as probe:
        port = probe.getsockname()[1]
    with pytest.raises(HttpError, match=rf"127\.0\.0\.1:{port}: ") as refused:
        http11.connect("127.0.0.1", port, Deadline(10))
    assert not isinstance(refused.value, HttpTimeout)


def test_a_request_that_would_split_into_two_is_never_sent(peer) -> None:  # type: ignore[no-untyped-def]
    server = peer(replying(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"))
    deadline = Deadline(10)
    connection = http11.connect("127.0.0.1", server.port, deadline)
    with pytest.raises(HttpError, match="a request that cannot be sent"):
        connection.send_request("GET", "/x", {"Host": "api", "X-Node": "a\r\nX-Injected: 1"}, None, deadline)
    with pytest.raises(HttpError, match="a request that cannot be sent"):
        connection.send_request("GET", "/x HTTP/1.1\r\nX: y", {"Host": "api"}, None, deadline)
    connection.close()
    assert server.requests in ([], [b"\r\n\r\n"])  # nothing but the close reached the peer


# ---- a proxy's tunnel -------------------------------------------------------------------------------------------

def test_a_tunnel_through_an_http_proxy(peer) -> None:  # type: ignore[no-untyped-def]
    def proxy(conn: socket.socket, me: Peer) -> None:
        me.read_head(conn)
        conn.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
        me.read_head(conn)  # the tunnelled request, as the target would read it
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 6\r\n\r\ntarget")

    server = peer(proxy)
    deadline = Deadline(10)
    connection = http11.connect("api.internal", 6443, deadline, proxy=("127.0.0.1", server.port))
    connection.send_request("GET", "/version", {"Host": "api.internal:6443"}, None, deadline)
    assert connection.receive_head(deadline).status == 200
    assert connection.read_body(deadline, 100) == b"target"
    assert server.requests[0].startswith(b"CONNECT api.internal:6443 HTTP/1.1\r\n")
    assert b"\r\nHost: api.internal:6443\r\n" in server.requests[0]
    assert server.requests[1].startswith(b"GET /version HTTP/1.1\r\n")


def test_an_ipv6_targets_authority_is_bracketed_and_a_refused_tunnel_is_one_line(peer) -> None:  # type: ignore[no-untyped-def]
    server = peer(replying(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\n\r\n"))
    with pytest.raises(HttpError, match=r"the proxy refused a tunnel to \[fd00::1\]:6443: HTTP 403"):
        http11.connect("fd00::1", 6443, Deadline(10), proxy=("127.0.0.1", server.port))
    assert server.requests[0].startswith(b"CONNECT [fd00::1]:6443 HTTP/1.1\r\n")


def test_a_proxy_that_never_answers_ends_at_the_deadline(peer) -> None:  # type: ignore[no-untyped-def]
    server = peer(replying(b"", hold=True))
    with pytest.raises(HttpTimeout):
        http11.connect("api.internal", 6443, Deadline(0.3), proxy=("127.0.0.1", server.port))


# ---- a server's view of a request head --------------------------------------------------------------------------

def test_a_request_head_is_parsed_with_lower_case_header_names() -> None:
    parsed = http11.parse_request_head(b"GET /healthz?verbose HTTP/1.1\r\nHost: node\r\nUser-Agent: kubelet\r\n\r\n")
    assert parsed == ("GET", "/healthz?verbose", "1.1", {"host": "node", "user-agent": "kubelet"})
    # the version is the caller's to judge (its server decides what it serves): h11 reads any HTTP/x.y
    assert http11.parse_request_head(b"GET / HTTP/2.0\r\nHost: a\r\n\r\n")[2] == "2.0"


@pytest.mark.parametrize(("head", "status"), [
    (b"GET / HTTP/1.1\r\n\r\n", 400),  # HTTP/1.1 without Host
    (b"GARBAGE\r\n\r\n", 400),
    (b"GET / HTTP/1.1\r\nHost: a\r\n", None),  # no blank line: incomplete
    (b"", None),
    (b"GET / HTTP/1.1\r\nHost: a\r\nX: " + b"x" * (http11.MAX_HEAD_BYTES + 10), 431),
    (b"GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", None),
    (b"GET / HTTP/1.1\r\nHost: a\r\nContent-Length: x\r\n\r\n", 400),
    (b"GET /\x00 HTTP/1.1\r\nHost: a\r\n\r\n", 400),
])
def test_a_request_head_that_is_not_http_11_is_a_status_to_answer(head: bytes, status: int | None) -> None:
    parsed = http11.parse_request_head(head)
    if status is None and len(parsed) == 4:
        return  # h11 accepts it (a repeated Host is the caller's to judge): a request, never a traceback
    assert len(parsed) == 2
    code, why = parsed
    assert isinstance(code, int) and 400 <= code < 600 and isinstance(why, str)
    if status is not None:
        assert code == status
