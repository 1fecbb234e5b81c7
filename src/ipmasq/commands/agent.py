"""`ipmasq agent`: the node agent, a drop-in for ip-masq-agent (same flags, config file, chain and rules)."""

from __future__ import annotations

import argparse
import logging
import signal
from collections.abc import Callable
from typing import Any

from ipmasq import __version__
from ipmasq.agent.health import DEFAULT_METRICS_ADDRESS, StatusServer
from ipmasq.agent.logs import LOG_FORMATS, configure_logging
from ipmasq.agent.loop import Agent, LoopSettings, Wakeup
from ipmasq.agent.metrics import AgentStatus
from ipmasq.agent.reconcile import Reconciler
from ipmasq.backends.base import Runner
from ipmasq.backends.choose import make_backend
from ipmasq.backends.runner import SubprocessRunner
from ipmasq.commands.common import add_backend_flags, add_policy_flags, go_bool, options_from_args
from ipmasq.conntrack import flush_stale_conntrack
from ipmasq.errors import IpmasqError
from ipmasq.policy import Policy

__all__ = ["DEFAULT_CONFIG", "register"]

DEFAULT_CONFIG = "/etc/config/ip-masq-agent"


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "agent", help="run the node agent (drop-in for ip-masq-agent)",
        description="Keep the nat rules in line with the config: apply on change (inotify), repair drift every "
        "resyncInterval and on SIGHUP, keep the last good config when a new one is bad. SIGTERM exits at once "
        "and leaves the rules; `ipmasq uninstall` removes them.",
    )
    add_policy_flags(parser, config_help=f"config file or directory (default {DEFAULT_CONFIG}; missing: defaults)")
    add_backend_flags(parser)
    parser.add_argument("--once", action="store_true",
                        help="reconcile once; exit 0 when the kernel then matches the config, 1 otherwise")
    parser.add_argument("--poll", action="store_true", help="poll the config instead of using inotify")
    parser.add_argument("--flush-conntrack", type=go_bool, default=False, metavar="BOOL",
                        help="after a config change, delete the conntrack entries of destinations whose verdict "
                             "changed, so connections already retrying (SYN retransmissions) get the new decision")
    parser.add_argument("--metrics-address", default=DEFAULT_METRICS_ADDRESS, metavar="HOST:PORT",
                        help="serve /metrics, /healthz and /readyz here (default %(default)s, loopback only: "
                             "`ipmasq health` queries it from an exec probe); empty: no endpoints")
    parser.add_argument("--log-format", choices=LOG_FORMATS, default="text",
                        help="one line per event, as text or JSON (default %(default)s)")
    parser.add_argument("--version", action="version", version=f"ipmasq {__version__}")
    # klog flags of existing manifests: accepted, ignored (we log one line per event to stderr)
    parser.add_argument("-v", "--v", help=argparse.SUPPRESS)
    for flag in ("--log_dir", "--stderrthreshold", "--vmodule"):
        parser.add_argument(flag, help=argparse.SUPPRESS)
    for flag in ("--logtostderr", "--alsologtostderr"):
        parser.add_argument(flag, help=argparse.SUPPRESS)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    options = options_from_args(args)
    log = configure_logging(args.log_format)
    wakeup = Wakeup()
    runner = SubprocessRunner(cancel=wakeup.stop)
    backend, others = make_backend(args.backend, options, runner, variant=args.iptables_variant, log=log)
    settings = LoopSettings(config_path=args.config or DEFAULT_CONFIG, use_inotify=not args.poll)
    on_change = _conntrack_flusher(runner, log) if args.flush_conntrack else None
    status = AgentStatus(version=__version__, backend=backend.name)
    agent = Agent(Reconciler(backend, options, log=log, others=others, on_policy_change=on_change), settings, log=log,
                  observer=status)
    if args.once:
        return agent.once()
    server = _serve_status(status, args.metrics_address, log)
    signal.signal(signal.SIGTERM, lambda *_: wakeup.request_stop())
    signal.signal(signal.SIGINT, lambda *_: wakeup.request_stop())
    signal.signal(signal.SIGHUP, lambda *_: wakeup.request_resync())
    try:
        agent.run(wakeup)
    finally:
        if server is not None:
            server.stop()
    return 0


def _serve_status(status: AgentStatus, address: str, log: logging.Logger) -> StatusServer | None:
    if not address:
        return None
    server = StatusServer(status, address)
    server.start()
    log.info("serving /metrics, /healthz and /readyz on %s", address)
    return server


def _conntrack_flusher(runner: Runner, log: logging.Logger) -> Callable[[Policy, Policy], None]:
    def flush(before: Policy, after: Policy) -> None:
        try:
            result = flush_stale_conntrack(runner, before, after)
        except IpmasqError as exc:
            log.error("conntrack: %s (the new rules are in place; old connections keep their NAT decision)", exc)
            return
        if result.prefixes:
            log.info("conntrack: deleted %d entries to the %d ranges whose verdict changed", result.deleted,
                     len(result.prefixes))

    return flush
