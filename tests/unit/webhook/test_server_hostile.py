"""The webhook against hostile peers on loopback: slow uploads, slow heads, more connections than its limit, a
review of more than a ConfigMap may hold, a request its log line cannot describe; an ordinary review is answered
all the while. And a listen backlog that takes a burst of connections, and a shutdown that finishes what is in
flight."""

from __future__ import annotations

import contextlib
import json
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from ipmasq.webhook import server as server_module
from ipmasq.webhook.certificate import CertificateSet
from ipmasq.webhook.connections import ConnectionLimits
from ipmasq.webhook.review import MAX_CONFIGMAP_DATA, AdmissionVerdict, respond
from ipmasq.webhook.server import MAX_BODY_BYTES, VALIDATE_PATH, WebhookServer, serve
from tests.clock import Clock
from tests.eventually import eventually
from tests.hostile.admission import configmap

HOST = "ipmasq-webhook.kube-system.svc"


def tls(server: WebhookServer, certificate: CertificateSet, timeout: float = 10.0,
        source: str = "127.0.0.1") -> ssl.SSLSocket:
    """A secure connection from `source` (any 127.x address: a source of its own for the connection budget)."""
    context = ssl.create_default_context(cadata=certificate.ca_bundle.decode())
    sock = socket.create_connection(("127.0.0.1", server.server_address[1]), timeout=timeout,
                                    source_address=(source, 0))
    return context.wrap_socket(sock, server_hostname=HOST)


@contextlib.contextmanager
def limited(certificate: CertificateSet, **limits: float) -> Iterator[WebhookServer]:
    """A server with these limits whose clock stands still: no connection reaches a deadline while the test runs."""
    running = WebhookServer(("127.0.0.1", 0), respond, log=lambda line: None, limits=ConnectionLimits(**limits),
                            clock=Clock())
    running.use_certificate(certificate.tls_cert, certificate.tls_key)
    serve(running)
    try:
        yield running
    finally:
        running.shutdown()
        running.server_close()


def review_body(config: str = "nonMasqueradeCIDRs: [10.0.0.0/8]\n", **request: Any) -> bytes:
    fields = {"uid": "u-1", "kind": {"group": "", "version": "v1", "kind": "ConfigMap"}, "namespace": "kube-system",
              "name": "ip-masq-agent", "operation": "UPDATE", "userInfo": {"username": "alice"},
              "object": configmap({"config": config}), **request}
    return json.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": fields}).encode()


def ask(server: WebhookServer, certificate: CertificateSet, body: bytes) -> tuple[int, dict[str, Any], float]:
    """One review on a new connection: the status, the answer and the seconds it took."""
    started = time.monotonic()
    with tls(server, certificate) as sock:
        sock.sendall(f"POST {VALIDATE_PATH} HTTP/1.1\r\nHost: {HOST}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    head, _, payload = answer.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    return status, json.loads(payload) if status == 200 else {}, time.monotonic() - started


def test_slow_uploads_hold_no_decision_slot(server: WebhookServer, certificate: CertificateSet) -> None:
    slow = [tls(server, certificate) for _ in range(4)]  # more than the two decision slots
    for sock in slow:
        sock.sendall(f"POST {VALIDATE_PATH} HTTP/1.1\r\nHost: {HOST}\r\nContent-Length: {MAX_BODY_BYTES}\r\n\r\n"
                     .encode() + b'{"apiVersion": ')
    try:
        for _ in range(3):
            status, answer, _seconds = ask(server, certificate, review_body())
            assert status == 200 and answer["response"]["allowed"] is True
            # answered while every slow upload was still pending (open, unanswered): no slot is held by one
            for sock in slow:
                sock.setblocking(False)
                with pytest.raises(ssl.SSLWantReadError):
                    sock.recv(1)
    finally:
        for sock in slow:
            sock.close()


def test_slow_heads_beyond_the_connection_limit_do_not_lock_out_a_review(certificate: CertificateSet) -> None:
    with limited(certificate, connections=16) as server:
        slow, refused = [], 0
        try:
            for _ in range(70):  # more than the limit, each with a head that is never finished
                try:
                    sock = tls(server, certificate, source="127.0.0.2")
                    sock.sendall(f"POST {VALIDATE_PATH} HTTP/1.1\r\nHost: {HOST}\r\n".encode())
                except (ConnectionResetError, ssl.SSLError):  # past its share: refused at its accept
                    refused += 1
                    continue
                slow.append(sock)
            # answered while no deadline could have freed a place (the clock stands still): room was made
            status, answer, _seconds = ask(server, certificate, review_body())
            assert status == 200 and answer["response"]["allowed"] is True
            assert refused >= 70 - 16 and server.refused >= 70 - 16
        finally:
            for sock in slow:
                sock.close()


def test_more_data_than_a_configmap_may_hold_is_denied_unparsed(server: WebhookServer,
                                                                certificate: CertificateSet) -> None:
    cidrs = "".join(f"  - 10.{i >> 16 & 255}.{i >> 8 & 255}.{i & 255}/32\n" for i in range(60_000))
    config = f"cidrLimit: 100000\nnonMasqueradeCIDRs:\n{cidrs}"
    assert len(config) > MAX_CONFIGMAP_DATA
    status, answer, _seconds = ask(server, certificate, review_body(config))
    assert status == 200 and answer["response"]["allowed"] is False
    assert "more than a ConfigMap may hold" in answer["response"]["status"]["message"]


@pytest.mark.parametrize("user_info", ["alice", ["alice"], None, 7])
def test_a_request_its_log_line_cannot_describe_is_still_answered(server: WebhookServer,
                                                                  certificate: CertificateSet,
                                                                  user_info: object) -> None:
    status, answer, _seconds = ask(server, certificate, review_body("nonMasqueradeCIDRs: [10.0.0.0/33]\n",
                                                                    userInfo=user_info))
    assert status == 200 and answer["response"]["allowed"] is False
    assert server.logged[-1].startswith("denied UPDATE of ConfigMap kube-system/ip-masq-agent")  # type: ignore[attr-defined]


def test_a_log_that_fails_loses_no_decision(certificate: CertificateSet) -> None:
    def failing(_line: str) -> None:
        raise OSError(28, "No space left on device")
    running = WebhookServer(("127.0.0.1", 0), respond, log=failing)
    running.use_certificate(certificate.tls_cert, certificate.tls_key)
    serve(running)
    try:
        status, answer, _seconds = ask(running, certificate, review_body("nonMasqueradeCIDRs: [10.0.0.0/33]\n"))
        assert status == 200 and answer["response"]["allowed"] is False
    finally:
        running.shutdown()
        running.server_close()


def test_the_backlog_takes_a_burst_of_connections_before_any_is_accepted(certificate: CertificateSet) -> None:
    running = WebhookServer(("127.0.0.1", 0), respond)  # listening, not yet accepting
    assert server_module.BACKLOG >= 128
    burst = []
    try:
        for _ in range(150):  # with a backlog of 5, all but six would wait on SYN retransmits (1 s, 3 s, ...)
            sock = socket.socket()
            sock.settimeout(0.5)
            sock.connect(running.server_address)
            burst.append(sock)
    finally:
        for sock in burst:
            sock.close()
        running.server_close()


def test_shutdown_finishes_the_review_in_flight(certificate: CertificateSet) -> None:
    entered, release = threading.Event(), threading.Event()

    def slow_respond(review: object, *, abandoned: threading.Event | None = None,
                 ) -> tuple[dict[str, Any], AdmissionVerdict]:
        entered.set()
        release.wait(10)
        return respond(review)
    running = WebhookServer(("127.0.0.1", 0), slow_respond)
    running.use_certificate(certificate.tls_cert, certificate.tls_key)
    serve(running)
    answers: list[int] = []
    asking = threading.Thread(target=lambda: answers.append(ask(running, certificate, review_body())[0]))
    asking.start()
    assert entered.wait(10)
    stopping = threading.Thread(target=running.shutdown)
    stopping.start()
    # the shutdown has begun (stopped accepting) while the review is still being decided
    eventually(lambda: not running._accepting, "the shutdown begun: no more accepting")
    release.set()
    asking.join(10)
    stopping.join(20)
    running.server_close()
    assert answers == [200]


def test_a_body_of_millions_of_tiny_json_values_is_refused_before_it_is_parsed(server: WebhookServer,
                                                                               certificate: CertificateSet) -> None:
    body = b'{"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {"uid": "u", "x": [' \
        + b"1.5," * 2_000_000 + b'1.5]}}'  # 8 MB that json.loads would make 2 million floats of
    status, _answer, _seconds = ask(server, certificate, body)
    assert status == 400
    assert ask(server, certificate, review_body())[0] == 200


@pytest.mark.parametrize("name", ["yaml-nested-1mib", "json-nested-1mib", "alias-bomb-deep", "random-bytes-1mib",
                                  "directory-form-1000-files", "keys-10000"])
def test_the_hostile_corpus_gets_through_the_server_the_decision_respond_gives(
        server: WebhookServer, certificate: CertificateSet, name: str) -> None:
    from tests.hostile.admission import hostile_configmaps

    obj = hostile_configmaps()[name]
    body = review_body(object=obj, oldObject=configmap({"config": "{}"}))
    expected, _verdict = respond(json.loads(body))
    status, answer, _seconds = ask(server, certificate, body)
    assert status == 200 and answer["response"]["allowed"] == expected["response"]["allowed"]


def test_connections_that_never_start_tls_are_counted_and_evicted(certificate: CertificateSet) -> None:
    with limited(certificate, connections=16) as server:
        silent = [socket.create_connection(("127.0.0.1", server.server_address[1]), source_address=("127.0.0.2", 0))
                  for _ in range(16)]
        try:
            eventually(lambda: server.table.holding("127.0.0.2") == 16, "the 16 silent connections held")
            # answered while no deadline could have freed a place (the clock stands still)
            status, answer, _seconds = ask(server, certificate, review_body())
            assert status == 200 and answer["response"]["allowed"] is True
            # the oldest silent one was closed to make room: the server ended it
            silent[0].settimeout(30)
            assert silent[0].recv(1) == b""
        finally:
            for sock in silent:
                sock.close()


def test_a_queue_of_connections_is_taken_in_batches_and_whole(certificate: CertificateSet) -> None:
    """The listener is read ACCEPT_BATCH connections at a time (the connections already open are served between
    batches), and taking goes on until the queue is empty: 100 silent connections queued before serving, then a
    review behind them, answered, with all 100 counted."""
    assert server_module.ACCEPT_BATCH < 100
    running = WebhookServer(("127.0.0.1", 0), respond, clock=Clock())  # none of them leaves on its own meanwhile
    running.use_certificate(certificate.tls_cert, certificate.tls_key)
    queued = [socket.create_connection(running.server_address) for _ in range(100)]
    serve(running)
    try:
        status, answer, _seconds = ask(running, certificate, review_body())
        assert status == 200 and answer["response"]["allowed"] is True
        assert len(running.table) >= 100  # every queued one taken before the review's (the queue's order)
    finally:
        for sock in queued:
            sock.close()
        running.shutdown()
        running.server_close()
