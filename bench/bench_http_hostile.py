"""The API client and the webhook against hostile peers on loopback, figures side by side for one or two source trees.

    .venv/bin/python bench/bench_http_hostile.py [--before OTHER_CHECKOUT/src] [--out bench/out]

Each scenario runs in a fresh Python process (its peak RSS is its own: VmHWM) with the tree's src first on
sys.path, so `--before` puts an older checkout's figures beside this one's in one run. Everything talks over
127.0.0.1 only, and every loop is bounded in count and time (a client that never gives up is reported as still
waiting when its scenario's limit is reached).

API client (KubeClient.get / watch against a scripted TLS server):
  chunk-4gib       a chunk that announces ffffffff bytes, then data as fast as the socket takes it (64 MiB at most)
  slow-loris       an answer's head, then one byte a second (the client's own timeout is 10 s)
  one-byte-chunks  a watch line of 1 MiB sent in 1-byte chunks: the seconds to read it
  redirect         a 302 to another host: an error, or followed
  retry-after      a 429 with Retry-After: 1, then the answer: the seconds between the two requests

Webhook (WebhookServer with the real respond(), its memory measured in its own process):
  ordinary reviews at concurrency 20 (each of 20 threads on its own kept-alive connection, as the API server),
  alone and during each attack: two slow 16 MB uploads, 300 slow heads, 2,000 connections that never start TLS,
  two 14 MB reviews of 700,000 CIDRs at once, two 16 MB bodies of 4 million tiny JSON values at once, a userInfo
  that is not an object; then a burst of 200 new connections (the listen backlog). Targets: every ordinary review
  within 1 s, the webhook's peak RSS under 200 MiB.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import http.client
import inspect
import json
import os
import select
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SRC = HERE.parent / "src"
HOST = "ipmasq-webhook.kube-system.svc"
ORDINARY_TARGET_S = 1.0
WEBHOOK_RSS_TARGET_MIB = 200.0
ATTACKS = ("none", "slow uploads", "slow heads", "silent connections", "big reviews", "tiny JSON values",
           "userInfo not an object")


def rss_mib(pid: int, key: str = "VmHWM") -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    return 0.0


def descendants(pid: int) -> list[int]:
    """The processes `pid` started (the webhook's decision process), and theirs."""
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            for child in (task / "children").read_text().split():
                found += [int(child), *descendants(int(child))]
    return found


def family_rss_mib(pid: int) -> float:
    """Peak RSS of `pid` and of every process it started, added up (their peaks may not coincide: an upper bound)."""
    total = 0.0
    for member in [pid, *descendants(pid)]:
        with contextlib.suppress(OSError):
            total += rss_mib(member)
    return total


def reset_peak(pid: int) -> None:
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM back to the current RSS (Linux 4.0+)


# ---- the API client ---------------------------------------------------------------------------------------------

def _serve_once(context: ssl.SSLContext, script: Any) -> tuple[socket.socket, threading.Thread]:
    listener = socket.create_server(("127.0.0.1", 0))

    def run() -> None:
        listener.settimeout(30)
        try:
            raw, _ = listener.accept()
        except OSError:
            return
        raw.settimeout(60)
        try:
            with context.wrap_socket(raw, server_side=True) as sock:
                head = b""
                while b"\r\n\r\n" not in head:
                    head += sock.recv(65536) or b"\r\n\r\n"
                script(sock)
        except (OSError, ssl.SSLError):
            pass

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return listener, thread


def client_scenario(name: str, cert: str, key: str) -> dict[str, Any]:
    """Runs in the scenario's own process."""
    from ipmasq.errors import ApiError
    from ipmasq.kube.client import KubeClient
    from ipmasq.kube.credentials import Credentials

    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    requests: list[float] = []
    limit = 40.0

    def chunk_4gib(sock: ssl.SSLSocket) -> None:
        sock.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nffffffff\r\n")
        block = b"x" * 65536
        for _ in range(1024):  # 64 MiB at most
            sock.sendall(block)

    def slow_loris(sock: ssl.SSLSocket) -> None:
        sock.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n")
        for _ in range(int(limit) + 5):
            time.sleep(1)
            sock.sendall(b" ")

    def one_byte_chunks(sock: ssl.SSLSocket) -> None:
        event = json.dumps({"type": "ADDED", "object": {"metadata": {"name": "x" * (1 << 20)}}}).encode() + b"\n"
        sock.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for start in range(0, len(event), 8192):  # made as it is sent: the scenario's memory is the client's
            sock.sendall(b"".join(b"1\r\n" + event[i:i + 1] + b"\r\n" for i in range(start, min(start + 8192,
                                                                                              len(event)))))
        sock.sendall(b"0\r\n\r\n")

    def redirect(sock: ssl.SSLSocket) -> None:
        sock.sendall(b"HTTP/1.1 302 Found\r\nLocation: https://127.0.0.2:1/steal\r\nContent-Length: 2\r\n\r\n{}")

    def retry_after(sock: ssl.SSLSocket) -> None:
        sock.sendall(b"HTTP/1.1 429 Too Many Requests\r\nRetry-After: 1\r\nContent-Length: 2\r\n\r\n{}")
        requests.append(time.monotonic())
        head = b""
        while b"\r\n\r\n" not in head:
            data = sock.recv(65536)
            if not data:
                return
            head += data
        requests.append(time.monotonic())
        sock.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")

    scripts = {"chunk-4gib": chunk_4gib, "slow-loris": slow_loris, "one-byte-chunks": one_byte_chunks,
               "redirect": redirect, "retry-after": retry_after}
    listener, _thread = _serve_once(context, scripts[name])
    client = KubeClient(Credentials(host="127.0.0.1", port=listener.getsockname()[1], ca_file=cert,
                                    token="secret"))
    outcome: dict[str, Any] = {}

    def call() -> None:
        started = time.monotonic()
        try:
            if name == "one-byte-chunks":
                events = list(client.watch("/api/v1/configmaps", query={}))
                outcome["result"] = f"{len(events)} event(s)"
            else:
                outcome["result"] = f"answer {str(client.get('/api/v1/nodes'))[:30]}"
        except ApiError as exc:
            outcome["result"] = f"{type(exc).__name__}: {str(exc)[:70]}"
        outcome["seconds"] = time.monotonic() - started

    caller = threading.Thread(target=call, daemon=True)
    caller.start()
    caller.join(limit)
    if caller.is_alive():
        outcome = {"result": f"still waiting after {limit:.0f} s", "seconds": limit}
    if name == "retry-after":
        outcome["waited_s"] = requests[1] - requests[0] if len(requests) == 2 else None
    outcome["peak_rss_mib"] = rss_mib(os.getpid())
    listener.close()
    return outcome


# ---- the webhook ------------------------------------------------------------------------------------------------

def webhook_child(cert: str, key: str) -> None:
    """Runs in the webhook's own process: serves until stdin closes; prints its port."""
    from ipmasq.webhook.review import respond
    from ipmasq.webhook.server import WebhookServer, serve

    # isolated: as `ipmasq webhook` runs it (a tree from before the decision process has no such parameter)
    isolated = {"isolated": True} if "isolated" in inspect.signature(WebhookServer).parameters else {}
    server = WebhookServer(("127.0.0.1", 0), respond, log=lambda line: None, **isolated)
    server.use_certificate(Path(cert).read_bytes(), Path(key).read_bytes())
    serve(server)
    if hasattr(server, "accepting"):  # its decision process started (as a replica's is before it is ready)
        server.accepting.wait(120)
    print(server.server_address[1], flush=True)
    sys.stdin.read()
    server.shutdown()
    server.server_close()


def review(config: str, **request: Any) -> bytes:
    obj = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "ip-masq-agent", "namespace": "kube-system"},
           "data": {"config": config}}
    fields = {"uid": "u-1", "kind": {"group": "", "version": "v1", "kind": "ConfigMap"}, "namespace": "kube-system",
              "name": "ip-masq-agent", "operation": "UPDATE", "userInfo": {"username": "bench"}, "object": obj,
              **request}
    return json.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": fields}).encode()


class Webhook:
    def __init__(self, src: Path, cert: str, key: str, ca: str) -> None:
        self.proc = subprocess.Popen([sys.executable, __file__, "--webhook-child", cert, key],
                                     env={**os.environ, "PYTHONPATH": str(src)}, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE)
        assert self.proc.stdout is not None
        self.port = int(self.proc.stdout.readline())
        self.context = ssl.create_default_context(cafile=ca)

    def tls(self, timeout: float = 5.0) -> ssl.SSLSocket:
        sock = socket.create_connection(("127.0.0.1", self.port), timeout=timeout)
        return self.context.wrap_socket(sock, server_hostname=HOST)

    def connection(self) -> http.client.HTTPSConnection:
        webhook = self

        class Pinned(http.client.HTTPSConnection):
            def connect(self) -> None:
                self.sock = webhook.tls()

        return Pinned(HOST, self.port, timeout=5)

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(30)


def ordinary_latencies(webhook: Webhook, concurrency: int = 20, each: int = 10) -> list[float]:
    """Seconds per ordinary review (5.0 when it got no answer within the API server's 5 s: admitted unreviewed)."""
    body = review("nonMasqueradeCIDRs: [10.0.0.0/8]\n")
    latencies: list[float] = []
    lock = threading.Lock()

    def worker() -> None:
        conn = webhook.connection()
        for _ in range(each):
            started = time.monotonic()
            try:
                conn.request("POST", "/validate", body, {"Content-Type": "application/json"})
                response = conn.getresponse()
                response.read()
                seconds = time.monotonic() - started if response.status == 200 else 5.0
            except (OSError, http.client.HTTPException):
                seconds = 5.0
                conn.close()
                conn = webhook.connection()
            with lock:
                latencies.append(min(seconds, 5.0))
        conn.close()

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    return latencies


def slow_uploads(webhook: Webhook, stop: threading.Event) -> list[socket.socket]:
    socks: list[socket.socket] = []
    for _ in range(2):
        sock = webhook.tls()
        sock.sendall(f"POST /validate HTTP/1.1\r\nHost: {HOST}\r\nContent-Length: {16 << 20}\r\n\r\n".encode())
        socks.append(sock)

    def trickle() -> None:
        while not stop.wait(2):
            for sock in socks:
                with contextlib.suppress(OSError):
                    sock.sendall(b" ")
    threading.Thread(target=trickle, daemon=True).start()
    return socks


def slow_heads(webhook: Webhook, stop: threading.Event, count: int = 300) -> list[socket.socket]:
    socks: list[socket.socket] = []
    for _ in range(count):
        try:
            sock = webhook.tls()
            sock.sendall(f"POST /validate HTTP/1.1\r\nHost: {HOST}\r\n".encode())
            socks.append(sock)
        except OSError:
            break

    def trickle() -> None:
        while not stop.wait(2):
            for sock in socks:
                with contextlib.suppress(OSError):
                    sock.sendall(b"X-Slow: 1\r\n")
    threading.Thread(target=trickle, daemon=True).start()
    return socks


def big_reviews(webhook: Webhook, results: list[str], body: bytes | None = None) -> list[threading.Thread]:
    if body is None:
        cidrs = "".join(f"  - {10 + (i >> 16)}.{i >> 8 & 255}.{i & 255}.0/24\n" for i in range(700_000))
        body = review(f"cidrLimit: 1000000\nnonMasqueradeCIDRs:\n{cidrs}")

    def send() -> None:
        started = time.monotonic()
        try:
            conn = webhook.connection()
            conn.timeout = 60
            conn.request("POST", "/validate", body, {"Content-Type": "application/json"})
            response = conn.getresponse()
            data = response.read()
            verdict = json.loads(data)["response"]["allowed"] if response.status == 200 else f"HTTP {response.status}"
            results.append(f"{'admitted' if verdict is True else 'denied' if verdict is False else verdict} "
                           f"in {time.monotonic() - started:.1f} s ({len(body) / 1e6:.0f} MB)")
        except (OSError, http.client.HTTPException, ValueError) as exc:
            results.append(f"{type(exc).__name__} after {time.monotonic() - started:.1f} s")

    threads = [threading.Thread(target=send) for _ in range(2)]
    for thread in threads:
        thread.start()
    return threads


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def webhook_run(src: Path, cert: str, key: str, ca: str) -> dict[str, Any]:
    webhook = Webhook(src, cert, key, ca)
    figures: dict[str, Any] = {"idle_rss_mib": rss_mib(webhook.proc.pid, "VmRSS")}
    try:
        for attack in ATTACKS:
            reset_peak(webhook.proc.pid)
            stop = threading.Event()
            held: list[socket.socket] = []
            extra: list[str] = []
            threads: list[threading.Thread] = []
            if attack == "slow uploads":
                held = slow_uploads(webhook, stop)
            elif attack == "slow heads":
                held = slow_heads(webhook, stop)
            elif attack == "silent connections":  # TCP only: no TLS handshake ever starts
                for _ in range(2000):
                    try:
                        held.append(socket.create_connection(("127.0.0.1", webhook.port), timeout=5))
                    except OSError:
                        break
            elif attack == "big reviews":
                threads = big_reviews(webhook, extra)
                time.sleep(1.0)  # while they are being read and decided
            elif attack == "tiny JSON values":
                threads = big_reviews(webhook, extra, b"[" + b"1.5," * 4_000_000 + b"1]")
                time.sleep(1.0)
            elif attack == "userInfo not an object":
                conn = webhook.connection()
                try:
                    conn.request("POST", "/validate", review("nonMasqueradeCIDRs: [10.0.0.0/33]\n",
                                                             userInfo="alice"))
                    response = conn.getresponse()
                    extra.append(f"HTTP {response.status}: "
                                 f"{'admitted' if json.loads(response.read())['response']['allowed'] else 'denied'}")
                except (OSError, http.client.HTTPException, ValueError) as exc:
                    extra.append(f"no answer ({type(exc).__name__})")
            latencies = ordinary_latencies(webhook)
            for thread in threads:
                thread.join(120)
            stop.set()
            for sock in held:
                sock.close()
            figures[attack] = {"p50_s": percentile(latencies, 0.5), "p99_s": percentile(latencies, 0.99),
                               "max_s": max(latencies), "over_1s": sum(1 for s in latencies if s > 1.0),
                               "count": len(latencies), "peak_rss_mib": rss_mib(webhook.proc.pid),
                               "note": "; ".join(extra)}
        # a burst of new connections before any is accepted: with a backlog of 5, SYN retransmits (1 s, 3 s)
        connects: list[float] = []
        burst = []
        for _ in range(200):
            sock = socket.socket()
            sock.setblocking(False)
            burst.append((sock, time.monotonic()))
            sock.connect_ex(("127.0.0.1", webhook.port))
        deadline = time.monotonic() + 10
        pending = dict(burst)
        while pending and time.monotonic() < deadline:
            _, writable, _ = select.select([], list(pending), [], 0.05)
            for sock in writable:
                connects.append(time.monotonic() - pending.pop(sock))
        connects += [10.0] * len(pending)
        for sock, _ in burst:
            sock.close()
        figures["connect_burst"] = {"p50_s": percentile(connects, 0.5), "p99_s": percentile(connects, 0.99)}
    finally:
        webhook.close()
    return figures


# ---- the run ----------------------------------------------------------------------------------------------------

def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", type=Path, help="another checkout's src, measured first")
    parser.add_argument("--out", type=Path, default=HERE / "out")
    parser.add_argument("--client-scenario", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument("--webhook-child", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--skip-webhook", action="store_true")
    args = parser.parse_args()
    if args.client_scenario:
        print(json.dumps(client_scenario(*args.client_scenario)))
        return 0
    if args.webhook_child:
        webhook_child(*args.webhook_child)
        return 0
    trees = [("before", args.before.resolve())] if args.before else []
    trees.append(("this tree", SRC))
    sys.path.insert(0, str(SRC))
    from ipmasq.webhook.certificate import issue, service_names

    pair = issue(service_names("ipmasq-webhook", "kube-system"), datetime.datetime.now(datetime.UTC), 30)
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="ipmasq-bench-http-") as scratch:
        cert, key, ca = (os.path.join(scratch, n) for n in ("tls.crt", "tls.key", "ca.crt"))
        Path(cert).write_bytes(pair.tls_cert)
        Path(key).write_bytes(pair.tls_key)
        Path(ca).write_bytes(pair.ca_bundle)
        client_cert = os.path.join(scratch, "client.crt")
        client_key = os.path.join(scratch, "client.key")
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", client_key, "-out",
                        client_cert, "-days", "1", "-subj", "/CN=localhost", "-addext",
                        "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
        for label, src in trees:
            results[label] = {"client": {}}
            for scenario in ("chunk-4gib", "slow-loris", "one-byte-chunks", "redirect", "retry-after"):
                run = subprocess.run([sys.executable, __file__, "--client-scenario", scenario, client_cert,
                                      client_key], env={**os.environ, "PYTHONPATH": str(src)}, capture_output=True,
                                     timeout=120)
                results[label]["client"][scenario] = (json.loads(run.stdout) if run.returncode == 0 else
                                                      {"result": f"crashed: {run.stderr.decode()[-200:]}"})
            if not args.skip_webhook:
                results[label]["webhook"] = webhook_run(src, cert, key, ca)
    labels = list(results)
    print("API client" + "".join(f" | {label:<58}" for label in labels))
    for scenario in results[labels[0]]["client"]:
        row = []
        for label in labels:
            r = results[label]["client"][scenario]
            text = f"{r['result'][:34]} {r.get('seconds', 0):.1f} s {r.get('peak_rss_mib', 0):.0f} MiB"
            if r.get("waited_s") is not None:
                text += f" waited {r['waited_s']:.2f} s"
            row.append(f"{text:<58}")
        print(f"  {scenario:<16}" + "".join(f" | {cell}" for cell in row))
    failed = False
    if not args.skip_webhook:
        print("\nwebhook: ordinary reviews at concurrency 20 (200)" + "".join(f" | {label:<48}" for label in labels))
        for attack in ATTACKS:
            cells = []
            for label in labels:
                f = results[label]["webhook"][attack]
                cells.append(f"p50 {f['p50_s'] * 1000:6.1f} ms p99 {f['p99_s'] * 1000:6.1f} ms >1s {f['over_1s']:3d} "
                             f"peak {f['peak_rss_mib']:5.0f} MiB")
            print(f"  {attack:<47}" + "".join(f" | {cell:<48}" for cell in cells))
            for label in labels:
                if results[label]["webhook"][attack]["note"]:
                    print(f"      {label}: {results[label]['webhook'][attack]['note']}")
        cells = [f"p50 {results[label]['webhook']['connect_burst']['p50_s'] * 1000:.1f} ms "
                 f"p99 {results[label]['webhook']['connect_burst']['p99_s'] * 1000:.1f} ms" for label in labels]
        print(f"  {'burst of 200 connects':<47}" + "".join(f" | {cell:<48}" for cell in cells))
        ours = results["this tree"]["webhook"]
        failed = any(ours[a]["over_1s"] or ours[a]["peak_rss_mib"] > WEBHOOK_RSS_TARGET_MIB
                     for a in ATTACKS)
        print(f"\ntargets (this tree): every ordinary review within {ORDINARY_TARGET_S:g} s, peak RSS under "
              f"{WEBHOOK_RSS_TARGET_MIB:.0f} MiB: {'MISSED' if failed else 'met'}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "http_hostile.json").write_text(json.dumps(results, indent=2) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
