"""The webhook under each attack of a hostile peer, with ordinary reviews sent beside it; two source trees side by
side in one run (before and after a change).

    .venv/bin/python bench/bench_webhook_attacks.py [--before OTHER_CHECKOUT/src] [--only NAME ...] [--out bench/out]
    .venv/bin/python bench/bench_webhook_attacks.py --lint [--before OTHER_CHECKOUT/src]

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
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

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
)

ATTACK_CAP_S = 60.0
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
    parser.add_argument("--only", nargs="+", choices=list(ATTACKS), metavar="NAME")
    parser.add_argument("--out", type=Path, default=HERE / "out")
    parser.add_argument("--lint", action="store_true", help="only the rules' lint alone (`ipmasq lint`, no budget)")
    args = parser.parse_args()
    from ipmasq.webhook.certificate import issue, service_names

    trees = ([("before", args.before.resolve())] if args.before else []) + [("after", SRC)]
    pair = issue(service_names("ipmasq-webhook", "kube-system"), datetime.datetime.now(datetime.UTC), 30)
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="ipmasq-bench-webhook-") as scratch:
        cert, key, ca = (os.path.join(scratch, n) for n in ("tls.crt", "tls.key", "ca.crt"))
        Path(cert).write_bytes(pair.tls_cert)
        Path(key).write_bytes(pair.tls_key)
        Path(ca).write_bytes(pair.ca_bundle)
        if args.lint:
            for case, make in LINT_CASES.items():
                text = make()
                cells = [f"{label}: {lint_alone(src, text, scratch)}" for label, src in trees]
                print(f"{case:<24} " + " | ".join(cells), flush=True)
            return 0
        for name in args.only or ATTACKS:
            results[name] = {}
            for label, src in trees:  # side by side: each attack on both trees before the next
                results[name][label] = figures = run_attack(src, cert, key, ca, name)
                print(f"{name:<30} {label:<6} cpu {'≥' if figures['capped'] else ' '}{figures['cpu_s']:6.1f} s  "
                      f"peak {figures['peak_rss_mib']:5.0f} MiB  ordinary p50 {figures['p50_s'] * 1000:6.0f} ms "
                      f"p99 {figures['p99_s'] * 1000:6.0f} ms  >1s {figures['over_1s']:3d}/{figures['count']}  "
                      f"{figures['note'][:90]}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "webhook_attacks.json").write_text(json.dumps(results, indent=2) + "\n")
    (args.out / "webhook_attacks.md").write_text(table(results))
    missed = [name for name, by in results.items()
              if by["after"]["over_1s"] or by["after"]["peak_rss_mib"] > RSS_TARGET_MIB]
    print(f"\ntargets (after): ordinary reviews within {ORDINARY_TARGET_S:g} s, under {RSS_TARGET_MIB:.0f} MiB: "
          + (f"MISSED under {', '.join(missed)}" if missed else "met"))
    return 1 if missed else 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        raise SystemExit(main())
