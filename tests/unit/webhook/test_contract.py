"""What the webhook's server relies on from h11 and ssl, each held here so that a release that changes it fails
this test, not a hostile peer's request in a cluster (pyproject.toml bounds h11's version around what is tested)."""

from __future__ import annotations

import contextlib
import re
import ssl
import tomllib
from importlib.metadata import version
from pathlib import Path

import h11
import pytest

from ipmasq.webhook.certificate import CertificateSet


def _bound(package: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    project = tomllib.loads((Path(__file__).parents[3] / "pyproject.toml").read_text())
    (spec,) = [d for d in project["project"]["dependencies"] if re.match(rf"{package}\b", d)]
    low, high = re.fullmatch(rf"{package}>=([\d.]+),<([\d.]+)", spec).groups()  # type: ignore[union-attr]
    return tuple(map(int, low.split("."))), tuple(map(int, high.split(".")))


def test_the_installed_h11_is_inside_the_bound_pyproject_gives() -> None:
    low, high = _bound("h11")
    installed = tuple(int(part) for part in version("h11").split(".")[:2])
    assert low <= installed < high


def _events(connection: h11.Connection) -> list[object]:
    out = []
    while (event := connection.next_event()) not in (h11.NEED_DATA, h11.PAUSED):
        out.append(event)
    return out


def test_h11_bounds_a_head_by_max_incomplete_event_size() -> None:
    connection = h11.Connection(h11.SERVER, max_incomplete_event_size=1024)
    connection.receive_data(b"POST /validate HTTP/1.1\r\n" + b"X-Slow: 1\r\n" * 200)
    with pytest.raises(h11.RemoteProtocolError) as caught:
        connection.next_event()
    assert caught.value.error_status_hint == 431


def test_h11_hands_both_framings_to_the_server_which_must_refuse_them() -> None:
    """h11 frames a request with both Content-Length and chunked by the chunks: the server sees both headers and
    refuses (else a body past MAX_BODY_BYTES came in under a small Content-Length)."""
    connection = h11.Connection(h11.SERVER)
    connection.receive_data(b"POST /validate HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n"
                            b"Transfer-Encoding: chunked\r\n\r\n")
    (request,) = _events(connection)
    assert isinstance(request, h11.Request)
    names = {name for name, _ in request.headers}
    assert {b"content-length", b"transfer-encoding"} <= names


def test_h11_pauses_at_a_pipelined_request_and_keeps_its_bytes() -> None:
    connection = h11.Connection(h11.SERVER)
    connection.receive_data(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\nGET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    first = _events(connection)
    assert [type(e) for e in first] == [h11.Request, h11.EndOfMessage]
    assert connection.next_event() is h11.PAUSED and connection.trailing_data[0].startswith(b"GET /healthz")
    connection.send(h11.Response(status_code=200, headers=[(b"content-length", b"0")]))
    connection.send(h11.EndOfMessage())
    connection.start_next_cycle()
    assert isinstance(connection.next_event(), h11.Request)


def test_h11_gives_a_chunked_body_as_data_events_the_server_counts() -> None:
    connection = h11.Connection(h11.SERVER)
    connection.receive_data(b"POST /validate HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                            b"5\r\nhello\r\n0\r\n\r\n")
    events = _events(connection)
    assert [type(e) for e in events] == [h11.Request, h11.Data, h11.EndOfMessage]
    assert events[1].data == b"hello"  # type: ignore[attr-defined]


def test_a_server_side_tls_handshake_runs_over_memory_bios(certificate: CertificateSet) -> None:
    """ssl's memory BIOs, as the server uses them: no socket, the records handed in and out by the caller."""
    from ipmasq.memory_file import memory_file

    server_context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    with memory_file(certificate.tls_cert) as cert, memory_file(certificate.tls_key) as key:
        server_context.load_cert_chain(cert, key)
    client_context = ssl.create_default_context(cadata=certificate.ca_bundle.decode())
    s_in, s_out, c_in, c_out = (ssl.MemoryBIO() for _ in range(4))
    server = server_context.wrap_bio(s_in, s_out, server_side=True)
    client = client_context.wrap_bio(c_in, c_out, server_hostname="ipmasq-webhook.kube-system.svc")
    finished: set[str] = set()
    for _ in range(10):
        for name, end, incoming, peer_out in (("client", client, c_in, s_out), ("server", server, s_in, c_out)):
            incoming.write(peer_out.read())
            if name not in finished:
                with contextlib.suppress(ssl.SSLWantReadError):
                    end.do_handshake()
                    finished.add(name)
    assert finished == {"server", "client"}
    client.write(b"ping")
    s_in.write(c_out.read())
    assert server.read(16 * 1024) == b"ping"
