"""A real etcd and kube-apiserver for benches, on this machine's loopback, started and stopped by the bench.

    with ApiServer(workdir, tools.etcd, tools.binaries["kube-apiserver"], users=...) as api:
        api.admin.get("/api/v1/nodes")
        api.restart()  # the API server only, etcd keeps its data

Ports are free ones found at start, so the bench runs beside anything else on the machine; the API server listens on
127.0.0.1 only, with a self-signed serving certificate and static tokens (one per user given); an optional audit
policy logs to workdir/audit.log as JSON lines. Every process started is stopped on exit, also on failure.
"""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import time
from pathlib import Path
from types import TracebackType

from ipmasq.kube.client import KubeClient
from ipmasq.kube.credentials import Credentials

__all__ = ["ADMIN_TOKEN", "ApiServer", "User"]

ADMIN_TOKEN = "bench-admin-token"
User = tuple[str, str, tuple[str, ...]]  # token, user name, groups


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class ApiServer:
    def __init__(self, workdir: Path, etcd: str, apiserver: str, *, users: tuple[User, ...] = (),
                 audit_policy: str | None = None, extra_flags: tuple[str, ...] = ()) -> None:
        self.workdir, self.etcd_binary, self.apiserver_binary = workdir, etcd, apiserver
        self.users, self.audit_policy, self.extra_flags = users, audit_policy, extra_flags
        self.port = _free_port()
        self.etcd_port, self.peer_port = _free_port(), _free_port()
        self.etcd: subprocess.Popen[bytes] | None = None
        self.apiserver: subprocess.Popen[bytes] | None = None
        self.admin = KubeClient(self.credentials(ADMIN_TOKEN), timeout=60.0)
        self.kubeconfig = workdir / "kubeconfig"

    @property
    def audit_log(self) -> Path:
        return self.workdir / "audit.log"

    def credentials(self, token: str) -> Credentials:
        return Credentials(host="127.0.0.1", port=self.port, token=token, insecure=True)

    def __enter__(self) -> ApiServer:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.stop()

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        lines = [f'{ADMIN_TOKEN},admin,admin,"system:masters"']
        lines += [f'{token},{name},{name},"{",".join(groups)}"' for token, name, groups in self.users]
        (self.workdir / "tokens.csv").write_text("\n".join(lines) + "\n")
        subprocess.run(["openssl", "genrsa", "-out", str(self.workdir / "sa.key"), "2048"], check=True,
                       capture_output=True)
        if self.audit_policy is not None:
            (self.workdir / "audit-policy.yaml").write_text(self.audit_policy)
        self.kubeconfig.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "bench",
            "clusters": [{"name": "bench", "cluster": {"server": f"https://127.0.0.1:{self.port}",
                                                       "insecure-skip-tls-verify": True}}],
            "users": [{"name": "admin", "user": {"token": ADMIN_TOKEN}}],
            "contexts": [{"name": "bench", "context": {"cluster": "bench", "user": "admin"}}]}))
        log = (self.workdir / "etcd.log").open("ab")
        self.etcd = subprocess.Popen([
            self.etcd_binary, f"--data-dir={self.workdir / 'etcd'}",
            f"--listen-client-urls=http://127.0.0.1:{self.etcd_port}",
            f"--advertise-client-urls=http://127.0.0.1:{self.etcd_port}",
            f"--listen-peer-urls=http://127.0.0.1:{self.peer_port}",
            f"--initial-advertise-peer-urls=http://127.0.0.1:{self.peer_port}",
            f"--initial-cluster=default=http://127.0.0.1:{self.peer_port}",
            "--quota-backend-bytes=8589934592"], stdout=log, stderr=log)
        self.start_apiserver()

    def start_apiserver(self, timeout: float = 120.0) -> float:
        """Start the API server; the seconds until it answered."""
        flags = [
            f"--etcd-servers=http://127.0.0.1:{self.etcd_port}", "--bind-address=127.0.0.1",
            f"--secure-port={self.port}", "--advertise-address=127.0.0.1",
            f"--token-auth-file={self.workdir / 'tokens.csv'}", "--authorization-mode=RBAC",
            f"--service-account-key-file={self.workdir / 'sa.key'}",
            f"--service-account-signing-key-file={self.workdir / 'sa.key'}",
            "--service-account-issuer=https://kubernetes.default.svc", f"--cert-dir={self.workdir / 'certs'}",
            "--service-cluster-ip-range=10.96.0.0/16",
            "--endpoint-reconciler-type=none",  # 1.24+ refuses a loopback advertise address for the Service endpoint
            *self.extra_flags]
        if self.audit_policy is not None:
            flags += [f"--audit-policy-file={self.workdir / 'audit-policy.yaml'}",
                      f"--audit-log-path={self.audit_log}", "--audit-log-format=json", "--audit-log-maxsize=0"]
        log = (self.workdir / "kube-apiserver.log").open("ab")
        started = time.monotonic()
        self.apiserver = subprocess.Popen([self.apiserver_binary, *flags], stdout=log, stderr=log)
        while not self.ready():
            if self.apiserver.poll() is not None:
                tail = (self.workdir / "kube-apiserver.log").read_text(errors="replace")[-3000:]
                raise RuntimeError(f"kube-apiserver exited {self.apiserver.returncode}:\n{tail}")
            if time.monotonic() - started > timeout:
                raise RuntimeError(f"kube-apiserver did not answer within {timeout:.0f} s")
            time.sleep(0.1)
        return time.monotonic() - started

    def ready(self) -> bool:
        """/readyz says ok (its answer is plain text: asked with curl, not the JSON client)."""
        result = subprocess.run(["curl", "-sk", "--max-time", "2", f"https://127.0.0.1:{self.port}/readyz",
                                 "-H", f"Authorization: Bearer {ADMIN_TOKEN}"], capture_output=True, text=True)
        return result.stdout.strip() == "ok"

    def stop_apiserver(self, grace: float = 30.0) -> None:
        """SIGTERM (it stops listening at once, then drains its long-running requests), SIGKILL after `grace`."""
        _stop(self.apiserver, grace)
        self.apiserver = None

    def restart(self, down_seconds: float = 0.0, grace: float = 30.0) -> float:
        """Stop the API server (SIGTERM, as a rolling control-plane update does), wait, start it again; the seconds
        from the start until it answered."""
        self.stop_apiserver(grace)
        time.sleep(down_seconds)
        return self.start_apiserver()

    def stop(self) -> None:
        _stop(self.apiserver)
        _stop(self.etcd)
        self.apiserver = self.etcd = None

    def kubectl(self, kubectl: str, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run([kubectl, f"--kubeconfig={self.kubeconfig}", *args], input=stdin, check=True,
                              capture_output=True, text=True)


def _stop(proc: subprocess.Popen[bytes] | None, grace: float = 30.0) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(grace)
    if proc.poll() is None:
        proc.kill()
        proc.wait()
