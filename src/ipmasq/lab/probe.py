"""Real TCP probes: a server that records the source address each connection arrived with, and a client.

    python -m ipmasq.lab.probe serve PORT [ADDRESS] [--log FILE] [--allow CIDR]...
    python -m ipmasq.lab.probe connect HOST PORT [TIMEOUT]
    python -m ipmasq.lab.probe connect-many HOST:PORT... [--timeout S]
    python -m ipmasq.lab.probe repeat HOST:PORT --seconds S [--interval S] [--timeout S]

The server accepts on every local address (with an AnyIP route, on *any* address), appends one line per
connection to the log file, `<ACCEPT|REJECT> <destination> <source>`, and answers the client with the source it saw.
`--allow` makes it behave like the firewalls of the outages it reproduces (the AWS VPC admitting only node IPs): a
source outside the allowed ranges is logged, then reset, so the client sees the connection fail exactly as a REJECT.
`connect` prints the source the server saw (or FAILED); `connect-many` prints one line per target,
`<target> <seen source|FAILED>`, making many probes with one process; `repeat` connects to one target again and
again for a while (continuous traffic across a rolling update), one line per connection: `<seen source|FAILED>`.
"""

from __future__ import annotations

import ipaddress
import socket
import struct
import sys
import time
from collections.abc import Sequence

__all__ = ["connect", "main", "serve"]


def serve(port: int, address: str = "::", *, log_path: str = "/dev/null", allow: Sequence[str] = ()) -> None:
    allowed = [ipaddress.ip_network(a) for a in allow]
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            server.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)  # one socket for both families
        server.bind((address, port))
        server.listen(512)
        print("ready", flush=True)
        with open(log_path, "a", buffering=1) as log:
            while True:
                conn, peer = server.accept()
                with conn:
                    seen = peer[0].removeprefix("::ffff:")
                    destination = conn.getsockname()[0].removeprefix("::ffff:")
                    source = ipaddress.ip_address(seen)
                    ok = not allowed or any(source in net for net in allowed if net.version == source.version)
                    log.write(f"{'ACCEPT' if ok else 'REJECT'} {destination} {seen}\n")
                    try:
                        if ok:
                            conn.sendall(f"{seen}\n".encode())
                            # let the client close first: TIME_WAIT then sits with the client, not here, where a
                            # later connection NATed to the same source port would run into it and be refused
                            conn.settimeout(2.0)
                            while conn.recv(256):
                                pass
                        else:
                            # linger 0: close sends a RST, which the client sees as "connection refused/reset"
                            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    except OSError:
                        pass


def connect(host: str, port: int, timeout: float = 2.0) -> str | None:
    """The source address the server saw, or None when no connection was made (timeout, reset, refused)."""
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


def _split_target(target: str) -> tuple[str, int]:
    host, _, port = target.rpartition(":")
    return host.strip("[]"), int(port)


def _options(argv: list[str], names: set[str]) -> tuple[list[str], dict[str, list[str]]]:
    positional: list[str] = []
    options: dict[str, list[str]] = {n: [] for n in names}
    rest = list(argv)
    while rest:
        word = rest.pop(0)
        if word in names and rest:
            options[word].append(rest.pop(0))
        else:
            positional.append(word)
    return positional, options


def main(argv: list[str]) -> int:
    command, args = (argv[0], argv[1:]) if argv else ("", [])
    if command == "serve" and args:
        positional, options = _options(args, {"--log", "--allow"})
        address = positional[1] if len(positional) > 1 else "::"
        serve(int(positional[0]), address, log_path=(options["--log"] or ["/dev/null"])[-1], allow=options["--allow"])
        return 0
    if command == "connect" and len(args) >= 2:
        seen = connect(args[0], int(args[1]), float(args[2]) if len(args) > 2 else 2.0)
        print(seen if seen is not None else "FAILED")
        return 0 if seen is not None else 1
    if command == "connect-many":
        targets, options = _options(args, {"--timeout"})
        timeout = float((options["--timeout"] or ["2.0"])[-1])
        failures = 0
        for target in targets:
            seen = connect(*_split_target(target), timeout=timeout)
            failures += seen is None
            print(f"{target} {seen if seen is not None else 'FAILED'}", flush=True)
        return 0 if failures == 0 else 1
    if command == "repeat" and args:
        positional, options = _options(args, {"--seconds", "--interval", "--timeout"})
        seconds = float((options["--seconds"] or ["10"])[-1])
        interval = float((options["--interval"] or ["0.05"])[-1])
        timeout = float((options["--timeout"] or ["1.0"])[-1])
        host, port = _split_target(positional[0])
        deadline = time.monotonic() + seconds
        failures = 0
        while time.monotonic() < deadline:
            seen = connect(host, port, timeout=timeout)
            failures += seen is None
            print(seen if seen is not None else "FAILED", flush=True)
            time.sleep(interval)
        return 0 if failures == 0 else 1
    print("usage: probe serve PORT [ADDRESS] [--log FILE] [--allow CIDR]... | probe connect HOST PORT [TIMEOUT] | "
          "probe connect-many HOST:PORT... [--timeout S] | probe repeat HOST:PORT --seconds S [--interval S]",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
