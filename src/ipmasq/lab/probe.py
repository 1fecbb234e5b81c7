"""A TCP server that tells each client the source address it saw, and the client that asks.

Run inside a namespace: `python -m ipmasq.lab.probe serve PORT [ADDRESS]` / `... connect HOST PORT`.
The server answers one line per connection: the peer's address as the kernel delivered it (after any NAT).
"""

from __future__ import annotations

import contextlib
import socket
import sys

__all__ = ["connect", "serve"]


def serve(port: int, address: str = "::") -> None:
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            server.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)  # one socket for both families
        server.bind((address, port))
        server.listen(128)
        print("ready", flush=True)
        while True:
            conn, peer = server.accept()
            with conn:
                seen = peer[0].removeprefix("::ffff:")
                with contextlib.suppress(OSError):
                    conn.sendall(f"{seen}\n".encode())


def connect(host: str, port: int, timeout: float = 2.0) -> str | None:
    """The source address the server saw, or None when no connection could be made in time."""
    try:
        with socket.create_connection((host, port), timeout=timeout) as conn:
            data = b""
            while not data.endswith(b"\n"):
                chunk = conn.recv(256)
                if not chunk:
                    break
                data += chunk
            return data.decode().strip() or None
    except OSError:
        return None


def main(argv: list[str]) -> int:
    if argv[:1] == ["serve"]:
        serve(int(argv[1]), argv[2] if len(argv) > 2 else "::")
        return 0
    if argv[:1] == ["connect"]:
        timeout = float(argv[3]) if len(argv) > 3 else 2.0
        seen = connect(argv[1], int(argv[2]), timeout)
        print(seen if seen is not None else "FAILED")
        return 0 if seen is not None else 1
    print("usage: probe serve PORT [ADDRESS] | probe connect HOST PORT [TIMEOUT]", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
