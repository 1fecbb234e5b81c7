"""The client's seam on a local HTTPS server: statuses become the error tree, answers are bounded, watches stream
line by line, a 401 reads a rotated token again. (The lab's tests hold it to a real API server and to lightkube.)"""

from __future__ import annotations

import http.server
import json
import ssl
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from ipmasq.errors import ApiRefused, ApiUnreachable, Conflict, Forbidden, Gone, NotFound
from ipmasq.kube.client import MAX_ANSWER_BYTES, KubeClient
from ipmasq.kube.credentials import Credentials

Handler = Callable[[http.server.BaseHTTPRequestHandler], None]


@pytest.fixture
def server(certificate: tuple[Path, Path]) -> Iterator[tuple[list[Handler], list[tuple[str, str, str]], int]]:
    """A TLS server whose answers the test queues; it records (method, path, Authorization) of every request."""
    answers: list[Handler] = []
    seen: list[tuple[str, str, str]] = []

    class Answer(http.server.BaseHTTPRequestHandler):
        def _any(self) -> None:
            seen.append((self.command, self.path, self.headers.get("Authorization", "")))
            length = int(self.headers.get("Content-Length") or 0)
            if length:
                self.rfile.read(length)
            answers.pop(0)(self)

        do_GET = do_POST = do_PATCH = _any

        def log_message(self, *args: object) -> None:
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Answer)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(*certificate)
    httpd.socket = context.wrap_socket(httpd.socket, server_side=True)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield answers, seen, httpd.server_address[1]
    httpd.shutdown()
    httpd.server_close()


def reply(status: int, body: bytes, content_type: str = "application/json") -> Handler:
    def send(handler: http.server.BaseHTTPRequestHandler) -> None:
        handler.send_response(status)
        handler.send_header("Content-Type", content_type)
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        handler.wfile.write(body)
    return send


def stream(lines: list[bytes]) -> Handler:
    def send(handler: http.server.BaseHTTPRequestHandler) -> None:
        handler.send_response(200)
        handler.send_header("Transfer-Encoding", "chunked")
        handler.end_headers()
        for line in lines:
            handler.wfile.write(f"{len(line):x}\r\n".encode() + line + b"\r\n")
        handler.wfile.write(b"0\r\n\r\n")
    return send


def client(port: int, certificate: tuple[Path, Path], **kwargs: str) -> KubeClient:
    return KubeClient(Credentials(host="127.0.0.1", port=port, ca_file=str(certificate[0]), **kwargs), timeout=5)


def status(code: int, message: str) -> bytes:
    return json.dumps({"kind": "Status", "code": code, "message": message}).encode()


def test_statuses_are_the_error_tree_with_the_servers_message(server, certificate) -> None:  # type: ignore[no-untyped-def]
    answers, _seen, port = server
    api = client(port, certificate, token="t")
    for code, error in ((403, Forbidden), (404, NotFound), (409, Conflict), (410, Gone), (500, ApiRefused)):
        answers.append(reply(code, status(code, f'configmaps "x" is {code}')))
        with pytest.raises(error) as raised:
            api.get("/api/v1/namespaces/kube-system/configmaps/x")
        assert raised.value.status == code and f'configmaps "x" is {code}' in str(raised.value)


def test_a_401_reads_the_rotated_token_and_asks_once_more(server, certificate, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    answers, seen, port = server
    token = tmp_path / "token"
    token.write_text("old")
    api = client(port, certificate, token_file=str(token))
    answers.append(lambda handler: (token.write_text("new"), reply(401, status(401, "Unauthorized"))(handler)))
    answers.append(reply(200, b'{"kind": "ConfigMap"}'))
    assert api.get("/x") == {"kind": "ConfigMap"}
    assert [auth for _m, _p, auth in seen] == ["Bearer old", "Bearer new"]


def test_answers_that_are_not_the_apis_are_one_line_errors(server, certificate) -> None:  # type: ignore[no-untyped-def]
    answers, _seen, port = server
    api = client(port, certificate)
    for body in (b"<html>proxy error</html>", b"[1, 2]", b"\xff\xfe" * 10, b"[" * 100_000):
        answers.append(reply(200, body, "text/html"))
        with pytest.raises(ApiUnreachable) as raised:
            api.get("/x")
        assert "\n" not in str(raised.value) and len(str(raised.value)) < 300
    answers.append(reply(200, b" " * (MAX_ANSWER_BYTES + 10)))
    with pytest.raises(ApiUnreachable, match="more than"):
        api.get("/x")


def test_a_watch_streams_events_and_an_error_event_is_raised(server, certificate) -> None:  # type: ignore[no-untyped-def]
    answers, seen, port = server
    api = client(port, certificate)
    cm = {"metadata": {"name": "ip-masq-agent", "resourceVersion": "7"}, "data": {"config": "a"}}
    answers.append(stream([json.dumps({"type": "MODIFIED", "object": cm}).encode() + b"\n",
                           json.dumps({"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "9"}}}).encode()
                           + b"\n",
                           json.dumps({"type": "ERROR", "object": {"kind": "Status", "code": 410,
                                                                   "message": "too old resource version"}}).encode()
                           + b"\n"]))
    events = api.watch("/api/v1/namespaces/kube-system/configmaps", query={"resourceVersion": "5"})
    assert next(events).object == cm
    assert next(events).type == "BOOKMARK"
    with pytest.raises(Gone, match="too old resource version"):
        next(events)
    assert "watch=true" in seen[0][1] and "allowWatchBookmarks=true" in seen[0][1]
    answers.append(stream([b'{"type": "ADDED"}\n']))
    with pytest.raises(ApiUnreachable, match="not a watch event"):
        list(api.watch("/x", query={}))


def test_nobody_listening_is_unreachable(certificate) -> None:  # type: ignore[no-untyped-def]
    api = client(1, certificate)
    with pytest.raises(ApiUnreachable, match=r"127\.0\.0\.1:1"):
        api.get("/x")
