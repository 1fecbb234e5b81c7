"""trace's outcome against the source a real peer saw, on a node holding the agent's rules and the foreign ones of
real outages.

pod (100.64.0.50) -> node (applies `render` output, kubenet's rule, the fix-nat DaemonSet's rule and an
operator's hand-written SNAT) -> peer answering on every destination. For each destination: a real TCP connection
from the pod, the source the peer's kernel delivered, and `trace` over the node's own iptables-save output must
agree; `check` on the same dump names each foreign rule with the destinations it changes. The same for a config
with rules (source-scoped, port-scoped, snat to a spare node address), two pods and two ports, on iptables and on
nftables (our table and a hand-written one hooked ahead of it): trace on the live rules (iptables-save, nft -j list
ruleset), explain and the peer agree, and for 400 more packets trace equals explain.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from ipmasq.cli import main
from ipmasq.config import ConfigInput, config_from_bytes
from ipmasq.diagnose.check import FindingId
from ipmasq.diagnose.check_iptables import check_iptables
from ipmasq.diagnose.check_nft import check_nft
from ipmasq.diagnose.trace import Tracer, trace
from ipmasq.diagnose.trace_nft import NftTracer
from ipmasq.lab.netns import Network
from ipmasq.netfilter.iptables import parse_save, render_restore
from ipmasq.netfilter.nft import render_script
from ipmasq.netfilter.nft_json import parse_list_json
from ipmasq.options import PolicyOptions
from ipmasq.policy.packet import Packet
from ipmasq.policy.policy import Policy
from ipmasq.prefix import Family, parse_address, parse_cidr

POD, NODE_POD_SIDE, NODE, PEER_SIDE = "100.64.0.50", "100.64.0.1", "10.142.15.203", "10.142.15.1"
PORT = 8080
DESTINATIONS = {
    "172.30.12.110": NODE,  # the AWS VPC behind the VPN: kept by the chain (172.16.0.0/12), then kubenet masquerades it
    "10.11.0.5": NODE,  # the VPN range inside 10/8: kept by the chain (10.0.0.0/8), then fix-nat masquerades it
    "10.2.1.100": NODE,  # the private endpoint: the hand-written rule above our jump masquerades it
    "10.130.0.6": POD,  # an ordinary VPC address: the pod IP, as the config says
    "34.120.0.10": NODE,  # the internet: our catch-all
}
FOREIGN = [
    ["-I", "POSTROUTING", "1", "-s", "100.64.0.0/16", "-d", "10.2.1.100", "-j", "MASQUERADE"],
    ["-A", "POSTROUTING", "!", "-d", "10.0.0.0/8", "-m", "comment", "--comment",
     "kubenet: SNAT for outbound traffic from cluster", "-m", "addrtype", "!", "--dst-type", "LOCAL",
     "-j", "MASQUERADE"],
    ["-A", "POSTROUTING", "-d", "10.11.0.0/24", "-m", "comment", "--comment",
     "NAT-VPN: SNAT for outbound traffic through VPN", "-m", "addrtype", "!", "--dst-type", "LOCAL",
     "-j", "MASQUERADE"],
]


def test_trace_agrees_with_what_the_peer_saw(net: Network, capsys: pytest.CaptureFixture[str]) -> None:
    options = PolicyOptions(masq_chain="IP-MASQ", nomasq_all_reserved_ranges=True)
    policy = Policy(config_from_bytes(ConfigInput(()), options), options)  # GKE: no ConfigMap, all reserved
    pod, node, peer = net.add("pod"), net.add("node"), net.add("peer")
    node.sysctl("net.ipv4.ip_forward", "1")
    net.link(pod, [f"{POD}/24"], node, [f"{NODE_POD_SIDE}/24"])
    net.link(node, [f"{NODE}/24"], peer, [f"{PEER_SIDE}/24"])
    pod.run(["ip", "route", "add", "default", "via", NODE_POD_SIDE])
    node.run(["ip", "route", "add", "default", "via", PEER_SIDE])
    peer.run(["ip", "route", "add", "100.64.0.0/16", "via", NODE])  # the VPC routes pod ranges back
    for address in DESTINATIONS:
        peer.run(["ip", "addr", "add", f"{address}/32", "dev", "lo"])
    node.run(["iptables-restore", "--noflush", "-w"], stdin=render_restore(policy, Family.V4))
    for rule in FOREIGN:
        node.run(["iptables", "-w", "-t", "nat", *rule])

    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp, "peer.log")
        server = peer.popen([sys.executable, "-m", "ipmasq.lab.probe", "serve", str(PORT), "--log", str(log)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        try:
            assert server.stdout is not None and server.stdout.readline().strip() == "ready"
            result = pod.run([sys.executable, "-m", "ipmasq.lab.probe", "connect-many", "--timeout", "2",
                              *[f"{d}:{PORT}" for d in DESTINATIONS]], check=False)
        finally:
            server.kill()
            server.wait()
        seen = {line.split()[1]: line.split()[2] for line in log.read_text().splitlines()}
        dump_text = node.run(["iptables-save", "-t", "nat"]).stdout
        dump = Path(tmp, "node.save")
        dump.write_text(dump_text)

        assert seen == DESTINATIONS, result.stdout  # the kernel did what the outages describe
        table = parse_save(dump_text)
        for destination, peer_saw in seen.items():
            packet = Packet.of(destination, source=POD, local_addresses=[NODE, NODE_POD_SIDE], out_interface="v2a")
            traced = trace(table, packet)
            assert traced.source_seen(packet, masquerade_address=NODE) == peer_saw, (destination, traced)
        # the CLI, on the dump file, says the same (JSON contract)
        assert main(["trace", "172.30.12.110", "--source", POD, "--dump", str(dump), "--local-address", NODE,
                     "-o", "json"]) == 0
        document = json.loads(capsys.readouterr().out)
        assert document["source_seen"] == seen["172.30.12.110"] and "kubenet" in document["steps"][-1]["rule"]

    report = check_iptables(policy, table, Family.V4, pod_ranges=(parse_cidr("100.64.0.0/16"),))
    foreign = {f.rule: f.destinations for f in report.findings if f.id is FindingId.FOREIGN_MASQUERADE}
    assert not report.ok
    by_comment = {("kubenet" if "kubenet" in r else "fix-nat" if "NAT-VPN" in r else "hand-written"): d
                  for r, d in foreign.items() if r is not None}
    assert by_comment["fix-nat"] == ("10.11.0.0/24",)
    assert by_comment["hand-written"] == ("10.2.1.100/32",)
    assert "172.16.0.0/12" in by_comment["kubenet"]
    assert {f.id for f in report.findings} == {FindingId.FOREIGN_MASQUERADE}  # our own rules read back exactly


RULES_CONFIG = """\
nonMasqueradeCIDRs: [10.0.0.0/8, 172.16.0.0/12]
rules:
  - name: partner-snat
    destinations: [10.2.1.0/24]
    protocol: tcp
    ports: [443]
    action: snat
    snatTo: 10.142.15.250
  - name: batch-masq
    destinations: [10.130.0.0/16]
    sources: [100.64.8.0/24]
    action: masquerade
  - name: web-keep
    destinations: [34.120.0.0/16]
    protocol: tcp
    ports: ["8000-8090"]
    action: preserve
"""
SECOND_POD, SECOND_POD_SIDE, SNAT_ADDRESS = "100.64.8.50", "100.64.8.1", "10.142.15.250"
RULES_DESTINATIONS = ("10.2.1.100", "10.130.0.6", "34.120.0.10", "172.30.12.110")
RULES_PORTS = (443, 8080)
# written by hand in front of our jump: it masquerades what the config keeps (172.16.0.0/12) for tcp port 443 only;
# check must name it with exactly that traffic
PORT_FOREIGN = ["-I", "POSTROUTING", "1", "-d", "172.30.0.0/16", "-p", "tcp", "-m", "multiport", "--dports", "443",
                "-j", "MASQUERADE"]


# the same hand-written rule on an nftables node: a table of its own, hooked ahead of ours
NFT_FOREIGN = """table ip handwritten {
  chain post {
    type nat hook postrouting priority 50; policy accept;
    ip daddr 172.30.0.0/16 tcp dport 443 masquerade
  }
}
"""


@pytest.mark.parametrize("backend", ["iptables", "nftables"])
def test_trace_decides_config_rules_like_explain_and_the_peer(net: Network, backend: str) -> None:
    options = PolicyOptions()
    policy = Policy(config_from_bytes(ConfigInput((("/etc/config/ip-masq-agent", RULES_CONFIG.encode()),)), options),
                    options)
    pods = {POD: net.add("pod"), SECOND_POD: net.add("pod2")}
    node, peer = net.add("node"), net.add("peer")
    node.sysctl("net.ipv4.ip_forward", "1")
    net.link(pods[POD], [f"{POD}/24"], node, [f"{NODE_POD_SIDE}/24"])
    net.link(pods[SECOND_POD], [f"{SECOND_POD}/24"], node, [f"{SECOND_POD_SIDE}/24"])
    _, peer_if = net.link(node, [f"{NODE}/24", f"{SNAT_ADDRESS}/24"], peer, [f"{PEER_SIDE}/24"])
    pods[POD].run(["ip", "route", "add", "default", "via", NODE_POD_SIDE])
    pods[SECOND_POD].run(["ip", "route", "add", "default", "via", SECOND_POD_SIDE])
    node.run(["ip", "route", "add", "default", "via", PEER_SIDE])
    peer.run(["ip", "route", "add", "100.64.0.0/16", "via", NODE])
    for address in RULES_DESTINATIONS:
        peer.run(["ip", "addr", "add", f"{address}/32", "dev", "lo"])
    if backend == "iptables":
        node.run(["iptables-restore", "--noflush", "-w"], stdin=render_restore(policy, Family.V4))
        node.run(["iptables", "-w", "-t", "nat", *PORT_FOREIGN])
    else:
        node.run(["nft", "-f", "-"], stdin=render_script(policy))
        node.run(["nft", "-f", "-"], stdin=NFT_FOREIGN)
    out_interface = "v3a"
    assert peer_if == "v3b"

    seen: dict[tuple[str, str, int], str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        servers = []
        try:
            for port in RULES_PORTS:
                log = Path(tmp, f"peer-{port}.log")
                log.touch()  # the server opens it (append) only after saying "ready"
                server = peer.popen([sys.executable, "-m", "ipmasq.lab.probe", "serve", str(port), "--log", str(log)],
                                    stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
                servers.append(server)
                assert server.stdout is not None and server.stdout.readline().strip() == "ready"
            for pod_ip, pod in pods.items():
                for port in RULES_PORTS:
                    before = {p: len(Path(tmp, f"peer-{p}.log").read_text().splitlines()) for p in RULES_PORTS}
                    result = pod.run([sys.executable, "-m", "ipmasq.lab.probe", "connect-many", "--timeout", "2",
                                      *[f"{d}:{port}" for d in RULES_DESTINATIONS]], check=False)
                    assert result.returncode == 0, result.stdout
                    lines = Path(tmp, f"peer-{port}.log").read_text().splitlines()[before[port]:]
                    for line in lines:
                        _, destination, source = line.split()
                        seen[(pod_ip, destination, port)] = source
        finally:
            for server in servers:
                server.kill()
                server.wait()
    if backend == "iptables":
        table = parse_save(node.run(["iptables-save", "-t", "nat"]).stdout)
        tracer: Tracer | NftTracer = Tracer(table)
        foreign_label = "POSTROUTING:1"
    else:
        ruleset = node.run(["nft", "-j", "list", "ruleset"]).stdout
        tracer = NftTracer(ruleset)
        foreign_label = next(label for chain in tracer.chains.values() for r in chain
                             if (label := r.label).startswith("ip handwritten post handle "))
    assert len(seen) == len(pods) * len(RULES_DESTINATIONS) * len(RULES_PORTS)

    names = set()
    for (pod_ip, destination, port), peer_saw in seen.items():
        packet = Packet.of(destination, source=pod_ip, protocol="tcp", port=port, out_interface=out_interface,
                           local_addresses=[NODE, NODE_POD_SIDE, SECOND_POD_SIDE, SNAT_ADDRESS])
        traced = tracer.trace(packet)
        assert traced.source_seen(packet, masquerade_address=NODE) == peer_saw, (packet, traced)
        names.add(traced.decided_label)
        explained = _explain_seen(policy, destination, pod_ip, "tcp", port)
        if destination.startswith("172.30.") and port == 443:
            assert explained == pod_ip and peer_saw == NODE  # the hand-written rule overrides the config
        else:
            assert explained == peer_saw, (pod_ip, destination, port)
    assert {"rule partner-snat", "rule batch-masq", "rule web-keep", foreign_label} <= names
    assert seen[(POD, "10.2.1.100", 443)] == SNAT_ADDRESS and seen[(SECOND_POD, "10.130.0.6", 8080)] == NODE

    # many more packets than the peer answered: trace on the live rules equals explain (but for the foreign rule)
    rng = random.Random(11)
    for _ in range(400):
        pod_ip = rng.choice([POD, SECOND_POD, "100.64.8.200", "100.64.9.1"])
        destination = rng.choice([*RULES_DESTINATIONS, "10.2.1.7", "10.2.2.1", "34.120.200.1", "8.8.8.8"])
        protocol = rng.choice(["tcp", "udp", "icmp"])
        any_port: int | None = None if protocol == "icmp" else rng.choice([53, 443, 444, 7999, 8000, 8090, 8091])
        packet = Packet.of(destination, source=pod_ip, protocol=protocol, port=any_port, out_interface=out_interface,
                           local_addresses=[NODE])
        traced = tracer.trace(packet, record_steps=False)
        if traced.decided_label == foreign_label:
            continue
        assert traced.source_seen(packet, masquerade_address=NODE) == _explain_seen(
            policy, destination, pod_ip, protocol, any_port), packet

    pod_range = (parse_cidr("100.64.0.0/16"),)
    if backend == "iptables":
        report = check_iptables(policy, table, Family.V4, pod_ranges=pod_range)
    else:
        report = check_nft(policy, parse_list_json(ruleset), ruleset=ruleset, pod_ranges=pod_range)
    assert [(f.id, f.destinations) for f in report.findings] == [(FindingId.FOREIGN_MASQUERADE, ("172.30.0.0/16",))]
    assert f"(172.30.0.0/16 (tcp port 443)): {foreign_label} " in report.findings[0].message


def _explain_seen(policy: Policy, destination: str, source: str, protocol: str, port: int | None) -> str:
    family, address = parse_address(destination)
    verdict = policy.verdict_for(family, address, source=parse_address(source)[1], protocol=protocol, port=port)
    assert verdict.decided
    return verdict.snat_to or (NODE if verdict.masquerade else source)
