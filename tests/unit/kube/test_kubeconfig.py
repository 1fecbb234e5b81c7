"""Kubeconfigs read as kubectl reads them: KUBECONFIG's files merged, contexts, exec credential plugins (their
expiry honoured), tls-server-name, key material kept in memory."""

from __future__ import annotations

import base64
import datetime
import json
import os
import stat
import subprocess
import tempfile
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from ipmasq.errors import ApiError
from ipmasq.kube import auth as auth_module
from ipmasq.kube.auth import Auth, ssl_context
from ipmasq.kube.kubeconfig import load


def write(path: Path, config: dict[str, object]) -> Path:
    path.write_text(json.dumps(config))
    return path


def one(name: str, server: str, user: dict[str, object], current: str | None = None) -> dict[str, object]:
    return {"current-context": current or name,
            "contexts": [{"name": name, "context": {"cluster": name, "user": name}}],
            "clusters": [{"name": name, "cluster": {"server": server}}],
            "users": [{"name": name, "user": user}]}


def plugin(tmp_path: Path, body: str, name: str = "plugin") -> Path:
    script = tmp_path / name
    script.write_text("#!/bin/sh\n" + body)
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script


def test_kubeconfig_files_merge_first_one_wins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = write(tmp_path / "a", one("a", "https://10.0.0.1:6443", {"token": "ta"}))
    second = write(tmp_path / "b", {**one("b", "https://10.0.0.2", {"token": "tb"}, current="b"),
                                    "clusters": [{"name": "a", "cluster": {"server": "https://shadowed"}},
                                                 {"name": "b", "cluster": {"server": "https://10.0.0.2",
                                                                           "tls-server-name": "api.internal"}}]})
    monkeypatch.setenv("KUBECONFIG", os.pathsep.join([str(tmp_path / "missing"), str(first), str(second)]))
    current = load()
    assert (current.host, current.port, current.token) == ("10.0.0.1", 6443, "ta")  # a's current-context, a's cluster
    other = load(context="b")
    assert (other.host, other.port, other.token, other.tls_server_name) == ("10.0.0.2", 443, "tb", "api.internal")
    with pytest.raises(ApiError, match="no context named 'c'"):
        load(context="c")
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "none"))
    with pytest.raises(ApiError, match="no kubeconfig there"):
        load()


def test_relative_paths_are_relative_to_the_file_that_named_them(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    config = write(tmp_path / "sub" / "config", one("a", "https://h", {"tokenFile": "token", "client-certificate":
                                                                       "c.pem", "client-key": "k.pem"}))
    found = load(str(config))
    assert found.token_file == str(tmp_path / "sub" / "token")
    assert (found.client_cert_file, found.client_key_file) == (str(tmp_path / "sub" / "c.pem"),
                                                               str(tmp_path / "sub" / "k.pem"))


def test_client_key_data_is_loaded_without_a_file_on_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "key.pem", "-out",
                    "cert.pem", "-days", "1", "-subj", "/CN=user"], cwd=tmp_path, check=True, capture_output=True)
    cert, key = (tmp_path / "cert.pem").read_bytes(), (tmp_path / "key.pem").read_bytes()
    config = write(tmp_path / "config", one("a", "https://127.0.0.1:1", {
        "client-certificate-data": base64.b64encode(cert).decode(),
        "client-key-data": base64.b64encode(key).decode()}))
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    credentials = load(str(config))
    assert credentials.client_key_data == key.decode() and credentials.client_key_file is None
    ssl_context(credentials)  # loads the pair (it fails loudly when it cannot)
    assert list(scratch.iterdir()) == []
    assert "PRIVATE KEY" not in repr(credentials)


def test_an_exec_plugin_gives_the_token_and_is_run_again_when_it_expires(tmp_path: Path) -> None:
    calls = tmp_path / "calls"
    soon = (datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=30)).strftime("%Y-%m-%dT%H:%M:%SZ")
    script = plugin(tmp_path, f"""echo run >> {calls}
echo "$KUBERNETES_EXEC_INFO" > {tmp_path}/info
echo '{{"apiVersion":"client.authentication.k8s.io/v1","kind":"ExecCredential",
       "status":{{"token":"tok-'$(wc -l < {calls})'","expirationTimestamp":"{soon}"}}}}'
""")
    config = write(tmp_path / "config", one("gke", "https://10.0.0.1", {"exec": {
        "apiVersion": "client.authentication.k8s.io/v1", "command": str(script), "interactiveMode": "Never",
        "provideClusterInfo": True, "env": [{"name": "X", "value": "1"}]}}))
    auth = Auth(load(str(config)))
    assert auth.token() == "tok-1"
    info = json.loads((tmp_path / "info").read_text())
    assert info["spec"]["interactive"] is False and info["spec"]["cluster"]["server"] == "https://10.0.0.1"
    # expiring within the minute's margin: run again for the next request
    assert auth.token() == "tok-2"
    assert auth.token(reread=True) == "tok-3"  # after a 401


def test_exec_plugins_that_fail_are_one_line_errors(tmp_path: Path) -> None:
    cases = {
        "missing": ({"command": "no-such-auth-plugin", "installHint": "install it with gcloud components"},
                    "not installed.*gcloud components"),
        "fails": ({"command": str(plugin(tmp_path, "echo denied >&2; exit 3", "fails"))}, "exit 3"),
        "garbage": ({"command": str(plugin(tmp_path, "echo '<html>'", "garbage"))}, "not an ExecCredential"),
        "empty": ({"command": str(plugin(tmp_path, """echo '{"apiVersion":"client.authentication.k8s.io/v1beta1",
"kind":"ExecCredential","status":{}}'""", "empty"))}, "neither a token"),
        "wrong": ({"command": str(plugin(tmp_path, """echo '{"apiVersion":"client.authentication.k8s.io/v1",
"kind":"ExecCredential","status":{"token":"t"}}'""", "wrong"))}, "asked for"),
    }
    for name, (exec_config, message) in cases.items():
        config = write(tmp_path / f"{name}.yaml", one("a", "https://h", {"exec": {
            "apiVersion": "client.authentication.k8s.io/v1beta1", **exec_config}}))
        with pytest.raises(ApiError, match=message) as raised:
            Auth(load(str(config))).token()
        assert "\n" not in str(raised.value)
    old = write(tmp_path / "alpha.yaml", one("a", "https://h", {"exec": {
        "apiVersion": "client.authentication.k8s.io/v1alpha1", "command": "x"}}))
    with pytest.raises(ApiError, match="v1alpha1"):
        load(str(old))
    provider = write(tmp_path / "provider.yaml", one("a", "https://h", {"auth-provider": {"name": "gcp"}}))
    with pytest.raises(ApiError, match="exec plugin"):
        load(str(provider))


def test_an_exec_plugin_that_never_answers_is_cut_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = write(tmp_path / "config", one("a", "https://h", {"exec": {
        "apiVersion": "client.authentication.k8s.io/v1", "interactiveMode": "Never",
        "command": str(plugin(tmp_path, "exec sleep 30"))}}))
    monkeypatch.setattr(auth_module, "EXEC_SECONDS", 0.5)
    credentials = load(str(config))
    with pytest.raises(ApiError, match="no credential within"):
        auth_module.run_exec_plugin(credentials.exec_plugin, timeout=0.5)  # type: ignore[arg-type]


def test_what_lightkube_reads_from_one_kubeconfig_we_read_the_same(tmp_path: Path) -> None:
    """lightkube (a well-kept client) as the oracle for what both read: contexts, servers, tokens, CA data."""
    from lightkube.config.kubeconfig import KubeConfig

    ca = base64.b64encode(b"-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n").decode()
    config = write(tmp_path / "config", {
        "current-context": "prod",
        "contexts": [{"name": "prod", "context": {"cluster": "p", "user": "admin"}},
                     {"name": "dev", "context": {"cluster": "d", "user": "dev"}}],
        "clusters": [{"name": "p", "cluster": {"server": "https://203.0.113.10:6443",
                                               "certificate-authority-data": ca}},
                     {"name": "d", "cluster": {"server": "https://[2001:db8::1]", "insecure-skip-tls-verify": True}}],
        "users": [{"name": "admin", "user": {"token": "t-admin"}}, {"name": "dev", "user": {"tokenFile": "tok"}}]})
    oracle = KubeConfig.from_file(config)
    for context in ("prod", "dev", None):
        theirs = oracle.get(context)
        assert theirs is not None and theirs.user is not None
        ours = load(str(config), context=context)
        server = urlsplit(theirs.cluster.server)
        assert (ours.host.strip("[]"), ours.port) == (server.hostname, server.port or 443)
        assert ours.insecure == theirs.cluster.insecure
        assert ours.token == theirs.user.token
        assert (ours.token_file is None) == (theirs.user.token_file is None)
        assert ours.ca_data == (base64.b64decode(theirs.cluster.certificate_auth_data).decode()
                                if theirs.cluster.certificate_auth_data else None)


def test_a_kubeconfig_that_is_no_file_is_one_line_not_a_wait(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for path in (str(fifo), "/dev/zero", str(tmp_path)):
        with pytest.raises(ApiError, match="cannot read the kubeconfig") as raised:
            load(path)
        assert "\n" not in str(raised.value)
    monkeypatch.setenv("KUBECONFIG", f"{fifo}:/dev/zero")
    with pytest.raises(ApiError, match="cannot read the kubeconfig"):
        load()
    for hostile in ("clusters: 5\n", "current-context: [1]\ncontexts: []\nclusters: []\n", "a: &a [*a]\n",
                    "[" * 10_000, json.dumps(one("a", "https://h:99999", {"token": "t"})),
                    json.dumps(one("a", "https://h", {"exec": {"apiVersion": "client.authentication.k8s.io/v1",
                                                               "command": "x", "env": "X=1"}}))):
        config = tmp_path / "hostile"
        config.write_text(hostile)
        with pytest.raises(ApiError) as raised:
            load(str(config))
        assert str(raised.value).startswith(str(config)) and "\n" not in str(raised.value)
