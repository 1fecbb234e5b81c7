"""The webhook's server holds connections as its table decides, over real sockets on loopback from several source
addresses (127.0.0.2, .3, ...), its clock the test's: nothing here waits for a deadline in wall-clock time, and each
wait is a hang guard that returns as soon as its condition holds."""

from __future__ import annotations

import contextlib
import json
import socket
import ssl
from collections.abc import Callable, Iterator

from ipmasq.webhook.certificate import CertificateSet
from ipmasq.webhook.connections import ConnectionLimits
from ipmasq.webhook.review import respond
from ipmasq.webhook.server import VALIDATE_PATH, WebhookServer, serve
from tests.clock import Clock
from tests.eventually import eventually
from tests.unit.webhook.test_server_hostile import HOST, review_body

GUARD_SECONDS = 30.0  # hang guards only: each returns as soon as its condition holds


@contextlib.contextmanager
def running(certificate: CertificateSet, clock: Clock, **limits: float) -> Iterator[WebhookServer]:
    server = WebhookServer(("127.0.0.1", 0), respond, log=lambda line: None, limits=ConnectionLimits(**limits),
                           clock=clock)
    server.use_certificate(certificate.tls_cert, certificate.tls_key)
    serve(server)
    assert server.accepting.wait(GUARD_SECONDS)
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def connect(server: WebhookServer, source: str) -> socket.socket:
    sock = socket.socket()
    sock.settimeout(GUARD_SECONDS)
    sock.bind((source, 0))
    sock.connect(server.server_address)
    return sock


def secure(server: WebhookServer, certificate: CertificateSet, source: str) -> ssl.SSLSocket:
    context = ssl.create_default_context(cadata=certificate.ca_bundle.decode())
    return context.wrap_socket(connect(server, source), server_hostname=HOST)


def review(sock: ssl.SSLSocket) -> int:
    """One review on `sock`, kept alive: its status."""
    body = review_body()
    sock.sendall(f"POST {VALIDATE_PATH} HTTP/1.1\r\nHost: {HOST}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
                 + body)
    answer = b""
    while b"\r\n\r\n" not in answer or len(answer.partition(b"\r\n\r\n")[2]) < _length(answer):
        chunk = sock.recv(65536)
        assert chunk, "closed before its answer"
        answer += chunk
    head, _, payload = answer.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    assert status != 200 or json.loads(payload)["response"]["allowed"] is True
    return status


def _length(answer: bytes) -> int:
    for line in answer.partition(b"\r\n\r\n")[0].split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return 0


def closed_by_server(sock: socket.socket) -> bool:
    """Whether the server closes `sock` (waits for it, up to the hang guard)."""
    sock.settimeout(GUARD_SECONDS)
    try:
        return sock.recv(1) == b""
    except (ConnectionResetError, ssl.SSLError):
        return True
    except TimeoutError:
        return False


def still_open(sock: socket.socket) -> bool:
    """Whether `sock` is open, nothing said to it, now."""
    sock.setblocking(False)
    try:
        sock.recv(1)
    except (ssl.SSLWantReadError, BlockingIOError):
        return True
    except OSError:
        return False
    finally:
        sock.settimeout(GUARD_SECONDS)
    return False


def wait_for(condition: Callable[[], bool]) -> None:
    eventually(condition, "the server's table as the test expects", timeout=GUARD_SECONDS, interval=0.01)


def refused(server: WebhookServer, source: str) -> bool:
    """Whether a new connection from `source` is closed by the server without a word. The close can come before the
    client's connect returns (a connect with a timeout reads its outcome after the server's reset on a loaded
    machine): that is a refusal too."""
    try:
        sock = connect(server, source)
    except ConnectionResetError:
        return True
    try:
        return closed_by_server(sock)
    finally:
        sock.close()


def test_a_secure_connection_that_says_nothing_is_closed_at_the_handshake_deadline(
        certificate: CertificateSet) -> None:
    clock = Clock()
    with running(certificate, clock, handshake_seconds=5.0, keep_alive_seconds=30.0) as server:
        silent = secure(server, certificate, "127.0.0.2")  # its handshake done
        head_only = secure(server, certificate, "127.0.0.2")
        head_only.sendall(f"POST {VALIDATE_PATH} HTTP/1.1\r\nHost: {HOST}\r\nContent-Length: 100\r\n\r\n".encode()
                          + b"{" * 50)  # a head whole, half a body: no whole request
        wait_for(lambda: server.table.holding("127.0.0.2") == 2)
        assert still_open(silent) and still_open(head_only)
        clock.now += 5.0
        assert closed_by_server(silent) and closed_by_server(head_only)
        wait_for(lambda: len(server.table) == 0)


def test_a_head_that_trickles_is_closed_at_the_handshake_deadline_however_lively(
        certificate: CertificateSet) -> None:
    clock = Clock()
    with running(certificate, clock, handshake_seconds=5.0, request_seconds=10.0) as server:
        sock = secure(server, certificate, "127.0.0.2")
        sock.sendall(f"POST {VALIDATE_PATH} HTTP/1.1\r\n".encode())
        for _ in range(4):
            clock.now += 1.0
            sock.sendall(b"X-Slow: 1\r\n")  # a line a second: each a request's byte, none a whole request
        clock.now += 1.0
        assert closed_by_server(sock)


def test_only_an_answered_connection_earns_the_keep_alive_grace(certificate: CertificateSet) -> None:
    clock = Clock()
    with running(certificate, clock, handshake_seconds=5.0, keep_alive_seconds=30.0) as server:
        kept = secure(server, certificate, "127.0.0.2")
        assert review(kept) == 200
        control = secure(server, certificate, "127.0.0.3")  # never answered
        wait_for(lambda: server.table.holding("127.0.0.3") == 1)
        clock.now += 6.0
        assert closed_by_server(control)  # the deadlines were looked at with the clock past the handshake's
        assert still_open(kept)
        assert review(kept) == 200  # and it serves on
        clock.now += 30.0
        assert closed_by_server(kept)


def test_a_pipelined_request_has_the_request_deadline_from_its_turn(certificate: CertificateSet) -> None:
    """A whole request, then the start of another in the same write: the second one's deadline runs from its
    answer's turn, not the keep-alive grace (it stayed open 45 s and more, the deadline armed only by bytes still to
    come)."""
    clock = Clock()
    with running(certificate, clock, request_seconds=10.0, keep_alive_seconds=60.0) as server:
        sock = secure(server, certificate, "127.0.0.2")
        sock.sendall(f"GET /healthz HTTP/1.1\r\nHost: {HOST}\r\n\r\nPOST {VALIDATE_PATH} HTTP/1.1\r\n".encode())
        answer = b""
        while not answer.endswith(b"ok\n"):
            answer += sock.recv(65536)
        assert answer.startswith(b"HTTP/1.1 200 ")
        clock.now += 10.0
        assert closed_by_server(sock)


def test_a_source_at_its_share_is_refused_at_the_accept_and_another_source_takes_room_from_it(
        certificate: CertificateSet) -> None:
    clock = Clock()
    with running(certificate, clock, connections=8) as server:
        flood = [connect(server, "127.0.0.2") for _ in range(8)]  # alone: the whole budget is its share
        wait_for(lambda: server.table.holding("127.0.0.2") == 8)
        assert refused(server, "127.0.0.2")
        wait_for(lambda: server.refused == 1)  # refused at its accept: no TLS made for it
        # another source's review, on a new connection: room made at the heaviest source, its oldest
        ordinary = secure(server, certificate, "127.0.0.3")
        assert review(ordinary) == 200
        assert closed_by_server(flood[0])
        assert all(still_open(sock) for sock in flood[1:])
        assert all(connection.tls is None for connection in list(server._open)
                   if connection.held.address == "127.0.0.2")  # a connection that said nothing has no TLS state
        for sock in [*flood, ordinary]:
            sock.close()


def test_room_is_made_at_the_heaviest_source_and_kept_alive_clients_keep_theirs(
        certificate: CertificateSet) -> None:
    clock = Clock()
    with running(certificate, clock, connections=9) as server:
        flood = [connect(server, "127.0.0.2") for _ in range(6)]
        wait_for(lambda: server.table.holding("127.0.0.2") == 6)
        kept = [secure(server, certificate, "127.0.0.3") for _ in range(3)]
        for sock in kept:
            assert review(sock) == 200
        # three reviews from a third source, each on a new connection kept open: 6/3/1, 5/3/2, 4/3/3
        ordinary = [secure(server, certificate, "127.0.0.4") for _ in range(3)]
        for sock in ordinary:
            assert review(sock) == 200
        assert all(closed_by_server(sock) for sock in flood[:3])
        assert all(still_open(sock) for sock in flood[3:])
        assert all(review(sock) == 200 for sock in kept + ordinary)  # none of theirs was closed
        for sock in flood + kept + ordinary:
            sock.close()


def test_a_new_connection_is_not_closed_for_a_flood_of_handshaken_ones(certificate: CertificateSet) -> None:
    """A connection past its handshake was ranked as having got furthest and evicted last: at the budget, the new
    handshakes (the API server's) were the ones closed. Now the flood's secure connections make the room."""
    clock = Clock()
    with running(certificate, clock, connections=8) as server:
        flood = [secure(server, certificate, "127.0.0.2") for _ in range(8)]
        wait_for(lambda: server.table.holding("127.0.0.2") == 8)
        ordinary = [secure(server, certificate, "127.0.0.3") for _ in range(3)]
        for sock in ordinary:
            assert review(sock) == 200
        assert all(closed_by_server(sock) for sock in flood[:3])  # the flood's oldest
        assert all(still_open(sock) for sock in flood[3:])
        for sock in flood + ordinary:
            sock.close()


def test_a_head_past_its_bound_is_refused_and_a_held_connection_buffers_no_more(certificate: CertificateSet) -> None:
    """Every held connection may buffer a head: bounded small (8 KiB), so that the budget of connections can be
    large."""
    with running(certificate, Clock()) as server:
        sock = secure(server, certificate, "127.0.0.2")
        sock.sendall(f"POST {VALIDATE_PATH} HTTP/1.1\r\nHost: {HOST}\r\nX-Long: ".encode() + b"a" * (9 * 1024))
        answer = b""
        with contextlib.suppress(ConnectionResetError, ssl.SSLError):
            while chunk := sock.recv(65536):
                answer += chunk
        assert answer.startswith(b"HTTP/1.1 431 ")
