"""`ipmasq agent`: the node agent, a drop-in for ip-masq-agent (same flags, config file, chain and rules)."""

from __future__ import annotations

import argparse
import logging
import os
import signal
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from ipmasq import __version__
from ipmasq.agent.health import DEFAULT_METRICS_ADDRESS, EndpointServer
from ipmasq.agent.logs import LOG_FORMATS, configure_logging
from ipmasq.agent.loop import (
    Agent,
    ConfigChooser,
    Listeners,
    LoopListener,
    LoopSettings,
    Wakeup,
    read_config,
    wait_for_node_lock,
)
from ipmasq.agent.metrics import AgentVitals
from ipmasq.agent.nodelock import DEFAULT_LOCK_DIRECTORY, NodeLock, default_lock_path
from ipmasq.agent.reconcile import Reconciler
from ipmasq.backends.base import Backend, Removable, Runner
from ipmasq.backends.choose import count_foreign_masquerade, make_backend
from ipmasq.backends.generation import KernelFingerprint, nftables_generation
from ipmasq.backends.runner import SubprocessRunner
from ipmasq.backends.xtables_lock import xtables_lock_path
from ipmasq.commands.common import add_backend_flags, add_policy_flags, agent_settings, options_from_args
from ipmasq.conntrack import conntrack_flusher
from ipmasq.errors import ApiError, IpmasqError, UsageError
from ipmasq.goflags import go_bool
from ipmasq.kube import credentials as kube_credentials
from ipmasq.kube import kubeconfig
from ipmasq.options import DEFAULT_CHAIN, PolicyOptions
from ipmasq.version import VersionAction

if TYPE_CHECKING:  # the API features' modules load only when the API is used (see _api)
    from ipmasq.agent.api.report import ApiReporter
    from ipmasq.writers import Writer

__all__ = ["DEFAULT_CONFIG", "register"]

DEFAULT_CONFIG = "/etc/config/ip-masq-agent"
DEFAULT_CONFIGMAP = "ip-masq-agent"
DEFAULT_CONFIGMAP_KEY = "config"  # the key the reference's manifests mount as the file ip-masq-agent


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
    parser.add_argument("--observe", metavar="WRITER", type=_writer_name,
                        help="observe mode: another program (WRITER, e.g. gke or reference: named in the status) "
                             "writes the node's nat rules with the policy flags given here (e.g. --masq-chain "
                             "IP-MASQ --nomasq-all-reserved-ranges for GKE's agent); aks and eks: that provider's "
                             "agent, its chain and flags, compared with its own inputs read through the API server "
                             "(AKS's two ConfigMaps merged as AKS merges them; the aws-node DaemonSet's env); never "
                             "write netfilter, conntrack or the node lock, and report whether its rules enforce the "
                             "config (status, Events, metrics, `ipmasq status`); ready while observing, whatever the "
                             "rules say")
    parser.add_argument("--poll", action="store_true", help="poll the config instead of using inotify")
    parser.add_argument("--observe-interval", type=_seconds, default=None, metavar="SECONDS",
                        help="observe mode: how often the rules are looked at (default 2; a look reads nothing "
                             "while the kernel says no rule changed)")
    parser.add_argument("--flush-conntrack", type=go_bool, default=False, metavar="BOOL",
                        help="after a config change, delete the conntrack entries of destinations whose verdict "
                             "changed, so connections already retrying (SYN retransmissions) get the new decision")
    parser.add_argument("--metrics-address", default=DEFAULT_METRICS_ADDRESS, metavar="HOST:PORT",
                        help="serve /metrics, /healthz and /readyz here (default %(default)s, loopback only: "
                             "`ipmasq health` queries it from an exec probe); empty: no endpoints")
    parser.add_argument("--prometheus-address", default="", metavar="HOST:PORT",
                        help="also serve /metrics, and only /metrics, here: for Prometheus to scrape the agent from "
                             "outside the node, in either mode (the DaemonSet passes the node's own address, "
                             "$(HOST_IP):9848; an observer's, 9849); default empty: not served")
    parser.add_argument("--prometheus-rule-metrics", type=go_bool, default=False, metavar="BOOL",
                        help="also serve the per-rule series (ipmasq_rule_packets_total, ipmasq_rule_bytes_total, "
                             "labelled with the config rules' names) on --prometheus-address; default false: the "
                             "node's address is open to the pod network, and the rules' names and traffic are the "
                             "config's to tell (the loopback --metrics-address always serves them)")
    parser.add_argument("--lock-file", metavar="PATH",
                        help="the node lock: only the agent holding it writes rules, another one waits (a rolling "
                             f"update); default {DEFAULT_LOCK_DIRECTORY}/agent-netns-<inode>.lock, one per network "
                             "namespace (mount the directory from the host)")
    parser.add_argument("--node-name", default=os.environ.get("NODE_NAME") or None, metavar="NAME",
                        help="this node's name, which selects the config rules that have `nodes` (default: "
                             "$NODE_NAME, which the DaemonSet sets from spec.nodeName)")
    api = parser.add_argument_group("the API server (config at once from the ConfigMap, Events, the node's status)")
    api.add_argument("--api", choices=("auto", "off"), default="auto",
                     help="auto (default): use the API server when in a pod with a service-account token, or "
                          "with --kubeconfig; off: the mounted file only, no Events, no status (the reference's way)")
    api.add_argument("--kubeconfig", metavar="PATH", help="reach the API server with this kubeconfig instead of the "
                     "pod's service account")
    api.add_argument("--configmaps", default=DEFAULT_CONFIGMAP, metavar="NAME[,NAME...]",
                     help="the ConfigMaps to follow (default %(default)s; several are merged as the directory form "
                          "merges files, in name order)")
    api.add_argument("--configmap-namespace", metavar="NAMESPACE",
                     help="their namespace (default: the pod's own, else kube-system)")
    api.add_argument("--configmap-key", default=DEFAULT_CONFIGMAP_KEY, metavar="KEY",
                     help="the key holding the config in each ConfigMap (default %(default)s, as the reference's "
                          "manifests mount it)")
    api.add_argument("--summary-lease", default=DEFAULT_CONFIGMAP, metavar="NAME",
                     help="the Lease (in the ConfigMaps' namespace) whose holder, one agent of the fleet, writes the "
                          "fleet's verdict on the ConfigMap as at most two Events ('rejected on 998 of 1,000 "
                          "nodes: ...'); default %(default)s; empty: this agent never writes it")
    api.add_argument("--pod-name", default=os.environ.get("POD_NAME") or None, metavar="NAME",
                     help="this agent's pod, named in its status (default: $POD_NAME)")
    parser.add_argument("--log-format", choices=LOG_FORMATS, default="text",
                        help="one line per event, as text or JSON (default %(default)s)")
    parser.add_argument("--version", action=VersionAction)
    # klog flags of existing manifests: accepted, ignored (we log one line per event to stderr)
    parser.add_argument("-v", "--v", help=argparse.SUPPRESS)
    for flag in ("--log_dir", "--stderrthreshold", "--vmodule"):
        parser.add_argument(flag, help=argparse.SUPPRESS)
    for flag in ("--logtostderr", "--alsologtostderr"):
        parser.add_argument(flag, help=argparse.SUPPRESS)
    parser.set_defaults(func=run)


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.01 <= value <= 3600:
        raise argparse.ArgumentTypeError(f"not a number of seconds from 0.01 to 3600: {text[:20]!r}")
    return value


def _writer_name(text: str) -> str:
    if not text or len(text) > 63 or not all(c.isascii() and (c.isalnum() or c in "-_.") for c in text):
        raise argparse.ArgumentTypeError(f"not a writer's name (letters, digits, - _ .): {text[:63]!r}")
    return text


def run(args: argparse.Namespace) -> int:
    options = options_from_args(args)
    log = configure_logging(args.log_format)
    wakeup = Wakeup()
    runner = SubprocessRunner(cancel=wakeup.stop)
    settings = LoopSettings(config_path=args.config or DEFAULT_CONFIG, use_inotify=not args.poll)
    if args.observe:
        return _observe(args, options, settings, runner, log, wakeup)
    if args.observe_interval is not None:
        raise UsageError("--observe-interval goes with --observe")
    lock = NodeLock(args.lock_file or default_lock_path())
    if args.once:
        wait_for_node_lock(lock, wakeup, log=log)  # never stopped: --once waits for the running agent to exit
        backend, others = make_backend(args.backend, options, runner, variant=args.iptables_variant, log=log,
                                       generation=nftables_generation)
        return _agent(backend, others, options, settings, runner, log, args, AgentVitals(
            version=__version__, backend=backend.name)).once()
    # the endpoints come up first: while this agent waits for the node lock it is alive, and says why not ready
    vitals = AgentVitals(version=__version__, backend="")
    vitals.settings = agent_settings(args, settings.config_path)
    endpoints = _serve_endpoints(vitals, args, log)
    signal.signal(signal.SIGTERM, lambda *_: wakeup.request_stop())
    signal.signal(signal.SIGINT, lambda *_: wakeup.request_stop())
    signal.signal(signal.SIGHUP, lambda *_: wakeup.request_resync())
    try:
        api_config, reporter = _api(args, log, wakeup, facts=vitals)
        listener: LoopListener = vitals if reporter is None else Listeners(vitals, reporter)
        if not wait_for_node_lock(lock, wakeup, log=log, listener=listener, announce=True):
            log.info("agent stopping: it never held the node lock, nothing written")
            return 0
        # chosen only now: what the node holds may have changed while the other agent ran
        backend, others = make_backend(args.backend, options, runner, variant=args.iptables_variant, log=log,
                                       generation=nftables_generation)
        vitals.backend = backend.name
        vitals.settings["backend"] = backend.name
        if reporter is not None:
            reporter.narrator.set_backend(backend.name)
        _agent(backend, others, options, settings, runner, log, args, listener, api_config).run(wakeup)
    finally:
        _stop(endpoints)
    return 0


def _observe(args: argparse.Namespace, options: PolicyOptions, settings: LoopSettings, runner: Runner,
             log: logging.Logger, wakeup: Wakeup) -> int:
    """Observe mode (ipmasq.observe.observer): the loop drives an Observer; no node lock, no backend that writes, no
    conntrack; the same endpoints, API features and reports as the enforcing agent. aks and eks: that provider's
    profile and inputs (ipmasq.observe.provider_inputs), which only the API server holds."""
    from ipmasq.observe.observer import OBSERVE_POLL_SECONDS, Observer, reference_reading
    from ipmasq.writers import REFERENCE_CONFIGMAP, WRITERS

    if args.flush_conntrack:
        raise UsageError("--observe never writes: --flush-conntrack cannot go with it")
    # a provider's agent whose inputs are more than the ip-masq-agent ConfigMap (which the agent follows as when it
    # enforces, with the flags given) and whose truth is a chain (Cilium's is a BPF map): AKS's, EKS's
    profile = WRITERS.get(args.observe)
    extra: dict[str, Any] = {}
    if profile is None or profile.chain is None:
        profile = None
    elif profile.daemonset is None and profile.configmaps == (REFERENCE_CONFIGMAP,):
        # the reference's reading (reference, gke) of the ConfigMap followed as when enforcing, under the flags
        # given: the keys that agent ignores are said (ignored-by-writer), never compared
        load, compare = reference_reading(profile)
        extra = {"load": load, "compare": compare}
        profile = None
    if profile is not None:
        from ipmasq.observe.provider_inputs import compare_for, load_for  # the API's modules: only with the API

        options = _profile_options(args, profile.name, profile.options)
        extra = {"load": load_for(profile), "compare": compare_for(profile)}
    backend = args.backend if profile is None or args.backend != "auto" else profile.backend_hint
    observer_pass = Observer(options, runner, log=log, writer=args.observe, backend=backend,
                             fingerprint=KernelFingerprint(xtables_lock=xtables_lock_path()),
                             poll=args.observe_interval or OBSERVE_POLL_SECONDS, **extra)
    if profile is not None and (args.once or args.api == "off"):
        raise UsageError(f"--observe {profile.name} compares with that provider's inputs, which only the API server "
                         f"holds: {'--once' if args.once else '--api off'} cannot go with it")
    if args.once:
        observer_pass.take_config(read_config(settings.config_path))
        return 0 if observer_pass.reconcile().result.verified else 1
    vitals = AgentVitals(version=__version__, backend=observer_pass.backend.name)
    vitals.settings = agent_settings(args, settings.config_path)
    vitals.settings["backend"] = observer_pass.backend.name
    endpoints = _serve_endpoints(vitals, args, log)  # an observer is scraped as an enforcing agent is
    signal.signal(signal.SIGTERM, lambda *_: wakeup.request_stop())
    signal.signal(signal.SIGINT, lambda *_: wakeup.request_stop())
    signal.signal(signal.SIGHUP, lambda *_: wakeup.request_resync())
    try:
        api_config, reporter = _api(args, log, wakeup, mode="observe", writer=args.observe, chain=options.masq_chain,
                                    inputs=profile, facts=vitals)
        if profile is not None:
            from ipmasq.observe.provider_inputs import WriterInputs

            if not isinstance(api_config, WriterInputs):
                raise UsageError(f"--observe {profile.name} compares with that provider's inputs, which only the API "
                                 "server holds, and it is not used (above): not observed")
        listener: LoopListener = vitals if reporter is None else Listeners(vitals, reporter)
        if reporter is not None:
            reporter.narrator.set_backend(observer_pass.backend.name)
        log.info("observe mode: the rules %s writes in %s are compared with the config; this agent writes nothing",
                 args.observe, options.masq_chain)
        Agent(observer_pass, settings, log=log, listener=listener, api_config=api_config).run(wakeup)
    finally:
        _stop(endpoints)
    return 0


def _profile_options(args: argparse.Namespace, writer: str, options: PolicyOptions) -> PolicyOptions:
    """A provider's profile runs with that agent's own flags: any policy or ConfigMap flag given is refused."""
    given = [flag for flag, value, default in (
        ("--masq-chain", args.masq_chain, DEFAULT_CHAIN), ("--nomasq-all-reserved-ranges",
                                                           args.nomasq_all_reserved_ranges, False),
        ("--random-fully", args.random_fully, True), ("--to-ports", args.to_ports, ""),
        ("--configmaps", args.configmaps, DEFAULT_CONFIGMAP), ("--configmap-key", args.configmap_key,
                                                               DEFAULT_CONFIGMAP_KEY)) if value != default]
    if given:
        raise UsageError(f"--observe {writer} runs with that agent's own flags and inputs: drop {', '.join(given)}")
    return replace(options, node_name=args.node_name)


def _agent(backend: Backend, others: tuple[Removable, ...], options: PolicyOptions, settings: LoopSettings,
           runner: Runner, log: logging.Logger, args: argparse.Namespace, listener: LoopListener,
           api_config: ConfigChooser | None = None) -> Agent:
    on_change = conntrack_flusher(runner, log) if args.flush_conntrack else None
    # the count of foreign NAT rules is a metric: --once serves none, so it does not read every table again for it
    count_foreign = None if args.once else lambda: count_foreign_masquerade(runner)
    fingerprint = KernelFingerprint(xtables_lock=xtables_lock_path())
    reconciler = Reconciler(backend, options, log=log, others=others, on_policy_change=on_change,
                            count_foreign=count_foreign, fingerprint=fingerprint)
    return Agent(reconciler, settings, log=log, listener=listener, api_config=api_config)


def _api(args: argparse.Namespace, log: logging.Logger, wakeup: Wakeup, *, mode: str = "enforce",
         writer: str | None = None, chain: str = "", inputs: Writer | None = None,
         facts: AgentVitals | None = None) -> tuple[ConfigChooser | None, ApiReporter | None]:
    """The API server's part, when there is one: the ConfigMaps followed, and the reporter of Events and status.

    Started before the node lock is taken (a waiting agent says so in an Event), but nothing here ever decides
    whether the agent runs: no credentials, or an API server that never answers, leave the agent on its file."""
    if args.api == "off":
        return None, None
    try:
        credentials = (kubeconfig.load(args.kubeconfig) if args.kubeconfig
                       else kube_credentials.in_cluster())
    except ApiError as exc:
        raise UsageError(f"--kubeconfig: {exc}") from None
    if credentials is None:
        log.info("no service-account token and no --kubeconfig: the config comes from the mounted file only, and "
                 "no Events or status are written")
        return None, None
    if not args.node_name:
        log.warning("the API server is not used: its features need the node's name (--node-name or $NODE_NAME); "
                    "the config comes from the mounted file only")
        return None, None
    # imported here, the one place the API features start: TLS and HTTP cost about 6 MiB, and the agent without
    # them keeps its own, smaller budget (docs/measurements.md)
    from ipmasq.agent.api.wiring import start_api
    from ipmasq.kube.client import KubeClient

    try:
        client = KubeClient(credentials)
    except ApiError as exc:
        raise UsageError(str(exc)) from None
    namespace = args.configmap_namespace or kube_credentials.pod_namespace() or "kube-system"
    names = [name for name in args.configmaps.split(",") if name]
    if not names:
        raise UsageError("--configmaps: no ConfigMap named")
    api_config, reporter = start_api(client, args.node_name, pod=args.pod_name, namespace=namespace, names=names,
                                     key=args.configmap_key, summary_lease=args.summary_lease, log=log,
                                     poke=wakeup.request_look, stop=wakeup.stop, mode=mode, writer=writer,
                                     chain=chain, inputs=inputs, facts=facts)
    if inputs is not None:
        log.info("API server %s: following %s's inputs in kube-system (%s); Events and status for node %s",
                 credentials.server, inputs.name, ", ".join(inputs.configmaps) or f"daemonset/{inputs.daemonset}",
                 args.node_name)
        return api_config, reporter
    log.info("API server %s: following ConfigMap%s %s in %s (key %s); Events and status for node %s",
             credentials.server, "s" if len(names) > 1 else "", ", ".join(names), namespace, args.configmap_key,
             args.node_name)
    return api_config, reporter


def _serve_endpoints(vitals: AgentVitals, args: argparse.Namespace, log: logging.Logger) -> list[EndpointServer]:
    """Both endpoint servers of a running agent, in either mode: the status port (--metrics-address, the probes'),
    and the scrape port (--prometheus-address, the DaemonSet's declared port `metrics`)."""
    endpoints = []
    try:
        for address, metrics_only, flag in ((args.metrics_address, False, "--metrics-address"),
                                            (args.prometheus_address, True, "--prometheus-address")):
            server = _serve_status(vitals, address, log, metrics_only=metrics_only, flag=flag,
                                   rule_series=metrics_only and args.prometheus_rule_metrics)
            if server is not None:
                endpoints.append(server)
    except BaseException:
        _stop(endpoints)  # the one already serving, when the other cannot
        raise
    return endpoints


def _stop(endpoints: list[EndpointServer]) -> None:
    for endpoint in endpoints:
        endpoint.stop()


def _serve_status(vitals: AgentVitals, address: str, log: logging.Logger, *, metrics_only: bool = False,
                  flag: str = "--metrics-address", rule_series: bool = False) -> EndpointServer | None:
    if not address:
        return None
    server = EndpointServer(vitals, address, metrics_only=metrics_only, flag=flag, rule_series=rule_series)
    try:
        server.start(wait_if_in_use=True, log=log)
    except IpmasqError as exc:
        server.stop()
        # a malformed HOST:PORT is the operator's to fix (exit 2, as any flag); the status port is the probes'; but
        # a scrape listener that cannot bind is not worth the node's rules: the agent runs on without it, and
        # Prometheus says the target is down (IpMasqAgentDown)
        if not metrics_only or isinstance(exc, UsageError):
            raise
        log.error("%s; not serving /metrics for Prometheus", exc)
        return None
    if server.serving:
        log.info("serving %s on %s", server.what, address)
    return server
