"""TCP and UDP probes for the rules' random kernel test: a peer that answers every datagram and connection with the
source address it arrived from, and a pod-side client that sends from a chosen pod address.

    python rule_probe.py serve PORT...              # in the peer namespace (AnyIP: any destination address)
    python rule_probe.py probe SRC,PROTO,DST,PORT... # in the pod namespace; one line per probe: the source seen

Standard library only, run by path, so it needs nothing installed in the namespaces. The server answers a datagram
from the address it was sent to (IP_PKTINFO), so the reply meets the node's NAT entry and comes back to the pod
whatever address the AnyIP route made local. A TCP client closes first: TIME_WAIT stays with the pod, never with the
peer, where a later connection NATed to the same address and port would run into it.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import sys
import threading

IP_PKTINFO = getattr(socket, "IP_PKTINFO", 8)  # Linux's value; Python does not export it everywhere
TRIES = 3


def _serve_tcp(port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("0.0.0.0", port))
        server.listen(512)
        while True:
            conn, peer = server.accept()
            with conn:
                try:
                    conn.sendall(f"{peer[0]}\n".encode())
                    conn.settimeout(2.0)
                    while conn.recv(256):
                        pass
                except OSError:
                    pass


def _serve_udp(port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as server:
        server.setsockopt(socket.IPPROTO_IP, IP_PKTINFO, 1)
        server.bind(("0.0.0.0", port))
        while True:
            _data, ancillary, _flags, peer = server.recvmsg(512, socket.CMSG_SPACE(12))
            local = next((data[4:8] for level, kind, data in ancillary
                          if level == socket.IPPROTO_IP and kind == IP_PKTINFO), None)
            if local is None:
                continue
            # in_pktinfo: ifindex, spec_dst (the source of the answer), addr
            info = struct.pack("I4s4s", 0, local, b"\0\0\0\0")
            with contextlib.suppress(OSError):
                server.sendmsg([f"{peer[0]}\n".encode()], [(socket.IPPROTO_IP, IP_PKTINFO, info)], 0, peer)


def serve(ports: list[int]) -> None:
    for port in ports:
        for target in (_serve_tcp, _serve_udp):
            threading.Thread(target=target, args=(port,), daemon=True).start()
    print("ready", flush=True)
    threading.Event().wait()


def _tcp(source: str, destination: str, port: int) -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as conn:
        conn.settimeout(1.0)
        conn.bind((source, 0))
        conn.connect((destination, port))
        data = b""
        while not data.endswith(b"\n"):
            chunk = conn.recv(256)
            if not chunk:
                break
            data += chunk
        return data.decode().strip() or None


def _udp(source: str, destination: str, port: int) -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as conn:
        conn.settimeout(0.5)
        conn.bind((source, 0))
        conn.connect((destination, port))
        conn.send(b"probe\n")
        return conn.recv(512).decode().strip() or None


def probe(source: str, protocol: str, destination: str, port: int) -> str | None:
    """The source address the peer saw, or None after TRIES attempts (a fresh link may still be resolving
    neighbours; each try is a new socket, so a new flow)."""
    send = _tcp if protocol == "tcp" else _udp
    for _ in range(TRIES):
        try:
            seen = send(source, destination, port)
        except OSError:
            continue
        if seen:
            return seen
    return None


def main(argv: list[str]) -> int:
    if len(argv) >= 2 and argv[0] == "serve":
        serve([int(p) for p in argv[1:]])
        return 0
    if argv and argv[0] == "probe":
        for spec in argv[1:]:
            source, protocol, destination, port = spec.split(",")
            print(f"{spec} {probe(source, protocol, destination, int(port)) or 'FAILED'}", flush=True)
        return 0
    print("usage: rule_probe.py serve PORT... | rule_probe.py probe SRC,PROTO,DST,PORT...", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
