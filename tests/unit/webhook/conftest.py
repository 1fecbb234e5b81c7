"""What the webhook's server tests share: a serving certificate for the Service's names, and the server on a
loopback port with it, its log lines kept for the test to read."""

from __future__ import annotations

import datetime
from collections.abc import Iterator

import pytest

from ipmasq.webhook.certificate import CertificateSet, issue, service_names
from ipmasq.webhook.review import respond
from ipmasq.webhook.server import WebhookServer, serve

NAMES = service_names("ipmasq-webhook", "kube-system")


@pytest.fixture
def certificate() -> CertificateSet:
    return issue(NAMES, datetime.datetime.now(datetime.UTC), 30)


@pytest.fixture
def server(certificate: CertificateSet) -> Iterator[WebhookServer]:
    logged: list[str] = []
    running = WebhookServer(("127.0.0.1", 0), respond, log=logged.append)
    running.use_certificate(certificate.tls_cert, certificate.tls_key)
    running.logged = logged  # type: ignore[attr-defined]
    serve(running)
    try:
        yield running
    finally:
        running.shutdown()
        running.server_close()
