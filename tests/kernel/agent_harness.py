"""A three-namespace world for the agent: pod -> node (runs the agent) -> peer, and the agent as a real process."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from ipmasq.agent.health_probe import DEFAULT_METRICS_ADDRESS
from ipmasq.lab.netns import Namespace, Network, stop_process
from ipmasq.netfilter.iptables import marker_chain
from tests.eventually import eventually
from tests.kernel.servers import LAB_PROBE, start_server, stop_server

POD, POD_GW, NODE, PEER_GW = "10.44.14.15", "10.44.14.1", "10.142.15.203", "10.142.0.1"
AWS_DB, ONPREM = "172.30.12.110", "10.2.1.100"  # the AWS VPC host behind the VPN; an on-prem host inside 10/8
POD6, POD6_GW, NODE6, PEER6_GW, PEER6_FAR = "fd44::15", "fd44::1", "fd42::203", "fd42::1", "2001:db8:ff::10"
PORT = 8080
BUILTIN = (":PREROUTING", ":INPUT", ":OUTPUT", ":POSTROUTING")


@dataclass
class World:
    pod: Namespace
    node: Namespace
    peer: Namespace
    server: subprocess.Popen[str]

    def seen(self, destination: str) -> str | None:
        """The source address the peer saw for a real TCP connection from the pod."""
        for _ in range(3):  # a fresh IPv6 link may still be resolving neighbours: try again before failing
            out = self.pod.run([sys.executable, "-m", "ipmasq.lab.probe", "connect", destination, str(PORT), "1"],
                               check=False).stdout.strip()
            if out != "FAILED":
                return out
        return None

    def nat(self, *, family: int = 4, counters: bool = False) -> str:
        tool = "iptables-save" if family == 4 else "ip6tables-save"
        return self.node.run([tool, "-t", "nat", *(["-c"] if counters else [])]).stdout


def build(net: Network, *, ipv6: bool = False) -> World:
    pod, node, peer = net.add("pod"), net.add("node"), net.add("peer")
    net.link(pod, [f"{POD}/24", *([f"{POD6}/64"] if ipv6 else [])],
             node, [f"{POD_GW}/24", *([f"{POD6_GW}/64"] if ipv6 else [])])
    net.link(node, [f"{NODE}/20", *([f"{NODE6}/64"] if ipv6 else [])],
             peer, [f"{PEER_GW}/20", *([f"{PEER6_GW}/64"] if ipv6 else [])])
    pod.run(["ip", "route", "add", "default", "via", POD_GW])
    node.run(["ip", "route", "add", "default", "via", PEER_GW])
    node.sysctl("net.ipv4.ip_forward", "1")
    for address in (AWS_DB, ONPREM):
        peer.run(["ip", "addr", "add", f"{address}/32", "dev", "lo"])
    # the peer routes pod IPs back through the node, as a VPC routes alias ranges natively
    peer.run(["ip", "route", "add", "10.44.0.0/14", "via", NODE])
    if ipv6:
        pod.run(["ip", "-6", "route", "add", "default", "via", POD6_GW])
        node.run(["ip", "-6", "route", "add", "default", "via", PEER6_GW])
        node.sysctl("net.ipv6.conf.all.forwarding", "1")
        peer.run(["ip", "addr", "add", f"{PEER6_FAR}/128", "dev", "lo"])
        peer.run(["ip", "-6", "route", "add", "fd44::/64", "via", NODE6])
    return World(pod, node, peer, start_server(peer, [*LAB_PROBE, "serve", str(PORT)]))


@contextmanager
def world(net: Network, *, ipv6: bool = False) -> Iterator[World]:
    w = build(net, ipv6=ipv6)
    try:
        yield w
    finally:
        stop_server(w.server)


class AgentProcess:
    def __init__(self, proc: subprocess.Popen[str], log: Path) -> None:
        self.proc = proc
        self.log_path = log

    @property
    def log(self) -> str:
        return self.log_path.read_text()

    def lines(self, needle: str) -> list[str]:
        return [line for line in self.log.splitlines() if needle in line]

    def stop(self) -> float:
        """SIGTERM; returns how long the agent took to exit."""
        started = time.monotonic()
        stop_process(self.proc)
        return time.monotonic() - started


@contextmanager
def agent(node: Namespace, log: Path, *args: str, env: dict[str, str] | None = None) -> Iterator[AgentProcess]:
    """`ipmasq agent ARGS` as a real process inside the node namespace; SIGTERM on the way out."""
    fh = log.open("w")
    full_env = {**os.environ, **(env or {})}
    proc = node.popen([sys.executable, "-m", "ipmasq", "agent", *args], stdout=fh, stderr=subprocess.STDOUT,
                      env=full_env)
    running = AgentProcess(proc, log)
    try:
        eventually(lambda: "agent started" in running.log or proc.poll() is not None,
                   lambda: f"the agent started (or exited)\n{running.log}")
        assert proc.poll() is None, running.log
        yield running
    finally:
        running.stop()
        fh.close()


def passes(node: Namespace, result: str | None = None, *, address: str = DEFAULT_METRICS_ADDRESS) -> float:
    """The reconcile passes the agent in `node` has counted (ipmasq_syncs_total on its /metrics): of one result
    (in-sync, applied, no-policy, ...), or of all."""
    script = "import sys, urllib.request\nprint(urllib.request.urlopen(sys.argv[1], timeout=10).read().decode())"
    text = node.run([sys.executable, "-c", script, f"http://{address}/metrics"]).stdout
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == "ipmasq_syncs_total" and result in (None, sample.labels.get("result")))


def more_passes(node: Namespace, count: int, *, address: str = DEFAULT_METRICS_ADDRESS) -> None:
    """Wait until the agent in `node` has run `count` more reconcile passes: an idle spell is counted in the
    agent's passes, never in seconds (a loaded machine stretches seconds, and fewer passes would fit in them)."""
    start = passes(node, address=address)
    eventually(lambda: passes(node, address=address) >= start + count,
               lambda: f"{count} more passes (from {start:g}: {passes(node, address=address):g})")


def ours(save_text: str, chain: str = "IP-MASQ-AGENT") -> list[str]:
    """Our declaration, jump and rules, and the chain's ownership marker and its record, as iptables-save printed
    them."""
    declared = (f":{chain} ", f"-A {chain} ", f":{marker_chain(chain)} ", f"-A {marker_chain(chain)} ")
    return [line for line in save_text.splitlines()
            if line.startswith(declared) or (line.startswith("-A POSTROUTING") and chain in line)]


def foreign(save_text: str, chain: str = "IP-MASQ-AGENT") -> list[str]:
    """Every line that is not ours (minus the comments with timestamps), byte for byte."""
    mine = set(ours(save_text, chain))
    return [line for line in save_text.splitlines() if line not in mine and not line.startswith("#")]
