"""The webhook's calls to the API server: its certificate's Secret and its ValidatingWebhookConfiguration's caBundle.

`Api` is what the rest of the package uses (keeper.py); `InClusterApi` makes those calls through the project's one
client (ipmasq.kube.client: the pod's service account, its token read again as it rotates), and the tests hold a
fake. Every failure is one of ipmasq.errors' ApiError tree; Conflict when a write lost a race to another replica.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from ipmasq.errors import ApiError, Conflict, NotFound
from ipmasq.kube.client import KubeClient
from ipmasq.kube.credentials import SERVICE_ACCOUNT_DIR, in_cluster

__all__ = ["Api", "ApiError", "Conflict", "InClusterApi"]

_CONFIGURATIONS = "/apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations"


class Api(Protocol):
    def get_secret(self, namespace: str, name: str) -> dict[str, Any] | None: ...

    def create_secret(self, namespace: str, body: dict[str, Any]) -> dict[str, Any]: ...

    def replace_secret(self, namespace: str, name: str, body: dict[str, Any]) -> dict[str, Any]: ...

    def get_webhook_configuration(self, name: str) -> dict[str, Any] | None: ...

    def patch_webhook_configuration(self, name: str, patch: list[dict[str, Any]]) -> None: ...


class InClusterApi:
    """The API server as a pod reaches it: KUBERNETES_SERVICE_HOST/PORT, the service account's token and CA."""

    def __init__(self, account: Path = Path(SERVICE_ACCOUNT_DIR)) -> None:
        credentials = in_cluster(str(account))
        if credentials is None:
            raise ApiError("not in a pod: KUBERNETES_SERVICE_HOST or the service account's token is missing (run the "
                           "webhook in the cluster, or give --tls-cert-file and --tls-key-file)")
        self.client = KubeClient(credentials)

    def get_secret(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return self.client.get(f"/api/v1/namespaces/{namespace}/secrets/{name}")
        except NotFound:
            return None

    def create_secret(self, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        return self.client.create(f"/api/v1/namespaces/{namespace}/secrets", body)

    def replace_secret(self, namespace: str, name: str, body: dict[str, Any]) -> dict[str, Any]:
        try:
            return self.client.replace(f"/api/v1/namespaces/{namespace}/secrets/{name}", body)
        except NotFound:
            raise Conflict(404, f"secret {namespace}/{name} was deleted meanwhile") from None

    def get_webhook_configuration(self, name: str) -> dict[str, Any] | None:
        try:
            return self.client.get(f"{_CONFIGURATIONS}/{name}")
        except NotFound:
            return None

    def patch_webhook_configuration(self, name: str, patch: list[dict[str, Any]]) -> None:
        try:
            self.client.request("PATCH", f"{_CONFIGURATIONS}/{name}", body=patch,
                                content_type="application/json-patch+json")
        except NotFound:
            raise ApiError(f"ValidatingWebhookConfiguration {name} is missing (kubectl apply -k deploy/webhook)"
                           ) from None
