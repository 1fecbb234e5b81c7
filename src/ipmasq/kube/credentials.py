"""Where the API server is and how to prove who we are: in the cluster (the pod's service account) or a kubeconfig.

Values only (no ssl here): the agent reads them to decide whether the API features start at all.

The service account's token is a file the kubelet rewrites as it rotates (projected, bound tokens expire within
the hour): it is read again whenever its file changed, never kept from start-up. Every credential file is read
through ipmasq.input_files.read_regular (regular files only, bounded, with a deadline). A kubeconfig is read by
ipmasq.kube.kubeconfig, which builds on this module (never the other way round).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from ipmasq.errors import ApiError, InputRefused, clip, one_line
from ipmasq.input_files import read_regular

__all__ = ["MAX_CERTIFICATE_BYTES", "MAX_TOKEN_BYTES", "SERVICE_ACCOUNT_DIR", "Credentials", "ExecPlugin",
           "TokenFile", "in_cluster", "pod_namespace", "read_credential"]

SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
# A bound service-account token is about 1 KiB, an OIDC token a few; a CA bundle (the machine's whole store) about
# 200 KiB; a kubeconfig with dozens of clusters and embedded CAs about 100 KiB.
MAX_TOKEN_BYTES = 1 << 20
MAX_CERTIFICATE_BYTES = 4 << 20


def read_credential(path: str, what: str, *, limit: int = MAX_CERTIFICATE_BYTES) -> bytes:
    """A credential file's bytes through the one bounded reader; one ApiError line naming `what` and the path when
    it cannot be read (missing, no permission, a FIFO, a device, too large, too slow)."""
    try:
        return read_regular(path, limit=limit)
    except OSError as exc:
        why = exc.strerror or type(exc).__name__
    except InputRefused as exc:
        why = str(exc) or type(exc).__name__
    raise ApiError(one_line(f"{clip(path, 200)}: cannot read {what}: {why}"))


@dataclass(frozen=True, slots=True)
class ExecPlugin:
    """A kubeconfig user's exec credential plugin (gke-gcloud-auth-plugin, `aws eks get-token`, kubelogin): the
    command that prints an ExecCredential with a token or a client certificate, and when it expires."""

    command: str
    api_version: str
    args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    install_hint: str | None = None
    interactive_mode: str = "IfAvailable"  # Never, IfAvailable, Always
    provide_cluster_info: bool = False
    base_dir: str = "."  # a relative command is found from the kubeconfig that named it


@dataclass(frozen=True, slots=True)
class Credentials:
    """How to reach one API server: its address, the CA that signs its certificate, and a bearer token (literal, a
    file read again as it rotates, or an exec plugin's) and/or a client certificate (a file or PEM kept in memory:
    key material is never written anywhere)."""

    host: str
    port: int
    ca_file: str | None = None
    ca_data: str | None = None  # PEM
    token: str | None = None
    token_file: str | None = None
    client_cert_file: str | None = None
    client_key_file: str | None = None
    client_cert_data: str | None = field(default=None, repr=False)  # PEM
    client_key_data: str | None = field(default=None, repr=False)  # PEM
    insecure: bool = False  # a kubeconfig's insecure-skip-tls-verify
    tls_server_name: str | None = None  # the name the server's certificate is checked against, when not host
    proxy_url: str | None = None  # http://host:port: the API server reached through this proxy's CONNECT
    exec_plugin: ExecPlugin | None = None
    cluster_info: dict[str, object] | None = field(default=None, repr=False, compare=False)  # for provideClusterInfo

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
        """The token; ApiError when its file cannot be read and none was read before (after that, the last one read
        is kept through a rotation in progress: the next request reads again)."""
        if self.path is None:
            return self._literal
        try:
            status = os.stat(self.path)
            stamp = (status.st_ino, status.st_mtime_ns, status.st_size)
            if reread or stamp != self._stamp:
                data = read_credential(self.path, "the token file", limit=MAX_TOKEN_BYTES)
                self._token = data.decode("utf-8", "replace").strip()
                self._stamp = stamp
        except OSError as exc:  # the stat: the file gone (a rotation in progress) or unreadable
            if self._token is None:
                raise ApiError(one_line(f"{clip(self.path, 200)}: cannot read the token file: "
                                        f"{exc.strerror}")) from None
        except ApiError:
            if self._token is None:
                raise
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
        return read_regular(os.path.join(directory, "namespace"), limit=4096).decode("utf-8", "replace").strip() \
            or None
    except (OSError, InputRefused):
        return None
