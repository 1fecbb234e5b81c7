"""The machinery of the routed scenarios (ipmasq.lab.routed_scenarios): what a scenario is (its phases, what each
peer must see and why), the building blocks its node is made of (routers, pods, peers, the agent), and the run.

On these nodes the nat rules alone do not answer "which address will the partner's firewall see": ip rules pick a
route table by source, destination or firewall mark, mangle marks connections, and MASQUERADE takes the address of
whichever interface the route chose. Before each probe the run asks `ipmasq trace` on the node, as an operator would
(DEST --source POD --protocol tcp --port P, trace reading the node's routes and rules itself), and a probe is ok only
when the peer saw what the scenario says and trace predicted it. `dump_node_facts` (ipmasq.lab.facts) writes what a
node holds so that trace can be run on it offline.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ipmasq.errors import IpmasqError
from ipmasq.lab.facts import dump_node_facts, write_probes
from ipmasq.lab.kubelet import publish
from ipmasq.lab.netns import Namespace, Network, stop_process
from ipmasq.lab.topology import Lab, Probe, ProbeResult, start_probe_server
from ipmasq.options import PolicyOptions

__all__ = [
    "Expect", "RoutedLab", "RoutedOutcome", "RoutedPhase", "RoutedPhaseResult", "RoutedResult", "RoutedScenario",
    "Traced", "add_peers", "add_pod", "facts_directory", "forwarding", "node_interface", "run_routed", "start_agent",
    "trace_argv", "uplink_router",
]


# a connection's deadline: the first IPv6 packet over a freshly made uplink sometimes costs one SYN retransmission
# (1 s: measured, 4 runs in 10 of two-uplinks' first probe over eth1); a source is what these scenarios check, so
# the deadline leaves room for one retransmission, and a dropped connection costs it once
PROBE_TIMEOUT = 3.0


@dataclass(frozen=True)
class Expect:
    """One probe from a pod and what its peer must see (None: no connection: dropped on the way), and why.

    `leaves_by`: the node's interface the packet leaves by. `leaves_with`: the source it leaves the node with, where
    the network drops it after. `hops`: a multipath route's next hops, each (out interface, the source that hop
    gives): the kernel's hash of the flow picks one, so the peer sees one of them (`source` is None), and trace,
    which cannot know which, must say so and, asked about one hop (--out-interface), give that hop's source."""

    pod: str  # the pod namespace's role
    destination: str
    port: int
    source: str | None
    why: str
    leaves_by: str | None = None
    leaves_with: str | None = None
    hops: tuple[tuple[str, str], ...] = ()

    @property
    def probe(self) -> Probe:
        return Probe(self.destination, self.port)

    @property
    def node_source(self) -> str | None:
        """The source the packet has when it leaves the node (what a model of the node predicts)."""
        return self.source if self.leaves_with is None else self.leaves_with


@dataclass
class RoutedLab:
    """A routed node's world: its namespaces (roles `node`, the pods, routers, `peers`) and probe servers (the Lab),
    and the agent when the scenario runs it."""

    lab: Lab
    agent: subprocess.Popen[str] | None = None
    backend: str = "iptables"  # the agent's, where the scenario runs it

    @property
    def net(self) -> Network:
        return self.lab.net

    @property
    def node(self) -> Namespace:
        return self.lab.net["node"]

    def stop_agent(self) -> None:
        if self.agent is not None:
            stop_process(self.agent)
            self.agent = None


@dataclass(frozen=True)
class RoutedPhase:
    name: str
    configure: Callable[[RoutedLab], None]  # what changes on the node before the probes (run in order)
    expects: tuple[Expect, ...]


@dataclass(frozen=True)
class RoutedScenario:
    name: str
    summary: str
    build: Callable[[Lab], RoutedLab]  # the lab's namespaces and probe servers (which it owns) -> the node's world
    phases: tuple[RoutedPhase, ...]


@dataclass(frozen=True)
class Traced:
    """What `ipmasq trace DEST --source POD --protocol tcp --port P` on the node predicted, before the probe: the
    source the destination sees (None: it cannot say, or the node drops the packet; `reason` says which, and the
    field it asks for), the interface the packet leaves by, and for a multipath route each hop's answer
    (--out-interface)."""

    source: str | None
    reason: str | None
    interface: str | None
    hops: tuple[tuple[str, str | None], ...] = ()


@dataclass(frozen=True)
class RoutedOutcome:
    pod: str
    pod_ip: str
    destination: str
    port: int
    expected_source: str | None
    seen_source: str | None
    connected: bool
    why: str
    node_source: str | None  # the source it leaves the node with (the expected source, unless dropped after)
    traced: Traced
    leaves_by: str | None = None
    hops: tuple[tuple[str, str], ...] = ()

    @property
    def target(self) -> str:
        return f"{self.destination}:{self.port}"

    @property
    def peer_ok(self) -> bool:
        """The peer saw what the scenario says (one of the hops' sources, for a multipath route), and a connection
        was made exactly when a source was expected."""
        if self.hops:
            return self.connected and self.seen_source in {source for _, source in self.hops}
        return self.seen_source == self.expected_source and self.connected == (self.expected_source is not None)

    @property
    def trace_ok(self) -> bool:
        """trace predicted the source the packet leaves the node with, by the interface the scenario names; for a
        multipath route it said it cannot know the hop, asked for --out-interface, and gave each hop's source."""
        if self.hops:
            return (self.traced.source is None and "--out-interface" in (self.traced.reason or "")
                    and self.traced.hops == self.hops)
        return self.traced.source == self.node_source and (
            self.leaves_by is None or self.traced.interface == self.leaves_by)

    @property
    def ok(self) -> bool:
        return self.peer_ok and self.trace_ok

    def as_dict(self) -> dict[str, object]:
        shown: dict[str, object] = {
            "pod": self.pod, "pod_ip": self.pod_ip, "destination": self.destination, "port": self.port,
            "expected_source": self.expected_source, "node_source": self.node_source, "leaves_by": self.leaves_by,
            "seen_source": self.seen_source, "connected": self.connected,
            "traced_source": self.traced.source, "traced_reason": self.traced.reason,
            "traced_interface": self.traced.interface, "ok": self.ok, "why": self.why}
        if self.hops:
            shown["hops"] = dict(self.hops)
            shown["traced_hops"] = dict(self.traced.hops)
        return shown


@dataclass
class RoutedPhaseResult:
    name: str
    probes: list[RoutedOutcome] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(p.ok for p in self.probes)


@dataclass
class RoutedResult:
    name: str
    summary: str
    phases: list[RoutedPhaseResult] = field(default_factory=list)
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and all(p.ok for p in self.phases)


# ---- building blocks ------------------------------------------------------------------------------------------


def _no_dad(namespace: Namespace) -> None:
    """Interfaces made from now on in this namespace have their IPv6 link-local addresses usable at once: duplicate
    address detection would hold them tentative for a second, and neighbour discovery over a link whose addresses
    are all tentative can miss a probe's deadline (the lab's addresses are unique by construction)."""
    for scope in ("all", "default"):
        namespace.sysctl(f"net.ipv6.conf.{scope}.accept_dad", "0")


def forwarding(*namespaces: Namespace) -> None:
    for ns in namespaces:
        ns.sysctl("net.ipv4.ip_forward", "1")
        ns.sysctl("net.ipv4.conf.all.rp_filter", "0")
        ns.sysctl("net.ipv4.conf.default.rp_filter", "0")
        _no_dad(ns)


def add_peers(lab: Lab, addresses: Sequence[str], ports: Sequence[int]) -> Namespace:
    """The peers' namespace: every address on its loopback, a probe server per port admitting any source. It keeps
    no TIME_WAIT (a later probe NATed to the same source port would otherwise meet an old one)."""
    peers = lab.net.add("peers")
    _no_dad(peers)
    peers.sysctl("net.ipv4.tcp_max_tw_buckets", "0")
    peers.sysctl("net.ipv4.conf.all.rp_filter", "0")
    for address in addresses:
        peers.run(["ip", "addr", "add", f"{address}/{128 if ':' in address else 32}", "dev", "lo"])
    for port in ports:
        start_probe_server(lab, "peers", port, [])
    return peers


def _family_of(address: str) -> str:
    return "-6" if ":" in address else "-4"


def uplink_router(net: Network, role: str, node: Namespace, node_if: str, node_addresses: Sequence[str],
                  router_addresses: Sequence[str], peers: Namespace, transit: Sequence[tuple[str, str]],
                  back: Sequence[str]) -> Namespace:
    """A router between one of the node's interfaces and the peers: its default route (each family's) leads to the
    peers, and the ranges in `back` (the node's pods) to the node's first address of their family. transit: the
    (router side, peers side) addresses of their link, with prefix lengths."""
    router = net.add(role)
    forwarding(router)
    router.sysctl("net.ipv6.conf.all.forwarding", "1")
    net.link(node, node_addresses, router, router_addresses, names=(node_if, None))
    net.link(router, [r for r, _ in transit], peers, [p for _, p in transit])
    for _, peer_side in transit:
        router.run(["ip", _family_of(peer_side), "route", "add", "default", "via", peer_side.split("/")[0]])
    for prefix in back:
        node_address = next(a for a in node_addresses if _family_of(a) == _family_of(prefix)).split("/")[0]
        router.run(["ip", _family_of(prefix), "route", "add", prefix, "via", node_address])
    return router


def add_pod(net: Network, role: str, node: Namespace, address: str, gateway: str, *, pod_if: str = "eth0",
            node_if: str | None = None) -> tuple[Namespace, str]:
    """A pod namespace with one interface to the node (a CNI's veth): `address` (with its prefix length) on the
    pod's side, the pod's gateway on the node's; returns the pod and the node's interface name."""
    pod = net.namespaces.get(role)
    if pod is None:
        pod = net.add(role)
        _no_dad(pod)
    _, host_if = net.link(pod, [address], node, [gateway], names=(pod_if, node_if))
    return pod, host_if


def start_agent(world: RoutedLab, config: str, workdir: str) -> None:
    """The real `ipmasq agent` on the node (the run's backend), its ConfigMap published as kubelet does; returns once
    the node's kernel holds its rules."""
    from ipmasq.lab.run import NodeAgent
    from ipmasq.lab.scenarios import policy_for

    config_dir = os.path.join(workdir, "agent-config")
    publish(config_dir, config)
    agent = NodeAgent(world.lab, world.backend, (), config_dir)
    agent.start()
    world.agent = agent.proc
    agent.wait_synced(policy_for(config, PolicyOptions()))


# ---- running ----------------------------------------------------------------------------------------------------


def _pod_client(pod: Namespace) -> Callable[[list[str], float], subprocess.CompletedProcess[str]]:
    def run(argv: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
        return pod.run([sys.executable, *argv], check=False, timeout=timeout)
    return run


def node_interface(node: Namespace, pod_ip: str) -> str:
    """The node's interface toward a pod address (the one the pod's packets arrive by)."""
    shown = node.run(["ip", "-o", "route", "get", pod_ip]).stdout.split()
    return shown[shown.index("dev") + 1] if "dev" in shown else ""


def _source_address(pod: Namespace, destination: str) -> str:
    """The address the pod's kernel gives a connection to `destination` (the route's choice on a pod with two
    interfaces)."""
    shown = pod.run(["ip", "-o", "route", "get", destination]).stdout.split()
    return shown[shown.index("src") + 1] if "src" in shown else ""


def facts_directory(root: Path, scenario: RoutedScenario, index: int) -> Path:
    """Where --dump-facts writes a phase's facts: ROOT/SCENARIO/phase-N (N from 1)."""
    return root / scenario.name / f"phase-{index + 1}"


def trace_argv(pod_ip: str, destination: str, port: int, *flags: str) -> list[str]:
    """The question an operator asks on the node (`kubectl ipmasq trace NODE` runs it in the node's agent pod):
    `ipmasq trace DEST --source POD --protocol tcp --port P`, trace reading the node's routes and rules itself."""
    return ["-m", "ipmasq", "trace", destination, "--source", pod_ip, "--protocol", "tcp", "--port", str(port),
            *flags]


def _trace_on_node(node: Namespace, pod_ip: str, expect: Expect) -> Traced:
    """trace's prediction for one probe, run on the node as an operator runs it (-o json); each hop of a multipath
    route asked again with --out-interface."""
    def ask(*flags: str) -> tuple[str | None, str | None, str | None]:
        result = node.run([sys.executable, *trace_argv(pod_ip, expect.destination, expect.port, *flags, "-o",
                                                       "json")], check=False, timeout=60)
        try:
            report = json.loads(result.stdout)
        except ValueError:
            return None, f"trace exited {result.returncode}: {result.stderr.strip()[-500:]}", None
        return report.get("source_seen"), report.get("source_seen_reason"), report.get("egress_interface")

    source, reason, interface = ask()
    hops = tuple((device, ask("--out-interface", device)[0]) for device, _ in expect.hops)
    return Traced(source, reason, interface, hops)


def run_routed(scenario: RoutedScenario, *, backend: str = "iptables", workdir: str | None = None,
               facts: Path | None = None,
               after_phase: Callable[[RoutedLab, RoutedPhaseResult], None] | None = None) -> RoutedResult:
    """Build the scenario's world in namespaces of its own, run each phase (configure, ask trace on the node for
    every expected pair, probe it with real TCP), and take everything down, also on failure. `facts`: a directory
    where each phase's node facts are written once it is configured, and its probes once they are made
    (ipmasq.lab.facts). `after_phase`: called with the world after each phase's probes, while it stands."""
    result = RoutedResult(scenario.name, scenario.summary)
    from ipmasq.lab.netns import new_prefix

    net = Network(new_prefix())
    lab = Lab(net, workdir or tempfile.mkdtemp(prefix=f"ipmasq-lab-{scenario.name}-"))
    world: RoutedLab | None = None
    try:
        world = scenario.build(lab)
        world.backend = backend
        for index, phase in enumerate(scenario.phases):
            phase.configure(world)
            if facts is not None:
                dump_node_facts(world.node, facts_directory(facts, scenario, index))
            result.phases.append(_probe_phase(world, phase))
            if facts is not None:
                write_probes(facts_directory(facts, scenario, index),
                             [{**p.as_dict(), "protocol": "tcp", "in_interface": node_interface(world.node, p.pod_ip)}
                              for p in result.phases[-1].probes])
            if after_phase is not None:
                after_phase(world, result.phases[-1])
    except (IpmasqError, subprocess.SubprocessError, OSError) as exc:
        result.error = str(exc) if isinstance(exc, IpmasqError) else f"{type(exc).__name__}: {exc}"
    finally:
        if world is not None:
            world.stop_agent()
        lab.close()  # the probe servers, whatever the build reached
        net.delete()
    return result


def _probe_phase(world: RoutedLab, phase: RoutedPhase) -> RoutedPhaseResult:
    outcome = RoutedPhaseResult(phase.name)
    by_pod: dict[str, list[Expect]] = {}
    for expect in phase.expects:
        by_pod.setdefault(expect.pod, []).append(expect)
    for role, expects in by_pod.items():
        pod = world.net[role]
        pod_ips = [_source_address(pod, expect.destination) for expect in expects]
        # trace's prediction first, from what the node holds before any of these connections exists
        traced = [_trace_on_node(world.node, pod_ip, expect) for pod_ip, expect in zip(pod_ips, expects, strict=True)]
        results: list[ProbeResult] = world.lab.probe([e.probe for e in expects], client=_pod_client(pod),
                                                     nodes=[world.node], timeout=PROBE_TIMEOUT)
        for expect, pod_ip, predicted, probed in zip(expects, pod_ips, traced, results, strict=True):
            outcome.probes.append(RoutedOutcome(role, pod_ip, expect.destination, expect.port, expect.source,
                                                probed.seen_source, probed.connected, expect.why,
                                                expect.node_source, predicted, expect.leaves_by, expect.hops))
    return outcome
