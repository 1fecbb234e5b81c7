"""The running webhook: the server, and the certificate kept current beside it (from the Secret, or from files).

It listens only once it has a certificate, so a replica is not ready (its HTTPS probe fails) before it can answer.
After that nothing stops it serving: a failed renewal or an unreachable API server is logged and tried again at the
next check, with the certificate it has.
"""

from __future__ import annotations

import functools
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ipmasq.errors import IpmasqError, one_line
from ipmasq.options import PolicyOptions
from ipmasq.webhook.keeper import CertificateKeeper, KeeperSettings
from ipmasq.webhook.kube import InClusterApi
from ipmasq.webhook.review import respond
from ipmasq.webhook.server import WebhookServer, serve

__all__ = ["WebhookProcess", "WebhookSettings"]

_FIRST_RETRY = 2.0  # seconds between attempts at the first certificate (the API server may not be reachable yet)


def _log(line: str) -> None:
    print(f"ipmasq webhook: {line}", file=sys.stderr, flush=True)


@dataclass(frozen=True, slots=True)
class WebhookSettings:
    """What `ipmasq webhook` was told, checked: where it listens, the policy flags its reviews are made with, how many
    small decisions at once, how often the certificate is read, and where the certificate comes from (files, when
    both are named; else the Secret the keeper's settings name)."""

    address: tuple[str, int]
    options: PolicyOptions
    keeper: KeeperSettings
    workers: int = 2
    certificate_check: float = 60.0
    tls_cert_file: str | None = None
    tls_key_file: str | None = None


class WebhookProcess:
    def __init__(self, settings: WebhookSettings) -> None:
        self.settings = settings
        self.address = settings.address
        self.respond = functools.partial(respond, options=settings.options)
        self.serving: tuple[bytes, bytes] | None = None
        self.pending: tuple[bytes, bytes] | None = None

    def run(self, stop: threading.Event) -> None:
        fetch = self._from_files if self.settings.tls_cert_file else self._from_secret()
        while not stop.is_set():
            try:
                first = fetch()
                break
            except IpmasqError as exc:
                _log(f"no certificate yet: {exc}")
                stop.wait(_FIRST_RETRY)
        else:
            return
        # isolated: the reviews that take real work are decided in a process of their own (ipmasq.webhook.worker)
        server = WebhookServer(self.address, self.respond, workers=self.settings.workers, isolated=True, log=_log)
        self._use(server, first)
        serve(server)
        _log(f"serving https://{self.address[0]}:{self.address[1]}/validate")
        try:
            while not stop.wait(self.settings.certificate_check):
                try:
                    self._use(server, fetch())
                except IpmasqError as exc:
                    _log(f"keeping the certificate it serves: {exc}")
        finally:
            server.shutdown()
            server.server_close()

    def _use(self, server: WebhookServer, pair: tuple[bytes, bytes]) -> None:
        """Serve `pair`; a changed one only when it is seen a second time, one check later. The caBundle trusts its
        CA before the Secret holds it, but the API server learns of a new caBundle through its own watch: served at
        once, the new certificate could be refused for a moment, and the webhook, failing open, skipped."""
        if pair == self.serving:
            self.pending = None
            return
        if self.serving is not None and pair != self.pending:
            self.pending = pair
            _log("a renewed certificate: served from the next check on")
            return
        server.use_certificate(*pair)
        if self.serving is not None:
            _log("serving the renewed certificate")
        self.serving = pair
        self.pending = None

    def _from_files(self) -> tuple[bytes, bytes]:
        assert self.settings.tls_cert_file is not None and self.settings.tls_key_file is not None
        try:
            return Path(self.settings.tls_cert_file).read_bytes(), Path(self.settings.tls_key_file).read_bytes()
        except OSError as exc:
            raise IpmasqError(one_line(f"{exc.filename}: {exc.strerror}")) from None

    def _from_secret(self) -> Any:
        keeper = CertificateKeeper(InClusterApi(), self.settings.keeper, log=_log)

        def fetch() -> tuple[bytes, bytes]:
            current = keeper.sync()
            return current.tls_cert, current.tls_key

        return fetch
