"""Config rules on real netfilter, once per backend: for each field a rule can test, the source address the peer
really saw for a real TCP connection equals what `ipmasq explain` answers for that packet."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from ipmasq.lab.netns import Namespace, Network
from tests.kernel.agent_harness import AWS_DB, NODE, NODE6, ONPREM, PEER6_FAR, POD, POD6, PORT, agent, wait_until, world
from tests.kernel.flavors import FLAVORS, Flavor

POD_B = "10.44.14.16"  # a second pod address on the pod's side
SPARE = "10.142.15.204"  # a spare node address a partner's firewall would allow
SPARE6 = "fd42::204"
OTHER_PORT = 9090
CONFIG = f"""\
nonMasqueradeCIDRs: [10.0.0.0/8]
rules:
  - name: pod-b-keeps-its-ip
    destinations: [{AWS_DB}/32]
    sources: [{POD_B}/32]
    action: preserve
  - name: onprem-9090-fixed-address
    destinations: [{ONPREM}/32]
    protocol: tcp
    ports: [{OTHER_PORT}, "9990-9999"]
    action: snat
    snatTo: {SPARE}
  - name: egress-pool-masquerades-10-2
    destinations: [10.2.0.0/16]
    nodes: ["egress-*"]
    action: masquerade
"""
# (pod source, destination, port): every rule above matched and missed, and the overlap of the last two
PACKETS = [(POD, AWS_DB, PORT), (POD_B, AWS_DB, PORT), (POD, ONPREM, OTHER_PORT), (POD, ONPREM, PORT),
           (POD_B, ONPREM, OTHER_PORT)]
CONNECT = (
    "import socket, sys\n"
    "source, host, port = sys.argv[1], sys.argv[2], int(sys.argv[3])\n"
    "try:\n"
    "    with socket.create_connection((host, port), timeout=2, source_address=(source, 0)) as c:\n"
    "        data = b''\n"
    "        while not data.endswith(b'\\n'):\n"
    "            chunk = c.recv(256)\n"
    "            if not chunk:\n"
    "                break\n"
    "            data += chunk\n"
    "    print(data.decode().strip() or 'FAILED')\n"
    "except OSError:\n"
    "    print('FAILED')\n"
)

backends = pytest.mark.parametrize("flavor", FLAVORS, ids=str)


def seen(pod: Namespace, source: str, destination: str, port: int) -> str | None:
    """The source address the peer saw for a TCP connection from `source` in the pod namespace."""
    for _ in range(3):  # a fresh link may still be resolving neighbours
        out = pod.run([sys.executable, "-c", CONNECT, source, destination, str(port)], check=False).stdout.strip()
        if out and out != "FAILED":
            return out
    return None


def explained(config: Path, source: str, destination: str, port: int, node_name: str, node_ip: str,
              *extra: str) -> dict[str, object]:
    result = subprocess.run([sys.executable, "-m", "ipmasq", "explain", destination, f"--config={config}",
                             f"--source={source}", "--protocol=tcp", f"--port={port}", f"--node-name={node_name}",
                             f"--node-ip={node_ip}", "-o", "json", *extra], capture_output=True, text=True, check=True)
    (answer,) = json.loads(result.stdout)
    assert answer["depends_on"] == []  # every field was given
    return dict(answer)


def interface_of(ns: Namespace, address: str) -> str:
    for line in ns.run(["ip", "-o", "addr", "show"]).stdout.splitlines():
        if f" {address}/" in line:
            return line.split()[1]
    raise AssertionError(f"no interface holds {address}")


@contextmanager
def second_server(peer: Namespace, port: int) -> Iterator[None]:
    server = peer.popen([sys.executable, "-m", "ipmasq.lab.probe", "serve", str(port)], stdout=subprocess.PIPE,
                        stderr=subprocess.DEVNULL)
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "ready"
        yield
    finally:
        server.kill()
        server.wait()


@backends
@pytest.mark.parametrize("node_name", ["egress-1", "general-7"])
def test_each_rule_field_changes_what_the_peer_sees_as_explain_says(net: Network, tmp_path: Path, flavor: Flavor,
                                                                   node_name: str) -> None:
    config = tmp_path / "ip-masq-agent"
    config.write_text(CONFIG)
    with world(net) as w, second_server(w.peer, OTHER_PORT):
        w.peer.sysctl("net.ipv4.tcp_max_tw_buckets", "0")  # a reused NATed port never meets a TIME_WAIT
        w.pod.run(["ip", "addr", "add", f"{POD_B}/32", "dev", "lo"])
        w.node.run(["ip", "addr", "add", f"{SPARE}/20", "dev", interface_of(w.node, NODE)])
        with agent(w.node, tmp_path / "agent.log", f"--config={config}", flavor.flag,
                   f"--node-name={node_name}") as running:
            assert wait_until(lambda: "rule onprem-9090-fixed-address" in flavor.dump(w.node)), running.log
            # the node-scoped rule is in the kernel exactly on a matching node
            assert ("rule egress-pool-masquerades-10-2" in flavor.dump(w.node)) == node_name.startswith("egress-")
            observed = {}
            for source, destination, port in PACKETS:
                answer = explained(config, source, destination, port, node_name, NODE)
                observed[(source, destination, port)] = seen(w.pod, source, destination, port)
                assert observed[(source, destination, port)] == answer["source_seen"], (source, destination, port,
                                                                                        answer, running.log)
    egress = node_name.startswith("egress-")
    assert observed == {
        (POD, AWS_DB, PORT): NODE,  # no rule: the list's catch-all
        (POD_B, AWS_DB, PORT): POD_B,  # the source-scoped rule
        (POD, ONPREM, OTHER_PORT): SPARE,  # the port-scoped snat rule, ahead of the overlapping node rule
        (POD, ONPREM, PORT): NODE if egress else POD,  # another port: the node rule, or on other nodes the list
        (POD_B, ONPREM, OTHER_PORT): SPARE,
    }


@backends
def test_an_ipv6_rule_snats_to_a_spare_node_address(net: Network, tmp_path: Path, flavor: Flavor) -> None:
    config = tmp_path / "ip-masq-agent"
    config.write_text(f'rules:\n  - name: far-v6\n    destinations: ["{PEER6_FAR}/128"]\n    protocol: tcp\n'
                      f'    ports: [{PORT}]\n    action: snat\n    snatTo: "{SPARE6}"\n')
    with world(net, ipv6=True) as w:
        w.peer.sysctl("net.ipv4.tcp_max_tw_buckets", "0")
        w.node.run(["ip", "-6", "addr", "add", f"{SPARE6}/64", "dev", interface_of(w.node, NODE6), "nodad"])
        with agent(w.node, tmp_path / "agent.log", f"--config={config}", "--enable-ipv6", flavor.flag) as running:
            assert wait_until(lambda: "rule far-v6" in flavor.dump(w.node, 6)), running.log
            answer = explained(config, POD6, PEER6_FAR, PORT, "any", NODE6, "--enable-ipv6")
            assert answer["source_seen"] == SPARE6 and answer["rule_name"] == "far-v6"
            assert w.seen(PEER6_FAR) == SPARE6, running.log
