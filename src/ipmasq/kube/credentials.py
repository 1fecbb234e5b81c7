"""Where the API server is and how to prove who we are: in the cluster (the pod's service account) or a kubeconfig.

Values only (no ssl here): the agent reads them to decide whether the API features start at all.

The service account's token is a file the kubelet rewrites as it rotates (projected, bound tokens expire within
the hour): it is read again whenever its file changed, never kept from start-up.
"""

from __future__ import annotations

import base64
import binascii
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from ipmasq.errors import ApiError, clip

__all__ = ["SERVICE_ACCOUNT_DIR", "Credentials", "TokenFile", "from_kubeconfig", "in_cluster", "pod_namespace"]

SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"


@dataclass(frozen=True, slots=True)
class Credentials:
    """How to reach one API server: its address, the CA that signs its certificate, and a bearer token (literal or
    a file read again as it rotates) and/or a client certificate."""

    host: str
    port: int
    ca_file: str | None = None
    ca_data: str | None = None  # PEM
    token: str | None = None
    token_file: str | None = None
    client_cert_file: str | None = None
    client_key_file: str | None = None
    insecure: bool = False  # a kubeconfig's insecure-skip-tls-verify

    @property
    def server(self) -> str:
        return f"https://{self.host}:{self.port}"


class TokenFile:
    """A bearer token read from its file again whenever the file changed (the kubelet rotates it)."""

    def __init__(self, path: str | None, literal: str | None = None) -> None:
        self.path = path
        self._literal = literal
        self._stamp: tuple[int, int, int] | None = None
        self._token: str | None = literal

    def token(self, *, reread: bool = False) -> str | None:
        if self.path is None:
            return self._literal
        try:
            status = os.stat(self.path)
            stamp = (status.st_ino, status.st_mtime_ns, status.st_size)
            if reread or stamp != self._stamp:
                self._token = Path(self.path).read_text().strip()
                self._stamp = stamp
        except OSError:
            pass  # keep the last token read: a rotation in progress, the next request reads again
        return self._token


def in_cluster(directory: str = SERVICE_ACCOUNT_DIR) -> Credentials | None:
    """The pod's own credentials (None: not in a pod with a service account token)."""
    host = os.environ.get("KUBERNETES_SERVICE_HOST")
    port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
    token = os.path.join(directory, "token")
    if not host or not os.path.exists(token):
        return None
    try:
        port_number = int(port)
    except ValueError:
        raise ApiError(f"KUBERNETES_SERVICE_PORT is not a port: {clip(port)!r}") from None
    if ":" in host:  # an IPv6 service address
        host = f"[{host}]"
    return Credentials(host=host, port=port_number, ca_file=os.path.join(directory, "ca.crt"), token_file=token)


def pod_namespace(directory: str = SERVICE_ACCOUNT_DIR) -> str | None:
    try:
        return Path(directory, "namespace").read_text().strip() or None
    except OSError:
        return None


def from_kubeconfig(path: str | None = None, *, context: str | None = None) -> Credentials:
    """The credentials of a kubeconfig's current (or named) context: $KUBECONFIG's first file, or ~/.kube/config.

    Embedded certificate data is written to private files (ssl loads a client certificate only from a file)."""
    if path is None:
        path = (os.environ.get("KUBECONFIG") or "").split(os.pathsep)[0] or os.path.expanduser("~/.kube/config")
    try:
        with open(path, "rb") as fh:
            config = yaml.safe_load(fh.read(1 << 20))
    except OSError as exc:
        raise ApiError(f"{path}: cannot read the kubeconfig: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ApiError(f"{path}: not a kubeconfig: {clip(str(exc).splitlines()[0])}") from None
    if not isinstance(config, dict):
        raise ApiError(f"{path}: not a kubeconfig (no mapping at the top)")
    name = context or config.get("current-context")
    ctx = _named(config, "contexts", name, "context", path)
    cluster = _named(config, "clusters", ctx.get("cluster"), "cluster", path)
    user = _named(config, "users", ctx.get("user"), "user", path) if ctx.get("user") else {}
    server = urlsplit(str(cluster.get("server", "")))
    if server.scheme != "https" or not server.hostname:
        raise ApiError(f"{path}: the cluster's server is not an https address: {clip(str(cluster.get('server')))!r}")
    host = f"[{server.hostname}]" if ":" in server.hostname else server.hostname
    base = os.path.dirname(os.path.abspath(path))
    return Credentials(
        host=host, port=server.port or 443,
        ca_file=_relative(base, cluster.get("certificate-authority")),
        ca_data=_decoded(cluster.get("certificate-authority-data"), path),
        insecure=bool(cluster.get("insecure-skip-tls-verify")),
        token=user.get("token"), token_file=_relative(base, user.get("tokenFile")),
        client_cert_file=_relative(base, user.get("client-certificate"))
        or _private_file(_decoded(user.get("client-certificate-data"), path)),
        client_key_file=_relative(base, user.get("client-key"))
        or _private_file(_decoded(user.get("client-key-data"), path)),
    )


def _named(config: dict[str, Any], section: str, name: object, key: str, path: str) -> dict[str, Any]:
    for item in config.get(section) or []:
        if isinstance(item, dict) and item.get("name") == name and isinstance(item.get(key), dict):
            found: dict[str, Any] = item[key]
            return found
    raise ApiError(f"{path}: no {key} named {clip(str(name))!r} in {section}")


def _relative(base: str, value: object) -> str | None:
    return os.path.join(base, value) if isinstance(value, str) and value else None


def _decoded(value: object, path: str) -> str | None:
    if not isinstance(value, str) or not value:
        return None
    try:
        return base64.b64decode(value, validate=True).decode()
    except (binascii.Error, UnicodeDecodeError):
        raise ApiError(f"{path}: certificate data that is not base64 PEM") from None


def _private_file(pem: str | None) -> str | None:
    if pem is None:
        return None
    fd, name = tempfile.mkstemp(prefix="ipmasq-kube-", suffix=".pem")
    with os.fdopen(fd, "w") as fh:
        fh.write(pem)
    return name
