"""check and trace on a node where kube-proxy runs in nftables mode, beside the agent on each backend.

kube-proxy 1.37's ruleset (tests/dumps/kube-proxy-nftables.nft: a ClusterIP and a NodePort service, one endpoint
on this node, cluster CIDR 10.244.0.0/16, masqueradeAll false) loaded with `nft -f` beside the agent's rules
(nftables: its own table; iptables-nft and iptables-legacy: its chain in iptables' nat table). Its nat-postrouting
sits at srcnat (100) like the agent's chain, and masquerades only what it marked 0x4000 (NodePort traffic) and an
endpoint reaching itself through its Service (hairpin).

Real TCP: a pod's egress to the internet and to 10/8, a client outside the node to the NodePort, the endpoint to
its own ClusterIP, a second pod to that ClusterIP; each server logs the source it saw. `ipmasq trace` on the live
rules (run in the node's namespace, --backend auto) must say the same source and name the rule that decided it:
the agent's for pod egress, kube-proxy's masquerading chain for the NodePort and hairpin connections. `ipmasq check`
on the live node must find nothing.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from ipmasq.config import ConfigInput, config_from_bytes
from ipmasq.lab.netns import Namespace, Network
from ipmasq.netfilter.iptables import render_restore
from ipmasq.netfilter.nft import render_script
from ipmasq.options import PolicyOptions
from ipmasq.policy.policy import Policy
from ipmasq.policy.prefix import Family
from tests.conftest import ROOT

FIXTURE = ROOT / "tests" / "dumps" / "kube-proxy-nftables.nft"
FIXTURE_JSON = ROOT / "tests" / "dumps" / "kube-proxy-nftables.json"
CONFIG = "nonMasqueradeCIDRs: [10.0.0.0/8]\n"
# the fixture's addresses: the endpoint pod, the node's address the NodePort listens on, the services
POD, POD_SIDE = "10.244.1.5", "10.244.1.1"
POD2, POD2_SIDE = "10.244.2.6", "10.244.2.1"
NODE, CLIENT = "192.168.0.2", "192.168.0.1"
INTERNET, PRIVATE = "203.0.113.10", "10.20.0.5"
WEB_CLUSTER_IP, NODE_PORT, ENDPOINT_PORT = "10.96.0.10", 30080, 8080
LOCAL = [NODE, POD_SIDE, POD2_SIDE]
BACKENDS = ["nftables", "iptables-nft", "iptables-legacy"]


def _policy() -> Policy:
    options = PolicyOptions()
    return Policy(config_from_bytes(ConfigInput((("/etc/config/ip-masq-agent", CONFIG.encode()),)), options), options)


@contextmanager
def _server(ns: Namespace, log: Path, port: int) -> Iterator[None]:
    log.touch()
    server = ns.popen([sys.executable, "-m", "ipmasq.lab.probe", "serve", str(port), "--log", str(log)],
                      stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "ready"
        yield
    finally:
        server.kill()
        server.wait()


def _connect(ns: Namespace, host: str, port: int) -> str:
    """The source the server saw for one real TCP connection."""
    result = ns.run([sys.executable, "-m", "ipmasq.lab.probe", "connect", host, str(port), "3"], check=False)
    assert result.returncode == 0, (host, port, result.stdout, result.stderr)
    return result.stdout.strip()


def _ipmasq(node: Namespace, *args: str) -> tuple[int, dict[str, object]]:
    result = node.run([sys.executable, "-m", "ipmasq", *args, "-o", "json"], check=False)
    assert result.returncode in (0, 1), result.stderr
    document: dict[str, object] = json.loads(result.stdout)
    return result.returncode, document


def _trace(node: Namespace, destination: str, source: str, *extra: str) -> dict[str, object]:
    locals_ = [a for address in LOCAL for a in ("--local-address", address)]
    code, document = _ipmasq(node, "trace", destination, "--source", source, "--protocol", "tcp", *locals_, *extra)
    assert code == 0, document
    return document


@pytest.mark.parametrize("backend", BACKENDS)
def test_check_and_trace_beside_kube_proxy_nftables(net: Network, backend: str) -> None:
    policy = _policy()
    pod, pod2, node, client = net.add("pod"), net.add("pod2"), net.add("node"), net.add("client")
    node.sysctl("net.ipv4.ip_forward", "1")
    net.link(pod, [f"{POD}/24"], node, [f"{POD_SIDE}/24"])
    net.link(pod2, [f"{POD2}/24"], node, [f"{POD2_SIDE}/24"])
    net.link(node, [f"{NODE}/24"], client, [f"{CLIENT}/24"])
    pod.run(["ip", "route", "add", "default", "via", POD_SIDE])
    pod2.run(["ip", "route", "add", "default", "via", POD2_SIDE])
    node.run(["ip", "route", "add", "default", "via", CLIENT])
    client.run(["ip", "route", "add", "10.244.0.0/16", "via", NODE])  # the network routes pod ranges to the node
    for address in (INTERNET, PRIVATE):
        client.run(["ip", "addr", "add", f"{address}/32", "dev", "lo"])
    if backend == "nftables":
        node.run(["nft", "-f", "-"], stdin=render_script(policy))
    else:
        node.run([f"iptables-{backend.split('-')[1]}-restore", "--noflush", "-w"],
                 stdin=render_restore(policy, Family.V4))
    node.run(["nft", "-f", str(FIXTURE)])  # kube-proxy (re)starting after the agent: its hook is the newest

    with tempfile.TemporaryDirectory() as tmp:
        with _server(client, Path(tmp, "client.log"), ENDPOINT_PORT), \
                _server(pod, Path(tmp, "pod.log"), ENDPOINT_PORT):
            seen = {
                "egress to the internet": _connect(pod, INTERNET, ENDPOINT_PORT),
                "egress to 10/8": _connect(pod, PRIVATE, ENDPOINT_PORT),
                "NodePort from outside": _connect(client, NODE, NODE_PORT),
                "endpoint to its own ClusterIP": _connect(pod, WEB_CLUSTER_IP, 80),
                "another pod to the ClusterIP": _connect(pod2, WEB_CLUSTER_IP, 80),
            }
        config = Path(tmp, "config.yaml")
        config.write_text(CONFIG)
        code, report = _ipmasq(node, "check", "--config", str(config), "--pod-range", "10.244.0.0/16",
                               "--agent", "none")
    # what the kernel did: the agent decides pod egress, kube-proxy masquerades the NodePort and hairpin connections
    assert seen == {
        "egress to the internet": NODE,
        "egress to 10/8": POD,
        "NodePort from outside": POD_SIDE,
        "endpoint to its own ClusterIP": POD_SIDE,
        "another pod to the ClusterIP": POD2,
    }
    assert (code, report) == (0, {"ok": True, "findings": []})

    agent_chain = "inet ip-masq-agent postrouting" if backend == "nftables" else "IP-MASQ-AGENT"
    traced = {
        "egress to the internet": _trace(node, INTERNET, POD, "--port", str(ENDPOINT_PORT)),
        "egress to 10/8": _trace(node, PRIVATE, POD, "--port", str(ENDPOINT_PORT)),
        "NodePort from outside": _trace(node, POD, CLIENT, "--port", str(ENDPOINT_PORT), "--service",
                                        "--mark", "0x4000"),
        "endpoint to its own ClusterIP": _trace(node, POD, POD, "--port", str(ENDPOINT_PORT), "--service"),
        "another pod to the ClusterIP": _trace(node, POD, POD2, "--port", str(ENDPOINT_PORT), "--service"),
    }
    out_address = {"egress to the internet": NODE, "egress to 10/8": NODE}
    for case, document in traced.items():
        # trace names the out interface's address only through --local-address: its first one is NODE
        expected = seen[case]
        if document["outcome"] == "masqueraded":
            assert out_address.get(case, POD_SIDE) == expected, (case, document)
        else:
            assert document["source_seen"] == expected, (case, document)
        rules = [step["rule"] for step in document["steps"]]  # type: ignore[attr-defined]
        assert "jump masquerading" in rules, (case, document)  # kube-proxy's chain was walked, whatever the backend
    assert traced["egress to the internet"]["outcome"] == "masqueraded"
    assert str(traced["egress to the internet"]["decided_by"]).startswith(
        agent_chain if backend == "nftables" else "-A IP-MASQ-AGENT")
    assert str(traced["NodePort from outside"]["decided_by_name"]).startswith("ip kube-proxy masquerading handle ")
    assert "meta mark & 0x00004000 != 0x00000000" in str(traced["NodePort from outside"]["decided_by"])
    assert "@hairpin-connections" in str(traced["endpoint to its own ClusterIP"]["decided_by"])
    assert traced["another pod to the ClusterIP"]["outcome"] == "unchanged"
    # the agent's chain and kube-proxy's share priority 100: trace says that the order does not matter here
    assert any("share priority 100" in note for note in traced["NodePort from outside"]["notes"])  # type: ignore


def test_the_json_fixture_is_what_nft_lists_for_the_text_fixture(net: Network) -> None:
    """tests/dumps/kube-proxy-nftables.json (the unit tests' input) is `nft -j list ruleset` of the .nft fixture,
    and nft lists that fixture back exactly as it is written."""
    node = net.add("node")
    node.run(["nft", "-f", str(FIXTURE)])
    assert node.run(["nft", "list", "ruleset"]).stdout == FIXTURE.read_text()
    listed = [o for o in json.loads(node.run(["nft", "-j", "list", "ruleset"]).stdout)["nftables"]
              if "metainfo" not in o]
    committed = [o for o in json.loads(FIXTURE_JSON.read_text())["nftables"] if "metainfo" not in o]
    assert listed == committed
