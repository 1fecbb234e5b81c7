"""A fleet in the lab: four GKE-like nodes, the real agent on each, a real Prometheus watching them.

    pod-x1 ─ gke-prod-default-pool-1a2b3c4d-x1 ─┐
    pod-x2 ─ gke-prod-default-pool-1a2b3c4d-x2 ─┤  vpc (a bridge: the nodes' subnet 10.142.0.0/20, and the router
    pod-y1 ─ gke-prod-egress-pool-5e6f7a8b-y1  ─┤       that routes each node's pod range to it, like alias IPs)
    pod-y2 ─ gke-prod-egress-pool-5e6f7a8b-y2  ─┤   ├─ peer: one probe server on several addresses, logging the
               monitoring (Prometheus :9090)   ─┘   │        source each connection arrived with

Every node has its own ConfigMap directory, updated the way kubelet does; Prometheus scrapes every agent at
NODE_IP:9847 with `node` and `pool` labels and evaluates the product's alert rules with short `for:` durations.

The scenario `fleet-rollout`: (1) one config everywhere, (2) a changed config rolled out node by node, each node's
convergence read from Prometheus (`ipmasq_enforced_config_info{config_hash}`), (3) one node's rules deleted again
and again until its drift alert fires, (4) one node given an invalid config: `ipmasq_config_valid` 0, the alert
pending then firing, its last good rules kept; after each step every node's pod probes the peer and the source the
peer saw must equal explain's answer for that node's enforced policy. Every wait is for a condition, with a deadline.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ipmasq.cloudnat import follow_path
from ipmasq.errors import FleetError, IpmasqError, NetnsError
from ipmasq.lab.kubelet import publish
from ipmasq.lab.netns import Namespace, Network, stop_process
from ipmasq.lab.prometheus import FiredAlert, PrometheusServer, ScrapeTarget
from ipmasq.lab.scenarios import GKE_FLAGS, GKE_OPTIONS, policy_for
from ipmasq.lab.topology import OPEN_PORT
from ipmasq.lab.wait import until
from ipmasq.policy.hash import config_hash, policy_hash

__all__ = ["FLEET", "FleetLab", "FleetNode", "FleetResult", "NodeReport", "build_fleet", "run_fleet_rollout"]

METRICS_PORT = 9847
ALERT_FOR_SECONDS = 2.0
CONVERGE_TIMEOUT = 20.0
ALERT_TIMEOUT = 25.0
POLL_SECONDS = 0.2
STAGGER_SECONDS = 0.4  # between two nodes' kubelet updates: the rollout shows in the convergence times
MONITOR_ADDRESS = "10.142.15.250"
ROUTER_ADDRESS = "10.142.0.1"

# The peer's addresses: a VPN/on-prem endpoint inside 10/8, an AWS VPC host, a VPC VM, an internet host.
ONPREM = "10.2.1.100"
AWS = "172.30.12.110"
VPC_VM = "10.130.0.6"
INTERNET = "34.120.0.10"
DESTINATIONS = (ONPREM, AWS, VPC_VM, INTERNET)

# The rollout flips two destinations: the AWS VPC starts seeing pod IPs, the on-prem endpoint the node IP.
INITIAL_CONFIG = "nonMasqueradeCIDRs:\n  - 10.0.0.0/8\nresyncInterval: 1s\n"
ROLLOUT_CONFIG = ("nonMasqueradeCIDRs:\n  - 10.0.0.0/8\n  - 172.16.0.0/12\nmasqueradeCIDRs:\n  - 10.2.1.100/32\n"
                  "resyncInterval: 1s\n")
INVALID_CONFIG = "nonMasqueradeCIDRs:\n  - 10.0.0.0/8\n  - 172.16.0.0/33\nresyncInterval: 1s\n"

DRIFT_ALERT = "IpMasqAgentDriftRepairs"
INVALID_ALERT = "IpMasqAgentConfigInvalid"
MAX_TAMPERS = 12  # the drift alert wants repeated repairs ("something keeps rewriting"); bounded all the same


@dataclass(frozen=True)
class FleetNode:
    name: str
    pool: str
    node_ip: str
    pod_ip: str
    pod_range: str

    @property
    def short(self) -> str:
        return self.name.rsplit("-", 1)[1]


def _node(name: str, pool: str, index: int) -> FleetNode:
    return FleetNode(name, pool, f"10.142.0.{11 + index}", f"10.44.{index + 1}.15", f"10.44.{index + 1}.0/24")


FLEET: tuple[FleetNode, ...] = (
    _node("gke-prod-default-pool-1a2b3c4d-x1", "default-pool", 0),
    _node("gke-prod-default-pool-1a2b3c4d-x2", "default-pool", 1),
    _node("gke-prod-egress-pool-5e6f7a8b-y1", "egress-pool", 2),
    _node("gke-prod-egress-pool-5e6f7a8b-y2", "egress-pool", 3),
)
TAMPERED = FLEET[2].name
INVALID = FLEET[3].name


@dataclass
class FleetLab:
    net: Network
    workdir: str
    nodes: tuple[FleetNode, ...]
    backend: str
    agents: dict[str, subprocess.Popen[str]] = field(default_factory=dict)
    servers: list[subprocess.Popen[str]] = field(default_factory=list)
    prometheus: PrometheusServer | None = None

    def node_ns(self, node: FleetNode) -> Namespace:
        return self.net[node.name]

    def pod_ns(self, node: FleetNode) -> Namespace:
        return self.net[f"pod-{node.short}"]

    def config_dir(self, node: FleetNode) -> str:
        return os.path.join(self.workdir, "configmaps", node.name)

    @property
    def peer_log(self) -> str:
        return os.path.join(self.workdir, "peer.log")

    def start_agent(self, node: FleetNode) -> None:
        log = open(os.path.join(self.workdir, f"agent-{node.name}.log"), "a")  # noqa: SIM115 - the agent owns it
        config = os.path.join(self.config_dir(node), "ip-masq-agent")
        argv = [sys.executable, "-m", "ipmasq", "agent", "--config", config, "--backend", self.backend, *GKE_FLAGS,
                f"--metrics-address={node.node_ip}:{METRICS_PORT}",
                # the node lock in the lab's own directory: nothing is left in the machine's /run
                f"--lock-file={os.path.join(self.workdir, f'agent-{node.name}.lock')}"]
        self.agents[node.name] = self.node_ns(node).popen(argv, stdout=log, stderr=subprocess.STDOUT)
        log.close()

    def probe(self, node: FleetNode) -> dict[str, str | None]:
        """Connect from the node's pod to every destination; the source the peer saw for each (None: no connection)."""
        offset = os.path.getsize(self.peer_log) if os.path.exists(self.peer_log) else 0
        self.node_ns(node).run(["conntrack", "-F"], check=False)  # a fresh connection gets today's NAT decision
        result = self.pod_ns(node).run(
            [sys.executable, "-m", "ipmasq.lab.probe", "connect-many", "--timeout", "1.0",
             *[f"{d}:{OPEN_PORT}" for d in DESTINATIONS]], check=False, timeout=30)
        connected = {line.rpartition(" ")[0].rpartition(":")[0]: line.rpartition(" ")[2] != "FAILED"
                     for line in result.stdout.splitlines()}
        if set(connected) != set(DESTINATIONS):
            raise NetnsError(f"probe client on {node.name} failed: {result.stderr.strip() or result.stdout.strip()}")
        seen: dict[str, str | None] = dict.fromkeys(DESTINATIONS)
        with open(self.peer_log) as fh:
            fh.seek(offset)
            for line in fh:
                _verdict, destination, source = line.split()
                seen[destination] = source
        return {d: seen[d] if connected[d] else None for d in DESTINATIONS}

    def processes(self) -> list[subprocess.Popen[str]]:
        return [*self.agents.values(), *self.servers, *(self.prometheus.processes if self.prometheus else [])]

    def close(self) -> None:
        """Stop every process the lab started, then whatever still runs in its namespaces; remove its files."""
        if self.prometheus is not None:
            self.prometheus.stop()
        for proc in [*self.agents.values(), *self.servers]:
            stop_process(proc, timeout=3.0)
        self.agents.clear()
        self.servers.clear()
        for ns in self.net.namespaces.values():
            # a probe client cut short by Ctrl-C, for instance: only the lab's processes live in its namespaces
            pids = subprocess.run(["ip", "netns", "pids", ns.name], capture_output=True, text=True).stdout.split()
            for pid in pids:
                with contextlib.suppress(OSError, ValueError):  # gone meanwhile
                    os.kill(int(pid), signal.SIGKILL)
        shutil.rmtree(self.workdir, ignore_errors=True)


def build_fleet(net: Network, backend: str, *, nodes: tuple[FleetNode, ...] = FLEET) -> FleetLab:
    """The namespaces, the bridge, routes and the peer's probe server. `net` owns the namespaces' cleanup."""
    lab = FleetLab(net, tempfile.mkdtemp(prefix="ipmasq-fleet-"), nodes, backend)
    vpc, peer, monitor = net.add("vpc"), net.add("peer"), net.add("monitoring")
    vpc.sysctl("net.ipv4.ip_forward", "1")
    vpc.sysctl("net.ipv4.conf.all.rp_filter", "0")
    # many short connections from NATed sources on few ports: no TIME_WAIT left to refuse the next one
    peer.sysctl("net.ipv4.tcp_max_tw_buckets", "0")
    vpc.run(["ip", "link", "add", "nodes", "type", "bridge"])
    vpc.run(["ip", "addr", "add", f"{ROUTER_ADDRESS}/20", "dev", "nodes"])
    vpc.run(["ip", "link", "set", "nodes", "up"])

    def on_subnet(ns: Namespace, address: str) -> None:
        bridge_port, _ = net.link(vpc, [], ns, [f"{address}/20"])
        vpc.run(["ip", "link", "set", bridge_port, "master", "nodes"])
        ns.run(["ip", "route", "add", "default", "via", ROUTER_ADDRESS])

    for node in nodes:
        node_ns, pod_ns = net.add(node.name), net.add(f"pod-{node.short}")
        node_ns.sysctl("net.ipv4.ip_forward", "1")
        node_ns.sysctl("net.ipv4.conf.all.rp_filter", "0")
        gateway = node.pod_range.replace(".0/24", ".1")
        net.link(pod_ns, [f"{node.pod_ip}/24"], node_ns, [f"{gateway}/24"])
        pod_ns.run(["ip", "route", "add", "default", "via", gateway])
        on_subnet(node_ns, node.node_ip)
        vpc.run(["ip", "route", "add", node.pod_range, "via", node.node_ip])  # alias IP ranges are VPC-routable
    on_subnet(monitor, MONITOR_ADDRESS)
    net.link(vpc, ["10.250.0.1/30"], peer, ["10.250.0.2/30"])
    peer.run(["ip", "route", "add", "default", "via", "10.250.0.1"])
    for address in DESTINATIONS:
        peer.run(["ip", "addr", "add", f"{address}/32", "dev", "lo"])
        vpc.run(["ip", "route", "add", f"{address}/32", "via", "10.250.0.2"])
    server = peer.popen([sys.executable, "-m", "ipmasq.lab.probe", "serve", str(OPEN_PORT), "--log", lab.peer_log],
                        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    lab.servers.append(server)
    assert server.stdout is not None
    if server.stdout.readline().strip() != "ready":
        raise NetnsError("the peer's probe server did not start")
    return lab


# ---- the scenario ----


@dataclass(frozen=True)
class ProbeCheck:
    step: str
    destination: str
    predicted_source: str | None
    seen_source: str | None

    @property
    def ok(self) -> bool:
        return self.seen_source == self.predicted_source


@dataclass
class NodeReport:
    name: str
    pool: str
    config_hash: str | None = None  # what Prometheus last reported this node enforces
    seconds_to_converge: float | None = None  # from the rollout's start to Prometheus showing the new hash
    alerts_seen: set[tuple[str, str]] = field(default_factory=set)  # (alert, state)
    probes: list[ProbeCheck] = field(default_factory=list)

    @property
    def probes_ok(self) -> bool:
        return bool(self.probes) and all(p.ok for p in self.probes)

    def alert_list(self) -> list[str]:
        order = {"pending": 0, "firing": 1}
        return [f"{name} {state}" for name, state in sorted(self.alerts_seen, key=lambda a: (a[0], order.get(a[1], 2)))]

    def as_dict(self) -> dict[str, object]:
        return {"name": self.name, "pool": self.pool, "config_hash": self.config_hash,
                "seconds_to_converge": None if self.seconds_to_converge is None else round(self.seconds_to_converge, 2),
                "alerts_seen": self.alert_list(), "probes_ok": self.probes_ok,
                "probes": [{"step": p.step, "destination": p.destination, "predicted_source": p.predicted_source,
                            "seen_source": p.seen_source, "ok": p.ok} for p in self.probes]}


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str


@dataclass
class FleetResult:
    backend: str
    initial_hash: str
    rollout_hash: str
    nodes: list[NodeReport]
    checks: list[Check] = field(default_factory=list)
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.checks) and all(c.ok for c in self.checks)

    @property
    def verdict(self) -> str:
        if self.ok:
            return "the fleet behaved as its metrics, alerts and explain predict"
        failed = [c.name for c in self.checks if not c.ok]
        return "FLEET DIFFERS: " + "; ".join([*failed, *([self.error] if self.error else [])])

    def as_dict(self) -> dict[str, object]:
        return {"scenario": "fleet-rollout", "backend": self.backend, "ok": self.ok, "verdict": self.verdict,
                "error": self.error, "initial_config_hash": self.initial_hash, "rollout_config_hash": self.rollout_hash,
                "nodes": [n.as_dict() for n in self.nodes],
                "checks": [{"name": c.name, "ok": c.ok, "detail": c.detail} for c in self.checks]}


def expected_hash(config: str) -> str:
    """The hash `ipmasq render --print-hash` prints for this config with the lab's agent flags."""
    return config_hash(policy_hash(policy_for(config, GKE_OPTIONS)))


class _Watch:
    """Polls Prometheus for the fleet's hashes, counters and alerts, recording every alert state it sees."""

    def __init__(self, lab: FleetLab, reports: dict[str, NodeReport]) -> None:
        assert lab.prometheus is not None
        self.prometheus = lab.prometheus
        self.lab = lab
        self.reports = reports

    def poll(self) -> dict[str, set[str]]:
        """Each node's enforced config hashes now (one, except for an instant mid-change), alerts recorded."""
        for alert in self.prometheus.alerts():
            self._record(alert)
        hashes: dict[str, set[str]] = {name: set() for name in self.reports}
        for labels, value in self.prometheus.query("ipmasq_enforced_config_info"):
            node = labels.get("node")
            if node in hashes and value == 1:
                hashes[node].add(labels.get("config_hash", ""))
        for name, seen in hashes.items():
            if len(seen) == 1:
                self.reports[name].config_hash = next(iter(seen))
        return hashes

    def _record(self, alert: FiredAlert) -> None:
        node = alert.label("node")
        if node in self.reports:
            self.reports[node].alerts_seen.add((alert.name, alert.state))

    def value(self, expr: str, node: str) -> float | None:
        for labels, value in self.prometheus.query(expr):
            if labels.get("node") == node:
                return value
        return None

    def until(self, what: str, condition: Callable[[], bool], *, timeout: float,
              between: Callable[[], None] | None = None) -> float:
        """Poll until `condition()` holds; seconds it took. The agents must stay up meanwhile."""
        def holds() -> bool:
            if condition():
                return True
            if between is not None:
                between()
            return False

        def exited() -> str | None:
            for name, proc in self.lab.agents.items():
                if proc.poll() is not None:
                    return (f"the agent on {name} exited with {proc.returncode} "
                            f"(log: {self.lab.workdir}/agent-{name}.log)")
            return None

        start = time.monotonic()
        until(holds, what, timeout=timeout, interval=POLL_SECONDS, gone=exited, error=FleetError)
        return time.monotonic() - start


def _probe_all(lab: FleetLab, step: str, reports: dict[str, NodeReport], enforced: dict[str, str]) -> bool:
    """Every node's pod probes the peer; each source must be explain's answer for the config the node enforces."""
    ok = True
    for node in lab.nodes:
        policy = policy_for(enforced[node.name], GKE_OPTIONS)
        for destination, seen in lab.probe(node).items():
            predicted = follow_path(policy.verdict(destination), pod_ip=node.pod_ip, node_ip=node.node_ip,
                                    cloud_nat=None).source_seen
            check = ProbeCheck(step, destination, predicted, seen)
            reports[node.name].probes.append(check)
            ok = ok and check.ok
    return ok


def run_fleet_rollout(lab: FleetLab, *, progress: Callable[[str], None] = lambda _: None) -> FleetResult:
    """The scenario on a built fleet (the caller closes it): steps in order, stopping at the first failed wait."""
    initial, rollout = expected_hash(INITIAL_CONFIG), expected_hash(ROLLOUT_CONFIG)
    reports = {n.name: NodeReport(n.name, n.pool) for n in lab.nodes}
    result = FleetResult(lab.backend, initial, rollout, list(reports.values()))
    checks = result.checks
    enforced = {n.name: INITIAL_CONFIG for n in lab.nodes}
    try:
        for node in lab.nodes:
            publish(lab.config_dir(node), INITIAL_CONFIG)
            lab.start_agent(node)
        lab.prometheus = PrometheusServer(lab.net["monitoring"], MONITOR_ADDRESS, os.path.join(lab.workdir, "prom"))
        lab.prometheus.start([ScrapeTarget(f"{n.node_ip}:{METRICS_PORT}", (("node", n.name), ("pool", n.pool)))
                              for n in lab.nodes], for_seconds=ALERT_FOR_SECONDS)
        watch = _Watch(lab, reports)

        # (1) one config everywhere
        took = watch.until("every node reporting the initial config's hash",
                           lambda: all(h == {initial} for h in watch.poll().values()), timeout=CONVERGE_TIMEOUT)
        checks.append(Check("initial config enforced everywhere", True,
                            f"Prometheus shows {initial} on {len(lab.nodes)} nodes after {took:.1f} s"))
        progress(f"initial config {initial} enforced on every node")
        checks.append(Check("probes follow the initial config", _probe_all(lab, "initial", reports, enforced), ""))

        # (2) the change rolls out, one kubelet after the other
        start = time.monotonic()
        pending = list(lab.nodes)
        next_publish = start

        def publish_due() -> None:
            nonlocal next_publish
            while pending and time.monotonic() >= next_publish:
                node = pending.pop(0)
                publish(lab.config_dir(node), ROLLOUT_CONFIG)
                enforced[node.name] = ROLLOUT_CONFIG
                next_publish += STAGGER_SECONDS

        def converged() -> bool:
            hashes = watch.poll()
            now = time.monotonic() - start
            for name, seen in hashes.items():
                if seen == {rollout} and reports[name].seconds_to_converge is None:
                    reports[name].seconds_to_converge = now
            return not pending and all(h == {rollout} for h in hashes.values())

        publish_due()
        took = watch.until("every node reporting the new config's hash", converged, timeout=CONVERGE_TIMEOUT,
                           between=publish_due)
        checks.append(Check("config change converged on every node", True,
                            f"Prometheus shows {rollout} on every node {took:.1f} s after the rollout began"))
        progress(f"config {rollout} rolled out in {took:.1f} s")
        checks.append(Check("probes follow the new config", _probe_all(lab, "rollout", reports, enforced), ""))

        # (3) something keeps deleting one node's rules: the agent repairs, the drift alert fires
        tampered = next(n for n in lab.nodes if n.name == TAMPERED)
        before = watch.value("ipmasq_drift_repairs_total", TAMPERED) or 0.0
        tampers = 0
        repairs = before

        def drift_alert_firing() -> bool:
            watch.poll()
            return (DRIFT_ALERT, "firing") in reports[TAMPERED].alerts_seen

        def tamper_after_each_repair() -> None:
            nonlocal tampers, repairs
            now = watch.value("ipmasq_drift_repairs_total", TAMPERED) or 0.0
            if (tampers == 0 or now > repairs) and tampers < MAX_TAMPERS:
                repairs = now
                lab.node_ns(tampered).run([sys.executable, "-m", "ipmasq", "uninstall", f"--masq-chain="
                                           f"{GKE_OPTIONS.masq_chain}"])
                tampers += 1

        tamper_after_each_repair()
        took = watch.until(f"{DRIFT_ALERT} firing for {TAMPERED}", drift_alert_firing, timeout=ALERT_TIMEOUT,
                           between=tamper_after_each_repair)
        # Prometheus may still hold a scrape from before the last deletion: only a repair counted after it (the
        # counter past its value when we deleted) says the rules the probes go through are back
        watch.until(f"{TAMPERED} enforcing its config again",
                    lambda: (watch.value("ipmasq_drift_repairs_total", TAMPERED) or 0.0) > repairs
                    and watch.poll()[TAMPERED] == {rollout} and watch.value("ipmasq_ready", TAMPERED) == 1,
                    timeout=CONVERGE_TIMEOUT)
        after = watch.value("ipmasq_drift_repairs_total", TAMPERED) or 0.0
        checks.append(Check("drift repaired and alerted", after > before,
                            f"{TAMPERED}: rules deleted {tampers} times, ipmasq_drift_repairs_total {before:g} -> "
                            f"{after:g}, {DRIFT_ALERT} firing after {took:.1f} s"))
        progress(f"{TAMPERED}: {tampers} deletions repaired, {DRIFT_ALERT} firing")
        checks.append(Check("probes follow the config after the repair", _probe_all(lab, "repaired", reports,
                                                                                    enforced), ""))

        # (4) one node gets an invalid config: it says so, alerts, and keeps its last good rules
        invalid = next(n for n in lab.nodes if n.name == INVALID)
        publish(lab.config_dir(invalid), INVALID_CONFIG)  # `enforced` keeps the last good config: the agent should

        def invalid_alert_firing() -> bool:
            watch.poll()
            return (INVALID_ALERT, "firing") in reports[INVALID].alerts_seen

        took = watch.until(f"{INVALID_ALERT} firing for {INVALID}", invalid_alert_firing, timeout=ALERT_TIMEOUT)
        valid = watch.value("ipmasq_config_valid", INVALID)
        hashes = watch.poll()
        states = sorted((s for a, s in reports[INVALID].alerts_seen if a == INVALID_ALERT),
                        key=lambda state: state != "pending")
        kept = ", ".join(sorted(hashes[INVALID])) or "nothing"
        checks.append(Check("invalid config refused and alerted",
                            valid == 0 and "pending" in states and hashes[INVALID] == {rollout},
                            f"{INVALID}: ipmasq_config_valid {valid:g}, {INVALID_ALERT} {' then '.join(states)} "
                            f"after {took:.1f} s, still enforcing {kept}"))
        progress(f"{INVALID}: invalid config refused, {INVALID_ALERT} firing, last good config kept")
        checks.append(Check("probes follow the last good config", _probe_all(lab, "invalid", reports, enforced), ""))

        # node-specific alerts only where the scenario caused them
        stray = [f"{r.name}: {a}" for r in reports.values() for a, s in r.alerts_seen
                 if s == "firing" and (r.name, a) not in {(TAMPERED, DRIFT_ALERT), (INVALID, INVALID_ALERT)}]
        checks.append(Check("no other alert fired", not stray, "; ".join(stray)))
    except (IpmasqError, subprocess.TimeoutExpired) as exc:
        result.error = str(exc)
    return result
