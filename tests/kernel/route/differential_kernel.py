"""The kernel side of the differential (tests/kernel/route/differential.py): a generated topology built in fresh
namespaces, each probe asked of the model (reading the node live, as `trace` does) and of the kernel twice, with
`ip route get` and with a real TCP connection from the pod (the peer that accepts it and the source it saw).

The sockets are made in the namespaces by this thread stepping into each and back (a socket keeps the namespace it
was made in): no process per listener or probe, which keeps a topology to about a third of a second.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import selectors
import socket
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field

from ipmasq.diagnose.path import PathAnswer, path
from ipmasq.diagnose.path_sources import read_live_facts
from ipmasq.lab.netns import Namespace, NamespaceRunner, Network, network
from ipmasq.policy.packet import Packet
from ipmasq.prefix import Family, format_address
from tests.kernel.route.differential import PORTS, Topology, plain

__all__ = ["CaseResult", "build", "check", "run_case", "socket_in"]

# `ip route get`'s refusals, by what the kernel answered (as tests/kernel/route/test_lookup.py reads them)
REFUSALS = {"Network is unreachable": {"no-route", "unreachable"}, "No route to host": {"unreachable"},
            "Permission denied": {"prohibit"}, "Invalid argument": {"blackhole"}}
# a hang guard only: every connection the kernel routes out is answered at once; a mismatch waits this long
ARRIVAL_TIMEOUT = 20.0

_CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


def _setns(fd: int) -> None:
    if _libc.setns(fd, _CLONE_NEWNET) != 0:
        number = ctypes.get_errno()
        raise OSError(number, f"setns: {os.strerror(number)}")


def socket_in(namespace: Namespace, family: Family) -> socket.socket:
    """A TCP socket of the namespace, made by this thread stepping into it and back (a socket keeps the namespace
    it was made in): real TCP from and to the namespaces without a process per probe or per listener."""
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    try:
        target = os.open(f"/run/netns/{namespace.name}", os.O_RDONLY | os.O_CLOEXEC)
        try:
            _setns(target)
            try:
                return socket.socket(socket.AF_INET6 if family is Family.V6 else socket.AF_INET, socket.SOCK_STREAM)
            finally:
                _setns(own)
        finally:
            os.close(target)
    finally:
        os.close(own)


@dataclass
class Built:
    node: Namespace
    pod: Namespace
    peers: list[Namespace]
    rejected: list[str]  # commands the kernel refused (the node is what it accepted: the model reads it live)


def build(net: Network, topology: Topology) -> Built:
    v6 = topology.v6
    node, pod = net.add("node"), net.add("pod")
    peers = [net.add(f"peer{i}") for i in range(len(topology.uplinks))]
    dad = ["net.ipv6.conf.all.accept_dad=0", "net.ipv6.conf.default.accept_dad=0"]
    node.run(["sysctl", "-qw", "net.ipv4.ip_forward=1", "net.ipv6.conf.all.forwarding=1",
              "net.ipv4.conf.all.rp_filter=0", "net.ipv4.conf.default.rp_filter=0", *dad])
    for ns in (pod, *peers):
        ns.run(["sysctl", "-qw", "net.ipv4.tcp_max_tw_buckets=0", *dad])
    flag = "-6" if v6 else "-4"
    rejected: list[str] = []
    for ns, lines in ((node, topology.node_batch([p.name for p in peers], pod.name)),
                      *((peer, topology.peer_batch(i)) for i, peer in enumerate(peers)),
                      (pod, topology.pod_batch())):
        result = ns.run(["ip", flag, "-force", "-batch", "-"], stdin="\n".join(lines) + "\n", check=False)
        rejected += _rejected(result.stderr, lines, ns.name)
    tool = "ip6tables-restore" if v6 else "iptables-restore"
    node.run([tool, "-w"], stdin=topology.restore())
    return Built(node, pod, peers, rejected)


def _rejected(stderr: str, lines: list[str], where: str) -> list[str]:
    """The batch's failed lines, from its "Command failed -:N" reports."""
    out = []
    said = ""
    for text in stderr.splitlines():
        if text.startswith("Command failed -:"):
            number = int(text.rsplit(":", 1)[1])
            out.append(f"{where}: {lines[number - 1]} ({said})")
        else:
            said = text.strip()
    return out


def route_get(node: Namespace, topology: Topology, destination: str, port: int, mark: int) -> tuple[str, ...]:
    """The kernel's decision for the pod's packet: ("unicast", dev, gateway), ("local",) or ("refused", why)."""
    result = node.run(["ip", "-j", "route", "get", destination, "from", topology.pod, "iif", "pod0", "mark",
                       str(mark), "ipproto", "tcp", "dport", str(port)], check=False)
    if result.returncode != 0:
        return ("refused", result.stderr.strip().rsplit(": ", 1)[-1])
    got = json.loads(result.stdout)[0]
    if got.get("type", "unicast") != "unicast":
        return (str(got["type"]),)
    return ("unicast", got.get("dev", ""), got.get("gateway", ""))


@dataclass
class CaseResult:
    """One topology's checks: how many probes each comparison made, what it skipped (with the model's reason)
    and every mismatch, in words."""

    routes_checked: int = 0
    sources_checked: int = 0
    skipped: list[str] = field(default_factory=list)
    mismatches: list[str] = field(default_factory=list)
    rejected: list[str] = field(default_factory=list)


def _compare_route(kernel: tuple[str, ...], answer: PathAnswer, family: Family) -> str | None:
    decision = answer.route
    if decision is None:
        return f"the model made no routing decision ({answer.undecided}); kernel {kernel}"
    if kernel[0] == "refused":
        if decision.kind not in REFUSALS.get(kernel[1], {kernel[1]}):
            return f"kernel refused ({kernel[1]}), model: {decision.described}"
        return None
    if kernel[0] != "unicast":
        return None if decision.kind == kernel[0] else f"kernel {kernel[0]}, model: {decision.described}"
    if decision.kind != "unicast":
        return f"kernel {kernel}, model: {decision.kind} {decision.described}"
    hops = {(h.device, "" if h.gateway is None else format_address(h.gateway_family or family, h.gateway))
            for h in decision.nexthops}
    if (kernel[1], kernel[2]) not in hops:
        return f"kernel dev {kernel[1]} via {kernel[2] or '-'}, model: {decision.described}"
    return None


@contextmanager
def _listening(built: Built, family: Family) -> Iterator[dict[socket.socket, int]]:
    """Every peer listening on every port: socket -> the peer's index."""
    with ExitStack() as stack:
        listeners: dict[socket.socket, int] = {}
        for index, peer in enumerate(built.peers):
            for port in PORTS:
                server = stack.enter_context(socket_in(peer, family))
                server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                server.bind(("::" if family is Family.V6 else "0.0.0.0", port))
                server.listen(64)
                server.setblocking(False)
                listeners[server] = index
        yield listeners


def _connect_all(built: Built, topology: Topology, wanted: set[tuple[str, int]],
                 listeners: dict[socket.socket, int]) -> dict[tuple[str, int], tuple[int, str]]:
    """Connect from the pod to every probe; (destination, port) -> (peer index, source it saw), for every
    connection that arrived (waiting for the `wanted` ones, a hang guard bounding the wait)."""
    seen: dict[tuple[str, int], tuple[int, str]] = {}
    with ExitStack() as stack, selectors.DefaultSelector() as selector:
        for destination, port in topology.probe_packets():
            client = stack.enter_context(socket_in(built.pod, topology.family))
            client.setblocking(False)
            client.bind((topology.pod, 0))
            code = client.connect_ex((destination, port))
            if code not in (0, errno.EINPROGRESS):
                continue  # refused at once (an unreachable route answered by ICMP): nothing arrives
        for server in listeners:
            selector.register(server, selectors.EVENT_READ, server)
        deadline = time.monotonic() + ARRIVAL_TIMEOUT  # a hang guard: never reached unless a mismatch
        while True:
            waiting = wanted - set(seen)
            timeout = 0.0 if not waiting else max(0.0, deadline - time.monotonic())
            events = selector.select(timeout)
            for key, _ in events:
                server = key.data  # registered with itself as the data: typed, unlike fileobj
                try:
                    conn, peer = server.accept()
                except BlockingIOError:
                    continue
                with conn:
                    destination = plain(conn.getsockname()[0])
                    seen[(destination, conn.getsockname()[1])] = (listeners[server], plain(peer[0]))
            if not events and (not waiting or time.monotonic() >= deadline):
                return seen


def check(built: Built, topology: Topology) -> CaseResult:
    """Both comparisons for every probe of the built topology."""
    family = topology.family
    result = CaseResult(rejected=list(built.rejected))
    facts = read_live_facts(NamespaceRunner(built.node), family)
    answers: dict[tuple[str, int], PathAnswer] = {}
    kernel_routes: dict[tuple[str, int], tuple[str, ...]] = {}
    questions = [(d, p, True) for d, p in topology.probe_packets()]
    if topology.local_probe:
        questions.append((topology.all_node_addresses()[0], PORTS[0], False))
    for destination, port, probe in questions:
        answer = path(facts, Packet.of(destination, source=topology.pod, protocol="tcp", port=port))
        shown = f"{destination} port {port}"
        if answer.route is None:
            # the walk stopped before the routing decision: its reason is the whole answer
            if not answer.undecided:
                result.mismatches.append(f"{shown}: the model made no decision and gave no reason")
            result.skipped.append(f"{shown}: {answer.undecided}")
            continue
        kernel = route_get(built.node, topology, destination, port, answer.mark)
        if answer.route.kind == "undecided":
            if not answer.route.undecided:
                result.mismatches.append(f"{shown}: an undecided route without a reason")
            result.skipped.append(f"{shown}: {answer.route.undecided}")
        else:
            result.routes_checked += 1
            differs = _compare_route(kernel, answer, family)
            if differs is not None:
                result.mismatches.append(f"route to {shown} (mark {answer.mark:#x}): {differs}")
        if probe:
            answers[(destination, port)] = answer
            kernel_routes[(destination, port)] = kernel
    wanted = {k for k, kernel in kernel_routes.items() if kernel[0] == "unicast"}
    wanted |= {k for k, a in answers.items() if a.source_seen is not None}
    with _listening(built, family) as listeners:
        seen = _connect_all(built, topology, wanted, listeners)
    for key, answer in answers.items():
        shown = f"{key[0]} port {key[1]}"
        got = seen.get(key)
        if answer.source_seen is None:
            if not answer.undecided:
                result.mismatches.append(f"{shown}: no source and no reason")
            elif answer.delivered:
                result.skipped.append(f"{shown}: {answer.undecided}")
                continue
            if got is not None and not answer.delivered:
                result.mismatches.append(f"{shown}: peer{got[0]} saw {got[1]}, the model: {answer.undecided}")
            elif not answer.delivered:
                result.sources_checked += 1
            continue
        result.sources_checked += 1
        # a multipath route whose hops agree on the source names no one device: any of its hops' is right
        devices = {answer.out_interface} if answer.out_interface is not None or answer.route is None else \
            {h.device for h in answer.route.nexthops}
        if got is None:
            result.mismatches.append(f"{shown}: no peer saw it, the model: source {answer.source_seen} out of "
                                     f"{answer.out_interface} ({answer.route.described if answer.route else ''})")
        elif f"up{got[0]}" not in devices or got[1] != answer.source_seen:
            result.mismatches.append(f"{shown}: peer{got[0]} (up{got[0]}) saw {got[1]}, the model: source "
                                     f"{answer.source_seen} out of {answer.out_interface}; steps: "
                                     + "; ".join(f"{s.stage} {s.decided_by}: {s.result}" for s in answer.steps))
    return result


def run_case(topology: Topology) -> CaseResult:
    """Build the topology in fresh namespaces, check it, and delete them (also on failure)."""
    with network() as net:
        return check(build(net, topology), topology)
