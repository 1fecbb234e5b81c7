"""The peers of bench_webhook_attacks.py's connection attacks, each a process of its own inside a network namespace
(its source address): a hostile peer, and the API server's ordinary reviews. Standard library only, so that it runs
the same beside either tree. Every loop is bounded by the run's seconds.

    python bench/webhook_peers.py attack MODE HOST PORT CA COUNT SECONDS
    python bench/webhook_peers.py ordinary HOST PORT CA SECONDS

attack: COUNT connections at once, each made again 0.1 s after the server closed it (or refused it), for SECONDS:
  idle       a TLS handshake, then nothing
  slowloris  a TLS handshake, then a request head, one header line a second, never finished
  churn      a TLS handshake, then closed at once, and made again at once
  tcp        a TCP connection (no TLS), then nothing
Prints one JSON line: connects tried, handshakes done, connections the server closed, connections refused or
failed.

ordinary: the API server's reviews for SECONDS: FRESH threads each sending one review after another, each on a new
TLS connection; KEPT threads each on a connection kept alive (made before the attack, made again if it fails), a
review every KEPT_INTERVAL s. A review not answered within the API server's 5 s (timeoutSeconds) failed: admitted
unreviewed. Prints "ready" once the kept-alive connections are made and have each been answered once, then waits
for a line on stdin, then prints one JSON line of latencies and failures.
"""

from __future__ import annotations

import contextlib
import heapq
import json
import resource
import selectors
import socket
import ssl
import sys
import threading
import time
from typing import Any

SERVER_NAME = "ipmasq-webhook.kube-system.svc"
RECONNECT_SECONDS = 0.1
API_TIMEOUT_SECONDS = 5.0
FRESH = 4
KEPT = 5
KEPT_INTERVAL = 1.0
BODY = json.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
    "uid": "u-1", "kind": {"group": "", "version": "v1", "kind": "ConfigMap"}, "namespace": "kube-system",
    "name": "ip-masq-agent", "operation": "UPDATE", "userInfo": {"username": "bench"},
    "object": {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "ip-masq-agent",
                                                                     "namespace": "kube-system"},
               "data": {"config": "nonMasqueradeCIDRs: [10.0.0.0/8]\n"}}}}).encode()
REQUEST = (f"POST /validate?timeout=5s HTTP/1.1\r\nHost: {SERVER_NAME}\r\nContent-Type: application/json\r\n"
           f"Content-Length: {len(BODY)}\r\n\r\n").encode() + BODY


def _raise_file_limit() -> None:
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def attack(mode: str, host: str, port: int, ca: str, count: int, seconds: float) -> dict[str, Any]:
    _raise_file_limit()
    context = ssl.create_default_context(cafile=ca)
    selector = selectors.DefaultSelector()
    end = time.monotonic() + seconds
    stats = {"handshakes": 0, "closed_by_server": 0, "failed": 0, "connects": 0}
    held: set[int] = set()
    restarts: list[tuple[float, int]] = []
    sockets: dict[int, Any] = {}
    lines_due: dict[int, float] = {}

    def start(slot: int) -> None:
        sock = socket.socket()
        sock.setblocking(False)
        stats["connects"] += 1
        sock.connect_ex((host, port))
        sockets[slot] = sock
        selector.register(sock, selectors.EVENT_WRITE, (slot, "connecting"))

    def drop(slot: int, counted: str, again: float = RECONNECT_SECONDS) -> None:
        sock = sockets.pop(slot)
        with contextlib.suppress(KeyError, ValueError):
            selector.unregister(sock)
        sock.close()
        lines_due.pop(slot, None)
        held.discard(slot)
        if counted:
            stats[counted] += 1
        heapq.heappush(restarts, (time.monotonic() + again, slot))

    def handshake(slot: int) -> None:
        tls = sockets[slot]
        try:
            tls.do_handshake()
        except ssl.SSLWantReadError:
            selector.modify(tls, selectors.EVENT_READ, (slot, "handshaking"))
            return
        except ssl.SSLWantWriteError:
            selector.modify(tls, selectors.EVENT_WRITE, (slot, "handshaking"))
            return
        except OSError:
            drop(slot, "failed")
            return
        stats["handshakes"] += 1
        if mode == "churn":
            drop(slot, "", 0.0)
            return
        established(slot)

    def established(slot: int) -> None:
        held.add(slot)
        selector.modify(sockets[slot], selectors.EVENT_READ, (slot, "held"))
        if mode == "slowloris":
            with contextlib.suppress(OSError, ssl.SSLError):
                sockets[slot].send(f"POST /validate HTTP/1.1\r\nHost: {SERVER_NAME}\r\n".encode())
            lines_due[slot] = time.monotonic() + 1.0

    for slot in range(count):
        start(slot)
    while time.monotonic() < end:
        now = time.monotonic()
        while restarts and restarts[0][0] <= now:
            start(heapq.heappop(restarts)[1])
        for slot, due in list(lines_due.items()):
            if due <= now:
                try:
                    sockets[slot].send(b"X-Slow: 1\r\n")
                    lines_due[slot] = now + 1.0
                except (OSError, ssl.SSLError):
                    drop(slot, "closed_by_server")
        timeout = min(0.2, max(0.0, restarts[0][0] - now)) if restarts else 0.2
        for key, _events in selector.select(timeout):
            slot, state = key.data
            if slot not in sockets:
                continue
            sock = sockets[slot]
            if state == "connecting":
                if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
                    drop(slot, "failed")
                elif mode == "tcp":
                    established(slot)
                else:
                    selector.unregister(sock)
                    try:
                        sockets[slot] = tls = context.wrap_socket(sock, server_hostname=SERVER_NAME,
                                                                  do_handshake_on_connect=False)
                    except OSError:  # reset already
                        sockets.pop(slot).close()
                        stats["failed"] += 1
                        heapq.heappush(restarts, (time.monotonic() + RECONNECT_SECONDS, slot))
                        continue
                    selector.register(tls, selectors.EVENT_WRITE, (slot, "handshaking"))
                    handshake(slot)
            elif state == "handshaking":
                handshake(slot)
            else:  # held: anything readable is the server's answer or its close
                try:
                    data = sock.recv(4096)
                except (ssl.SSLWantReadError, BlockingIOError):
                    continue
                except OSError:
                    data = b""
                if not data:
                    drop(slot, "closed_by_server")
    for sock in sockets.values():
        sock.close()
    return stats


def _review(sock: ssl.SSLSocket | None, host: str, port: int, context: ssl.SSLContext,
            ) -> tuple[ssl.SSLSocket | None, float, str]:
    """One review, on `sock` or a new connection: (the connection to keep, seconds, "" or what failed)."""
    started = time.monotonic()
    try:
        if sock is None:
            raw = socket.create_connection((host, port), timeout=API_TIMEOUT_SECONDS)
            sock = context.wrap_socket(raw, server_hostname=SERVER_NAME)
        sock.settimeout(max(0.01, API_TIMEOUT_SECONDS - (time.monotonic() - started)))
        sock.sendall(REQUEST)
        answer = b""
        while True:
            head, sep, payload = answer.partition(b"\r\n\r\n")
            if sep:
                length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")[1:]
                               if line.lower().startswith(b"content-length:")), 0)
                if len(payload) >= length:
                    break
            left = API_TIMEOUT_SECONDS - (time.monotonic() - started)
            if left <= 0:
                raise TimeoutError("no answer within 5 s")
            sock.settimeout(left)
            chunk = sock.recv(65536)
            if not chunk:
                raise ConnectionResetError("closed before the answer")
            answer += chunk
        if not answer.startswith(b"HTTP/1.1 200 ") or b'"allowed": true' not in payload:
            raise ValueError(answer.split(b"\r\n", 1)[0].decode(errors="replace")[:60])
        return sock, time.monotonic() - started, ""
    except (OSError, ValueError) as exc:
        if sock is not None:
            sock.close()
        return None, min(time.monotonic() - started, API_TIMEOUT_SECONDS), type(exc).__name__


def ordinary(host: str, port: int, ca: str, seconds: float) -> dict[str, Any]:
    context = ssl.create_default_context(cafile=ca)
    kept: list[ssl.SSLSocket | None] = []
    for _ in range(KEPT):
        sock, _seconds, failed = _review(None, host, port, context)
        assert not failed, failed
        kept.append(sock)
    print("ready", flush=True)
    sys.stdin.readline()
    end = time.monotonic() + seconds
    results: dict[str, list[tuple[float, str]]] = {"fresh": [], "kept": []}
    lock = threading.Lock()

    def fresh() -> None:
        while time.monotonic() < end:
            _sock, took, failed = _review(None, host, port, context)
            if _sock is not None:
                _sock.close()
            with lock:
                results["fresh"].append((took, failed))

    def keep(index: int) -> None:
        sock = kept[index]
        while time.monotonic() < end:
            started = time.monotonic()
            sock, took, failed = _review(sock, host, port, context)
            with lock:
                results["kept"].append((took, failed))
            time.sleep(max(0.0, KEPT_INTERVAL - (time.monotonic() - started)))
        if sock is not None:
            sock.close()

    threads = [threading.Thread(target=fresh) for _ in range(FRESH)]
    threads += [threading.Thread(target=keep, args=(index,)) for index in range(KEPT)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(seconds + 2 * API_TIMEOUT_SECONDS + 10)
    return results


def main(argv: list[str]) -> int:
    if argv[0] == "attack":
        mode, host, port, ca, count, seconds = argv[1:7]
        print(json.dumps(attack(mode, host, int(port), ca, int(count), float(seconds))), flush=True)
    elif argv[0] == "ordinary":
        host, port, ca, seconds = argv[1:5]
        print(json.dumps(ordinary(host, int(port), ca, float(seconds))), flush=True)
    else:
        raise SystemExit(f"unknown peer {argv[0]!r}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
