"""The webhook under each attack of a hostile peer, with ordinary reviews sent beside it; two source trees side by
side in one run (before and after a change).

    sudo .venv/bin/python bench/bench_webhook_attacks.py [--baseline COMMIT | --before OTHER_CHECKOUT/src]
        [--only NAME ...] [--requests | --connections] [--out bench/out]
    .venv/bin/python bench/bench_webhook_attacks.py --lint [--baseline COMMIT | --before OTHER_CHECKOUT/src]
    .venv/bin/python bench/bench_webhook_attacks.py --per-connection 2000 [--baseline COMMIT]

--baseline COMMIT measures that commit of this repository (`git archive` of its src into a temporary directory)
beside this tree; --before, another checkout's src.

Connection attacks (root: network namespaces). The webhook (`ipmasq webhook`'s server: isolated, the real
respond()) runs in a namespace of its own, listening on 0.0.0.0:8443; every peer is a process in a namespace
linked to it by a veth pair of its own, so that each namespace is a source address of its own: the API server's
ordinary reviews from one, the attackers from up to ten others (bench/webhook_peers.py). While an attack runs for
CONNECTION_SECONDS, the ordinary client sends reviews one after another on fresh connections (4 threads) and one a
second on each of 5 connections kept alive (made before the attack, as the API server keeps its own); a review not
answered within 5 s failed (the API server's timeoutSeconds: admitted unreviewed). Recorded per attack: fresh
reviews failed of all, kept-alive ones failed of all, p99 of each, and the peak memory of the webhook's process
tree (VmHWM of the server and its decision process, added), against the Deployment's memory limit. Attackers run at
nice 19 (ATTACKER_NICE) and make their connections again 0.1 s after the server closes (or refuses) one:
  idle secure       a TLS handshake, then nothing (1,000 and 10,000 from one address; 1,000 from each of 10;
                    200 from one)
  slowloris secure  a TLS handshake, then a request head, one header line a second, never finished
  churn             TLS handshakes, each connection closed at once, 100 at a time
  silent TCP        connections that never start TLS (2,000 from one address)
Targets (this tree): at most 1 % of fresh reviews and no kept-alive review failed, p99 of each within 1 s, the
webhook within its Deployment's memory limit.

Request attacks (loopback):

Each attack gets a webhook process of its own (bench_http_hostile's child: WebhookServer with the real respond(),
the tree's src first on sys.path), so its CPU time and peak RSS (VmHWM) are the attack's alone, and an attack the
old code never finishes cannot slow the next one. While the attack runs, 20 threads send 10 ordinary reviews each
over kept-alive connections (as the API server does); a review not answered within the API server's 5 s counts as
5 s (the webhook fails open: admitted unreviewed). Recorded per attack: the webhook's CPU seconds from the attack's
start until its requests are answered or cut (ATTACK_CAP_S at most: "≥"), its peak RSS, the ordinary reviews'
p50/p99, and what the attacker saw. Everything talks over 127.0.0.1 only; every loop is bounded in count and time.

Attacks: a body of a quote and 40,000 escaped quotes (invalid JSON, 80 KB); a config of 520,000 values `[1,1,...]`
and one of 340,000 `{}` (each inside 1 MiB); 1,600 plain rules, 200 overlapping rules (two reviews at once each),
1,000 rules of a real shape; a name of 1 MB; a pipelined request left unfinished (seconds until the server closes
it); Content-Length 10 beside chunked with 42 MB of chunks (bytes the server took before it stopped reading);
two reviews of 200 overlapping rules whose client leaves at once (CPU spent for nobody); a flood of new TCP
connections, opened and dropped as fast as two processes can, for 20 s.

--per-connection N: the webhook's resident memory per connection it holds, N held at once in each shape (silent
TCP; secure and silent; answered and kept alive; an unfinished head of 8,000 bytes; an unfinished TLS record of 16
KiB), its budget and deadlines set out of the way: what bounds the connection budget.

--lint: `ipmasq lint`'s whole check of the rules (no budget) alone, in a process per case: CPU and peak RSS.

Targets (this tree): ordinary reviews within 1 s under every attack, the webhook under 200 MiB.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import http.client
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
SRC = HERE.parent / "src"
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from tests.hostile.admission import overlapping_rules, plain_rules, real_rules  # noqa: E402

from bench_http_hostile import (  # noqa: E402
    HOST,
    Webhook,
    descendants,
    family_rss_mib,
    ordinary_latencies,
    percentile,
    review,
    rss_mib,
)

ATTACK_CAP_S = 60.0
CONNECTION_SECONDS = 30.0
FRESH_FAILED_TARGET = 0.01
PEERS = HERE / "webhook_peers.py"
PORT = 8443
# The attackers' CPU is not the webhook's in a cluster; on this machine they share its two cores, so they run at the
# lowest priority: they still send all the CPU left lets them (their handshakes and connects are in the figures),
# but the measure is the webhook's work, not the scheduler's split (ten attackers at nice 10 weighed as much as the
# webhook).
ATTACKER_NICE = 19
ORDINARY_TARGET_S = 1.0
RSS_TARGET_MIB = 200.0


def cpu_seconds(pid: int) -> float:
    """The webhook's CPU: its own, its decision process's (alive), and its children's that ended (reaped)."""
    def ticks(member: int, reaped: bool) -> int:
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{member}/stat").read_text().rsplit(")", 1)[1].split()
            return sum(int(f) for f in fields[11:15 if reaped else 13])
        return 0
    return (ticks(pid, True) + sum(ticks(child, False) for child in descendants(pid))) / os.sysconf("SC_CLK_TCK")


def post(webhook: Webhook, body: bytes, timeout: float = ATTACK_CAP_S) -> str:
    started = time.monotonic()
    try:
        conn = webhook.connection()
        conn.timeout = timeout
        conn.request("POST", "/validate", body, {"Content-Type": "application/json"})
        response = conn.getresponse()
        data = response.read()
        conn.close()
        if response.status != 200:
            return f"HTTP {response.status} in {time.monotonic() - started:.1f} s"
        allowed = json.loads(data)["response"]["allowed"]
        return f"{'admitted' if allowed else 'denied'} in {time.monotonic() - started:.1f} s"
    except (OSError, http.client.HTTPException, ValueError) as exc:
        return f"{type(exc).__name__} after {time.monotonic() - started:.1f} s"


def configmap_review(config: str, name: str = "ip-masq-agent") -> bytes:
    return review(config, name=name, object={"apiVersion": "v1", "kind": "ConfigMap",
                                             "metadata": {"name": name, "namespace": "kube-system"},
                                             "data": {"config": config}})


def requests(*bodies: bytes) -> Callable[[Webhook, list[str], threading.Event], None]:
    def attack(webhook: Webhook, notes: list[str], stop: threading.Event) -> None:
        threads = [threading.Thread(target=lambda b=body: notes.append(post(webhook, b))) for body in bodies]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(ATTACK_CAP_S + 5)
    return attack


def pipelined(webhook: Webhook, notes: list[str], stop: threading.Event) -> None:
    sock = webhook.tls(timeout=ATTACK_CAP_S)
    started = time.monotonic()
    sock.sendall(f"GET /healthz HTTP/1.1\r\nHost: {HOST}\r\n\r\nPOST /validate HTTP/1.1\r\n".encode())
    try:
        while sock.recv(65536):
            pass
        notes.append(f"closed after {time.monotonic() - started:.1f} s")
    except TimeoutError:
        notes.append(f"still open after {ATTACK_CAP_S:.0f} s")
    except OSError as exc:
        notes.append(f"{type(exc).__name__} after {time.monotonic() - started:.1f} s")
    sock.close()


def chunked_past_the_bound(webhook: Webhook, notes: list[str], stop: threading.Event) -> None:
    """Whether the server answers on the head (before any of the body), and what it answers once all is sent."""
    sock = webhook.tls(timeout=10)
    sock.sendall(f"POST /validate HTTP/1.1\r\nHost: {HOST}\r\nContent-Length: 10\r\n"
                 "Transfer-Encoding: chunked\r\n\r\n".encode())
    early = ""
    sock.settimeout(1.0)
    with contextlib.suppress(TimeoutError, OSError):
        early = sock.recv(200).split(b"\r\n", 1)[0].decode(errors="replace")
    sock.settimeout(10)
    sent, chunk = 0, b"100000\r\n" + b"[" * 0x100000 + b"\r\n"
    try:
        while sent < 42 << 20:
            sock.sendall(chunk)
            sent += 0x100000
        sock.sendall(b"0\r\n\r\n")
        late = sock.recv(200).split(b"\r\n", 1)[0].decode(errors="replace") if not early else ""
        ending = f"{sent >> 20} MB sent (read and dropped while closing)" if early else \
            f"all {sent >> 20} MB read, then {late or 'closed'}"
    except OSError as exc:
        ending = f"{sent >> 20} MB sent, then {type(exc).__name__}"
    notes.append(f"on the head: {early or 'no answer'}; {ending}")
    sock.close()


def leaving(webhook: Webhook, notes: list[str], stop: threading.Event) -> None:
    body = configmap_review(overlapping_rules(200))
    for _ in range(2):
        sock = webhook.tls()
        sock.sendall(f"POST /validate HTTP/1.1\r\nHost: {HOST}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        sock.close()
    notes.append("2 reviews sent, connections closed at once")


_FLOOD = """
import socket, sys, time
port, seconds = int(sys.argv[1]), float(sys.argv[2])
opened = failed = 0
held = []
end = time.monotonic() + seconds
while time.monotonic() < end:
    try:
        sock = socket.create_connection(("127.0.0.1", port), timeout=2)
        held.append(sock)
        opened += 1
    except OSError:
        failed += 1
    if len(held) >= 64:  # each stays open a moment, as a peer that opens and drops them
        for sock in held:
            sock.close()
        held.clear()
print(opened, failed)
"""


def flood(webhook: Webhook, notes: list[str], stop: threading.Event) -> None:
    """New TCP connections, opened and dropped as fast as two processes can (no TLS: the cheapest for the peer)."""
    seconds = 20.0
    procs = [subprocess.Popen([sys.executable, "-c", _FLOOD, str(webhook.port), str(seconds)],
                              stdout=subprocess.PIPE, text=True) for _ in range(2)]
    opened = failed = 0
    for proc in procs:
        out, _ = proc.communicate(timeout=seconds + 30)
        a, b = (int(n) for n in out.split())
        opened, failed = opened + a, failed + b
    notes.append(f"{opened / seconds:.0f} new connections/s, {failed} refused")


def nothing(webhook: Webhook, notes: list[str], stop: threading.Event) -> None:
    pass


ATTACKS: dict[str, Callable[[Webhook, list[str], threading.Event], None]] = {
    "none (ordinary reviews alone)": nothing,
    "escaped quotes (80 KB)": requests(b'"' + b'\\"' * 40_000),
    "520,000 values [1,1,...]": requests(configmap_review("x: [" + "1," * 520_000 + "1]\n")),
    "340,000 values {}": requests(configmap_review("x: [" + "{}," * 340_000 + "{}]\n")),
    "1,600 plain rules x2": requests(*[configmap_review(plain_rules(1600))] * 2),
    "200 overlapping rules x2": requests(*[configmap_review(overlapping_rules(200))] * 2),
    "1,000 real-shaped rules": requests(configmap_review(real_rules(1000))),
    "1 MB name": requests(configmap_review("nonMasqueradeCIDRs: [10.0.0.0/8]\n", "ip-masq-" + "a" * (1 << 20))),
    "pipelined, unfinished": pipelined,
    "chunked 42 MB, CL 10": chunked_past_the_bound,
    "client leaves (200 rules x2)": leaving,
    "new connections flood": flood,
}


# name: the attackers, each (its namespace's number, mode, connections at once); several processes share an address
CONNECTION_ATTACKS: dict[str, list[tuple[int, str, int]]] = {
    "none (ordinary reviews alone)": [],
    "1,000 idle secure, one address": [(1, "idle", 500)] * 2,
    "10,000 idle secure, one address": [(1, "idle", 2500)] * 4,
    "1,000 idle secure from each of 10 addresses": [(n, "idle", 1000) for n in range(1, 11)],
    "1,000 slowloris secure, one address": [(1, "slowloris", 500)] * 2,
    "200 idle secure, one address": [(1, "idle", 200)],
    "churn: secure connections closed at once": [(1, "churn", 50)] * 2,
    "2,000 silent TCP, one address": [(1, "tcp", 1000)] * 2,
}

_SERVE = """
import sys
from pathlib import Path
from ipmasq.webhook.review import respond
from ipmasq.webhook.server import WebhookServer, serve
server = WebhookServer(("0.0.0.0", int(sys.argv[3])), respond, log=lambda line: None, isolated=True)
server.use_certificate(Path(sys.argv[1]).read_bytes(), Path(sys.argv[2]).read_bytes())
serve(server)
server.accepting.wait(120)
print("ready", flush=True)
sys.stdin.read()
server.shutdown()
server.server_close()
"""


def memory_limit_mib() -> float:
    """The webhook container's memory limit in deploy/webhook/deployment.yaml."""
    deployment = yaml.safe_load((HERE.parent / "deploy" / "webhook" / "deployment.yaml").read_text())
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    value = container["resources"]["limits"]["memory"]
    number, unit = re.fullmatch(r"(\d+)(Mi|Gi)", value).groups()  # type: ignore[union-attr]
    return float(number) * (1024 if unit == "Gi" else 1)


@contextlib.contextmanager
def namespaces() -> Iterator[dict[str, Any]]:
    """The webhook's namespace and eleven peers' (0: the API server's, 1-10: attackers'), each linked to the
    webhook's by a veth pair of its own: 10.77.N.2 is a peer's address, 10.77.N.1 the webhook's on its link."""
    from ipmasq.lab.netns import network

    with network() as net:
        server = net.add("srv")
        peers = {}
        for number in range(11):
            peer = net.add(f"p{number}")
            net.link(server, [f"10.77.{number}.1/24"], peer, [f"10.77.{number}.2/24"])
            peer.sysctl("net.ipv4.tcp_max_tw_buckets", "0")
            peers[number] = peer
        server.sysctl("net.ipv4.tcp_max_tw_buckets", "0")
        yield {"server": server, "peers": peers}


def percentile_ms(values: list[float], q: float) -> float:
    return percentile(values, q) * 1000 if values else 0.0


def run_connection_attack(net: dict[str, Any], src: Path, cert: str, key: str, ca: str, name: str,
                          seconds: float = CONNECTION_SECONDS) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(src)}
    procs: list[subprocess.Popen[str]] = []
    webhook = net["server"].popen([sys.executable, "-c", _SERVE, cert, key, str(PORT)], env=env,
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert webhook.stdout is not None and webhook.stdin is not None
        if webhook.stdout.readline().strip() != "ready":
            raise RuntimeError("the webhook did not start")
        ordinary = net["peers"][0].popen([sys.executable, str(PEERS), "ordinary", "10.77.0.1", str(PORT), ca,
                                          str(seconds)], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        procs.append(ordinary)
        assert ordinary.stdout is not None and ordinary.stdin is not None
        if ordinary.stdout.readline().strip() != "ready":
            raise RuntimeError("the ordinary client could not make its kept-alive connections")
        attackers = [net["peers"][number].popen(
            ["nice", "-n", str(ATTACKER_NICE), sys.executable, str(PEERS), "attack", mode, f"10.77.{number}.1",
             str(PORT), ca, str(count), str(seconds + 1)], stdout=subprocess.PIPE)
            for number, mode, count in CONNECTION_ATTACKS[name]]
        procs += attackers
        ordinary.stdin.write("go\n")
        ordinary.stdin.flush()
        reviews = json.loads(ordinary.communicate(timeout=seconds + 60)[0])
        seen: dict[str, int] = {}
        for attacker in attackers:
            for key_, value in json.loads(attacker.communicate(timeout=120)[0]).items():
                seen[key_] = seen.get(key_, 0) + value
        peak = family_rss_mib(webhook.pid)
    finally:
        for proc in [*procs, webhook]:
            if proc.poll() is None:
                proc.kill()
            proc.wait(30)
    figures: dict[str, Any] = {"peak_rss_mib": peak, "attackers": seen, "load": os.getloadavg()[0]}
    for kind in ("fresh", "kept"):
        done = reviews[kind]
        failures: dict[str, int] = {}
        for _seconds, failed in done:
            if failed:
                failures[failed] = failures.get(failed, 0) + 1
        figures[kind] = {"count": len(done), "failed": sum(failures.values()), "failures": failures,
                         "p50_ms": percentile_ms([s for s, _ in done], 0.5),
                         "p99_ms": percentile_ms([s for s, _ in done], 0.99)}
    return figures


def connection_line(name: str, label: str, f: dict[str, Any]) -> str:
    fresh, kept, seen = f["fresh"], f["kept"], f["attackers"]
    held = f" {seen.get('handshakes', 0)} handshakes, {seen.get('closed_by_server', 0)} closed, " \
        f"{seen.get('failed', 0)} refused or failed" if seen else ""
    return (f"{name:<46} {label:<6} fresh {fresh['failed']:5d}/{fresh['count']:<5d} kept {kept['failed']:3d}/"
            f"{kept['count']:<3d} p99 {fresh['p99_ms']:6.0f}/{kept['p99_ms']:5.0f} ms  "
            f"peak {f['peak_rss_mib']:4.0f} MiB load {f['load']:4.1f}"
            f"{held}  {dict(list(fresh['failures'].items())[:3]) or ''}")


def connection_table(results: dict[str, dict[str, Any]]) -> str:
    def cell(name: str, show: Callable[[dict[str, Any]], str]) -> str:
        return " / ".join(show(results[name][label]) for label in ("before", "after") if label in results[name])

    lines = ["| attack | fresh reviews failed (before / after) | kept-alive failed | p99 fresh ms | "
             "p99 kept-alive ms | peak MiB | attackers' handshakes, refused or failed connects |",
             "|---|---|---|---|---|---|---|"]
    for name in results:
        fresh = cell(name, lambda f: f"{f['fresh']['failed']:,} of {f['fresh']['count']:,}")
        kept = cell(name, lambda f: f"{f['kept']['failed']} of {f['kept']['count']}")
        p99f = cell(name, lambda f: f"{f['fresh']['p99_ms']:.0f}")
        p99k = cell(name, lambda f: f"{f['kept']['p99_ms']:.0f}")
        peak = cell(name, lambda f: f"{f['peak_rss_mib']:.0f}")
        seen = cell(name, lambda f: f"{f['attackers'].get('handshakes', 0):,}, {f['attackers'].get('failed', 0):,}"
                    ) if CONNECTION_ATTACKS[name] else ""
        lines.append(f"| {name} | {fresh} | {kept} | {p99f} | {p99k} | {peak} | {seen} |")
    return "\n".join(lines) + "\n"


def connections_missed(results: dict[str, dict[str, Any]], limit_mib: float) -> list[str]:
    missed = []
    for name, by in results.items():
        f = by["after"]
        if (f["fresh"]["failed"] > FRESH_FAILED_TARGET * f["fresh"]["count"] or f["kept"]["failed"]
                or max(f["fresh"]["p99_ms"], f["kept"]["p99_ms"]) > ORDINARY_TARGET_S * 1000
                or f["peak_rss_mib"] > limit_mib):
            missed.append(name)
    return missed


@contextlib.contextmanager
def baseline(commit: str) -> Iterator[Path]:
    """`commit`'s src, exported from this repository into a temporary directory (nothing changed in the repository)."""
    with tempfile.TemporaryDirectory(prefix="ipmasq-bench-baseline-") as scratch:
        git = subprocess.Popen(["git", "-C", str(HERE.parent), "archive", "--format=tar", commit, "src"],
                               stdout=subprocess.PIPE)
        subprocess.run(["tar", "-x", "-C", scratch], stdin=git.stdout, check=True)
        if git.wait(60) != 0:
            raise SystemExit(f"git archive {commit} failed")
        yield Path(scratch) / "src"


_HOLDING = """
import sys
from pathlib import Path
from ipmasq.webhook import server as module
from ipmasq.webhook.review import respond
long = 3600.0
if hasattr(module, "ConnectionLimits"):
    limits = {"limits": module.ConnectionLimits(connections=100_000, handshake_seconds=long, request_seconds=long,
                                                 keep_alive_seconds=long)}
else:  # a tree from before the connection table: its module's constants
    limits = {}
    module.MAX_CONNECTIONS = 100_000
    module.HANDSHAKE_SECONDS = module.KEEP_ALIVE_SECONDS = module.REQUEST_SECONDS = long
server = module.WebhookServer(("127.0.0.1", 0), respond, log=lambda line: None, **limits)
server.use_certificate(Path(sys.argv[1]).read_bytes(), Path(sys.argv[2]).read_bytes())
module.serve(server)
print(server.server_address[1], flush=True)
sys.stdin.read()
"""
SHAPES = ("silent TCP", "secure, nothing sent", "answered, kept alive", "a head of 8,000 bytes, unfinished",
          "a TLS record of 16 KiB, unfinished")


def held_connection_bytes(src: Path, cert: str, key: str, ca: str, shape: str, count: int) -> float:
    """The webhook's resident memory per connection held in `shape` (its budget and deadlines out of the way)."""
    import resource
    import socket
    import ssl

    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    child = subprocess.Popen([sys.executable, "-c", _HOLDING, cert, key], env={**os.environ, "PYTHONPATH": str(src)},
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    held: list[socket.socket] = []
    try:
        assert child.stdout is not None
        port = int(child.stdout.readline())
        context = ssl.create_default_context(cafile=ca)
        body = configmap_review("nonMasqueradeCIDRs: [10.0.0.0/8]\n")

        def connect(secure: bool) -> socket.socket:
            sock = socket.create_connection(("127.0.0.1", port), timeout=30)
            return context.wrap_socket(sock, server_hostname=HOST) if secure else sock

        for _ in range(50):  # the first handshakes' one-off costs (imports, caches) before the baseline
            connect(True).close()
        time.sleep(1.0)
        before = rss_mib(child.pid, "VmRSS")
        for _ in range(count):
            sock = connect(shape != "silent TCP")
            if shape == "answered, kept alive":
                sock.sendall(f"POST /validate HTTP/1.1\r\nHost: {HOST}\r\nContent-Length: {len(body)}\r\n\r\n"
                             .encode() + body)
                answer = b""
                while b'"allowed"' not in answer:
                    answer += sock.recv(65536)
            elif shape.startswith("a head"):
                sock.sendall(f"POST /validate HTTP/1.1\r\nHost: {HOST}\r\nX-Long: ".encode() + b"a" * 7940)
            elif shape.startswith("a TLS record"):  # a record's header and 16,000 of its 16,384 bytes, under TLS
                os.write(sock.fileno(), bytes([23, 3, 3, 0x40, 0x00]) + b"x" * 16_000)
            held.append(sock)
        time.sleep(2.0)  # the last ones read
        return (rss_mib(child.pid, "VmRSS") - before) * (1 << 20) / count
    finally:
        for sock in held:
            sock.close()
        child.kill()
        child.wait(30)


_LINT = """
import resource, sys, time
from ipmasq.lint.config import lint_config
from ipmasq.options import PolicyOptions
text = open(sys.argv[1]).read()
started = time.process_time()
findings = lint_config(text, source="config", options=PolicyOptions(node_name=""))
print(time.process_time() - started, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, len(findings))
"""
LINT_CASES: dict[str, Callable[[], str]] = {
    "400 plain rules": lambda: plain_rules(400),
    "1,600 plain rules": lambda: plain_rules(1600),
    "200 overlapping rules": lambda: overlapping_rules(200),
    "50 real-shaped rules": lambda: real_rules(50),
    "1,000 real-shaped rules": lambda: real_rules(1000),
}


def lint_alone(src: Path, text: str, scratch: str) -> str:
    """`ipmasq lint`'s whole check of the rules (no budget) in a process of its own: CPU seconds and peak RSS."""
    path = os.path.join(scratch, "config.yaml")
    Path(path).write_text(text)
    try:
        run = subprocess.run([sys.executable, "-c", _LINT, path], env={**os.environ, "PYTHONPATH": str(src)},
                             capture_output=True, text=True, timeout=ATTACK_CAP_S)
    except subprocess.TimeoutExpired:
        return f"> {ATTACK_CAP_S:.0f} s (stopped)"
    if run.returncode != 0:
        return f"failed: {run.stderr.strip()[-120:]}"
    seconds, peak, count = run.stdout.split()
    return f"{float(seconds):.2f} s CPU, {float(peak):.0f} MiB, {count} findings"


def run_attack(src: Path, cert: str, key: str, ca: str, name: str) -> dict[str, Any]:
    webhook = Webhook(src, cert, key, ca)
    pid = webhook.proc.pid
    try:
        idle_cpu = cpu_seconds(pid)
        notes: list[str] = []
        stop = threading.Event()
        attacker = threading.Thread(target=ATTACKS[name], args=(webhook, notes, stop))
        started = time.monotonic()
        attacker.start()
        time.sleep(0.2)  # the attack is under way
        latencies = ordinary_latencies(webhook)
        stop.set()
        attacker.join(ATTACK_CAP_S + 10)
        # the attack's work: until the process is idle again (a decision for a client that left goes on), capped
        previous = cpu_seconds(pid)
        while time.monotonic() - started < ATTACK_CAP_S:
            time.sleep(0.5)
            now = cpu_seconds(pid)
            if now - previous < 0.05:
                break
            previous = now
        capped = time.monotonic() - started >= ATTACK_CAP_S
        return {"cpu_s": cpu_seconds(pid) - idle_cpu, "capped": capped, "peak_rss_mib": family_rss_mib(pid),
                "p50_s": percentile(latencies, 0.5), "p99_s": percentile(latencies, 0.99),
                "over_1s": sum(1 for s in latencies if s > ORDINARY_TARGET_S), "count": len(latencies),
                "note": "; ".join(notes)}
    finally:
        webhook.proc.kill()
        webhook.proc.wait(10)


def table(results: dict[str, dict[str, Any]]) -> str:
    """The figures as docs/measurements.md shows them: a row per attack, before and after in each cell."""
    def cell(name: str, show: Callable[[dict[str, Any]], str]) -> str:
        return " / ".join(show(results[name][label]) for label in ("before", "after") if label in results[name])

    lines = ["| attack | webhook CPU s | peak RSS MiB | ordinary p50/p99 ms | over 1 s (of 200) | "
             "the attacker saw (after) |", "|---|---|---|---|---|---|"]
    for name in results:
        cpu = cell(name, lambda f: f"{'≥' if f['capped'] else ''}{f['cpu_s']:.1f}")
        rss = cell(name, lambda f: f"{f['peak_rss_mib']:.0f}")
        lat = cell(name, lambda f: f"{f['p50_s'] * 1000:.0f}/{f['p99_s'] * 1000:.0f}")
        over = cell(name, lambda f: str(f["over_1s"]))
        lines.append(f"| {name} | {cpu} | {rss} | {lat} | {over} | {results[name]['after']['note']} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", type=Path, help="another checkout's src, measured beside this one")
    parser.add_argument("--baseline", metavar="COMMIT", help="this repository's COMMIT, measured beside this tree")
    parser.add_argument("--only", nargs="+", choices=[*ATTACKS, *CONNECTION_ATTACKS], metavar="NAME")
    parser.add_argument("--requests", action="store_true", help="the request attacks only (loopback)")
    parser.add_argument("--connections", action="store_true", help="the connection attacks only (namespaces)")
    parser.add_argument("--seconds", type=float, default=CONNECTION_SECONDS, help="each connection attack's length")
    parser.add_argument("--per-connection", type=int, metavar="N",
                        help="only the memory a held connection costs, N held at once of each shape (loopback)")
    parser.add_argument("--out", type=Path, default=HERE / "out")
    parser.add_argument("--lint", action="store_true", help="only the rules' lint alone (`ipmasq lint`, no budget)")
    args = parser.parse_args()
    with contextlib.ExitStack() as stack:
        before = stack.enter_context(baseline(args.baseline)) if args.baseline else args.before
        return run(args, before.resolve() if before else None)


def run(args: argparse.Namespace, before: Path | None) -> int:
    from ipmasq.webhook.certificate import issue, service_names

    trees = ([("before", before)] if before else []) + [("after", SRC)]
    print(f"load average at the start: {' '.join(f'{n:.2f}' for n in os.getloadavg())}", flush=True)
    pair = issue(service_names("ipmasq-webhook", "kube-system"), datetime.datetime.now(datetime.UTC), 30)
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="ipmasq-bench-webhook-") as scratch:
        cert, key, ca = (os.path.join(scratch, n) for n in ("tls.crt", "tls.key", "ca.crt"))
        Path(cert).write_bytes(pair.tls_cert)
        Path(key).write_bytes(pair.tls_key)
        Path(ca).write_bytes(pair.ca_bundle)
        if args.per_connection:
            labels = " | ".join(label for label, _ in trees)
            print(f"memory per held connection, {args.per_connection:,} held: {labels}")
            for shape in SHAPES:
                cells = [f"{held_connection_bytes(src, cert, key, ca, shape, args.per_connection) / 1024:5.1f} KiB"
                         for _label, src in trees]
                print(f"  {shape:<36} " + " | ".join(cells), flush=True)
            return 0
        if args.lint:
            for case, make in LINT_CASES.items():
                text = make()
                cells = [f"{label}: {lint_alone(src, text, scratch)}" for label, src in trees]
                print(f"{case:<24} " + " | ".join(cells), flush=True)
            return 0
        connections: dict[str, dict[str, Any]] = {}
        names = [n for n in CONNECTION_ATTACKS if not args.only or n in args.only] if not args.requests else []
        if names and os.geteuid() != 0:
            print("the connection attacks need root (network namespaces): skipped", flush=True)
            names = []
        if names:
            with namespaces() as net:
                for name in names:
                    connections[name] = {}
                    for label, src in trees:  # side by side: each attack on both trees before the next
                        connections[name][label] = figures = run_connection_attack(net, src, cert, key, ca, name,
                                                                                         args.seconds)
                        print(connection_line(name, label, figures), flush=True)
        for name in [n for n in ATTACKS if not args.only or n in args.only] if not args.connections else []:
            results[name] = {}
            for label, src in trees:  # side by side: each attack on both trees before the next
                results[name][label] = figures = run_attack(src, cert, key, ca, name)
                print(f"{name:<30} {label:<6} cpu {'≥' if figures['capped'] else ' '}{figures['cpu_s']:6.1f} s  "
                      f"peak {figures['peak_rss_mib']:5.0f} MiB  ordinary p50 {figures['p50_s'] * 1000:6.0f} ms "
                      f"p99 {figures['p99_s'] * 1000:6.0f} ms  >1s {figures['over_1s']:3d}/{figures['count']}  "
                      f"{figures['note'][:90]}", flush=True)
    print(f"load average at the end: {' '.join(f'{n:.2f}' for n in os.getloadavg())}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "webhook_attacks.json").write_text(json.dumps({"requests": results, "connections": connections},
                                                              indent=2) + "\n")
    (args.out / "webhook_attacks.md").write_text((table(results) if results else "") + "\n"
                                                 + (connection_table(connections) if connections else ""))
    missed = [name for name, by in results.items()
              if by["after"]["over_1s"] or by["after"]["peak_rss_mib"] > RSS_TARGET_MIB]
    if results:
        print(f"\ntargets (after), requests: ordinary reviews within {ORDINARY_TARGET_S:g} s, under "
              f"{RSS_TARGET_MIB:.0f} MiB: " + (f"MISSED under {', '.join(missed)}" if missed else "met"))
    if connections:
        limit = memory_limit_mib()
        missed_connections = connections_missed(connections, limit)
        print(f"targets (after), connections: fresh reviews failed at most {FRESH_FAILED_TARGET:.0%}, kept-alive "
              f"none, p99 within {ORDINARY_TARGET_S:g} s, within the Deployment's {limit:.0f} MiB: "
              + (f"MISSED under {', '.join(missed_connections)}" if missed_connections else "met"))
        missed += missed_connections
    return 1 if missed else 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        raise SystemExit(main())
