"""The running webhook switches to a renewed certificate only when it sees it a second time (one check later): by
then the API server has the caBundle that trusts it."""

from __future__ import annotations

from typing import Any

from ipmasq.options import PolicyOptions
from ipmasq.webhook.keeper import KeeperSettings
from ipmasq.webhook.process import WebhookProcess, WebhookSettings


class RecordingServer:
    def __init__(self) -> None:
        self.served: list[tuple[bytes, bytes]] = []

    def use_certificate(self, cert: bytes, key: bytes) -> None:
        self.served.append((cert, key))


def test_the_first_certificate_at_once_a_renewed_one_on_its_second_sight() -> None:
    keeper = KeeperSettings("kube-system", "ipmasq-webhook", "ipmasq-webhook-certificate", "ipmasq-webhook")
    process = WebhookProcess(WebhookSettings(("127.0.0.1", 0), PolicyOptions(), keeper))
    server: Any = RecordingServer()
    first, second, third = (b"c1", b"k1"), (b"c2", b"k2"), (b"c3", b"k3")
    process._use(server, first)
    assert server.served == [first]
    process._use(server, second)  # seen once: not yet
    process._use(server, first)  # the Secret went back (a lost race read): nothing pending any more
    process._use(server, second)
    assert server.served == [first]
    process._use(server, third)
    process._use(server, third)
    assert server.served == [first, third]
