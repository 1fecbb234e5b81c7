"""Config rules against the kernel on random cases, once per backend: random configs with random rules (sources,
tcp/udp, ports and port ranges, snat to spare node addresses, node globs that match the agent's --node-name or not),
and random packets (one of several pod addresses, tcp or udp, a port, a destination): the source address the peer
really saw equals `ipmasq explain`'s answer for that packet on that node.

One lab, one agent per node name (three names, ten configs each); each config is published the way kubelet does it,
waited for in the kernel, then probed with 12 packets in one process. A failure names the random.Random start, the
case, the config and the packet, and IPMASQ_RULES_RANDOM_START replays or explores another start.
"""

from __future__ import annotations

import contextlib
import io
import ipaddress
import json
import os
import random
import sys
from collections import Counter
from fnmatch import fnmatchcase

import pytest

from ipmasq import cli
from ipmasq.lab.kubelet import publish
from ipmasq.lab.netns import Namespace, Network
from ipmasq.lab.run import NodeAgent
from ipmasq.lab.scenarios import policy_for
from ipmasq.lab.topology import ADDR, build_lab
from ipmasq.options import PolicyOptions
from ipmasq.policy.packet import Packet
from ipmasq.policy.policy import rule_match
from ipmasq.prefix import parse_address
from tests.conftest import ROOT
from tests.kernel.servers import serving

BACKENDS = ("iptables", "nftables")
PROBE = str(ROOT / "tests" / "kernel" / "rule_probe.py")
PORTS = (53, 123, 993, 3306, 5432, 6443, 8443, 9090, 9995, 11211)  # the peer answers tcp and udp on each
PODS = (ADDR.pod, "10.44.14.16", "10.44.14.77", "10.44.14.200")  # addresses of the pod namespace
SPARES = (ADDR.spare_node, "10.142.15.205", "10.142.15.206")  # secondary node addresses a snat rule may use
NODE_NAMES = ("gke-prod-egress-pool-7f3k", "gke-prod-general-pool-2b9x", "worker-3")
GLOBS = ("gke-prod-egress-*", "*-general-pool-*", "gke-prod-*", "worker-?", "worker-[0-9]", "*-7f3k",
         "gke-prod-egress-pool-7f3k", "db-*", "*")
CONFIGS_PER_NODE = 10
PACKETS_PER_CONFIG = 12
# destinations the peer namespace must answer for: not the lab's own subnets, links, partner or special space
_EXCLUDED = [ipaddress.ip_network(n) for n in ("0.0.0.0/8", "10.44.0.0/14", "10.142.0.0/20", "10.250.0.0/16",
                                                "127.0.0.0/8", "224.0.0.0/3", f"{ADDR.partner}/32")]

Packet4 = tuple[str, str, str, int]  # pod source, protocol, destination, port


def _prefix_near(rng: random.Random, anchor: int, lengths: tuple[int, ...]) -> str:
    length = rng.choice(lengths)
    network = anchor & ~((1 << (32 - length)) - 1) & 0xFFFFFFFF
    return f"{ipaddress.IPv4Address(network)}/{length}"


def _ports(rng: random.Random) -> list[str]:
    """1-3 entries: a port the peer serves, a range around one, or a port or range it does not serve."""
    entries: list[str] = []
    for _ in range(rng.randint(1, 3)):
        kind = rng.random()
        port = rng.choice(PORTS)
        if kind < 0.45:
            entries.append(str(port))
        elif kind < 0.85:
            low = max(1, port - rng.choice([0, 1, 50, 1000, 6000]))
            entries.append(f'"{low}-{min(65535, port + rng.choice([0, 2, 100, 3000, 6000]))}"')
        else:
            low = rng.randint(20000, 60000)
            entries.append(f'"{low}-{low + rng.randint(1, 500)}"' if rng.random() < 0.5 else str(low))
    return entries


def _rule(rng: random.Random, index: int, anchors: list[int]) -> tuple[list[str], list[str]]:
    """A rule's lines, and its destinations."""
    lines = [f"  - name: r{index}-{rng.getrandbits(16):04x}"]
    destinations = sorted({_prefix_near(rng, rng.choice(anchors), (8, 12, 16, 20, 24, 28, 32))
                           for _ in range(rng.randint(1, 2))})
    lines.append(f"    destinations: [{', '.join(destinations)}]")
    if rng.random() < 0.5:
        pods = [int(ipaddress.IPv4Address(p)) for p in PODS]
        sources = {_prefix_near(rng, rng.choice(pods), (32, 30, 28, 26, 25, 24, 16, 14))
                   for _ in range(rng.randint(1, 2))}
        if rng.random() < 0.15:
            sources.add("10.45.0.0/16")  # no pod of this node
        lines.append(f"    sources: [{', '.join(sorted(sources))}]")
    protocol = rng.choice([None, None, "tcp", "udp"])
    if protocol is not None:
        lines.append(f"    protocol: {protocol}")
        if rng.random() < 0.7:
            lines.append(f"    ports: [{', '.join(_ports(rng))}]")
    if rng.random() < 0.35:
        lines.append(f"    nodes: [{', '.join(json.dumps(g) for g in rng.sample(GLOBS, rng.randint(1, 2)))}]")
    action = rng.choice(["masquerade", "preserve", "snat"])
    lines.append(f"    action: {action}")
    if action == "snat":
        lines.append(f"    snatTo: {rng.choice(SPARES)}")
    return lines, destinations


def _random_case(rng: random.Random) -> tuple[str, list[Packet4]]:
    """A random config (CIDR lists and 0-8 rules around a few anchors) and distinct packets near those anchors."""
    anchors = [rng.getrandbits(32) for _ in range(3)]
    preserve = sorted({_prefix_near(rng, rng.choice(anchors), (8, 12, 16, 20, 24)) for _ in range(rng.randint(0, 3))})
    masquerade = sorted({_prefix_near(rng, rng.choice(anchors), (16, 20, 24, 28)) for _ in range(rng.randint(0, 2))}
                        - set(preserve))
    lines = ["nonMasqueradeCIDRs: [" + ", ".join(preserve) + "]"]
    if masquerade:
        lines.append("masqueradeCIDRs: [" + ", ".join(masquerade) + "]")
    count = rng.choice([0, 1, 2, 3, 4, 5, 6, 8])
    rule_destinations: list[ipaddress.IPv4Network] = []
    if count:
        lines.append("rules:")
        for index in range(count):
            rule_lines, destinations = _rule(rng, index, anchors)
            lines.extend(rule_lines)
            rule_destinations.extend(ipaddress.IPv4Network(d) for d in destinations)
    packets: list[Packet4] = []
    while len(packets) < PACKETS_PER_CONFIG:
        if rule_destinations and rng.random() < 0.6:  # inside a rule's destinations: the rule's other fields decide
            network = rng.choice(rule_destinations)
            address = network[rng.randrange(network.num_addresses)]
        else:
            address = ipaddress.IPv4Address(rng.choice(anchors) ^ rng.getrandbits(rng.choice([0, 3, 6, 10, 18, 26])))
        packet = (rng.choice(PODS), rng.choice(["tcp", "udp"]), str(address), rng.choice(PORTS))
        if any(address in n for n in _EXCLUDED) or packet in packets:
            continue
        packets.append(packet)
    return "\n".join(lines) + "\n", packets


def explain(config: str, node_name: str, packet: Packet4) -> dict[str, object]:
    """`ipmasq explain` for one packet, run as the command line runs it (in-process: 360 answers per backend)."""
    source, protocol, destination, port = packet
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli.main(["explain", destination, f"--config={config}", f"--source={source}", f"--protocol={protocol}",
                         f"--port={port}", f"--node-name={node_name}", f"--node-ip={ADDR.node}", "-o", "json"])
    assert code == 0, out.getvalue()
    (answer,) = json.loads(out.getvalue())["results"]
    assert answer["depends_on"] == [], answer  # every field was given
    return dict(answer)


def probe(pod: Namespace, packets: list[Packet4]) -> dict[Packet4, str | None]:
    specs = [",".join(map(str, p)) for p in packets]
    result = pod.run([sys.executable, PROBE, "probe", *specs], timeout=60)
    seen = dict(line.split(" ", 1) for line in result.stdout.splitlines())
    return {p: None if seen[s] == "FAILED" else seen[s] for p, s in zip(packets, specs, strict=True)}


def interface_of(ns: Namespace, address: str) -> str:
    for line in ns.run(["ip", "-o", "addr", "show"]).stdout.splitlines():
        if f" {address}/" in line:
            return line.split()[1]
    raise AssertionError(f"no interface holds {address}")


def _coverage(config_text: str, node_name: str, packet: Packet4) -> set[str]:
    """What the case exercised: "range" when a rule with a port range decided, and the fields on which rules whose
    destinations hold the packet's destination missed it."""
    policy = policy_for(config_text, PolicyOptions(node_name=node_name))
    source, protocol, destination, port = packet
    family, address = parse_address(destination)
    _, source_address = parse_address(source)
    verdict = policy.verdict_for(family, address, source=source_address, protocol=protocol, port=port)
    missed: set[str] = set()
    if verdict.rule is not None and any(low < high for low, high in verdict.rule.ports):
        missed.add("range")
    for rule in policy.config.rules:
        if not any(p.contains(address) for p in rule.destinations):
            continue
        if rule.nodes and not any(fnmatchcase(node_name, g) for g in rule.nodes):
            missed.add("nodes")
            continue
        if rule_match(rule, Packet.exact(family, address, source=source_address)) is None:
            missed.add("source")
        if rule_match(rule, Packet(family, address, protocol=protocol)) is None:
            missed.add("protocol")
        elif rule_match(rule, Packet(family, address, protocol=protocol, port=port)) is None:
            missed.add("port")  # the protocol matched, the port did not
    return missed


@pytest.mark.parametrize("backend", BACKENDS)
def test_random_rules_the_peer_sees_what_explain_answers(net: Network, backend: str) -> None:
    """360 random (config, packet) cases per backend: the source the peer saw equals explain's answer."""
    rng_start = int(os.environ.get("IPMASQ_RULES_RANDOM_START", 20261123 + BACKENDS.index(backend)))
    replay = (f"random.Random({rng_start}) (replay: IPMASQ_RULES_RANDOM_START={rng_start} pytest "
              f"'tests/kernel/policy/test_policy.py::test_random_rules_the_peer_sees_what_explain_answers"
              f"[{backend}]')")
    rng = random.Random(rng_start)
    lab = build_lab(net, anyip_peers=True)
    peers = lab.net["peers"]
    peers.sysctl("net.ipv4.tcp_max_tw_buckets", "0")  # a reused NATed port never meets a TIME_WAIT here
    for address in PODS[1:]:
        lab.pod.run(["ip", "addr", "add", f"{address}/32", "dev", "lo"])
    uplink = interface_of(lab.node, ADDR.node)
    for address in SPARES[1:]:
        lab.node.run(["ip", "addr", "add", f"{address}/20", "dev", uplink])
    config_dir = f"{lab.workdir}/config"
    config_file = f"{config_dir}/ip-masq-agent"
    agent = NodeAgent(lab, backend, (), config_dir)
    checked = 0
    decided_by: Counter[str] = Counter()
    exercised: set[str] = set()
    try:
        with serving(peers, [sys.executable, PROBE, "serve", *map(str, PORTS)]):
            for case in range(CONFIGS_PER_NODE * len(NODE_NAMES)):
                node_name = NODE_NAMES[case // CONFIGS_PER_NODE]
                config, packets = _random_case(rng)
                publish(config_dir, config)
                policy = policy_for(config, PolicyOptions(node_name=node_name))
                if agent.node_name != node_name:  # a new node name is a new node: its agent starts afresh
                    agent.stop()
                    lab.reset_node()
                    agent.node_name = node_name
                    agent.start()
                agent.wait_synced(policy)
                lab.node.run(["conntrack", "-F"], check=False)  # earlier configs' NAT decisions are gone
                observed = probe(lab.pod, packets)
                for packet in packets:
                    answer = explain(config_file, node_name, packet)
                    where = (f"{replay} case {case} on node {node_name}: packet {packet} explain answered "
                             f"{answer['source_seen']} ({answer['reason']}, rule {answer['rule_name']}, "
                             f"{answer['matched']}) but the peer saw {observed[packet]}; config:\n{config}")
                    assert observed[packet] is not None, where
                    assert observed[packet] == answer["source_seen"], where
                    checked += 1
                    decided_by[str(answer["action"] or answer["reason"])] += 1
                    exercised |= _coverage(config, node_name, packet)
    finally:
        agent.stop()
        lab.close()
    assert checked == CONFIGS_PER_NODE * len(NODE_NAMES) * PACKETS_PER_CONFIG
    # the random cases exercise every action, the lists behind the rules, and a miss on every field a rule tests, a port
    # range that decided
    assert {"masquerade", "preserve", "snat", "config", "catch-all"} <= set(decided_by), decided_by
    assert {"source", "protocol", "port", "nodes", "range"} <= exercised, exercised
