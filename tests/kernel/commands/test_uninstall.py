"""`ipmasq uninstall` and the agent's clean-up of the places it does not use, on real netfilter in namespaces the
tests create: a chain another program wrote with the reference agent's exact text (GKE's `IP-MASQ`, AKS's
`IP-MASQ-AGENT`: the reference's own measured output, restored by the plain tool) stays byte for byte in every place
(iptables-legacy and iptables-nft, IPv4 and IPv6; a same-named nftables table), and what ipmasq's agent wrote goes
with its ownership marker, leaving the node as it was before the agent ran."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from ipmasq.lab.netns import Namespace, Network
from tests.conftest import VECTORS

KUBE = (
    "*nat\n:KUBE-POSTROUTING - [0:0]\n"
    '-A POSTROUTING -m comment --comment "kubernetes postrouting rules" -j KUBE-POSTROUTING\n'
    "-A KUBE-POSTROUTING -m mark ! --mark 0x4000/0x4000 -j RETURN\n"
    "-A KUBE-POSTROUTING -j MARK --xor-mark 0x4000\nCOMMIT\n"
)
JUMP = ('-A POSTROUTING -m comment --comment "ip-masq-agent: ensure nat POSTROUTING directs all non-LOCAL destination '
        'traffic to our custom {chain} chain" -m addrtype ! --dst-type LOCAL -j {chain}')
LOCAL = ('-A {chain} -d {cidr} -m comment --comment "ip-masq-agent: local traffic is not subject to MASQUERADE" '
         '-j RETURN')
MASQ = ('-A {chain} -m comment --comment "ip-masq-agent: outbound traffic is subject to MASQUERADE (must be last in '
        'chain)" -j MASQUERADE')
# A table of our name that another program wrote (here by hand; ipmasq 0.2.0 wrote such tables too): no marker.
NFT_LOOK_ALIKE = (
    "table inet ip-masq-agent {\n"
    "\tset nomasq_v4 {\n\t\ttype ipv4_addr\n\t\tflags interval\n\t\telements = { 10.0.0.0/8 }\n\t}\n"
    "\tchain postrouting {\n\t\ttype nat hook postrouting priority srcnat; policy accept;\n"
    '\t\tip daddr @nomasq_v4 return comment "ip-masq-agent: local traffic is not subject to MASQUERADE"\n'
    '\t\tmasquerade comment "ip-masq-agent: outbound traffic is subject to MASQUERADE (must be last in chain)"\n'
    "\t}\n}\n"
)
CONFIG = "nonMasqueradeCIDRs: [10.0.0.0/8, 'fd00::/8']\n"


@dataclass(frozen=True)
class Place:
    variant: str  # legacy, nft
    family: int

    def __str__(self) -> str:
        return f"iptables-{self.variant}, ipv{self.family}"

    def tool(self, action: str) -> str:
        return f"{'iptables' if self.family == 4 else 'ip6tables'}-{self.variant}-{action}"

    def restore(self, node: Namespace, text: str) -> None:
        node.run([self.tool("restore"), "--noflush"], stdin=text)

    def nat(self, node: Namespace) -> list[str]:
        """The nat table as iptables-save prints it, its timestamps and the chains' counters aside."""
        return [line.split(" [")[0] if line.startswith(":") else line
                for line in node.run([self.tool("save"), "-t", "nat"]).stdout.splitlines() if not line.startswith("#")]


PLACES = [Place(variant, family) for variant in ("legacy", "nft") for family in (4, 6)]


def reference_chains(family: int) -> str:
    """GKE's IP-MASQ and AKS's IP-MASQ-AGENT as the reference agent writes them (IPv4: its measured output)."""
    if family == 4:
        lines = [*(VECTORS / "expected" / "17-gke-chain.out").read_text().splitlines(),
                 *(VECTORS / "expected" / "01-no-file.out").read_text().splitlines()]
    else:
        lines = []
        for chain in ("IP-MASQ", "IP-MASQ-AGENT"):
            lines += [f":{chain} - [0:0]", JUMP.format(chain=chain), LOCAL.format(chain=chain, cidr="fe80::/10"),
                      LOCAL.format(chain=chain, cidr="fd00::/8"), MASQ.format(chain=chain)]
    return "*nat\n" + "\n".join(lines) + "\nCOMMIT\n"


def ipmasq(node: Namespace, *args: str) -> subprocess.CompletedProcess[str]:
    result = node.run([sys.executable, "-m", "ipmasq", *args], check=False)
    assert result.returncode == 0, result.stderr
    return result


def everything(node: Namespace) -> dict[str, list[str]]:
    """Every nat table of both variants and families, and the whole nftables ruleset (stateless)."""
    tables = {str(place): place.nat(node) for place in PLACES}
    tables["nftables"] = node.run(["nft", "-s", "list", "ruleset"]).stdout.splitlines()
    return tables


def node_with_kube_proxy(net: Network) -> Namespace:
    node = net.add("node")
    for place in PLACES:
        place.restore(node, KUBE)
    return node


@pytest.mark.parametrize("place", PLACES, ids=str)
def test_a_chain_another_program_wrote_survives_uninstall_and_the_agents_clean_up(net: Network, tmp_path: Path,
                                                                                 place: Place) -> None:
    node = node_with_kube_proxy(net)
    place.restore(node, reference_chains(place.family))
    before = place.nat(node)
    assert sum(line.startswith("-A POSTROUTING") and "ip-masq-agent" in line for line in before) == 2
    kept = (f"kept IP-MASQ-AGENT, IP-MASQ ({place}): no ipmasq ownership marker: another program wrote them")
    assert ipmasq(node, "uninstall").stdout.splitlines() == [kept, "nothing to remove"]
    assert ipmasq(node, "uninstall", "--masq-chain=IP-MASQ").stdout.splitlines() == [
        kept.replace("IP-MASQ-AGENT, IP-MASQ", "IP-MASQ, IP-MASQ-AGENT"), "nothing to remove"]
    assert place.nat(node) == before
    config = tmp_path / "ip-masq-agent"
    config.write_text(CONFIG)
    other = "nft" if place.variant == "legacy" else "legacy"
    # the agent's clean-up of every place it does not use: the other backend, the other variant
    for args in (("--backend=nftables",), ("--backend=iptables", f"--iptables-variant={other}")):
        result = ipmasq(node, "agent", "--once", f"--config={config}", "--enable-ipv6", *args)
        assert place.nat(node) == before, args
        assert f"kept IP-MASQ-AGENT, IP-MASQ ({place})" in result.stderr
        assert f"removed the objects of iptables ({place.variant})" not in result.stderr
    # the agent in this very place under another name: both chains, under names not its own, stay
    result = ipmasq(node, "agent", "--once", f"--config={config}", "--enable-ipv6", "--backend=iptables",
                    f"--iptables-variant={place.variant}", "--masq-chain=PROOF-MASQ")
    assert {":PROOF-MASQ -", ":IPMASQ-OWNS-PROOF-MASQ -"} <= set(place.nat(node))
    assert [line for line in place.nat(node) if "PROOF-MASQ" not in line] == before
    lines = ipmasq(node, "uninstall", "--masq-chain=PROOF-MASQ").stdout.splitlines()
    assert f"removed: PROOF-MASQ ({place})" in lines and f"kept IP-MASQ, IP-MASQ-AGENT ({place}): no ipmasq " \
           "ownership marker: another program wrote them" in lines
    assert "nothing to remove" not in lines
    assert place.nat(node) == before


def test_a_table_of_our_name_another_program_wrote_survives(net: Network, tmp_path: Path) -> None:
    node = node_with_kube_proxy(net)
    node.run(["nft", "-f", "-"], stdin=NFT_LOOK_ALIKE)
    before = node.run(["nft", "-s", "list", "table", "inet", "ip-masq-agent"]).stdout
    assert ipmasq(node, "uninstall").stdout.splitlines() == [
        "kept table inet ip-masq-agent (nftables): no ipmasq ownership marker: another program wrote it",
        "nothing to remove"]
    config = tmp_path / "ip-masq-agent"
    config.write_text(CONFIG)
    result = ipmasq(node, "agent", "--once", f"--config={config}", "--enable-ipv6", "--backend=iptables")
    assert "kept table inet ip-masq-agent (nftables)" in result.stderr
    assert node.run(["nft", "-s", "list", "table", "inet", "ip-masq-agent"]).stdout == before
    # the operator's word (no other agent on this node): it goes, and nothing else
    assert ipmasq(node, "uninstall", "--remove-unmarked").stdout.splitlines() == [
        "removed: IP-MASQ-AGENT (iptables-nft, ipv4)", "removed: IP-MASQ-AGENT (iptables-nft, ipv6)",
        "removed: table inet ip-masq-agent (nftables): no ipmasq ownership marker (--remove-unmarked)"]
    assert node.run(["nft", "list", "table", "inet", "ip-masq-agent"], check=False).returncode != 0


@pytest.mark.parametrize("agent_flags", [("--backend=iptables", "--iptables-variant=legacy"),
                                         ("--backend=iptables", "--iptables-variant=nft"), ("--backend=nftables",)],
                         ids=["iptables-legacy", "iptables-nft", "nftables"])
def test_what_the_agent_wrote_goes_with_its_markers_and_leaves_the_node_as_it_was(
        net: Network, tmp_path: Path, agent_flags: tuple[str, ...]) -> None:
    node = node_with_kube_proxy(net)
    before = everything(node)
    config = tmp_path / "ip-masq-agent"
    config.write_text(CONFIG)
    ipmasq(node, "agent", "--once", f"--config={config}", "--enable-ipv6", *agent_flags)
    written = everything(node)
    if agent_flags[0] == "--backend=nftables":
        assert "\tset ipmasq-owns-this-table {" in written["nftables"]
        expected = ["removed: table inet ip-masq-agent (nftables)"]
    else:
        variant = agent_flags[1].split("=")[1]
        for family in (4, 6):
            assert ":IPMASQ-OWNS-IP-MASQ-AGENT -" in written[f"iptables-{variant}, ipv{family}"]
        expected = [f"removed: IP-MASQ-AGENT (iptables-{variant}, ipv{family})" for family in (4, 6)]
    assert ipmasq(node, "uninstall").stdout.splitlines() == expected
    assert everything(node) == before
    assert ipmasq(node, "uninstall").stdout.splitlines() == ["nothing to remove"]
