"""Proving who we are to the API server: the TLS context (CA, client certificate) and the bearer token, from a
Credentials value.

Key material stays in memory: ssl loads a certificate chain only from a path, so PEM data goes into an anonymous
in-memory file (memfd_create(2)) that ssl reads through /proc/self/fd and that is closed at once; nothing is
written to a file system. Files named by the credentials (CA, client certificate and key) are read through the one
bounded reader of credential files first (ipmasq.kube.credentials.read_credential), never handed to ssl by path: a
FIFO or /dev/zero there is one line, not a hang or a flood.

An exec credential plugin (client.authentication.k8s.io/v1 or v1beta1) is run when a token is first needed, again
when the ExecCredential it printed expires (its expirationTimestamp, less a minute), and again after a 401. Its
output is bounded and it has a deadline; a plugin that fails is one line: what ran, its exit, its first error line
and the installHint when it is not installed.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import selectors
import shutil
import ssl
import subprocess
import sys
import threading
import time
from typing import Any

from ipmasq.errors import ApiError, clip, one_line
from ipmasq.kube.credentials import Credentials, ExecPlugin, TokenFile, read_credential
from ipmasq.memory_file import memory_file

__all__ = ["Auth", "ExecCredential", "run_exec_plugin", "ssl_context"]

EXEC_SECONDS = 300.0  # an interactive login (a device code, a browser) takes a person a while
MAX_EXEC_OUTPUT = 1 << 20
_EXPIRY_MARGIN = 60.0  # refreshed a minute early: a token must not expire between the check and the request


class ExecCredential:
    """What an exec plugin printed: a token and/or a client certificate, and when they expire (monotonic)."""

    def __init__(self, token: str | None, cert_pem: str | None, key_pem: str | None, expires: float | None) -> None:
        self.token, self.cert_pem, self.key_pem, self.expires = token, cert_pem, key_pem, expires

    def fresh(self) -> bool:
        return self.expires is None or time.monotonic() < self.expires - _EXPIRY_MARGIN


class Auth:
    """The bearer token for each request and the TLS context, kept current (thread-safe: the agent's threads share
    one client)."""

    def __init__(self, credentials: Credentials) -> None:
        self.credentials = credentials
        self._token_file = TokenFile(credentials.token_file, credentials.token)
        self._lock = threading.Lock()
        self._exec: ExecCredential | None = None
        self._context: ssl.SSLContext | None = None
        self._context_pair: tuple[str | None, str | None] = (None, None)

    @property
    def rotates(self) -> bool:
        """Whether asking for the token again after a 401 can give another one."""
        return self.credentials.token_file is not None or self.credentials.exec_plugin is not None

    def token(self, *, reread: bool = False) -> str | None:
        plugin = self.credentials.exec_plugin
        if plugin is None or self.credentials.token or self.credentials.token_file:
            return self._token_file.token(reread=reread)
        return self._exec_credential(plugin, refresh=reread).token

    def context(self) -> ssl.SSLContext:
        """The TLS context; rebuilt when an exec plugin handed out a new client certificate."""
        with self._lock:
            pair: tuple[str | None, str | None] = (None, None)
            if self._exec is not None and self._exec.cert_pem:
                pair = (self._exec.cert_pem, self._exec.key_pem)
            if self._context is None or pair != self._context_pair:
                self._context = ssl_context(self.credentials, exec_pair=pair if pair[0] else None)
                self._context_pair = pair
            return self._context

    def prepare(self) -> None:
        """Run the exec plugin now when its client certificate is what TLS needs (before the first connection)."""
        plugin = self.credentials.exec_plugin
        if plugin is not None and not (self.credentials.token or self.credentials.token_file):
            self._exec_credential(plugin, refresh=False)

    def _exec_credential(self, plugin: ExecPlugin, *, refresh: bool) -> ExecCredential:
        with self._lock:
            if self._exec is None or refresh or not self._exec.fresh():
                self._exec = run_exec_plugin(plugin, self.credentials.cluster_info)
            return self._exec


def run_exec_plugin(plugin: ExecPlugin, cluster_info: dict[str, object] | None = None, *,
                    timeout: float = EXEC_SECONDS) -> ExecCredential:
    """Run the plugin as kubectl does (KUBERNETES_EXEC_INFO in its environment, its stderr to ours, stdin only when
    interactive) and read the ExecCredential it prints."""
    command = plugin.command
    if os.sep in command and not os.path.isabs(command):
        command = os.path.join(plugin.base_dir, command)
    name = os.path.basename(plugin.command)
    if shutil.which(command) is None:
        hint = f": {one_line(clip(plugin.install_hint, 200))}" if plugin.install_hint else ""
        raise ApiError(f"exec plugin {clip(name)!r} is not installed (not found on PATH){hint}")
    interactive = plugin.interactive_mode != "Never" and sys.stdin is not None and sys.stdin.isatty()
    if plugin.interactive_mode == "Always" and not interactive:
        raise ApiError(f"exec plugin {clip(name)!r} needs a terminal (interactiveMode Always)")
    spec: dict[str, Any] = {"interactive": interactive}
    if plugin.provide_cluster_info and cluster_info is not None:
        spec["cluster"] = {_camel(key): value for key, value in cluster_info.items()}
    env = dict(os.environ)
    env.update(plugin.env)
    env["KUBERNETES_EXEC_INFO"] = json.dumps({"apiVersion": plugin.api_version, "kind": "ExecCredential",
                                              "spec": spec})
    try:
        process = subprocess.Popen([command, *plugin.args], env=env, stdout=subprocess.PIPE,
                                   stdin=None if interactive else subprocess.DEVNULL)
    except OSError as exc:
        raise ApiError(f"exec plugin {clip(name)!r}: {exc.strerror or exc}") from None
    try:
        output = _bounded_output(process, timeout)
    finally:
        with contextlib.suppress(OSError):
            process.kill()
        process.wait()
    if process.returncode != 0:
        raise ApiError(f"exec plugin {clip(name)!r} failed (exit {process.returncode}): it says why above")
    return _parse_credential(output, plugin, name)


def _camel(key: str) -> str:
    """A kubeconfig cluster field as the ExecCredential's Cluster names it (certificate-authority-data ->
    certificateAuthorityData)."""
    if key == "insecure-skip-tls-verify":
        return "insecureSkipTLSVerify"
    first, *rest = key.split("-")
    return first + "".join(part.title() for part in rest)


def _bounded_output(process: subprocess.Popen[bytes], timeout: float) -> bytes:
    deadline = time.monotonic() + timeout
    assert process.stdout is not None
    chunks: list[bytes] = []
    size = 0
    os.set_blocking(process.stdout.fileno(), False)
    with selectors.DefaultSelector() as selector:
        selector.register(process.stdout, selectors.EVENT_READ)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ApiError(f"exec plugin: no credential within {timeout:.0f} s")
            if not selector.select(left):
                continue
            chunk = os.read(process.stdout.fileno(), 65536)
            if not chunk:
                return b"".join(chunks)
            size += len(chunk)
            if size > MAX_EXEC_OUTPUT:
                raise ApiError(f"exec plugin: more than {MAX_EXEC_OUTPUT >> 20} MiB of output")
            chunks.append(chunk)


def _parse_credential(output: bytes, plugin: ExecPlugin, name: str) -> ExecCredential:
    try:
        value = json.loads(output)
    except (ValueError, RecursionError):
        raise ApiError(f"exec plugin {clip(name)!r} printed something that is not an ExecCredential: "
                       f"{clip(output.decode('utf-8', 'replace'))!r}") from None
    if not isinstance(value, dict) or value.get("kind") != "ExecCredential":
        raise ApiError(f"exec plugin {clip(name)!r} printed something that is not an ExecCredential")
    if value.get("apiVersion") != plugin.api_version:
        raise ApiError(one_line(f"exec plugin {clip(name)!r} answered with apiVersion "
                                f"{clip(str(value.get('apiVersion')))!r}, asked for {plugin.api_version}"))
    status = value.get("status")
    if not isinstance(status, dict):
        raise ApiError(f"exec plugin {clip(name)!r} printed an ExecCredential without a status")
    token, cert, key = status.get("token"), status.get("clientCertificateData"), status.get("clientKeyData")
    if not isinstance(token, str):
        token = None
    if not (isinstance(cert, str) and isinstance(key, str)):
        cert = key = None
    if token is None and cert is None:
        raise ApiError(f"exec plugin {clip(name)!r} printed neither a token nor a client certificate and key")
    expires: float | None = None
    stamp = status.get("expirationTimestamp")
    if isinstance(stamp, str) and stamp:
        try:
            when = datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00"))
        except ValueError:
            raise ApiError(f"exec plugin {clip(name)!r}: an expirationTimestamp that is not RFC 3339: "
                           f"{clip(stamp)!r}") from None
        if when.tzinfo is None:
            when = when.replace(tzinfo=datetime.UTC)
        expires = time.monotonic() + (when - datetime.datetime.now(datetime.UTC)).total_seconds()
    return ExecCredential(token, cert, key, expires)


def _pem_or_der(data: bytes) -> str | bytes:
    """A CA file's bytes as ssl's cadata takes them: PEM text, or DER bytes."""
    try:
        return data.decode("ascii")
    except UnicodeDecodeError:
        return data



def ssl_context(credentials: Credentials, *, exec_pair: tuple[str | None, str | None] | None = None) -> ssl.SSLContext:
    """Trusts only the cluster's CA when one is named (not the machine's whole store: what the API server's
    certificate is signed by); a client certificate from files, from data, or from the exec plugin."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ca_data: str | bytes | None = credentials.ca_data
    cert_pem, key_pem = exec_pair or (credentials.client_cert_data, credentials.client_key_data)
    if not credentials.insecure and credentials.ca_file and not ca_data:
        ca_data = _pem_or_der(read_credential(credentials.ca_file, "the CA file"))
    if not cert_pem and credentials.client_cert_file:
        cert_pem = read_credential(credentials.client_cert_file, "the client certificate").decode("utf-8", "replace")
        if credentials.client_key_file:
            key_pem = read_credential(credentials.client_key_file, "the client key").decode("utf-8", "replace")
    try:
        if credentials.insecure:
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        elif ca_data:
            context.load_verify_locations(cadata=ca_data)
        else:
            context.load_default_certs()
        if cert_pem:
            with memory_file(cert_pem) as cert_path, memory_file(key_pem or cert_pem) as key_path:
                context.load_cert_chain(cert_path, key_path)
    except (OSError, ssl.SSLError, ValueError) as exc:
        text = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
        raise ApiError(f"the API server's CA or the client certificate cannot be loaded: {clip(str(text), 120)}") \
            from None
    return context
