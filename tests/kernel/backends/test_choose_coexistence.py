"""Both backends next to what kube-proxy leaves on a node (an nftables table of its own and iptables-nft chains),
switching from one backend to the other, and uninstall: real netfilter in namespaces, real TCP, the peer's view."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ipmasq.lab.netns import Namespace, Network
from tests.eventually import eventually
from tests.kernel.agent_harness import AWS_DB, NODE, ONPREM, POD, agent, more_passes, world
from tests.kernel.flavors import FLAVORS, Flavor, nft_table, save

KUBE_PROXY_NFT = (
    "table ip kube-proxy {\n"
    "\tchain nat-postrouting {\n"
    "\t\ttype nat hook postrouting priority srcnat; policy accept;\n"
    "\t\tmeta mark & 0x00004000 == 0x00004000 masquerade fully-random\n"
    "\t}\n"
    "}\n"
)
KUBE_IPTABLES = (
    "*nat\n:KUBE-POSTROUTING - [0:0]\n"
    '-A POSTROUTING -m comment --comment "kubernetes postrouting rules" -j KUBE-POSTROUTING\n'
    "-A KUBE-POSTROUTING -m mark ! --mark 0x4000/0x4000 -j RETURN\n"
    "-A KUBE-POSTROUTING -j MARK --xor-mark 0x4000\n"
    '-A KUBE-POSTROUTING -m comment --comment "kubernetes service traffic requiring SNAT" -j MASQUERADE\nCOMMIT\n'
)
CONFIG = "nonMasqueradeCIDRs: [10.0.0.0/8]\nresyncInterval: 200ms\n"


def kube_objects(node: Namespace) -> tuple[str, list[str]]:
    """kube-proxy's nft table as listed, and every iptables nat line that names KUBE, byte for byte."""
    table = node.run(["nft", "-s", "list", "table", "ip", "kube-proxy"]).stdout
    return table, [line for line in save(node).splitlines() if "KUBE" in line]


def with_kube_proxy(node: Namespace) -> None:
    node.run(["nft", "-f", "-"], stdin=KUBE_PROXY_NFT)
    node.run(["iptables-restore", "--noflush"], stdin=KUBE_IPTABLES)


def once(node: Namespace, *args: str) -> subprocess.CompletedProcess[str]:
    result = node.run([sys.executable, "-m", "ipmasq", "agent", "--once", *args], check=False)
    assert result.returncode == 0, result.stderr
    return result


@pytest.mark.parametrize("backend", [*(f.backend for f in FLAVORS), "auto"])
def test_kube_proxy_objects_stay_byte_for_byte(net: Network, tmp_path: Path, backend: str) -> None:
    config = tmp_path / "ip-masq-agent"
    config.write_text(CONFIG)
    with world(net) as w:
        with_kube_proxy(w.node)
        before = kube_objects(w.node)
        assert "kube-proxy" in before[0] and len(before[1]) == 5
        with agent(w.node, tmp_path / "agent.log", f"--config={config}", f"--backend={backend}") as running:
            eventually(lambda: "applied IPv4" in running.log, lambda: f"the config written\n{running.log}")
            more_passes(w.node, 3)  # a few resyncs
            assert kube_objects(w.node) == before
            assert w.seen(AWS_DB) == NODE  # masqueraded by us
            assert w.seen(ONPREM) == POD  # inside 10.0.0.0/8: kube-proxy's rules do not masquerade unmarked packets
            assert len(running.lines("applied")) == 1 and not running.lines("ERROR")
        assert kube_objects(w.node) == before
    if backend == "auto":
        # kube-proxy's nftables table means the node uses nftables for NAT
        assert running.lines("backend nftables chosen by --backend=auto: the node already uses nftables for NAT "
                             "(table ip kube-proxy: kube-proxy's nftables mode)"), running.log


def test_switching_backends_removes_the_other_ones_objects_and_uninstall_removes_both(net: Network,
                                                                                     tmp_path: Path) -> None:
    config = tmp_path / "ip-masq-agent"
    config.write_text(CONFIG)
    iptables, nftables = (Flavor("iptables"), Flavor("nftables"))
    with world(net) as w:
        with_kube_proxy(w.node)
        before = kube_objects(w.node)
        once(w.node, f"--config={config}", "--backend=iptables", "--enable-ipv6", "--masq-chain=IP-MASQ")
        assert ":IP-MASQ " in save(w.node, 6) and not nft_table(w.node)
        assert w.seen(AWS_DB) == NODE and w.seen(ONPREM) == POD
        # to nftables: our iptables chains (both families, any chain name, found by comment) go in the same run
        result = once(w.node, f"--config={config}", "--backend=nftables")
        assert "ip-masq-agent" not in save(w.node, 4) + save(w.node, 6)
        assert nft_table(w.node) and kube_objects(w.node) == before
        assert "removed the objects of iptables" in result.stderr
        assert w.seen(AWS_DB) == NODE and w.seen(ONPREM) == POD
        # a second run finds nothing to remove and writes nothing
        handles = nftables.fingerprint(w.node)
        result = once(w.node, f"--config={config}", "--backend=nftables")
        assert "removed" not in result.stderr and "applied" not in result.stderr
        assert nftables.fingerprint(w.node) == handles
        # back to iptables: our nftables table goes, kube-proxy's stays
        result = once(w.node, f"--config={config}", "--backend=iptables")
        assert not nft_table(w.node) and iptables.ours(w.node) and kube_objects(w.node) == before
        assert "removed the objects of nftables" in result.stderr
        assert w.seen(AWS_DB) == NODE
        # uninstall with both backends' objects present (nftables written by hand from render's script)
        script = w.node.run([sys.executable, "-m", "ipmasq", "render", "--backend", "nftables",
                             f"--config={config}"]).stdout
        w.node.run(["nft", "-f", "-"], stdin=script)
        assert nft_table(w.node) and iptables.ours(w.node)
        w.node.run([sys.executable, "-m", "ipmasq", "uninstall"])
        assert not nft_table(w.node) and not iptables.ours(w.node) and not iptables.ours(w.node, 6)
        assert kube_objects(w.node) == before
        assert w.seen(AWS_DB) == POD  # nothing of ours left: kube-proxy masquerades only marked packets
