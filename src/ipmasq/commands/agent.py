"""`ipmasq agent`: the node agent, a drop-in for ip-masq-agent (same flags, config file, chain and rules)."""

from __future__ import annotations

import argparse
import logging
import os
import signal
from typing import Any

from ipmasq import __version__
from ipmasq.agent.health import DEFAULT_METRICS_ADDRESS, StatusServer
from ipmasq.agent.logs import LOG_FORMATS, configure_logging
from ipmasq.agent.loop import Agent, LoopSettings, Wakeup, wait_for_node_lock
from ipmasq.agent.metrics import AgentStatus
from ipmasq.agent.nodelock import DEFAULT_LOCK_DIRECTORY, NodeLock, default_lock_path
from ipmasq.agent.reconcile import Reconciler
from ipmasq.backends.base import Backend, Removable, Runner
from ipmasq.backends.choose import count_foreign_masquerade, make_backend
from ipmasq.backends.generation import KernelFingerprint, nftables_generation
from ipmasq.backends.runner import SubprocessRunner
from ipmasq.backends.xtables_lock import xtables_lock_path
from ipmasq.commands.common import add_backend_flags, add_policy_flags, agent_settings, go_bool, options_from_args
from ipmasq.conntrack import conntrack_flusher
from ipmasq.options import PolicyOptions

__all__ = ["DEFAULT_CONFIG", "register"]

DEFAULT_CONFIG = "/etc/config/ip-masq-agent"


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "agent", help="run the node agent (drop-in for ip-masq-agent)",
        description="Keep the nat rules in line with the config: apply on change (inotify), repair drift every "
        "resyncInterval and on SIGHUP, keep the last good config when a new one is bad. One agent writes a node "
        "at a time (--lock-file); a second one waits, not ready, until the first exits. SIGTERM exits at once "
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
    parser.add_argument("--lock-file", metavar="PATH",
                        help="the node lock: only the agent holding it writes rules, another one waits (a rolling "
                             f"update); default {DEFAULT_LOCK_DIRECTORY}/agent-netns-<inode>.lock, one per network "
                             "namespace (mount the directory from the host)")
    parser.add_argument("--node-name", default=os.environ.get("NODE_NAME") or None, metavar="NAME",
                        help="this node's name, which selects the config rules that have `nodes` (default: "
                             "$NODE_NAME, which the DaemonSet sets from spec.nodeName)")
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
    settings = LoopSettings(config_path=args.config or DEFAULT_CONFIG, use_inotify=not args.poll)
    lock = NodeLock(args.lock_file or default_lock_path())
    if args.once:
        wait_for_node_lock(lock, wakeup, log=log)  # never stopped: --once waits for the running agent to exit
        backend, others = make_backend(args.backend, options, runner, variant=args.iptables_variant, log=log,
                                       generation=nftables_generation)
        return _agent(backend, others, options, settings, runner, log, args, AgentStatus(
            version=__version__, backend=backend.name)).once()
    # the endpoints come up first: while this agent waits for the node lock it is alive, and says why not ready
    status = AgentStatus(version=__version__, backend="")
    status.settings = agent_settings(args, settings.config_path)
    server = _serve_status(status, args.metrics_address, log)
    signal.signal(signal.SIGTERM, lambda *_: wakeup.request_stop())
    signal.signal(signal.SIGINT, lambda *_: wakeup.request_stop())
    signal.signal(signal.SIGHUP, lambda *_: wakeup.request_resync())
    try:
        if not wait_for_node_lock(lock, wakeup, log=log, observer=status, announce=True):
            log.info("agent stopping: it never held the node lock, nothing written")
            return 0
        # chosen only now: what the node holds may have changed while the other agent ran
        backend, others = make_backend(args.backend, options, runner, variant=args.iptables_variant, log=log,
                                       generation=nftables_generation)
        status.backend = backend.name
        status.settings["backend"] = backend.name
        _agent(backend, others, options, settings, runner, log, args, status).run(wakeup)
    finally:
        if server is not None:
            server.stop()
    return 0


def _agent(backend: Backend, others: tuple[Removable, ...], options: PolicyOptions, settings: LoopSettings,
           runner: Runner, log: logging.Logger, args: argparse.Namespace, status: AgentStatus) -> Agent:
    on_change = conntrack_flusher(runner, log) if args.flush_conntrack else None
    # the count of foreign NAT rules is a metric: --once serves none, so it does not read every table again for it
    count_foreign = None if args.once else lambda: count_foreign_masquerade(runner)
    fingerprint = KernelFingerprint(xtables_lock=xtables_lock_path())
    reconciler = Reconciler(backend, options, log=log, others=others, on_policy_change=on_change,
                            count_foreign=count_foreign, fingerprint=fingerprint)
    return Agent(reconciler, settings, log=log, observer=status)


def _serve_status(status: AgentStatus, address: str, log: logging.Logger) -> StatusServer | None:
    if not address:
        return None
    server = StatusServer(status, address)
    server.start(wait_if_in_use=True, log=log)
    if server.serving:
        log.info("serving /metrics, /healthz and /readyz on %s", address)
    return server
