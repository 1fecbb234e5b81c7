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
import tracemalloc
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


def alias_bomb(levels: int = 9) -> str:
    """A few hundred bytes of nested YAML aliases that stand for 9**levels values."""
    lines = ['a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for level in range(1, levels):
        lines.append(f"a{level}: &a{level} [" + ",".join([f"*a{level - 1}"] * 9) + "]")
    return "\n".join(lines) + f"\ncurrent-context: *a{levels - 1}\n"


def test_a_kubeconfig_alias_bomb_is_one_line_within_a_small_memory(tmp_path: Path) -> None:
    config = tmp_path / "bomb"
    config.write_text(alias_bomb())
    assert config.stat().st_size < 700
    tracemalloc.start()
    try:
        with pytest.raises(ApiError, match="YAML aliases repeat more than 10,000 values") as raised:
            load(str(config))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert "\n" not in str(raised.value) and str(raised.value).startswith(str(config))
    assert peak < 20 << 20  # it went past 1 GiB (and a MemoryError) when every alias was expanded


def test_a_few_aliases_still_load_as_kubectl_loads_them_and_a_cycle_is_refused(tmp_path: Path) -> None:
    config = tmp_path / "config"
    config.write_text("current-context: a\n"
                      "contexts: [{name: a, context: &ctx {cluster: a, user: a}}, {name: b, context: *ctx}]\n"
                      "clusters: [{name: a, cluster: &server {server: 'https://10.0.0.1:6443'}}]\n"
                      "users: [{name: a, user: {token: t}}, {name: b, user: {token: u}}]\n"
                      "extensions: [*server, *server, *server]\n")
    assert load(str(config)).host == "10.0.0.1"
    config.write_text("current-context: a\nclusters: &loop [{name: a, cluster: *loop}]\n")
    with pytest.raises(ApiError, match="refers to the value that contains it"):
        load(str(config))


def test_every_credential_file_is_read_bounded_and_never_waited_on(tmp_path: Path) -> None:
    """A FIFO (nobody writes to it: a wait for ever) or /dev/zero (endless: GiBs) as the token, CA, certificate or
    key file is one line naming the file, before any connection is made."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=x"], check=True,
                   capture_output=True)
    big = tmp_path / "big"
    with open(big, "wb") as fh:
        fh.truncate(64 << 20)  # sparse: a regular file over every bound
    for hostile in (str(fifo), "/dev/zero", str(big)):
        cases = {"the token file": {"tokenFile": hostile},
                 "the client certificate": {"client-certificate": hostile, "client-key": str(key)},
                 "the client key": {"client-certificate": str(cert), "client-key": hostile}}
        for what, user in cases.items():
            credentials = load(str(write(tmp_path / "config", one("a", "https://127.0.0.1:9", user))))
            auth = Auth(credentials)
            with pytest.raises(ApiError, match=f"cannot read {what}") as raised:
                auth.token()
                auth.context()
            assert "\n" not in str(raised.value) and hostile in str(raised.value)
        config = one("a", "https://127.0.0.1:9", {"token": "t"})
        config["clusters"] = [{"name": "a", "cluster": {"server": "https://127.0.0.1:9",
                                                        "certificate-authority": hostile}}]
        with pytest.raises(ApiError, match="cannot read the CA file"):
            ssl_context(load(str(write(tmp_path / "config", config))))


def test_a_pem_ca_file_and_a_client_certificate_from_files_still_load(tmp_path: Path) -> None:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=x"], check=True,
                   capture_output=True)
    config = one("a", "https://127.0.0.1:9", {"client-certificate": str(cert), "client-key": str(key)})
    config["clusters"] = [{"name": "a", "cluster": {"server": "https://127.0.0.1:9",
                                                    "certificate-authority": str(cert)}}]
    context = ssl_context(load(str(write(tmp_path / "config", config))))
    assert len(context.get_ca_certs()) == 1
