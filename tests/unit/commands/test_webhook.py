"""`ipmasq webhook` as a process: serves reviews over TLS from cert-manager-style files, stops on SIGTERM; bad
flags and a start outside a pod are one line; and neither the CLI nor the agent imports the webhook's dependencies."""

from __future__ import annotations

import datetime
import json
import signal
import socket
import ssl
import subprocess
import urllib.request
from pathlib import Path

from ipmasq.webhook.certificate import issue, service_names
from ipmasq.webhook.server import wait_listening
from tests.conftest import PYTHON
from tests.hostile.admission import configmap


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_serves_reviews_from_certificate_files_and_stops_on_sigterm(tmp_path: Path) -> None:
    made = issue(service_names("ipmasq-webhook", "kube-system"), datetime.datetime.now(datetime.UTC), 1)
    (tmp_path / "tls.crt").write_bytes(made.tls_cert)
    (tmp_path / "tls.key").write_bytes(made.tls_key)
    port = _free_port()
    process = subprocess.Popen([PYTHON, "-m", "ipmasq", "webhook", f"--listen=127.0.0.1:{port}",
                                f"--tls-cert-file={tmp_path / 'tls.crt'}", f"--tls-key-file={tmp_path / 'tls.key'}"],
                               stderr=subprocess.PIPE, text=True)
    try:
        assert wait_listening(("127.0.0.1", port), timeout=20)
        context = ssl.create_default_context(cadata=made.ca_cert.decode())
        context.check_hostname = False  # the certificate names the Service; here it is reached at 127.0.0.1
        body = json.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
            "uid": "1", "kind": {"group": "", "kind": "ConfigMap"}, "operation": "CREATE", "namespace": "kube-system",
            "object": configmap({"config": "resyncInterval: 0s\n"})}}).encode()
        request = urllib.request.Request(f"https://127.0.0.1:{port}/validate", data=body, method="POST")
        with urllib.request.urlopen(request, context=context, timeout=10) as response:
            answer = json.loads(response.read())
        assert answer["response"]["allowed"] is False and "resyncInterval" in answer["response"]["status"]["message"]
    finally:
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=20)
    assert process.returncode == 0, stderr
    assert "serving https://127.0.0.1:" in stderr and "denied CREATE of ConfigMap kube-system/ip-masq-agent" in stderr


def test_bad_flags_and_a_start_outside_a_pod_are_one_line() -> None:
    for argv, code, expected in [
        (["--listen=nowhere"], 2, "is not HOST:PORT"),
        (["--tls-cert-file=/x"], 2, "go together"),
        (["--certificate-days=0"], 2, "above zero"),
        ([], 3, "KUBERNETES_SERVICE_HOST or the service account's token is missing"),  # could not run
    ]:
        run = subprocess.run([PYTHON, "-m", "ipmasq", "webhook", *argv], capture_output=True, text=True, timeout=30,
                             env={"PATH": "/usr/bin:/bin"})
        assert run.returncode == code and expected in run.stderr, run.stderr
        assert len(run.stderr.splitlines()) == 1 and "Traceback" not in run.stderr


def test_the_agent_and_the_cli_never_import_the_webhooks_dependencies() -> None:
    probe = ("import sys\nfrom ipmasq.cli import build_parser\nimport ipmasq.agent.loop, ipmasq.commands.agent\n"
             "build_parser()\n"
             "print(sorted(m for m in sys.modules if m.startswith(('cryptography', 'ipmasq.webhook'))))")
    run = subprocess.run([PYTHON, "-c", probe], capture_output=True, text=True, check=True, timeout=60)
    assert run.stdout.strip() == "[]"
