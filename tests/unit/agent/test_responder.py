"""The agent's HTTP responder against well-formed and hostile clients: answers are right, and nothing a client does
(trickling a head, a huge request line, garbage, hundreds of idle connections, never reading the answer) holds the
loop beyond a bound or grows its memory beyond MAX_CONNECTIONS heads."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from ipmasq.agent import responder
from ipmasq.agent.health import EndpointServer, query
from ipmasq.agent.metrics import AgentVitals
from ipmasq.agent.responder import Request, Responder, Response, listen, parse_request_head
from tests.eventually import eventually

# Whether a client holds the loop is asked by order, not by speed (a loaded machine makes any probe slow): the
# client's own deadline is set to HELD_SECONDS, and a probe must be answered long before it, while that client is
# still where it stopped. PROBE_GUARD_SECONDS only ends a test that hangs; a loop held until the client's deadline
# would pass it.
HELD_SECONDS = 60.0
PROBE_GUARD_SECONDS = 20.0


@dataclass
class Running:
    responder: Responder
    port: int

    def connect(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=5)

    def exchange(self, request: bytes) -> bytes:
        return exchange(self.port, request)

    def probe(self) -> None:
        """A plain GET, answered 200 (PROBE_GUARD_SECONDS at most: a hang guard, not a speed)."""
        answer = exchange(self.port, b"GET /ok HTTP/1.1\r\nHost: x\r\n\r\n", timeout=PROBE_GUARD_SECONDS)
        assert answer.startswith(b"HTTP/1.1 200 OK\r\n"), answer[:80]

    def in_state(self, state: str, *, began: bool = False) -> int:
        """The server's connections in `state` (head, write, linger); `began`: only those with bytes read."""
        return sum(c.state == state and (not began or bool(c.read))
                   for c in list(self.responder.connections.values()))


def exchange(port: int, request: bytes, timeout: float = 5.0) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(request)
        return read_until_closed(sock)


def read_until_closed(sock: socket.socket, limit: int = 1 << 24) -> bytes:
    chunks: list[bytes] = []
    while sum(len(chunk) for chunk in chunks) < limit:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks)


def not_yet_accepted(port: int) -> int:
    """How many connections to the listener on 127.0.0.1:`port` wait in its accept queue (a LISTEN socket's rx_queue
    in /proc/net/tcp)."""
    for line in Path("/proc/self/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[1] == f"0100007F:{port:04X}" and fields[3] == "0A":
            return int(fields[4].split(":")[1], 16)
    raise AssertionError(f"no listener on 127.0.0.1:{port}")


def serve(handle: Callable[[str], Response]) -> Iterator[Running]:
    listener = listen("127.0.0.1", 0)
    wake_r, wake_w = os.pipe()
    server = Responder(listener, handle, wake_r)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        yield Running(server, listener.getsockname()[1])
    finally:
        os.write(wake_w, b"x")
        thread.join(5)
        assert not thread.is_alive()
        assert not server.connections  # every connection closed on the way out
        listener.close()
        os.close(wake_r)
        os.close(wake_w)


def echo_path(path: str) -> Response:
    if path == "/boom":
        raise RuntimeError("endpoint failed")
    if path == "/big":
        return Response(200, b"x" * (32 << 20))
    return Response(200, f"path {path}\n".encode())


@pytest.fixture
def running(monkeypatch: pytest.MonkeyPatch) -> Iterator[Running]:
    monkeypatch.setattr(responder, "REQUEST_SECONDS", 1.0)
    monkeypatch.setattr(responder, "RESPONSE_SECONDS", 1.0)
    monkeypatch.setattr(responder, "LINGER_SECONDS", 0.3)
    yield from serve(echo_path)


def status_of(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1])


def headers_of(answer: bytes) -> dict[str, str]:
    head = answer.split(b"\r\n\r\n", 1)[0].decode()
    return {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in head.split("\r\n")[1:])}


# --- the request head, parsed alone ---

@pytest.mark.parametrize(("head", "expected"), [
    (b"GET /metrics HTTP/1.1\r\nHost: node:9847\r\nAccept: */*", Request("GET", "/metrics")),
    (b"HEAD /readyz?verbose=1 HTTP/1.1\r\nHost: x", Request("HEAD", "/readyz")),
    (b"GET /healthz HTTP/1.0", Request("GET", "/healthz")),  # HTTP/1.0 needs no Host
    (b"GET http://node:9847/metrics?x HTTP/1.1\r\nHost: node", Request("GET", "/metrics")),  # absolute form
    (b"GET http://node:9847 HTTP/1.1\r\nHost: node", Request("GET", "/")),
    (b"GET /metrics HTTP/1.1\nHost: x", Request("GET", "/metrics")),  # bare LF, as typed into nc
])
def test_a_well_formed_head_is_read(head: bytes, expected: Request) -> None:
    assert parse_request_head(head) == expected


@pytest.mark.parametrize(("head", "status", "why"), [
    (b"GET /metrics", 400, "illegal request line"),  # HTTP/0.9
    (b"GET  /metrics HTTP/1.1\r\nHost: x", 400, "illegal request line"),  # two spaces
    (b"GET /metrics HTTP/1.1 extra\r\nHost: x", 400, "illegal request line"),
    (b"GET /metrics HTTP/1\r\nHost: x", 400, "illegal request line"),
    (b"GET /metrics http/1.1\r\nHost: x", 400, "illegal request line"),
    (b"PRI * HTTP/2.0", 505, "HTTP/1.0 and HTTP/1.1 only"),
    (b"GET /metrics HTTP/3.0", 505, "HTTP/1.0 and HTTP/1.1 only"),
    (b"G(T /metrics HTTP/1.1\r\nHost: x", 400, "illegal request line"),
    (b"POST /metrics HTTP/1.1\r\nHost: x", 405, "method POST not allowed: GET or HEAD"),
    (b"DELETE /metrics HTTP/1.0", 405, "method DELETE not allowed: GET or HEAD"),
    (b"GET /metrics HTTP/1.1", 400, "Missing mandatory Host"),
    (b"GET /metrics HTTP/1.1\r\nHost x", 400, "illegal header line"),
    (b"GET /metrics HTTP/1.1\r\nHost : x", 400, "illegal header line"),  # whitespace before the colon
    (b"GET /metrics HTTP/1.1\r\n: x\r\nHost: x", 400, "illegal header line"),
    (b"GET metrics HTTP/1.1\r\nHost: x", 400, "bad request target"),
    ("GET /m\u00e9trics HTTP/1.1\r\nHost: x".encode(), 400, "illegal request line"),
    (b"GET /m\x7ftrics HTTP/1.1\r\nHost: x", 400, "illegal request line"),
    (b"GET /metrics HTTP/1.1\r\nHost: x" + b"\r\nX: y" * 64, 431, "more than 64 header lines"),
])
def test_a_malformed_head_gets_the_right_error(head: bytes, status: int, why: str) -> None:
    answer = parse_request_head(head)
    assert answer == Response(status, why.encode() + b"\n")


def test_an_obsolete_folded_header_line_is_joined_as_rfc_9112_allows() -> None:
    assert parse_request_head(b"GET /metrics HTTP/1.1\r\nHost: x\r\n folded") == Request("GET", "/metrics")


def test_64_header_lines_are_fine() -> None:
    head = b"GET /metrics HTTP/1.1\r\nHost: x" + b"\r\nX: y" * 63
    assert parse_request_head(head) == Request("GET", "/metrics")


# --- over sockets ---

def test_get_head_and_errors_over_a_socket(running: Running) -> None:
    get = running.exchange(b"GET /hello?x=1 HTTP/1.1\r\nHost: x\r\n\r\n")
    assert get.startswith(b"HTTP/1.1 200 OK\r\n") and get.endswith(b"\r\n\r\npath /hello\n")
    headers = headers_of(get)
    assert headers["content-length"] == "12" and headers["connection"] == "close"
    assert headers["content-type"] == "text/plain; charset=utf-8" and headers["date"].endswith(" GMT")
    head = running.exchange(b"HEAD /hello HTTP/1.1\r\nHost: x\r\n\r\n")
    assert head.endswith(b"\r\n\r\n") and headers_of(head)["content-length"] == "12"  # GET's length, no body
    post = running.exchange(b"POST /hello HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nabcde")
    assert status_of(post) == 405 and headers_of(post)["allow"] == "GET, HEAD"
    assert status_of(running.exchange(b"BREW /pot HTCPCP/1.0\r\n\r\n")) == 400
    assert status_of(running.exchange(b"GET /boom HTTP/1.0\r\n\r\n")) == 500  # the endpoint failed: the loop did not
    running.probe()


def test_the_agent_endpoints_answer_through_the_responder() -> None:
    status = AgentVitals(version="9.9", backend="iptables")
    server = EndpointServer(status, "127.0.0.1:0")
    server.start()
    try:
        port = server.port
        metrics = exchange(port, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        assert status_of(metrics) == 200
        assert headers_of(metrics)["content-type"].startswith("text/plain; version=0.0.4")
        body = metrics.split(b"\r\n\r\n", 1)[1].decode()
        names = {family.name for family in text_string_to_metric_families(body)}  # the oracle reads it
        assert {"ipmasq_syncs", "ipmasq_ready", "ipmasq_build_info"} <= names
        unknown = exchange(port, b"GET /nope HTTP/1.0\r\n\r\n")
        assert status_of(unknown) == 404
        assert unknown.endswith(b"not found: try /metrics, /healthz, /readyz or /settings\n")
        assert query(f"127.0.0.1:{port}", "/healthz").ok
        ready = query(f"127.0.0.1:{port}", "/readyz")
        assert not ready.ok and ready.why  # no pass yet: 503 with its reason
    finally:
        server.stop()


def test_a_query_to_something_that_is_not_http_fails_in_one_line() -> None:
    with socket.socket() as fake:
        fake.bind(("127.0.0.1", 0))
        fake.listen()
        address = f"127.0.0.1:{fake.getsockname()[1]}"

        def answer_garbage() -> None:
            conn, _ = fake.accept()
            with conn:
                conn.recv(1024)
                conn.sendall(b"\x00\x01garbage\r\n\r\n")

        thread = threading.Thread(target=answer_garbage)
        thread.start()
        check = query(address, "/readyz")
        thread.join(5)
    assert not check.ok and check.why.startswith(f"cannot reach the agent at {address}: an answer that is not HTTP")


def test_a_query_that_gets_no_answer_times_out(running: Running) -> None:
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()  # accepts (the kernel does) but never answers
        check = query(f"127.0.0.1:{silent.getsockname()[1]}", "/readyz", timeout=0.3)
        # the peer still holds the connection, unanswered and open: the query is what gave up (its whole request
        # sent, then its own close), on the deadline its error names
        peer, _ = silent.accept()
        with peer:
            peer.settimeout(30)
            heard = read_until_closed(peer)
    assert heard.startswith(b"GET /readyz HTTP/1.1\r\n") and heard.endswith(b"\r\n\r\n")
    assert not check.ok and "in time" in check.why


def test_a_huge_request_line_is_refused_after_8_kib(running: Running) -> None:
    with running.connect() as sock:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            sock.sendall(b"GET /" + b"a" * (1 << 20))  # a 1 MiB request line: the server stops reading long before
        answer = read_until_closed(sock)
    assert status_of(answer) == 414 and answer.endswith(b"request head over 8192 bytes\n")
    running.probe()


def test_huge_headers_are_refused(running: Running) -> None:
    answer = running.exchange(b"GET / HTTP/1.1\r\nHost: x\r\nCookie: " + b"c" * 10000 + b"\r\n\r\n")
    assert status_of(answer) == 431


@pytest.mark.parametrize("garbage", [
    bytes(range(256)) * 4 + b"\r\n\r\n",
    b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 64 + b"\n\n",  # a TLS ClientHello's start
    b"\r\n\r\n",
    b"\x00" * 100 + b"\n\n",
])
def test_garbage_is_answered_400(running: Running, garbage: bytes) -> None:
    assert status_of(running.exchange(garbage)) == 400
    running.probe()


def test_garbage_without_an_end_is_cut_off(running: Running) -> None:
    with running.connect() as sock:
        sock.sendall(os.urandom(20000).replace(b"\n", b"x"))
        answer = read_until_closed(sock)
    assert status_of(answer) in (414, 431)


def test_slowloris_clients_do_not_hold_the_loop_and_are_cut_off(running: Running,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Ten clients trickle a head a byte at a time and never finish it; probes are answered meanwhile (while every
    trickler is still mid-head in the server), and each trickler gets 408 after REQUEST_SECONDS (2 s here)
    although it is still sending."""
    monkeypatch.setattr(responder, "REQUEST_SECONDS", 2.0)
    tricklers = [running.connect() for _ in range(10)]
    mid_head: list[int] = []  # tricklers mid-head in the server when each probe was answered
    deadline = time.monotonic() + 30  # a condition wait: the head is never finished, so only the server can end it
    request = b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"s" * 1000
    cut_off: list[tuple[int, bytes]] = []  # how much of the head each had sent when cut off, and what it was told
    try:
        for sock in tricklers:
            sock.setblocking(False)
        sent = 0
        while len(cut_off) < len(tricklers):
            if time.monotonic() > deadline:
                raise AssertionError(f"only {len(cut_off)} of {len(tricklers)} tricklers cut off")
            for sock in tricklers:
                if sock.fileno() < 0:
                    continue
                try:
                    sock.send(request[sent:sent + 1])
                    data = sock.recv(4096)
                except BlockingIOError:
                    continue
                except (BrokenPipeError, ConnectionResetError):
                    data = b""
                if data.startswith(b"HTTP/1.1 408 ") or not data:
                    cut_off.append((sent + 1, data))
                    sock.close()
            sent += 1
            running.probe()
            mid_head.append(running.in_state("head", began=True))
            time.sleep(0.05)  # the trickle's pace (not a wait for anything)
    finally:
        for sock in tricklers:
            sock.close()
    assert len(cut_off) == len(tricklers)
    # a loop held by a trickler answers a probe only once a deadline has freed it: here one was answered while all
    # ten were still sending, none of them cut off
    assert max(mid_head) == len(tricklers), mid_head
    # each was still sending its head (never the whole of it) when the deadline cut it off
    assert all(sent < len(request) for sent, _ in cut_off), cut_off
    # what each was told, when the close did not reset it first, names the deadline (a 408: its head had begun)
    assert all(told == b"" or b"request head not received within 2s" in told for _, told in cut_off), cut_off
    assert any(told for _, told in cut_off), cut_off


def test_silent_connections_are_closed_without_an_answer(running: Running, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(responder, "REQUEST_SECONDS", 3.0)  # room to see it held, however busy the machine
    with running.connect() as sock:
        sock.settimeout(30)
        eventually(lambda: len(running.responder.connections) == 1, "the connection in the server's table")
        assert read_until_closed(sock) == b""  # closed, nothing said: it never asked anything
        assert not running.responder.connections  # held until its time was up, then dropped from the table


def test_many_connections_stay_bounded_and_probes_get_in(running: Running, monkeypatch: pytest.MonkeyPatch) -> None:
    """Silent connections pile up past MAX_CONNECTIONS; probes get in while they are held (their deadline is
    HELD_SECONDS away: a loop they held would not answer before it)."""
    monkeypatch.setattr(responder, "REQUEST_SECONDS", HELD_SECONDS)
    idle = []
    try:
        for _ in range(200):
            idle.append(running.connect())
            if len(idle) % 20 == 0:
                running.probe()
        running.probe()  # accepted after all 200 (the listen queue is in order): each has been counted
        assert len(running.responder.connections) <= responder.MAX_CONNECTIONS
        assert running.in_state("head") >= responder.MAX_CONNECTIONS - 2  # still held, none cut off by a deadline
    finally:
        for sock in idle:
            sock.close()


def test_many_partial_heads_hold_at_most_max_connections_heads(running: Running,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(responder, "REQUEST_SECONDS", HELD_SECONDS)  # a loop they held would not answer before
    socks = []
    try:
        for _ in range(100):
            sock = running.connect()
            sock.sendall(b"GET / HTTP/1.1\r\nX: " + b"y" * (responder.MAX_HEAD_BYTES - 100))
            socks.append(sock)
        running.probe()  # accepted after all 100, and answered while they are held
        held = [len(c.read) for c in list(running.responder.connections.values())]
        assert len(held) <= responder.MAX_CONNECTIONS
        assert max(held) <= responder.MAX_HEAD_BYTES + responder.RECV_BYTES
        # none cut off meanwhile: the last ones accepted have their bytes read soon after the probe's answer
        eventually(lambda: running.in_state("head", began=True) >= responder.MAX_CONNECTIONS - 2,
                   lambda: f"heads held: {running.in_state('head', began=True)}, of {responder.MAX_CONNECTIONS}")
    finally:
        for sock in socks:
            sock.close()


def test_a_client_that_never_reads_its_answer_is_dropped(running: Running, monkeypatch: pytest.MonkeyPatch) -> None:
    """/big is 32 MiB: more than the socket buffers hold, so the send stalls; the loop goes on serving others (a
    probe is answered while the stalled write is still under way) and drops the stalled connection after
    RESPONSE_SECONDS."""
    monkeypatch.setattr(responder, "RESPONSE_SECONDS", 5.0)  # long after a probe's answer, however slow

    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", running.port))
        ours = sock.getsockname()

        def writing() -> bool:
            """Whether the server is still writing the stalled answer (the probes' own connections aside)."""
            for connection in list(running.responder.connections.values()):
                with contextlib.suppress(OSError):
                    if connection.state == "write" and connection.sock.getpeername() == ours:
                        return True
            return False

        sock.sendall(b"GET /big HTTP/1.1\r\nHost: x\r\n\r\n")
        eventually(writing, "the answer's write begun")
        for _ in range(3):
            running.probe()
            # a loop held by the stalled send answers only once RESPONSE_SECONDS has dropped it: here the write is
            # still under way after the probe's answer
            assert writing()
        # a condition wait (the client never reads, so only the server's RESPONSE_SECONDS can end the write)
        eventually(lambda: not writing(), "the stalled write dropped")
        received = read_until_closed(sock)
    assert len(received) < 32 << 20  # cut off: it never got the whole answer


def test_a_request_with_more_than_a_head_still_gets_its_answer(running: Running) -> None:
    """A body the server does not read must not turn the close into a reset that loses the answer."""
    with running.connect() as sock:
        sock.sendall(b"GET /hello HTTP/1.1\r\nHost: x\r\nContent-Length: 20000\r\n\r\n" + b"b" * 20000)
        answer = read_until_closed(sock)
    assert status_of(answer) == 200 and answer.endswith(b"path /hello\n")


def test_stop_returns_at_once_with_connections_open() -> None:
    status = AgentVitals(version="9.9", backend="")
    server = EndpointServer(status, "127.0.0.1:0")
    server.start()
    socks = [socket.create_connection(("127.0.0.1", server.port), timeout=30) for _ in range(5)]
    try:
        eventually(lambda: not_yet_accepted(server.port) == 0, "the server holding all five connections")
        stopper = threading.Thread(target=server.stop)
        stopper.start()
        stopper.join(30)  # a condition wait: the clients keep their connections open and never send a thing
        assert not stopper.is_alive() and not server.serving
        # stop() did not wait for the clients: their connections, still open on their side, were closed by it
        assert all(read_until_closed(sock) == b"" for sock in socks)
    finally:
        for sock in socks:
            sock.close()
