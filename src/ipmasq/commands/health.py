"""`ipmasq health`: ask a running agent whether it is ready (or, with --live, alive); for exec probes and operators.

The DaemonSet uses hostNetwork and a loopback-only port, so an httpGet probe (sent from the kubelet to the pod IP)
would either miss the port or need it open on the node's addresses; an exec probe runs this inside the pod instead.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ipmasq.agent.health_probe import DEFAULT_METRICS_ADDRESS, parse_listen_address, query

__all__ = ["register"]


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "health", help="is the local agent ready (or alive)? for exec probes",
        description="Query a running agent's /readyz (default: the kernel matches the current, good config) or "
        "/healthz (--live: the agent's loop is not wedged). Exit 0 when it is, 1 when not or unreachable; "
        "one line says why.",
    )
    parser.add_argument("--address", default=DEFAULT_METRICS_ADDRESS, metavar="HOST:PORT",
                        help="the agent's --metrics-address (default %(default)s)")
    parser.add_argument("--live", action="store_true", help="liveness instead of readiness")
    parser.add_argument("--timeout", type=float, default=3.0, metavar="SECONDS",
                        help="give up after this long (default %(default)s)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    parse_listen_address(args.address)  # a malformed address is a usage error (exit 2), not "not ready"
    check = query(args.address, "/healthz" if args.live else "/readyz", timeout=args.timeout)
    print(check.why, file=sys.stdout if check.ok else sys.stderr)
    return 0 if check.ok else 1
