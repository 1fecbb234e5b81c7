"""The webhook's calls to the API server: its certificate's Secret and its ValidatingWebhookConfiguration's caBundle.

`Api` is what the rest of the package uses (keeper.py); `InClusterApi` makes those calls through the project's one
client (ipmasq.kube.client: the pod's service account, its token read again as it rotates), and the tests hold a
fake. Every failure is one of ipmasq.errors' ApiError tree; Conflict when a write lost a race to another replica.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol, TypedDict

from ipmasq.errors import ApiError, Conflict, NotFound
from ipmasq.kube import objects, paths
from ipmasq.kube.client import KubeClient
from ipmasq.kube.credentials import SERVICE_ACCOUNT_DIR, in_cluster

__all__ = ["Api", "ApiError", "Conflict", "InClusterApi", "JsonPatchOperation"]



class JsonPatchOperation(TypedDict):
    """One operation of a JSON patch (RFC 6902): the keeper adds caBundles."""

    op: str
    path: str
    value: str


class Api(Protocol):
    def get_secret(self, namespace: str, name: str) -> objects.Secret | None: ...

    def create_secret(self, namespace: str, body: objects.Secret) -> objects.Secret: ...

    def replace_secret(self, namespace: str, name: str, body: objects.Secret) -> objects.Secret: ...

    def get_webhook_configuration(self, name: str) -> objects.WebhookConfiguration | None: ...

    def patch_webhook_configuration(self, name: str, patch: list[JsonPatchOperation]) -> None: ...


class InClusterApi:
    """The API server as a pod reaches it: KUBERNETES_SERVICE_HOST/PORT, the service account's token and CA. Every
    path from ipmasq.kube.paths, every answer read through its shape (ipmasq.kube.objects)."""

    def __init__(self, account: Path = Path(SERVICE_ACCOUNT_DIR)) -> None:
        credentials = in_cluster(str(account))
        if credentials is None:
            raise ApiError("not in a pod: KUBERNETES_SERVICE_HOST or the service account's token is missing (run the "
                           "webhook in the cluster, or give --tls-cert-file and --tls-key-file)")
        self.client = KubeClient(credentials)

    def get_secret(self, namespace: str, name: str) -> objects.Secret | None:
        path = paths.secrets(namespace, name)
        try:
            return objects.secret(self.client.get(path), f"GET {path}")
        except NotFound:
            return None

    def create_secret(self, namespace: str, body: objects.Secret) -> objects.Secret:
        path = paths.secrets(namespace)
        return objects.secret(self.client.create(path, body), f"POST {path}")

    def replace_secret(self, namespace: str, name: str, body: objects.Secret) -> objects.Secret:
        path = paths.secrets(namespace, name)
        try:
            return objects.secret(self.client.replace(path, body), f"PUT {path}")
        except NotFound:
            raise Conflict(404, f"secret {namespace}/{name} was deleted meanwhile") from None

    def get_webhook_configuration(self, name: str) -> objects.WebhookConfiguration | None:
        path = paths.webhook_configurations(name)
        try:
            return objects.webhook_configuration(self.client.get(path), f"GET {path}")
        except NotFound:
            return None

    def patch_webhook_configuration(self, name: str, patch: list[JsonPatchOperation]) -> None:
        try:
            self.client.request("PATCH", paths.webhook_configurations(name), body=patch,
                                content_type="application/json-patch+json")
        except NotFound:
            raise ApiError(f"ValidatingWebhookConfiguration {name} is missing (kubectl apply -k deploy/webhook)"
                           ) from None
