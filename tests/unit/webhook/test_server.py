"""The HTTPS layer on loopback: AdmissionReview in, the decision out, with a real TLS handshake verified against the
CA; bounded against bodies too large, peers that stall, garbage; a renewed certificate served to new connections."""

from __future__ import annotations

import datetime
import http.client
import json
import socket
import ssl
from typing import Any

import pytest

from ipmasq.webhook.certificate import CertificateSet, issue, service_names
from ipmasq.webhook.server import MAX_BODY_BYTES, VALIDATE_PATH, WebhookServer
from tests.hostile.admission import configmap

NAMES = service_names("ipmasq-webhook", "kube-system")
HOST = "ipmasq-webhook.kube-system.svc"


def connect(server: WebhookServer, ca: bytes) -> http.client.HTTPSConnection:
    context = ssl.create_default_context(cadata=ca.decode())
    port = server.server_address[1]

    class Pinned(http.client.HTTPSConnection):
        def connect(self) -> None:  # the Service's name, at loopback: what the API server verifies
            sock = socket.create_connection(("127.0.0.1", port), timeout=5)
            self.sock = context.wrap_socket(sock, server_hostname=HOST)

    return Pinned(HOST, port, timeout=5)


def post(conn: http.client.HTTPSConnection, body: bytes) -> tuple[int, bytes]:
    conn.request("POST", VALIDATE_PATH, body, {"Content-Type": "application/json"})
    response = conn.getresponse()
    return response.status, response.read()


def review(config: str) -> bytes:
    return json.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
        "uid": "u-1", "kind": {"group": "", "version": "v1", "kind": "ConfigMap"}, "namespace": "kube-system",
        "name": "ip-masq-agent", "operation": "UPDATE", "userInfo": {"username": "alice"},
        "object": configmap({"config": config})}}).encode()


def test_reviews_over_one_kept_alive_tls_connection(server: WebhookServer, certificate: CertificateSet) -> None:
    conn = connect(server, certificate.ca_bundle)
    status, body = post(conn, review("nonMasqueradeCIDRs: [10.0.0.0/33]\n"))
    answer: dict[str, Any] = json.loads(body)
    assert status == 200 and answer["response"]["allowed"] is False and answer["response"]["uid"] == "u-1"
    status, body = post(conn, review("nonMasqueradeCIDRs: [10.0.0.0/8]\n"))
    assert status == 200 and json.loads(body)["response"] == {"uid": "u-1", "allowed": True}
    logged = server.logged  # type: ignore[attr-defined]
    assert logged[0].startswith("denied UPDATE of ConfigMap kube-system/ip-masq-agent (uid u-1, by alice) in ")
    assert logged[1].startswith("admitted UPDATE")
    conn.request("GET", "/healthz")
    assert conn.getresponse().read() == b"ok\n"


@pytest.mark.parametrize(("body", "status"), [(b"{not json", 400), (b"[]", 400), (b'{"kind": "Pod"}', 400),
                                              (b"[" * 100_000, 400)])
def test_garbage_is_a_400_and_the_server_keeps_serving(server: WebhookServer, certificate: CertificateSet,
                                                       body: bytes, status: int) -> None:
    conn = connect(server, certificate.ca_bundle)
    assert post(conn, body)[0] == status
    assert post(connect(server, certificate.ca_bundle), review("{}"))[0] == 200


def test_a_body_too_large_is_refused_before_it_is_read(server: WebhookServer, certificate: CertificateSet) -> None:
    conn = connect(server, certificate.ca_bundle)
    conn.putrequest("POST", VALIDATE_PATH)
    conn.putheader("Content-Length", str(MAX_BODY_BYTES + 1))
    conn.endheaders()
    assert conn.getresponse().status == 413


def test_peers_that_stall_or_speak_no_tls_do_not_stop_it(server: WebhookServer, certificate: CertificateSet) -> None:
    port = server.server_address[1]
    stalled = [socket.create_connection(("127.0.0.1", port)) for _ in range(5)]  # never a handshake
    with socket.create_connection(("127.0.0.1", port)) as plain:
        plain.sendall(b"GET / HTTP/1.1\r\n\r\n")
        plain.settimeout(5)
        try:
            answer = plain.recv(100)
        except ConnectionResetError:
            answer = b""
        assert not answer.startswith(b"HTTP")  # closed, or a TLS alert: never served in plain text
    assert post(connect(server, certificate.ca_bundle), review("{}"))[0] == 200
    # answered while the stalled peers were all still connected, unanswered (not after they were cut off)
    for sock in stalled:
        sock.setblocking(False)
        with pytest.raises(BlockingIOError):
            sock.recv(1)
    for sock in stalled:
        sock.close()


def test_a_renewed_certificate_is_served_to_new_connections(server: WebhookServer,
                                                            certificate: CertificateSet) -> None:
    renewed = issue(NAMES, datetime.datetime.now(datetime.UTC), 30, previous=certificate)
    server.use_certificate(renewed.tls_cert, renewed.tls_key)
    assert post(connect(server, renewed.ca_cert), review("{}"))[0] == 200
    with pytest.raises(ssl.SSLCertVerificationError):
        post(connect(server, certificate.ca_cert), review("{}"))  # the old CA alone no longer verifies it
    assert post(connect(server, renewed.ca_bundle), review("{}"))[0] == 200  # the bundle, old and new, does
