"""The certificate keeper over a fake API server: one set for every replica (a lost create race reads the winner's),
the caBundle trusting it before a renewed Secret is served, and whatever else the configuration holds left alone."""

from __future__ import annotations

import base64
import copy
import datetime
from typing import Any

import pytest

from ipmasq.webhook.certificate import CertificateSet
from ipmasq.webhook.keeper import CertificateKeeper, KeeperSettings
from ipmasq.webhook.kube import ApiError, Conflict

NOW = datetime.datetime(2024, 5, 1, 12, 0, tzinfo=datetime.UTC)
SETTINGS = KeeperSettings(namespace="kube-system", service="ipmasq-webhook", secret="cert",
                          configuration="ipmasq-webhook", days=90)


class FakeApi:
    """A Secret and a ValidatingWebhookConfiguration with resourceVersions, and a log of the writes in order."""

    def __init__(self) -> None:
        self.secret: dict[str, Any] | None = None
        self.version = 0
        self.writes: list[str] = []
        self.before_create: Any = None
        self.configuration: dict[str, Any] | None = {"metadata": {"name": "ipmasq-webhook"}, "webhooks": [
            {"name": "other.example.com", "clientConfig": {"service": {"name": "other", "namespace": "x"},
                                                           "caBundle": "b3RoZXI="}},
            {"name": "configmaps.ipmasq-webhook.kube-system.svc", "timeoutSeconds": 5,
             "clientConfig": {"service": {"name": "ipmasq-webhook", "namespace": "kube-system"}}}]}

    def get_secret(self, namespace: str, name: str) -> dict[str, Any] | None:
        return copy.deepcopy(self.secret)

    def create_secret(self, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        if self.before_create is not None:
            before, self.before_create = self.before_create, None
            before()
        if self.secret is not None:
            raise Conflict(409, "already exists")
        return self._store(body, "create")

    def replace_secret(self, namespace: str, name: str, body: dict[str, Any]) -> dict[str, Any]:
        assert self.secret is not None
        if body["metadata"].get("resourceVersion") != self.secret["metadata"]["resourceVersion"]:
            raise Conflict(409, "stale")
        return self._store(body, "replace")

    def _store(self, body: dict[str, Any], what: str) -> dict[str, Any]:
        self.version += 1
        self.secret = copy.deepcopy(body)
        self.secret["metadata"]["resourceVersion"] = str(self.version)
        self.writes.append(f"secret {what}")
        return copy.deepcopy(self.secret)

    def get_webhook_configuration(self, name: str) -> dict[str, Any] | None:
        return copy.deepcopy(self.configuration)

    def patch_webhook_configuration(self, name: str, patch: list[dict[str, Any]]) -> None:
        assert self.configuration is not None
        for op in patch:
            assert op["op"] == "add"
            _, _, index, _, _ = op["path"].split("/")
            self.configuration["webhooks"][int(index)]["clientConfig"]["caBundle"] = op["value"]
        self.writes.append("caBundle")

    def bundle(self) -> bytes:
        assert self.configuration is not None
        return base64.b64decode(self.configuration["webhooks"][1]["clientConfig"]["caBundle"])

    def stored(self) -> CertificateSet:
        assert self.secret is not None
        return CertificateSet.from_secret_data(self.secret["data"])


def keeper(api: FakeApi, now: datetime.datetime = NOW) -> CertificateKeeper:
    return CertificateKeeper(api, SETTINGS, clock=lambda: now)


def test_the_first_replica_makes_the_set_and_the_second_serves_the_same() -> None:
    api = FakeApi()
    first = keeper(api).sync()
    assert api.writes == ["secret create", "caBundle"]
    assert keeper(api).sync() == first and api.writes == ["secret create", "caBundle"]  # nothing more to write
    assert api.bundle() == first.ca_cert
    assert api.configuration is not None
    assert api.configuration["webhooks"][0]["clientConfig"]["caBundle"] == "b3RoZXI="  # another webhook's: untouched
    assert api.configuration["webhooks"][1]["timeoutSeconds"] == 5


def test_a_replica_that_loses_the_create_race_serves_the_winners_set() -> None:
    api = FakeApi()
    winner: list[CertificateSet] = []
    api.before_create = lambda: winner.append(keeper(api).sync())  # the other replica creates first
    served = keeper(api).sync()
    assert served == winner[0] == api.stored()


def test_renewal_trusts_the_new_ca_before_the_secret_changes_and_keeps_the_old_one() -> None:
    api = FakeApi()
    old = keeper(api).sync()
    api.writes.clear()
    later = NOW + datetime.timedelta(days=61)
    new = keeper(api, later).sync()
    assert new != old and api.writes[:2] == ["caBundle", "secret replace"]
    assert old.ca_cert in api.bundle() and new.ca_cert in api.bundle()
    assert keeper(api, later).sync() == new  # the other replica reads it, renews nothing


def test_a_replica_reading_the_old_secret_during_a_renewal_does_not_untrust_the_new_ca() -> None:
    api = FakeApi()
    old = keeper(api).sync()
    stale = copy.deepcopy(api.secret)
    new = keeper(api, NOW + datetime.timedelta(days=61)).sync()
    api.secret = stale  # what a replica read just before the renewal replaced it
    keeper(api, NOW + datetime.timedelta(days=1)).sync()
    assert new.ca_cert in api.bundle() and old.ca_cert in api.bundle()


def test_a_broken_secret_is_replaced_and_a_missing_configuration_is_an_error() -> None:
    api = FakeApi()
    keeper(api).sync()
    assert api.secret is not None
    api.secret["data"] = {"tls.crt": "Zm9v"}
    remade = keeper(api).sync()
    assert api.stored() == remade and remade.ca_cert in api.bundle()
    api.configuration = None
    with pytest.raises(ApiError, match="kubectl apply -k deploy/webhook"):
        keeper(api).sync()
