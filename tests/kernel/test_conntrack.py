"""A failing connection keeps its NAT decision after a config fix unless its conntrack entry is deleted.

pod (10.44.14.15) -> node -> peer (172.30.12.110), the peer with no route back to the pod range (the GKE upgrade
outage: the AWS side cannot answer a pod IP). With the reference defaults, 172.16.0.0/12 is not masqueraded: the SYN
leaves with the pod IP and gets no answer; the client retransmits. The fix (nonMasqueradeCIDRs [10.0.0.0/8]) is
applied while the client waits. Its next SYN retransmission (about 1 s after the first) succeeds only when the
stale entries were deleted; otherwise it matches the old entry, keeps the pod IP, and the connect times out.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ipmasq.config import ConfigInput, config_from_bytes
from ipmasq.conntrack import flush_stale_conntrack
from ipmasq.lab.kubelet import publish
from ipmasq.lab.netns import Namespace, NamespaceRunner, Network
from ipmasq.netfilter.iptables import render_restore
from ipmasq.options import PolicyOptions
from ipmasq.policy.policy import Policy
from ipmasq.prefix import Family, parse_cidr
from tests.eventually import eventually
from tests.kernel.servers import LAB_PROBE, start_server, stop_server

POD, NODE_POD_SIDE, NODE_PEER_SIDE, PEER = "10.44.14.15", "10.44.14.1", "172.30.12.1", "172.30.12.110"
PORT = 8080
# the first retransmission comes after the initial RTO (1 s); the second after 3 s: wait between the two
CONNECT_TIMEOUT = 2.5


def _policy(text: str) -> Policy:
    options = PolicyOptions()
    return Policy(config_from_bytes(ConfigInput((("/etc/config/ip-masq-agent", text.encode()),)), options), options)


def _topology(net: Network) -> tuple[Namespace, Namespace]:
    pod, node, peer = net.add("pod"), net.add("node"), net.add("peer")
    node.sysctl("net.ipv4.ip_forward", "1")
    net.link(pod, [f"{POD}/24"], node, [f"{NODE_POD_SIDE}/24"])
    net.link(node, [f"{NODE_PEER_SIDE}/24"], peer, [f"{PEER}/24"])
    pod.run(["ip", "route", "add", "default", "via", NODE_POD_SIDE])
    # the peer has no route to 10.44.0.0/14: a SYN from the pod IP is never answered
    _servers.append(start_server(peer, [*LAB_PROBE, "serve", str(PORT), PEER]))
    return pod, node


_servers: list[subprocess.Popen[str]] = []


@pytest.fixture(autouse=True)
def _stop_servers() -> object:
    yield
    while _servers:
        stop_server(_servers.pop())


def _has_entry(node: Namespace) -> bool:
    """Whether the pod's first SYN to the peer has its conntrack entry on the node."""
    return POD in node.run(["conntrack", "-L", "-f", "ipv4", "--orig-dst", PEER], check=False).stdout


@pytest.mark.parametrize("flush", [True, False], ids=["flush", "no-flush"])
def test_retransmitted_syn_sees_the_fix_only_after_flush(net: Network, flush: bool) -> None:
    before = _policy("")  # reference defaults: 172.16.0.0/12 keeps the pod IP
    after = _policy("nonMasqueradeCIDRs: [10.0.0.0/8]\n")  # the GKE upgrade fix
    pod, node = _topology(net)
    node.run(["iptables-restore", "--noflush", "-w"], stdin=render_restore(before, Family.V4))
    client = pod.popen([sys.executable, "-m", "ipmasq.lab.probe", "connect", PEER, str(PORT), str(CONNECT_TIMEOUT)],
                       stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        eventually(lambda: _has_entry(node), "the first SYN's conntrack entry on the node")
        # the fix, as the agent applies it: the chain declared again (so flushed) and rewritten, in one restore
        node.run(["iptables-restore", "--noflush", "-w"], stdin=render_restore(after, Family.V4, with_jump=False))
        if flush:
            result = flush_stale_conntrack(NamespaceRunner(node), before, after)
            assert parse_cidr("172.16.0.0/12") in result.prefixes
            assert result.deleted == 1
        out, _ = client.communicate(timeout=CONNECT_TIMEOUT + 5)
    finally:
        client.kill()
        client.wait()
    seen = out.strip()
    if flush:
        assert seen == NODE_PEER_SIDE  # masqueraded by the new rules on the retransmission
    else:
        assert seen == "FAILED"  # every retransmission kept the stale no-NAT decision
        listed = node.run(["conntrack", "-L", "-f", "ipv4", "--orig-dst", PEER]).stdout
        assert f"src={POD} dst={PEER}" in listed and f"dst={POD}" in listed  # reply tuple: still not NATed


def test_nothing_to_delete_is_not_an_error(net: Network) -> None:
    node = net.add("node")
    result = flush_stale_conntrack(NamespaceRunner(node), _policy(""), _policy("nonMasqueradeCIDRs: []\n"))
    assert result.deleted == 0
    assert {str(p) for p in result.prefixes} == {"10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16"}


@pytest.mark.parametrize("flag", ["--flush-conntrack", "--flush-conntrack=false"], ids=["flag-on", "flag-off"])
def test_agent_flush_conntrack_flag(net: Network, flag: str, tmp_path: Path) -> None:
    """The same, end to end: the real agent running, the fix published the way kubelet updates a ConfigMap."""
    pod, node = _topology(net)
    config_dir = str(tmp_path / "config")
    publish(config_dir, "nonMasqueradeCIDRs: [10.0.0.0/8, 172.16.0.0/12]\n")  # 172.30.12.110 keeps the pod IP
    log_path = tmp_path / "agent.log"
    with log_path.open("w") as log:
        agent = node.popen([sys.executable, "-m", "ipmasq", "agent", "--backend=iptables", flag,
                            "--config", f"{config_dir}/ip-masq-agent"], stdout=log, stderr=subprocess.STDOUT)
    client = None
    try:
        eventually(lambda: "applied IPv4 rules" in log_path.read_text(),
                   lambda: f"the agent's first write\n{log_path.read_text()}")
        client = pod.popen([sys.executable, "-m", "ipmasq.lab.probe", "connect", PEER, str(PORT),
                            str(CONNECT_TIMEOUT)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        eventually(lambda: _has_entry(node), "the first SYN's conntrack entry on the node")
        publish(config_dir, "nonMasqueradeCIDRs: [10.0.0.0/8]\n")  # the GKE upgrade fix, while the SYNs retry
        out, _ = client.communicate(timeout=CONNECT_TIMEOUT + 5)
    finally:
        if client is not None:
            client.kill()
            client.wait()
        agent.terminate()
        agent.wait(5)
    text = log_path.read_text()
    if flag == "--flush-conntrack":
        assert out.strip() == NODE_PEER_SIDE, text
        assert "conntrack: deleted 1 entries" in text
    else:
        assert out.strip() == "FAILED", text
        assert "conntrack: deleted" not in text

