"""The API client against a hostile HTTPS server on loopback: each test scripts what the server sends, byte by byte,
and shows the client ends in a clear error (or its own end of a watch) within its deadline and within its bounds."""

from __future__ import annotations

import json
import socket
import ssl
import subprocess
import threading
import tracemalloc
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import pytest

from ipmasq import http11
from ipmasq.errors import ApiClientError, ApiMalformed, ApiServerError, ApiUnreachable, TooManyRequests
from ipmasq.kube import client as client_module
from ipmasq.kube import objects
from ipmasq.kube.client import MAX_ANSWER_BYTES, KubeClient, RetryGate, list_items
from ipmasq.kube.credentials import Credentials, ExecPlugin
from tests.eventually import eventually

Script = Callable[[ssl.SSLSocket, bytes], None]  # the connection and the request head it read


class HostileServer:
    """A TLS server on 127.0.0.1: every request is handed to the next script queued (the last one repeats)."""

    def __init__(self, certificate: tuple[Path, Path], client_ca: Path | None = None) -> None:
        self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.context.load_cert_chain(*certificate)
        if client_ca is not None:  # a client certificate signed by this CA is required
            self.context.verify_mode = ssl.CERT_REQUIRED
            self.context.load_verify_locations(cafile=str(client_ca))
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.scripts: list[Script] = []
        self.requests: list[bytes] = []
        self.connections = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        self.listener.settimeout(0.2)
        while not self.stop.is_set():
            try:
                raw, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._connection, args=(raw,), daemon=True).start()

    def _connection(self, raw: socket.socket) -> None:
        raw.settimeout(10)
        try:
            with self.context.wrap_socket(raw, server_side=True) as sock:
                while not self.stop.is_set():
                    head = b""
                    while b"\r\n\r\n" not in head:
                        data = sock.recv(65536)
                        if not data:
                            return
                        head += data
                    self.requests.append(head)
                    script = self.scripts.pop(0) if len(self.scripts) > 1 else self.scripts[0]
                    script(sock, head)
        except (OSError, ssl.SSLError):
            pass

    def close(self) -> None:
        self.stop.set()
        self.listener.close()
        self.thread.join(5)


@pytest.fixture
def hostile(certificate: tuple[Path, Path]) -> Iterator[HostileServer]:
    server = HostileServer(certificate)
    yield server
    server.close()


def api(server: HostileServer, certificate: tuple[Path, Path], timeout: float = 2.0,
        gate: RetryGate | None = None) -> KubeClient:
    return KubeClient(Credentials(host="127.0.0.1", port=server.port, ca_file=str(certificate[0]), token="secret"),
                      timeout=timeout, gate=gate)


class FrozenClock:
    """A RetryGate's clock and sleep: time stands still but for the sleeps, each recorded with how many requests the
    server had had when it began."""

    def __init__(self, server: HostileServer) -> None:
        self.server = server
        self.now = 0.0
        self.sleeps: list[tuple[float, int]] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append((seconds, len(self.server.requests)))
        self.now += seconds


def answer(status: int, body: bytes = b"{}", extra: str = "") -> Script:
    def send(sock: ssl.SSLSocket, _head: bytes) -> None:
        sock.sendall(f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
                     f"{extra}\r\n".encode() + body)
    return send


def trickle(prefix: bytes, stop: threading.Event, every: float = 0.1, unsent: list[int] | None = None) -> Script:
    """Sends `prefix`, then one byte every `every` seconds until the client goes away or the test ends. When the
    client goes away first, how many of its 600 bytes were still to send is appended to `unsent`."""
    def send(sock: ssl.SSLSocket, _head: bytes) -> None:
        sock.sendall(prefix)
        for sent in range(600):
            if stop.wait(every):
                return
            try:
                sock.sendall(b" ")
            except OSError:
                if unsent is not None:
                    unsent.append(600 - sent)
                raise
    return send


def test_a_server_that_trickles_a_byte_at_a_time_fails_the_call_within_its_deadline(hostile, certificate) -> None:  # type: ignore[no-untyped-def]
    for prefix in (b"", b"HTTP/1.1 200 OK\r\n", b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n"):
        unsent: list[int] = []
        hostile.scripts[:] = [trickle(prefix, hostile.stop, unsent=unsent)]
        with pytest.raises(ApiUnreachable, match=r"in time|not HTTP"):
            api(hostile, certificate, timeout=1.0).get("/api/v1/nodes")
        # the client hung up while the server was still trickling: one second's deadline, not the server's pace
        eventually(unsent.__len__, "the server seeing the client go away")
        assert unsent[0] > 0


def test_a_chunk_that_announces_4_gib_is_refused_at_the_bound_without_buffering_it(hostile, certificate) -> None:  # type: ignore[no-untyped-def]
    def huge_chunk(sock: ssl.SSLSocket, _head: bytes) -> None:
        sock.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nffffffff\r\n")
        block = b"x" * 65536
        for _ in range((MAX_ANSWER_BYTES >> 16) + 64):
            sock.sendall(block)
    hostile.scripts[:] = [huge_chunk]
    client = api(hostile, certificate, timeout=20.0)
    tracemalloc.start()
    try:
        with pytest.raises(ApiUnreachable, match="more than"):
            client.get("/api/v1/nodes")
        _now, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 3 * MAX_ANSWER_BYTES  # the answer up to its bound (joined once), never the 4 GiB announced


def test_a_long_line_in_small_chunks_is_read_and_one_byte_chunks_are_refused_at_once(hostile, certificate) -> None:  # type: ignore[no-untyped-def]
    event = json.dumps({"type": "ADDED", "object": {"metadata": {"name": "x" * 600_000}}}).encode() + b"\n"

    def chunks_of(size: int) -> Script:
        # made before the client asks: building 600,000 chunks takes the server seconds on a busy machine
        body = b"".join(f"{len(event[i:i + size]):x}\r\n".encode() + event[i:i + size] + b"\r\n"
                        for i in range(0, len(event), size))

        def send(sock: ssl.SSLSocket, _head: bytes) -> None:
            sock.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + body + b"0\r\n\r\n")
        return send
    hostile.scripts[:] = [chunks_of(64)]  # ten thousand chunks to one line: read in linear time
    events = list(api(hostile, certificate).watch("/api/v1/configmaps", query={}))
    assert len(events) == 1 and events[0].object["metadata"]["name"] == "x" * 600_000
    hostile.scripts[:] = [chunks_of(1)]  # a CPU sink (h11 spends microseconds on every chunk): refused early
    with pytest.raises(ApiUnreachable, match=r"chunks of 1\.0 bytes on average"):
        list(api(hostile, certificate, timeout=20.0).watch("/api/v1/configmaps", query={}))

    def endless_line(sock: ssl.SSLSocket, _head: bytes) -> None:
        sock.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        block = b"x" * 65536
        for _ in range((MAX_ANSWER_BYTES >> 16) + 64):
            sock.sendall(b"10000\r\n" + block + b"\r\n")
    hostile.scripts[:] = [endless_line]
    with pytest.raises(ApiUnreachable, match="more than"):
        list(api(hostile, certificate, timeout=20.0).watch("/api/v1/configmaps", query={}))


def test_a_watch_ends_on_the_clients_own_deadline(hostile, certificate, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(client_module, "WATCH_GRACE", 0.5)
    keepalive = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    unsent: list[int] = []
    hostile.scripts[:] = [lambda sock, head: trickle(keepalive, hostile.stop, unsent=unsent)(sock, head)]
    events = list(api(hostile, certificate).watch("/api/v1/configmaps", query={}, timeout_seconds=1))
    assert events == []
    # the watch ended while the server still kept the stream open: the client's deadline ended it, not the server
    eventually(unsent.__len__, "the server seeing the client go away")
    assert unsent[0] > 0


def test_a_redirect_is_an_error_and_is_not_followed(hostile, certificate) -> None:  # type: ignore[no-untyped-def]
    for status in (301, 302, 307, 308, 304):
        hostile.requests.clear()
        hostile.scripts[:] = [answer(status, b"", "Location: https://127.0.0.2/steal\r\n")]
        with pytest.raises(ApiClientError) as raised:
            api(hostile, certificate).get("/api/v1/nodes")
        assert raised.value.status == status and "not followed" in str(raised.value)
        assert len(hostile.requests) == 1


def test_retry_after_is_waited_out_and_shared_by_every_thread(hostile, certificate) -> None:  # type: ignore[no-untyped-def]
    hostile.scripts[:] = [answer(429, b'{"kind":"Status","code":429,"reason":"TooManyRequests","message":"slow"}',
                                 "Retry-After: 1\r\n"),
                          answer(200, b'{"kind":"NodeList"}')]
    frozen = FrozenClock(hostile)
    client = api(hostile, certificate, timeout=5.0, gate=RetryGate(frozen.clock, frozen.sleep))
    assert client.get("/api/v1/nodes") == {"kind": "NodeList"}
    # one sleep, of the second asked (jittered up to a quarter more), between the 429 and the request that got 200
    assert len(frozen.sleeps) == 1 and 1.0 <= frozen.sleeps[0][0] <= 1.25 and frozen.sleeps[0][1] == 1
    assert len(hostile.requests) == 2
    # another thread of the same agent, asking meanwhile, waits out the same Retry-After
    frozen = FrozenClock(hostile)
    gate = RetryGate(frozen.clock, frozen.sleep)
    gate.hold(1.0)
    shared = KubeClient(client.credentials, timeout=5.0, gate=gate)
    assert shared.get("/api/v1/nodes") == {"kind": "NodeList"}
    assert len(frozen.sleeps) == 1 and 1.0 <= frozen.sleeps[0][0] <= 1.25 and frozen.sleeps[0][1] == 2
    assert len(hostile.requests) == 3  # asked once, after the sleep


def test_a_retry_after_past_the_deadline_is_the_error_with_the_apis_status(hostile, certificate) -> None:  # type: ignore[no-untyped-def]
    hostile.scripts[:] = [answer(503, b'{"kind":"Status","code":503,"reason":"ServiceUnavailable","message":"busy"}',
                                 "Retry-After: 20\r\n")]
    frozen = FrozenClock(hostile)
    with pytest.raises(ApiServerError) as raised:
        api(hostile, certificate, timeout=1.0, gate=RetryGate(frozen.clock, frozen.sleep)).get("/api/v1/nodes")
    assert frozen.sleeps == [] and len(hostile.requests) == 1  # not waited out, not asked again: the error at once
    assert raised.value.status == 503 and raised.value.reason == "ServiceUnavailable"
    assert raised.value.retry_after == 20.0
    hostile.scripts[:] = [answer(429, b'{"kind":"Status","code":429,"message":"later"}', "Retry-After: 20\r\n")]
    with pytest.raises(TooManyRequests):
        api(hostile, certificate, timeout=1.0).get("/api/v1/nodes")


def test_one_kept_alive_connection_serves_call_after_call(hostile, certificate) -> None:  # type: ignore[no-untyped-def]
    hostile.scripts[:] = [answer(200, b'{"kind":"NodeList"}')]
    client = api(hostile, certificate)
    for _ in range(5):
        assert client.get("/api/v1/nodes") == {"kind": "NodeList"}
    assert hostile.connections == 1 and len(hostile.requests) == 5
    assert all(b"Authorization: Bearer secret" in request for request in hostile.requests)


def test_garbage_and_early_closes_are_one_line_errors(hostile, certificate) -> None:  # type: ignore[no-untyped-def]
    def close_at_once(sock: ssl.SSLSocket, _head: bytes) -> None:
        sock.close()
    for script in (answer(200, b"{}", "Content-Length: 3\r\n"), close_at_once,
                   lambda sock, head: sock.sendall(b"SSH-2.0-OpenSSH\r\n\r\n"),
                   lambda sock, head: sock.sendall(b"HTTP/1.1 200 OK\r\n" + b"X: y\r\n" * 20_000 + b"\r\n")):
        hostile.scripts[:] = [script]
        with pytest.raises(ApiUnreachable) as raised:
            api(hostile, certificate).get("/api/v1/nodes")
        assert "\n" not in str(raised.value) and len(str(raised.value)) < 300


def make_certificate(directory: Path, name: str, san: str) -> tuple[Path, Path]:
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out",
                    f"{name}.pem", "-days", "1", "-subj", f"/CN={name}", "-addext", f"subjectAltName={san}"],
                   cwd=directory, check=True, capture_output=True)
    return directory / f"{name}.pem", directory / f"{name}.key"


def test_tls_server_name_is_what_the_certificate_is_checked_against(tmp_path: Path) -> None:
    named = make_certificate(tmp_path, "api", "DNS:api.internal")  # no IP in it: 127.0.0.1 alone would not match
    server = HostileServer(named)
    try:
        server.scripts[:] = [answer(200, b'{"kind":"NodeList"}')]
        plain = Credentials(host="127.0.0.1", port=server.port, ca_file=str(named[0]))
        with pytest.raises(ApiUnreachable, match="CERTIFICATE_VERIFY_FAILED"):
            KubeClient(plain, timeout=2).get("/api/v1/nodes")
        renamed = Credentials(host="127.0.0.1", port=server.port, ca_file=str(named[0]),
                              tls_server_name="api.internal")
        assert KubeClient(renamed, timeout=2).get("/api/v1/nodes") == {"kind": "NodeList"}
    finally:
        server.close()


def test_the_api_server_is_reached_through_an_http_proxys_tunnel(hostile, certificate) -> None:  # type: ignore[no-untyped-def]
    asked: list[bytes] = []
    proxy = socket.create_server(("127.0.0.1", 0))

    def pipe(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            sink.close()

    def tunnel() -> None:
        client_side, _ = proxy.accept()
        head = b""
        while b"\r\n\r\n" not in head:
            head += client_side.recv(4096)
        asked.append(head.split(b"\r\n", 1)[0])
        upstream = socket.create_connection(("127.0.0.1", hostile.port))
        client_side.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
        threading.Thread(target=pipe, args=(upstream, client_side), daemon=True).start()
        pipe(client_side, upstream)

    threading.Thread(target=tunnel, daemon=True).start()
    hostile.scripts[:] = [answer(200, b'{"kind":"NodeList"}')]
    credentials = Credentials(host="127.0.0.1", port=hostile.port, ca_file=str(certificate[0]), token="secret",
                              proxy_url=f"http://127.0.0.1:{proxy.getsockname()[1]}")
    try:
        assert KubeClient(credentials, timeout=5).get("/api/v1/nodes") == {"kind": "NodeList"}
    finally:
        proxy.close()
    assert asked == [f"CONNECT 127.0.0.1:{hostile.port} HTTP/1.1".encode()]
    assert all(b"CONNECT" not in request for request in hostile.requests)  # the API server sees only the request


def test_an_exec_plugins_client_certificate_is_presented(tmp_path: Path, certificate) -> None:  # type: ignore[no-untyped-def]
    user_cert, user_key = make_certificate(tmp_path, "user", "DNS:user")
    server = HostileServer(certificate, client_ca=user_cert)
    credential = {"apiVersion": "client.authentication.k8s.io/v1", "kind": "ExecCredential",
                  "status": {"clientCertificateData": user_cert.read_text(), "clientKeyData": user_key.read_text()}}
    plugin = tmp_path / "plugin"
    plugin.write_text(f"#!/bin/sh\ncat <<'EOF'\n{json.dumps(credential)}\nEOF\n")
    plugin.chmod(0o700)
    try:
        server.scripts[:] = [answer(200, b'{"kind":"NodeList"}')]
        credentials = Credentials(host="127.0.0.1", port=server.port, ca_file=str(certificate[0]),
                                  exec_plugin=ExecPlugin(command=str(plugin),
                                                         api_version="client.authentication.k8s.io/v1",
                                                         interactive_mode="Never"))
        assert KubeClient(credentials, timeout=5).get("/api/v1/nodes") == {"kind": "NodeList"}
        assert all(b"Authorization" not in request for request in server.requests)  # a certificate, no token
    finally:
        server.close()


def test_ipmasq_status_logs_in_through_an_exec_plugin_from_a_merged_kubeconfig(
        hostile, certificate, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,  # type: ignore[no-untyped-def]
        capsys: pytest.CaptureFixture[str]) -> None:
    from ipmasq.cli import main

    plugin = tmp_path / "gke-gcloud-auth-plugin"
    plugin.write_text('#!/bin/sh\necho \'{"apiVersion":"client.authentication.k8s.io/v1beta1",'
                      '"kind":"ExecCredential","status":{"token":"from-the-plugin"}}\'\n')
    plugin.chmod(0o700)
    users = tmp_path / "users"
    users.write_text(json.dumps({"users": [{"name": "gke", "user": {"exec": {
        "apiVersion": "client.authentication.k8s.io/v1beta1", "command": str(plugin),
        "interactiveMode": "Never", "installHint": "gcloud components install gke-gcloud-auth-plugin"}}}]}))
    clusters = tmp_path / "clusters"
    clusters.write_text(json.dumps({
        "current-context": "gke", "contexts": [{"name": "gke", "context": {"cluster": "gke", "user": "gke"}}],
        "clusters": [{"name": "gke", "cluster": {"server": f"https://127.0.0.1:{hostile.port}",
                                                 "certificate-authority": str(certificate[0])}}]}))
    monkeypatch.setenv("KUBECONFIG", f"{clusters}:{users}")
    hostile.scripts[:] = [answer(200, b'{"kind":"List","items":[]}')]
    code = main(["status", "-o", "json"])
    assert code in (0, 1)  # an answer about the fleet: no usage error, no traceback
    json.loads(capsys.readouterr().out)
    assert hostile.requests and all(b"Authorization: Bearer from-the-plugin" in r for r in hostile.requests)
    assert hostile.connections == 1  # one kept-alive connection for every call of the command


def test_retry_after_is_ascii_digits_or_an_http_date_and_bounded() -> None:
    def head(value: str, status: int = 429) -> http11.Head:
        return http11.Head(status, {"retry-after": value})
    at = 1_700_000_000.0  # the wall clock an HTTP-date is measured from, injected
    cases = {"7": 7.0, " 12 ": 12.0, "99999999999999999999": 30.0, "\u00b2": 1.0, "\u0663": 1.0, "1\u00b2": 1.0,
             "Tue, 14 Nov 2023 22:13:30 GMT": 10.0, "Tue, 14 Nov 2023 22:13:10 GMT": 0.0,
             "Tue, 14 Nov 2023 23:13:20 GMT": 30.0, "Tue, 14 Nov 99999 22:13:30 GMT": 1.0, "soon": 1.0,
             "Tue, 14 Nov 2023 22:13:30": 1.0, "x" * 10_000: 1.0}
    for value, wait in cases.items():
        assert client_module._retry_after(head(value), now=lambda: at) == wait, value
    assert client_module._retry_after(head("\u00b2", 503)) == 1.0
    assert client_module._retry_after(head("", 503)) is None


def test_a_retry_after_of_unicode_digits_is_a_refusal_not_a_traceback(hostile, certificate) -> None:  # type: ignore[no-untyped-def]
    def superscript(sock: ssl.SSLSocket, _head: bytes) -> None:
        body = b'{"kind":"Status","code":429,"message":"later"}'
        sock.sendall(b"HTTP/1.1 429 X\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
                     b"Retry-After: \xb2\r\n\r\n%s" % (len(body), body))
    hostile.scripts[:] = [superscript]
    with pytest.raises(TooManyRequests) as raised:
        api(hostile, certificate, timeout=0.5).get("/api/v1/nodes")
    assert raised.value.retry_after == 1.0


class EndlessLister:
    """An ApiClient whose every list page says there is more (a new continue token each time, or the same)."""

    def __init__(self, items: list[object], *, same_token: bool = False) -> None:
        self.items, self.same_token, self.pages = items, same_token, 0

    def get(self, path: str, *, query: Mapping[str, str] | None = None) -> dict[str, object]:
        self.pages += 1
        token = "again" if self.same_token else f"page-{self.pages}"
        return {"kind": "List", "metadata": {"continue": token, "resourceVersion": "7"}, "items": self.items}


def node_item(name: str) -> dict[str, object]:
    return {"metadata": {"name": name, "uid": f"uid-{name}"}}


def test_a_list_whose_continue_never_ends_stops_at_its_bound_in_pages_or_bytes() -> None:
    endless = EndlessLister([node_item("a")])
    with pytest.raises(ApiMalformed, match="more than 50 pages") as raised:
        list_items(endless, "/api/v1/nodes", objects.node, max_pages=50)  # type: ignore[arg-type]
    assert endless.pages == 50 and "\n" not in str(raised.value)
    heavy = EndlessLister([node_item("n" * 1000)] * 100)  # about 100 KB a page
    with pytest.raises(ApiMalformed, match="more than 1 MiB"):
        list_items(heavy, "/api/v1/nodes", objects.node, max_bytes=1 << 20)  # type: ignore[arg-type]
    assert heavy.pages <= 11
    again = EndlessLister([node_item("a")], same_token=True)
    with pytest.raises(ApiMalformed, match="continue token it was given"):
        list_items(again, "/api/v1/nodes", objects.node)  # type: ignore[arg-type]
    assert again.pages == 2


def test_the_real_client_counts_a_lists_bytes_as_they_came_over_the_wire(hostile, certificate) -> None:  # type: ignore[no-untyped-def]
    page = json.dumps({"kind": "NodeList", "metadata": {"continue": "more"},
                       "items": [node_item(f"node-{i:05}") for i in range(2000)]}).encode()
    tokens = iter(range(10**6))

    def endless(sock: ssl.SSLSocket, _head: bytes) -> None:
        body = page.replace(b'"more"', b'"more-%d"' % next(tokens))
        sock.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                     % (len(body), body))
    hostile.scripts[:] = [endless]
    with pytest.raises(ApiMalformed, match="more than 1 MiB"):
        list_items(api(hostile, certificate), "/api/v1/nodes", objects.node, max_bytes=1 << 20)
    assert len(hostile.requests) == -(-(1 << 20) // len(page)) + ((1 << 20) % len(page) == 0)


def test_a_list_of_the_wrong_shape_is_one_line_naming_the_field() -> None:
    class Once:
        def __init__(self, answer: dict[str, object]) -> None:
            self.answer = answer

        def get(self, path: str, *, query: Mapping[str, str] | None = None) -> dict[str, object]:
            return self.answer
    wrong = {"items": [node_item("a"), {"metadata": {"name": 5}}]}
    with pytest.raises(ApiMalformed, match=r"GET /api/v1/nodes: items\[1\]\.metadata\.name is not a string"):
        list_items(Once(wrong), "/api/v1/nodes", objects.node)  # type: ignore[arg-type]
    for answer, field in (({"items": "x"}, "items is not a list"), ({"items": [7]}, r"items\[0\] is not an object"),
                          ({"metadata": [], "items": []}, "metadata is not an object"),
                          ({"metadata": {"continue": 5}}, r"metadata\.continue is not a string"),
                          ({"items": [{"metadata": {}}]}, r"items\[0\]\.metadata\.name is missing")):
        with pytest.raises(ApiMalformed, match=field) as raised:
            list_items(Once(answer), "/api/v1/nodes", objects.node)  # type: ignore[arg-type]
        assert "\n" not in str(raised.value)
    listing = list_items(Once({"metadata": {"resourceVersion": "9"}, "items": [node_item("a")]}), "/api/v1/nodes",
                         objects.node)  # type: ignore[arg-type]
    assert listing.items == [node_item("a")] and listing.resource_version == "9"


def test_ipmasq_status_says_one_line_for_list_items_of_the_wrong_shape(  # type: ignore[no-untyped-def]
        hostile, certificate, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from ipmasq.cli import main

    config = tmp_path / "config"
    config.write_text(json.dumps({
        "current-context": "c", "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "clusters": [{"name": "c", "cluster": {"server": f"https://127.0.0.1:{hostile.port}",
                                               "certificate-authority": str(certificate[0])}}]}))
    for items in ([5], [{"metadata": "x"}], [{"metadata": {"name": ["a"]}}], [{"spec": {"nodeName": 3}}]):
        hostile.scripts[:] = [answer(404, b'{"kind":"Status","code":404}'),
                              answer(200, json.dumps({"kind": "List", "items": items}).encode())]
        assert main(["status", "--kubeconfig", str(config)]) == 3  # the API server answered nonsense: could not run
        err = capsys.readouterr().err
        assert err.startswith("ipmasq status: the API server: GET ") and "not an answer the API server sends" in err
        assert err.count("\n") == 1 and "Traceback" not in err
