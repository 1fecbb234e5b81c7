"""The webhook's server against the requests of a hostile peer, each answered in bounded work: a body of escaped
quotes (a quadratic scan before), both framings at once and chunked bodies past the bound, a pipelined request
that never ends, decisions whose client left; and what a peer's behaviour leaves in the log (no traceback)."""

from __future__ import annotations

import contextlib
import socket
import ssl
import threading
import time
from typing import Any

import pytest

from ipmasq.webhook import wire
from ipmasq.webhook.answer import MAX_JSON_VALUES, json_values
from ipmasq.webhook.certificate import CertificateSet
from ipmasq.webhook.connections import ConnectionLimits
from ipmasq.webhook.review import AdmissionVerdict, respond
from ipmasq.webhook.server import VALIDATE_PATH, WebhookServer, serve
from tests.clock import Clock
from tests.eventually import eventually
from tests.unit.webhook.test_server_hostile import HOST, ask, review_body, tls


def _read_all(sock: ssl.SSLSocket) -> bytes:
    """Everything until the server closes (the socket's timeout bounds the wait)."""
    answer = b""
    try:
        while chunk := sock.recv(65536):
            answer += chunk
    except (ConnectionResetError, ssl.SSLError):
        pass
    return answer


def test_the_json_value_count_is_linear_in_a_body_of_escaped_quotes() -> None:
    """80 KB of `"\\"\\"...` took 21 s of CPU (each escaped quote restarted the string scan); 8 MB is one pass now.
    CPU time of this thread, far from what a quadratic scan would take, and no wall-clock bound."""
    body = bytearray(b'"' + b'\\"' * (4 << 20))
    started = time.thread_time()
    assert json_values(body) < MAX_JSON_VALUES
    assert time.thread_time() - started < 5.0


def test_a_body_of_escaped_quotes_is_refused_and_the_next_review_answered(server: WebhookServer,
                                                                          certificate: CertificateSet) -> None:
    status, _answer, _seconds = ask(server, certificate, b'"' + b'\\"' * 400_000)
    assert status == 400
    status, answer, _seconds = ask(server, certificate, review_body())
    assert status == 200 and answer["response"]["allowed"] is True


def test_a_request_framed_both_ways_is_refused(server: WebhookServer, certificate: CertificateSet) -> None:
    """Content-Length beside chunked: 42 MB came in under a small Content-Length; RFC 9112 lets a server refuse."""
    with tls(server, certificate) as sock:
        sock.sendall(f"POST {VALIDATE_PATH} HTTP/1.1\r\nHost: {HOST}\r\nContent-Length: 10\r\n"
                     "Transfer-Encoding: chunked\r\n\r\n".encode() + b"100000\r\n")
        with contextlib.suppress(OSError):  # refused on its head: the body may meet a closed connection
            sock.sendall(b"x" * 65536)
        answer = _read_all(sock)
    assert answer.startswith(b"HTTP/1.1 400 ") and b"connection: close" in answer.lower()


def test_a_chunked_body_is_held_to_the_same_bound(server: WebhookServer, certificate: CertificateSet,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(wire, "MAX_BODY_BYTES", 64 * 1024)
    with tls(server, certificate) as sock:
        sock.sendall(f"POST {VALIDATE_PATH} HTTP/1.1\r\nHost: {HOST}\r\nTransfer-Encoding: chunked\r\n\r\n"
                     .encode())
        with contextlib.suppress(OSError):  # the server may answer 413 and close while the upload goes on
            for _ in range(64):
                sock.sendall(b"4000\r\n" + b"x" * 0x4000 + b"\r\n")
        answer = _read_all(sock)
    assert answer.startswith(b"HTTP/1.1 413 ")


def test_a_chunked_review_within_the_bound_is_decided(server: WebhookServer, certificate: CertificateSet) -> None:
    body = review_body()
    with tls(server, certificate) as sock:
        sock.sendall(f"POST {VALIDATE_PATH} HTTP/1.1\r\nHost: {HOST}\r\nTransfer-Encoding: chunked\r\n"
                     "Connection: close\r\n\r\n".encode() + f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n")
        answer = _read_all(sock)
    assert answer.startswith(b"HTTP/1.1 200 ") and b'"allowed": true' in answer


def test_a_decision_whose_client_left_stops_and_logs_nothing(certificate: CertificateSet,
                                                             capfd: pytest.CaptureFixture[str]) -> None:
    entered, seen = threading.Event(), []

    def watching(review: object, *, abandoned: threading.Event | None = None,
                 ) -> tuple[dict[str, Any], AdmissionVerdict]:
        assert abandoned is not None
        if not entered.is_set():
            entered.set()
            seen.append(abandoned.wait(20))  # what the rules' work budget checks at every step
        return respond(review, abandoned=abandoned)

    logged: list[str] = []
    running = WebhookServer(("127.0.0.1", 0), watching, workers=1, log=logged.append)
    running.use_certificate(certificate.tls_cert, certificate.tls_key)
    serve(running)
    try:
        sock = tls(running, certificate)
        body = review_body()
        sock.sendall(f"POST {VALIDATE_PATH} HTTP/1.1\r\nHost: {HOST}\r\nContent-Length: {len(body)}\r\n\r\n"
                     .encode() + body)
        assert entered.wait(20)
        sock.close()
        eventually(lambda: seen, "the decision told whether its client waits")
        assert seen == [True]  # told at once that nobody waits for it
        # the next review is decided (the slot was given back) and only it is logged
        status, _answer, _seconds = ask(running, certificate, review_body())
        assert status == 200 and len(logged) == 1
    finally:
        running.shutdown()
        running.server_close()
    assert "Traceback" not in capfd.readouterr().err


def test_a_review_waiting_for_a_slot_is_never_begun_once_its_client_left(certificate: CertificateSet) -> None:
    release, calls = threading.Event(), []

    def blocking(review: object, *, abandoned: threading.Event | None = None,
                 ) -> tuple[dict[str, Any], AdmissionVerdict]:
        calls.append(review)
        release.wait(20)
        return respond(review)

    running = WebhookServer(("127.0.0.1", 0), blocking, workers=1)
    running.use_certificate(certificate.tls_cert, certificate.tls_key)
    serve(running)
    try:
        first = threading.Thread(target=lambda: ask(running, certificate, review_body()))
        first.start()
        eventually(lambda: calls, "the first review being decided")
        body = review_body()
        with tls(running, certificate) as sock:  # queued behind the first, then gone
            sock.sendall(f"POST {VALIDATE_PATH} HTTP/1.1\r\nHost: {HOST}\r\nContent-Length: {len(body)}\r\n\r\n"
                         .encode() + body)
        # the server sees the close before the slot frees (what is asserted does not depend on it)
        eventually(lambda: running.table.holding("127.0.0.1") == 1, "the queued review's connection closed")
        release.set()
        first.join(20)
        status, _answer, _seconds = ask(running, certificate, review_body())
        assert status == 200 and len(calls) == 2  # the first and the last: the one whose client left never ran
    finally:
        running.shutdown()
        running.server_close()


def _plain_text_answer(sock: socket.socket) -> bytes | None:
    """What a TLS server gives a peer that speaks plain HTTP: the close (b""), a TLS alert record, or a reset (None);
    a hang is the socket's timeout, raised."""
    try:
        return sock.recv(100)
    except ConnectionResetError:
        return None


def test_a_plain_text_probe_and_a_port_scan_leave_no_traceback(server: WebhookServer, certificate: CertificateSet,
                                                               capfd: pytest.CaptureFixture[str]) -> None:
    with socket.create_connection(("127.0.0.1", server.server_address[1]), timeout=5) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = _plain_text_answer(sock)
    # TLS's refusal, never a plain-text answer: the close, an alert (content type 21) or a reset
    assert answer is None or answer == b"" or answer[:1] == b"\x15", answer
    socket.create_connection(("127.0.0.1", server.server_address[1]), timeout=5).close()
    status, answered, _seconds = ask(server, certificate, review_body())  # the server lives on
    assert status == 200 and answered["response"]["allowed"] is True
    assert "Traceback" not in capfd.readouterr().err


def test_a_flood_of_silent_connections_closes_its_own_not_a_kept_alive_client(certificate: CertificateSet) -> None:
    """Past its share a flood's new connections are refused, and it is the heaviest source: evicted by age alone,
    the API server's connection kept between reviews went (its next review failed: 10-50% of reviews under 1,400
    new connections a second)."""
    running = WebhookServer(("127.0.0.1", 0), respond, log=lambda line: None, limits=ConnectionLimits(connections=16),
                            clock=Clock())
    running.use_certificate(certificate.tls_cert, certificate.tls_key)
    serve(running)
    body = review_body()
    head = (f"POST {VALIDATE_PATH} HTTP/1.1\r\nHost: {HOST}\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    try:
        with tls(running, certificate) as kept:
            kept.sendall(head + body)
            assert kept.recv(65536).startswith(b"HTTP/1.1 200 ")
            silent = []
            for _ in range(40):
                sock = socket.socket()
                sock.bind(("127.0.0.2", 0))
                sock.connect(running.server_address)
                silent.append(sock)
            try:
                kept.sendall(head + body)  # the oldest connection of all, and still served
                assert kept.recv(65536).startswith(b"HTTP/1.1 200 ")
                silent[-1].settimeout(30)
                try:
                    refused = silent[-1].recv(1) == b""
                except ConnectionResetError:
                    refused = True
                assert refused  # past its share (8 of 16, two sources): closed at its accept
            finally:
                for sock in silent:
                    sock.close()
    finally:
        running.shutdown()
        running.server_close()


def test_a_fault_in_a_decision_is_one_line_and_a_500(certificate: CertificateSet,
                                                     capfd: pytest.CaptureFixture[str]) -> None:
    def failing(review: object, *, abandoned: threading.Event | None = None,
                 ) -> tuple[dict[str, Any], AdmissionVerdict]:
        raise KeyError("a fault of the decision's own")

    logged: list[str] = []
    running = WebhookServer(("127.0.0.1", 0), failing, log=logged.append)
    running.use_certificate(certificate.tls_cert, certificate.tls_key)
    serve(running)
    try:
        status, _answer, _seconds = ask(running, certificate, review_body())
        assert status == 500
        assert logged and logged[0].startswith("a review could not be decided: KeyError")
        assert ask(running, certificate, b"{not json")[0] == 400  # and it serves on
    finally:
        running.shutdown()
        running.server_close()
    assert "Traceback" not in capfd.readouterr().err


def test_the_path_is_matched_without_its_query(server: WebhookServer, certificate: CertificateSet) -> None:
    """The API server calls the configured path with ?timeout=5s appended."""
    body = review_body("nonMasqueradeCIDRs: [10.0.0.0/33]\n")
    with tls(server, certificate) as sock:
        sock.sendall(f"POST {VALIDATE_PATH}?timeout=5s HTTP/1.1\r\nHost: {HOST}\r\nContent-Length: {len(body)}\r\n"
                     "Connection: close\r\n\r\n".encode() + body)
        answer = _read_all(sock)
    assert answer.startswith(b"HTTP/1.1 200 ") and b'"allowed": false' in answer
