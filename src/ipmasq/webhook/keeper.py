"""One serving certificate for every replica, and a caBundle that always trusts it.

Each replica, at start and then periodically, runs `CertificateKeeper.sync`: the Secret holds the set; the first
replica to find none creates it (a create conflict means another one did: read theirs); the replica that finds it
due for renewal makes the next one, puts the new CA beside the old one in the caBundle first, and only then replaces
the Secret (a stale resourceVersion means another replica renewed: read theirs). Every replica serves what the Secret
holds, so the caBundle never names a CA that no replica serves, nor misses one that a replica serves.
"""

from __future__ import annotations

import base64
import binascii
import datetime
import re
from collections.abc import Callable
from dataclasses import dataclass

from ipmasq.errors import CertificateError
from ipmasq.kube import objects
from ipmasq.ownership import labels
from ipmasq.webhook.certificate import CertificateSet, issue, needs_renewal, service_names, still_valid
from ipmasq.webhook.kube import Api, ApiError, Conflict, JsonPatchOperation

__all__ = ["CertificateKeeper", "KeeperSettings"]

Clock = Callable[[], datetime.datetime]


def utc_now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


@dataclass(frozen=True, slots=True)
class KeeperSettings:
    namespace: str  # the webhook's (its Service's and its Secret's)
    service: str
    secret: str
    configuration: str  # the ValidatingWebhookConfiguration whose webhooks call the Service
    days: float = 365.0


class CertificateKeeper:
    def __init__(self, api: Api, settings: KeeperSettings, clock: Clock = utc_now,
                 log: Callable[[str], None] = lambda line: None) -> None:
        self.api = api
        self.settings = settings
        self.clock = clock
        self.log = log
        self.names = service_names(settings.service, settings.namespace)

    def sync(self) -> CertificateSet:
        """The set to serve, made or renewed when due, and the caBundle made to trust it; raises ApiError."""
        for _ in range(3):  # a lost race is followed by a read of the winner's set
            secret = self.api.get_secret(self.settings.namespace, self.settings.secret)
            try:
                current = self._current(secret)
                if current is None:
                    made = issue(self.names, self.clock(), self.settings.days)
                    self.api.create_secret(self.settings.namespace, self._secret(made))
                    self.log(f"made the serving certificate (Secret {self.settings.namespace}/{self.settings.secret})")
                    current = made
                elif needs_renewal(current, self.names, self.clock()):
                    made = issue(self.names, self.clock(), self.settings.days, previous=current)
                    # the caBundle first: from here on both CAs are trusted, whichever certificate a replica serves
                    self._trust(made.ca_bundle)
                    assert secret is not None
                    self.api.replace_secret(self.settings.namespace, self.settings.secret,
                                            self._secret(made, secret["metadata"].get("resourceVersion")))
                    self.log("renewed the serving certificate (the previous CA stays trusted while it is valid)")
                    current = made
            except Conflict:
                continue
            self._trust(current.ca_bundle)
            return current
        raise ApiError(f"Secret {self.settings.namespace}/{self.settings.secret} keeps changing under us")

    def _current(self, secret: objects.Secret | None) -> CertificateSet | None:
        if secret is None:
            return None
        try:
            return CertificateSet.from_secret_data(secret.get("data"))
        except CertificateError as exc:
            # a Secret someone emptied or broke: renewed like an expired one (replace, with its resourceVersion)
            self.log(f"Secret {self.settings.namespace}/{self.settings.secret}: {exc}; making a new certificate")
            made = issue(self.names, self.clock(), self.settings.days)
            self._trust(made.ca_bundle)
            self.api.replace_secret(self.settings.namespace, self.settings.secret,
                                    self._secret(made, secret["metadata"].get("resourceVersion")))
            return made

    def _secret(self, made: CertificateSet, resource_version: str | None = None) -> objects.Secret:
        metadata: objects.ObjectMeta = {"name": self.settings.secret, "namespace": self.settings.namespace,
                                        "labels": labels("webhook", name="ipmasq-webhook")}
        if resource_version is not None:
            metadata["resourceVersion"] = resource_version
        return {"apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/tls", "metadata": metadata,
                "data": made.secret_data()}

    def _trust(self, bundle: bytes) -> None:
        """Make every webhook of the configuration that calls our Service trust `bundle` (a JSON patch of caBundle
        only: whatever else an operator changed in the configuration stays)."""
        configuration = self.api.get_webhook_configuration(self.settings.configuration)
        if configuration is None:
            raise ApiError(f"ValidatingWebhookConfiguration {self.settings.configuration} is missing "
                           "(kubectl apply -k deploy/webhook)", 404)
        patch: list[JsonPatchOperation] = []
        for index, webhook in enumerate(configuration.get("webhooks") or []):
            client = webhook.get("clientConfig") or {}
            service = client.get("service") or {}
            if service.get("name") != self.settings.service or service.get("namespace") != self.settings.namespace:
                continue
            trusted = _certificates(_decoded(client.get("caBundle")))
            wanted = _certificates(bundle)
            if all(cert in trusted for cert in wanted):
                continue
            # a replica that has not yet read a renewed Secret may still serve the previous CA's certificate: what is
            # trusted and still valid stays, beside what the Secret names
            kept = [cert for cert in trusted if cert not in wanted and still_valid(cert, self.clock())]
            value = base64.b64encode(b"".join(wanted + kept)).decode()
            patch.append({"op": "add", "path": f"/webhooks/{index}/clientConfig/caBundle", "value": value})
        if patch:
            self.api.patch_webhook_configuration(self.settings.configuration, patch)
            self.log(f"caBundle of ValidatingWebhookConfiguration {self.settings.configuration} updated")


_PEM_CERTIFICATE = re.compile(rb"-----BEGIN CERTIFICATE-----\r?\n.*?-----END CERTIFICATE-----\r?\n?", re.DOTALL)


def _decoded(value: object) -> bytes:
    if not isinstance(value, str):
        return b""
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        return b""


def _certificates(bundle: bytes) -> list[bytes]:
    """The PEM certificates of a bundle, each ending in one newline."""
    return [match.group().rstrip(b"\r\n") + b"\n" for match in _PEM_CERTIFICATE.finditer(bundle)]
