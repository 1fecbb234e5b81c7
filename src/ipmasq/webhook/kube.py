"""The webhook's one seam to the API server: the few calls it makes, over HTTPS with the pod's service account.

`Api` is what the rest of the package uses (keeper.py); `InClusterApi` is the real one, `tests` hold a fake. Every
failure is an ApiError (or Conflict, when a write lost a race to another replica), never a urllib exception.
"""

from __future__ import annotations

import json
import os
import ssl
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Protocol

from ipmasq.errors import IpmasqError, clip, one_line

__all__ = ["Api", "ApiError", "Conflict", "InClusterApi"]

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
_TIMEOUT = 10.0
_MAX_RESPONSE = 1 << 20  # a Secret or a ValidatingWebhookConfiguration; nothing the webhook reads is larger


class ApiError(IpmasqError):
    """The API server refused a call, or could not be reached."""

    def __init__(self, message: str, status: int | None = None) -> None:
        self.status = status
        super().__init__(message)


class Conflict(ApiError):
    """A create found the object already there, or an update's resourceVersion was stale: another replica won."""


class Api(Protocol):
    def get_secret(self, namespace: str, name: str) -> dict[str, Any] | None: ...

    def create_secret(self, namespace: str, body: dict[str, Any]) -> dict[str, Any]: ...

    def replace_secret(self, namespace: str, name: str, body: dict[str, Any]) -> dict[str, Any]: ...

    def get_webhook_configuration(self, name: str) -> dict[str, Any] | None: ...

    def patch_webhook_configuration(self, name: str, patch: list[dict[str, Any]]) -> None: ...


class InClusterApi:
    """The API server as a pod reaches it: KUBERNETES_SERVICE_HOST/PORT, the service account's token and CA."""

    def __init__(self, account: Path = SERVICE_ACCOUNT) -> None:
        host = os.environ.get("KUBERNETES_SERVICE_HOST")
        port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        if not host:
            raise ApiError("not in a pod: KUBERNETES_SERVICE_HOST is not set (run the webhook in the cluster, or "
                           "give --tls-cert-file and --tls-key-file)")
        self.base = f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"
        self.account = account
        try:
            self.context = ssl.create_default_context(cafile=str(account / "ca.crt"))
        except OSError as exc:
            raise ApiError(f"{account / 'ca.crt'}: {exc.strerror}") from None

    def _call(self, method: str, path: str, body: object = None,
              content_type: str = "application/json") -> dict[str, Any] | None:
        try:
            token = (self.account / "token").read_text().strip()  # re-read: kubelet rotates projected tokens
        except OSError as exc:
            raise ApiError(f"{self.account / 'token'}: {exc.strerror}") from None
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.base + path, data=data, method=method, headers={
            "Authorization": f"Bearer {token}", "Accept": "application/json", "Content-Type": content_type})
        try:
            with urllib.request.urlopen(request, timeout=_TIMEOUT, context=self.context) as response:
                answer: dict[str, Any] = json.loads(response.read(_MAX_RESPONSE))
                return answer
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return None
            detail = _status_message(exc)
            error = Conflict if exc.code == 409 else ApiError
            raise error(f"{method} {path}: {exc.code} {detail}", exc.code) from None
        except (urllib.error.URLError, OSError, ValueError) as exc:
            reason = getattr(exc, "reason", exc)
            raise ApiError(one_line(f"{method} {path}: {reason}")) from None

    def get_secret(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self._call("GET", f"/api/v1/namespaces/{namespace}/secrets/{name}")

    def create_secret(self, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        return self._call("POST", f"/api/v1/namespaces/{namespace}/secrets", body) or {}

    def replace_secret(self, namespace: str, name: str, body: dict[str, Any]) -> dict[str, Any]:
        answer = self._call("PUT", f"/api/v1/namespaces/{namespace}/secrets/{name}", body)
        if answer is None:
            raise Conflict(f"secret {namespace}/{name} was deleted meanwhile", 404)
        return answer

    def get_webhook_configuration(self, name: str) -> dict[str, Any] | None:
        return self._call("GET", f"/apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations/{name}")

    def patch_webhook_configuration(self, name: str, patch: list[dict[str, Any]]) -> None:
        path = f"/apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations/{name}"
        if self._call("PATCH", path, patch, "application/json-patch+json") is None:
            raise ApiError(f"ValidatingWebhookConfiguration {name} is missing (kubectl apply -k deploy/webhook)", 404)


def _status_message(exc: urllib.error.HTTPError) -> str:
    try:
        status = json.loads(exc.read(_MAX_RESPONSE))
        return one_line(clip(str(status.get("message", "")), 300))
    except (ValueError, OSError, AttributeError):
        return str(exc.reason)
