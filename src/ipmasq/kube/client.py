"""The seam to the API server: JSON requests and watch streams over one HTTPS connection per call.

Written on ssl (and the small HTTP/1.1 reader in ipmasq.kube._http) rather than a client library: the agent's memory
budget with the API on is 28 MiB, and the well-kept clients cost 14-35 MiB more (docs/measurements.md). The tests
hold this client to lightkube, a well-kept one, as the oracle of what goes over the wire.

Everything that goes wrong is one of ipmasq.errors' ApiError tree: ApiUnreachable when there was no usable answer,
an ApiRefused subclass (Unauthorized, Forbidden, NotFound, Conflict, Gone) when the server said no. Answers are
bounded (a ConfigMap is at most 1 MiB; nothing the agent asks for is larger than a few), so a hostile or broken
server costs a clear error, never the agent's memory.
"""

from __future__ import annotations

import json
import ssl
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import urlencode

from ipmasq import __version__
from ipmasq.errors import (
    ApiError,
    ApiRefused,
    ApiUnreachable,
    Conflict,
    Forbidden,
    Gone,
    NotFound,
    Unauthorized,
    clip,
)
from ipmasq.kube import _http
from ipmasq.kube.credentials import Credentials, TokenFile

__all__ = ["MAX_ANSWER_BYTES", "ApiClient", "KubeClient", "WatchEvent"]

# The largest answer (or watch line) read: a ConfigMap's 1 MiB of data, JSON-escaped, with its metadata and
# managedFields, fits several times over.
MAX_ANSWER_BYTES = 8 << 20
_REFUSALS: dict[int, type[ApiRefused]] = {401: Unauthorized, 403: Forbidden, 404: NotFound, 409: Conflict,
                                          410: Gone}
MERGE_PATCH = "application/merge-patch+json"


@dataclass(frozen=True, slots=True)
class WatchEvent:
    """One line of a watch stream: ADDED, MODIFIED, DELETED, BOOKMARK (the object then carries only its
    resourceVersion); an ERROR line is raised as its ApiRefused instead."""

    type: str
    object: dict[str, Any]


class ApiClient(Protocol):
    """What the agent asks of the API server: KubeClient on a node, ipmasq.testing.kube.FakeKubeClient in tests."""

    def get(self, path: str, *, query: Mapping[str, str] | None = None) -> dict[str, Any]: ...

    def create(self, path: str, body: Mapping[str, Any]) -> dict[str, Any]: ...

    def patch(self, path: str, body: Mapping[str, Any]) -> dict[str, Any]: ...

    def watch(self, path: str, *, query: Mapping[str, str], timeout_seconds: int = 300) -> Iterator[WatchEvent]: ...


class KubeClient:
    def __init__(self, credentials: Credentials, *, timeout: float = 10.0) -> None:
        self.credentials = credentials
        self.timeout = timeout
        self._context = _ssl_context(credentials)
        self._token = TokenFile(credentials.token_file, credentials.token)
        self.user_agent = f"ipmasq/{__version__}"

    # ---- requests -------------------------------------------------------------------------------------------

    def get(self, path: str, *, query: Mapping[str, str] | None = None) -> dict[str, Any]:
        return self.request("GET", path, query=query)

    def create(self, path: str, body: Mapping[str, Any]) -> dict[str, Any]:
        return self.request("POST", path, body=body)

    def replace(self, path: str, body: Mapping[str, Any]) -> dict[str, Any]:
        return self.request("PUT", path, body=body)

    def patch(self, path: str, body: Mapping[str, Any]) -> dict[str, Any]:
        """A JSON merge patch (RFC 7386): the fields given replace the object's, null removes one."""
        return self.request("PATCH", path, body=body, content_type=MERGE_PATCH)

    def delete(self, path: str) -> dict[str, Any]:
        return self.request("DELETE", path)

    def request(self, verb: str, path: str, *, query: Mapping[str, str] | None = None,
                body: Mapping[str, Any] | list[Any] | None = None,
                content_type: str = "application/json") -> dict[str, Any]:
        """One request; the answer's JSON object. A 401 reads the token again and tries once more (it rotated)."""
        target = path + (f"?{urlencode(dict(query))}" if query else "")
        payload = json.dumps(body, separators=(",", ":")).encode() if body is not None else None
        for attempt in (1, 2):
            response = self._send(verb, target, payload, content_type, timeout=self.timeout, reread=attempt == 2)
            try:
                data = _read_bounded(response, verb, path)
            finally:
                response.close()
            if response.status == 401 and attempt == 1 and self._token.path is not None:
                continue
            if response.status >= 400:
                raise _refusal(response.status, data, verb, path)
            return _json_object(data, verb, path)
        raise AssertionError("unreachable")  # the loop returns or raises

    def watch(self, path: str, *, query: Mapping[str, str], timeout_seconds: int = 300) -> Iterator[WatchEvent]:
        """The events of a watch, until the server ends it (its timeoutSeconds) or it breaks (ApiUnreachable).

        `query` gives resourceVersion (where to start) and any selector; bookmarks are asked for, so that a quiet
        watch still moves its resourceVersion on and a restart rarely lands on 410 Gone."""
        params = {**query, "watch": "true", "allowWatchBookmarks": "true", "timeoutSeconds": str(timeout_seconds)}
        target = f"{path}?{urlencode(params)}"
        # the server closes at timeoutSeconds; a silent connection well past that is a dead one
        response = self._send("GET", target, None, "application/json", timeout=timeout_seconds + 30.0, reread=False)
        try:
            if response.status == 401 and self._token.path is not None:
                self._token.token(reread=True)
            if response.status >= 400:
                raise _refusal(response.status, _read_bounded(response, "WATCH", path), "WATCH", path)
            while True:
                try:
                    line = response.readline(MAX_ANSWER_BYTES)
                except _http.HttpError as exc:
                    raise ApiUnreachable(f"watch {path}: the stream broke: {exc}") from None
                if not line:
                    return
                if len(line) > MAX_ANSWER_BYTES:
                    raise ApiUnreachable(f"watch {path}: an event of more than {MAX_ANSWER_BYTES:,} bytes")
                if not line.strip():
                    continue
                event = _json_object(line, "WATCH", path)
                kind, obj = event.get("type"), event.get("object")
                if not isinstance(kind, str) or not isinstance(obj, dict):
                    shown = clip(line.decode("utf-8", "replace"))
                    raise ApiUnreachable(f"watch {path}: a line that is not a watch event: {shown!r}")
                if kind == "ERROR":
                    code = obj.get("code")
                    raise _refusal(code if isinstance(code, int) else 500, line, "WATCH", path)
                yield WatchEvent(kind, obj)
        finally:
            response.close()

    # ---- the connection --------------------------------------------------------------------------------------

    def _send(self, verb: str, target: str, payload: bytes | None, content_type: str, *, timeout: float,
              reread: bool) -> _http.Response:
        headers = {"Accept": "application/json", "User-Agent": self.user_agent}
        token = self._token.token(reread=reread)
        if token:
            headers["Authorization"] = f"Bearer {token}"
        if payload is not None:
            headers["Content-Type"] = content_type
        try:
            return _http.request(self._context, self.credentials.host.strip("[]"), self.credentials.port, verb,
                                 target, headers, payload, timeout=timeout)
        except _http.HttpError as exc:
            raise ApiUnreachable(f"{verb} {target.split('?')[0]}: {self.credentials.server}: {exc}") from None


def _ssl_context(credentials: Credentials) -> ssl.SSLContext:
    """Trusts only the cluster's CA when one is named (not the machine's whole store: smaller, and what the API
    server's certificate is signed by)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:
        if credentials.insecure:
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        elif credentials.ca_file or credentials.ca_data:
            context.load_verify_locations(cafile=credentials.ca_file, cadata=credentials.ca_data)
        else:
            context.load_default_certs()
        if credentials.client_cert_file:
            context.load_cert_chain(credentials.client_cert_file, credentials.client_key_file)
    except (OSError, ssl.SSLError) as exc:
        raise ApiError(f"the API server's CA or the client certificate cannot be loaded: {_describe(exc)}") from None
    return context


def _describe(exc: BaseException) -> str:
    text = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
    return clip(str(text), 120)


def _read_bounded(response: _http.Response, verb: str, path: str) -> bytes:
    try:
        data = response.read(MAX_ANSWER_BYTES)
    except _http.HttpError as exc:
        raise ApiUnreachable(f"{verb} {path}: the answer broke off: {exc}") from None
    if len(data) > MAX_ANSWER_BYTES:
        raise ApiUnreachable(f"{verb} {path}: an answer of more than {MAX_ANSWER_BYTES:,} bytes")
    return data


def _json_object(data: bytes, verb: str, path: str) -> dict[str, Any]:
    try:
        value = json.loads(data)
    except (ValueError, RecursionError):
        raise ApiUnreachable(f"{verb} {path}: an answer that is not JSON: "
                             f"{clip(data.decode('utf-8', 'replace'))!r}") from None
    if not isinstance(value, dict):
        raise ApiUnreachable(f"{verb} {path}: an answer that is not a JSON object")
    return value


def _refusal(status: int, data: bytes, verb: str, path: str) -> ApiError:
    """The server's Status message when it sent one, else the start of whatever it sent."""
    message = data.decode("utf-8", "replace").strip()
    try:
        value = json.loads(data)
        if isinstance(value, dict):
            inner = value.get("object") if value.get("type") == "ERROR" else value
            if isinstance(inner, dict) and isinstance(inner.get("message"), str):
                message = inner["message"]
    except (ValueError, RecursionError):
        pass
    return _REFUSALS.get(status, ApiRefused)(status, message, verb=verb, path=path)
