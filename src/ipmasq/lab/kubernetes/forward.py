"""Forward a loopback port of the machine to an address inside one of the lab's network namespaces.

    python -m ipmasq.lab.kubernetes.forward 127.0.0.1:PORT /run/netns/NAME HOST:PORT

kubectl on the machine must reach the API server, which lives inside the lab (where kubelets, kube-proxies and
pods reach it), and the lab is never linked to the machine's network. This process listens on the machine's
loopback, then moves itself into the lab's namespace (setns): every connection it accepts there is opened from
inside the lab, and bytes are copied both ways until either side closes. The listening socket stays in the
namespace it was made in.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import socket
import sys
import threading

CLONE_NEWNET = 0x40000000


def _enter(netns: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(netns, os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns {netns}")
    finally:
        os.close(fd)


def _pipe(source: socket.socket, sink: socket.socket) -> None:
    try:
        while data := source.recv(65536):
            sink.sendall(data)
    except OSError:
        pass
    finally:
        for sock, how in ((sink, socket.SHUT_WR), (source, socket.SHUT_RD)):
            with contextlib.suppress(OSError):
                sock.shutdown(how)


def _serve(client: socket.socket, target: tuple[str, int]) -> None:
    try:
        upstream = socket.create_connection(target, timeout=10)
    except OSError:
        client.close()
        return
    upstream.settimeout(None)
    back = threading.Thread(target=_pipe, args=(upstream, client), daemon=True)
    back.start()
    _pipe(client, upstream)
    back.join()
    client.close()
    upstream.close()


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print("usage: forward LISTEN_HOST:PORT NETNS_PATH TARGET_HOST:PORT", file=sys.stderr)
        return 2
    listen_host, _, listen_port = argv[0].rpartition(":")
    target_host, _, target_port = argv[2].rpartition(":")
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind((listen_host, int(listen_port)))
    server.listen(128)
    _enter(argv[1])  # from here on, new sockets belong to the lab's namespace; `server` stays on the machine's
    while True:
        client, _ = server.accept()
        threading.Thread(target=_serve, args=(client, (target_host, int(target_port))), daemon=True).start()


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
