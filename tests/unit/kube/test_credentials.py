"""Credentials: the pod's service account (its token read again as the kubelet rotates it) or a kubeconfig."""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path

import pytest

from ipmasq.errors import ApiError
from ipmasq.kube.credentials import TokenFile, in_cluster
from ipmasq.kube.kubeconfig import load as from_kubeconfig


def test_a_rotated_token_is_read_again_and_a_vanished_one_keeps_the_last(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text("first\n")
    token = TokenFile(str(path))
    assert token.token() == "first"
    replacement = tmp_path / "token.new"
    replacement.write_text("second\n")
    os.replace(replacement, path)  # how the kubelet swaps a projected token: a new file at the path
    assert token.token() == "second"
    path.unlink()
    assert token.token() == "second"


def test_in_cluster_needs_the_service_host_and_a_token(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    assert in_cluster(str(tmp_path)) is None
    (tmp_path / "token").write_text("t")
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "fd00::1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    found = in_cluster(str(tmp_path))
    assert found is not None and found.server == "https://[fd00::1]:443"
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "https")
    with pytest.raises(ApiError, match="not a port"):
        in_cluster(str(tmp_path))


def test_a_kubeconfig_with_embedded_data_and_one_that_is_not(tmp_path: Path) -> None:
    config = tmp_path / "config"
    pem = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"
    config.write_text(json.dumps({
        "current-context": "lab", "contexts": [{"name": "lab", "context": {"cluster": "c", "user": "u"}}],
        "clusters": [{"name": "c", "cluster": {"server": "https://127.0.0.1:16443",
                                               "certificate-authority-data": base64.b64encode(pem.encode()).decode()}}],
        "users": [{"name": "u", "user": {"token": "abc"}}]}))
    found = from_kubeconfig(str(config))
    assert (found.host, found.port, found.token, found.ca_data) == ("127.0.0.1", 16443, "abc", pem)
    for broken in ("", "[]", "current-context: x\n", "{{{", json.dumps({
            "current-context": "lab", "contexts": [{"name": "lab", "context": {"cluster": "c"}}],
            "clusters": [{"name": "c", "cluster": {"server": "http://plain"}}]})):
        config.write_text(broken)
        with pytest.raises(ApiError) as error:
            from_kubeconfig(str(config))
        assert str(error.value).startswith(str(config)) and "\n" not in str(error.value)


def test_a_token_file_that_is_a_device_or_a_fifo_is_one_line_and_a_rotation_keeps_the_last(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for hostile in ("/dev/zero", str(fifo), str(tmp_path)):
        with pytest.raises(ApiError, match="cannot read the token file") as raised:
            TokenFile(hostile).token()
        assert "\n" not in str(raised.value)
    with pytest.raises(ApiError, match="cannot read the token file: No such file"):
        TokenFile(str(tmp_path / "absent")).token()
    path = tmp_path / "token"
    path.write_text("first\n")
    token = TokenFile(str(path))
    assert token.token() == "first"
    os.replace(fifo, path)  # swapped for something that is not a token: the last one read is kept
    assert token.token(reread=True) == "first"
