"""`ipmasq status` against hostile logins and a hostile API server, each in a process of its own: wall time, peak
resident memory, exit code and the last line it printed.

    python bench/bench_kube_hostile.py [--cap-mib 2500] [--timeout 60]

The inputs: a 687-byte YAML alias bomb as the kubeconfig; /dev/zero as the token file; a FIFO nobody writes to as
the token file and as the CA file; an API server on loopback whose every list page says there is more (a new
`continue` token each time, ~100 KB a page). Each process runs under an address-space cap (RLIMIT_AS) and a
timeout, so that an unbounded one ends in a MemoryError or is cut off instead of taking the machine. To measure
another checkout (before a change), run this file with PYTHONPATH=<that checkout>/src: the processes run
`python -m ipmasq` as the environment finds it.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path


def alias_bomb() -> str:
    lines = ['a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for level, name in enumerate("bcdefghi"):
        previous = "abcdefghi"[level]
        lines.append(f"{name}: &{name} [" + ",".join([f"*{previous}"] * 9) + "]")
    lines.append("clusters: [{name: c, cluster: {server: 'https://127.0.0.1:9'}}]")
    lines.append("current-context: *i")
    text = "\n".join(lines) + "\n"
    return text + "#" + "-" * (685 - len(text)) + "\n"  # a comment pads it to 687 bytes


def kubeconfig(server: str, user: dict[str, object], cluster: dict[str, object] | None = None) -> str:
    return json.dumps({"apiVersion": "v1", "kind": "Config", "current-context": "c",
                       "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
                       "clusters": [{"name": "c", "cluster": {"server": server, **(cluster or {})}}],
                       "users": [{"name": "u", "user": user}]})


class EndlessLists:
    """A TLS server on loopback: a list (a GET with `limit=`) is answered with a page of 500 objects and a new
    continue token, for ever; anything else is a 404 Status."""

    def __init__(self, directory: Path) -> None:
        self.cert, key = directory / "cert.pem", directory / "key.pem"
        subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                        "-nodes", "-keyout", str(key), "-out", str(self.cert), "-days", "1", "-subj", "/CN=localhost",
                        "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
        self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.context.load_cert_chain(self.cert, key)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.pages = 0
        self.stop = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        self.listener.settimeout(0.2)
        while not self.stop.is_set():
            try:
                raw, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=self._connection, args=(raw,), daemon=True).start()

    def _connection(self, raw: socket.socket) -> None:
        try:
            with self.context.wrap_socket(raw, server_side=True) as sock:
                while not self.stop.is_set():
                    head = b""
                    while b"\r\n\r\n" not in head:
                        data = sock.recv(65536)
                        if not data:
                            return
                        head += data
                    target = head.split(b" ", 2)[1]
                    if b"limit=" in target:
                        self.pages += 1
                        items = [{"metadata": {"name": f"node-{self.pages}-{i}", "uid": f"{self.pages}-{i}"},
                                  "spec": {"nodeName": f"node-{i}"}, "status": {"conditions": []},
                                  "padding": "x" * 150} for i in range(500)]
                        body = json.dumps({"kind": "List", "metadata": {"continue": f"page-{self.pages}"},
                                           "items": items}).encode()
                        status = b"200 OK"
                    else:
                        body, status = b'{"kind":"Status","code":404,"reason":"NotFound"}', b"404 Not Found"
                    sock.sendall(b"HTTP/1.1 " + status + b"\r\nContent-Type: application/json\r\nContent-Length: "
                                 + str(len(body)).encode() + b"\r\n\r\n" + body)
        except (OSError, ssl.SSLError):
            pass

    def close(self) -> None:
        self.stop.set()
        self.listener.close()


def run(kubeconfig_path: Path, cap: int, timeout: float) -> tuple[float, int, str, str]:
    """(seconds, peak RSS in KiB, exit, last line of stderr) of `ipmasq status` with this kubeconfig."""
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))

    started = time.monotonic()
    process = subprocess.Popen([sys.executable, "-m", "ipmasq", "status", "--kubeconfig", str(kubeconfig_path)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, preexec_fn=limit)
    try:
        _, err = process.communicate(timeout=timeout)
        code = str(process.returncode)
    except subprocess.TimeoutExpired:
        process.kill()
        _, err = process.communicate()
        code = f"cut off after {timeout:.0f} s"
    seconds = time.monotonic() - started
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)  # this process's only child: its peak
    lines = err.decode("utf-8", "replace").strip().splitlines()
    return seconds, usage.ru_maxrss, code, (lines[-1] if lines else "")[:110]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cap-mib", type=int, default=2500, help="each process's address-space cap")
    parser.add_argument("--timeout", type=float, default=60.0, help="each process's time limit in seconds")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as temporary:
        directory = Path(temporary)
        fifo = directory / "fifo"
        os.mkfifo(fifo)
        server = EndlessLists(directory)
        cases = {
            "alias bomb kubeconfig": alias_bomb(),
            "tokenFile /dev/zero": kubeconfig("https://127.0.0.1:9", {"tokenFile": "/dev/zero"}),
            "tokenFile a FIFO": kubeconfig("https://127.0.0.1:9", {"tokenFile": str(fifo)}),
            "CA file a FIFO": kubeconfig("https://127.0.0.1:9", {"token": "t"},
                                         {"certificate-authority": str(fifo)}),
            "endless list continue": kubeconfig(f"https://127.0.0.1:{server.port}", {"token": "t"},
                                                {"certificate-authority": str(server.cert)}),
        }
        print(f"{'input':<24} {'seconds':>8} {'peak RSS':>10}  {'exit':<18} last line")
        try:
            for name, text in cases.items():
                path = directory / "kubeconfig"
                path.write_text(text)
                if name == "alias bomb kubeconfig":
                    print(f"  (the alias bomb is {len(text.encode())} bytes)")
                child = subprocess.run([sys.executable, __file__, "--one", str(path), str(args.cap_mib << 20),
                                        str(args.timeout)], capture_output=True, text=True, check=True)
                seconds, rss, code, last = json.loads(child.stdout)
                pages = f" ({server.pages} pages served)" if name == "endless list continue" else ""
                print(f"{name:<24} {seconds:8.2f} {rss / 1024:8.0f} MiB  {code:<18} {last}{pages}")
        finally:
            server.close()



if __name__ == "__main__":
    if sys.argv[1:2] == ["--one"]:  # one case, in a process of its own (RUSAGE_CHILDREN's peak is this one's)
        print(json.dumps(run(Path(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]))))
    else:
        main()
