"""`ipmasq uninstall` after ipmasq's agent stopped and another program rewrote its chain, on real netfilter in
namespaces the tests create, with real TCP: the ownership marker records what ipmasq wrote (a digest), so a chain
rewritten since with other rules (the reference agent's exact text, after a migration back from ipmasq) is kept byte
for byte and said why, and pod traffic stays masqueraded by it; the very same rules written again cannot be told
from ipmasq's and go; an untouched chain goes; a drift the running agent repaired is recorded, and goes. Both
iptables variants, IPv4 and IPv6, and nftables."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from ipmasq.lab.netns import Namespace, Network
from tests.conftest import VECTORS
from tests.eventually import eventually
from tests.kernel.agent.test_reconcile_ownership import uninstall
from tests.kernel.agent_harness import (
    AWS_DB,
    NODE,
    NODE6,
    PEER6_FAR,
    POD,
    POD6,
    AgentProcess,
    World,
    agent,
    world,
)
from tests.kernel.commands.test_uninstall import KUBE, LOCAL, MASQ, Place
from tests.kernel.flavors import nft_table

CONFIG = "nonMasqueradeCIDRs: [10.0.0.0/8, 'fd00::/8']\nresyncInterval: 100ms\n"
FAR = "198.51.100.10"  # masqueraded by ipmasq's config and by the reference agent's defaults alike
NFT_KEPT = "kept table inet ip-masq-agent (nftables): its rules changed since ipmasq wrote them: another program " \
           "writes it now"
# what another program adds to ipmasq's nftables table (nothing but ipmasq writes that table, and 0.2.0 replaces it
# whole, marker and all: an in-place change is an operator's or a script's)
NFT_REWRITE = ["nft", "add", "element", "inet", "ip-masq-agent", "nomasq_v4", "{ 198.51.100.0/24 }"]


def reference_rewrite(family: int) -> str:
    """The reference agent's restore of its chain (its jump, already there and the same, left as it is: its
    EnsureRule checks with -C): IPv4 its measured text with its default CIDRs (10/8, 172.16/12, 192.168/16), IPv6
    with fc00::/7 where ipmasq's config has fd00::/8."""
    if family == 4:
        lines = [line for line in (VECTORS / "expected" / "01-no-file.out").read_text().splitlines()
                 if not line.startswith("-A POSTROUTING")]
    else:
        lines = [":IP-MASQ-AGENT - [0:0]", LOCAL.format(chain="IP-MASQ-AGENT", cidr="fe80::/10"),
                 LOCAL.format(chain="IP-MASQ-AGENT", cidr="fc00::/7"), MASQ.format(chain="IP-MASQ-AGENT")]
    return "*nat\n" + "\n".join(lines) + "\nCOMMIT\n"


def unmarked(lines: list[str]) -> list[str]:
    """A listing without ipmasq's ownership marker: iptables' marker chain and its rule; nftables' marker set."""
    out, skipping = [], False
    for line in lines:
        if line == "\tset ipmasq-owns-this-table {":
            skipping = True
        elif skipping:
            skipping = line != ""  # the set's block ends with the blank line nft prints between objects
        elif "IPMASQ-OWNS-" not in line:
            out.append(line)
    return out


@dataclass(frozen=True)
class Where:
    """Where the agent writes: an iptables variant (both families) or nftables."""

    name: str  # iptables-legacy, iptables-nft, nftables

    def __str__(self) -> str:
        return self.name

    @property
    def flags(self) -> tuple[str, ...]:
        if self.name == "nftables":
            return ("--backend=nftables",)
        return ("--backend=iptables", f"--iptables-variant={self.name.split('-')[1]}")

    @property
    def places(self) -> list[Place]:
        return [] if self.name == "nftables" else [Place(self.name.split("-")[1], family) for family in (4, 6)]

    def listings(self, node: Namespace) -> dict[str, list[str]]:
        if self.name == "nftables":
            return {"nftables": nft_table(node)}
        return {str(place): place.nat(node) for place in self.places}

    def marked(self, node: Namespace) -> bool:
        return all(any("ipmasq-owns-this-table" in line or line.startswith(":IPMASQ-OWNS-IP-MASQ-AGENT ")
                       for line in listing) and any("ipmasq wrote sha256:" in line for line in listing)
                   for listing in self.listings(node).values())

    def rewrite(self, node: Namespace) -> None:
        """Another program writes other rules there."""
        if self.name == "nftables":
            node.run(NFT_REWRITE)
        for place in self.places:
            place.restore(node, reference_rewrite(place.family))

    def write_again(self, node: Namespace) -> None:
        """Another program writes there exactly the rules ipmasq wrote: flushed and written again."""
        if self.name == "nftables":
            script = []
            for name in ("nomasq_v4", "nomasq_v6"):
                listed = node.run(["nft", "list", "set", "inet", "ip-masq-agent", name]).stdout
                found = re.search(r"elements = \{([^}]*)\}", listed)
                assert found is not None, listed
                elements = " ".join(found.group(1).split())
                script += [f"flush set inet ip-masq-agent {name}", f"add element inet ip-masq-agent {name} "
                                                                     f"{{ {elements} }}"]
            node.run(["nft", "-f", "-"], stdin="\n".join(script) + "\n")
        for place in self.places:
            rules = [line for line in place.nat(node) if line.startswith("-A IP-MASQ-AGENT ")]
            place.restore(node, "*nat\n:IP-MASQ-AGENT - [0:0]\n" + "".join(f"{r}\n" for r in rules) + "COMMIT\n")

    def kept(self) -> list[str]:
        if self.name == "nftables":
            return [NFT_KEPT]
        return [f"kept IP-MASQ-AGENT ({place}): its rules changed since ipmasq wrote them: another program writes "
                "it now" for place in self.places]

    def removed(self) -> list[str]:
        if self.name == "nftables":
            return ["removed: table inet ip-masq-agent (nftables)"]
        return [f"removed: IP-MASQ-AGENT ({place})" for place in self.places]


WHERE = [Where("iptables-legacy"), Where("iptables-nft"), Where("nftables")]


@contextmanager
def node_world(net: Network) -> Iterator[World]:
    """The pod, the node (kube-proxy's nat rules in both variants and families) and the peer, which also answers at
    FAR."""
    with world(net, ipv6=True) as w:
        for place in (Place(variant, family) for variant in ("legacy", "nft") for family in (4, 6)):
            place.restore(w.node, KUBE)
        w.peer.run(["ip", "addr", "add", f"{FAR}/32", "dev", "lo"])
        yield w


@contextmanager
def running_agent(w: World, tmp_path: Path, where: Where) -> Iterator[AgentProcess]:
    """ipmasq's agent writing its rules, until the block ends: stopped (SIGTERM leaves the rules, as on a DaemonSet
    deleted without an uninstall)."""
    config = tmp_path / "ip-masq-agent"
    config.write_text(CONFIG)
    with agent(w.node, tmp_path / "agent.log", f"--config={config}", "--enable-ipv6", *where.flags) as running:
        eventually(lambda: where.marked(w.node), lambda: f"the agent's rules marked\n{running.log}")
        # ipmasq's config masquerades 172.30.0.0/16
        eventually(lambda: w.seen(AWS_DB) == NODE, "the pod's traffic to 172.30.0.0/16 masqueraded")
        yield running


@pytest.mark.parametrize("where", WHERE, ids=str)
def test_rewritten_with_other_rules_after_the_agent_stopped_is_kept_byte_for_byte_and_said(
        net: Network, tmp_path: Path, where: Where) -> None:
    with node_world(net) as w:
        before = where.listings(w.node)
        with running_agent(w, tmp_path, where):
            pass
        where.rewrite(w.node)
        rewritten = where.listings(w.node)
        assert rewritten != before
        assert uninstall(w.node) == [*where.kept(), "nothing to remove"]
        # byte for byte, but for the marker that no longer told the truth
        assert where.listings(w.node) == {place: unmarked(lines) for place, lines in rewritten.items()}
        # pod traffic is still masqueraded, by the rules another program writes now, as they say
        assert w.seen(PEER6_FAR) == NODE6
        if where.name == "nftables":  # the element added there keeps FAR's /24 out of it
            assert w.seen(AWS_DB) == NODE and w.seen(FAR) == POD
        else:  # the reference's defaults keep 172.16.0.0/12
            assert w.seen(AWS_DB) == POD and w.seen(FAR) == NODE
        # from now on plainly another program's
        again = uninstall(w.node)
        assert again[-1] == "nothing to remove" and all("no ipmasq ownership marker" in line for line in again[:-1])
        assert where.listings(w.node) == {place: unmarked(lines) for place, lines in rewritten.items()}


@pytest.mark.parametrize("where", WHERE, ids=str)
def test_the_same_rules_written_again_cannot_be_told_from_ipmasqs_and_go(net: Network, tmp_path: Path,
                                                                        where: Where) -> None:
    with node_world(net) as w:
        before = where.listings(w.node)
        with running_agent(w, tmp_path, where):
            pass
        written = where.listings(w.node)
        where.write_again(w.node)
        assert where.listings(w.node) == written  # the very same text
        assert uninstall(w.node) == where.removed()
        assert where.listings(w.node) == before
        assert w.seen(FAR) == POD  # nothing masquerades any more: the node as before the agent ran


@pytest.mark.parametrize("where", WHERE, ids=str)
def test_untouched_since_the_agent_stopped_it_goes(net: Network, tmp_path: Path, where: Where) -> None:
    with node_world(net) as w:
        before = where.listings(w.node)
        with running_agent(w, tmp_path, where):
            pass
        assert uninstall(w.node) == where.removed()
        assert where.listings(w.node) == before and w.seen(FAR) == POD and w.seen(PEER6_FAR) == POD6


@pytest.mark.parametrize("where", WHERE, ids=str)
def test_a_drift_the_running_agent_repaired_is_recorded_and_goes(net: Network, tmp_path: Path, where: Where) -> None:
    with node_world(net) as w:
        before = where.listings(w.node)
        with running_agent(w, tmp_path, where) as running:
            good = where.listings(w.node)
            applied = len(running.lines("applied"))
            where.rewrite(w.node)
            eventually(lambda: len(running.lines("applied")) > applied and where.listings(w.node) == good,
                       lambda: f"the drift repaired\n{running.log}")
            assert running.lines("repaired drift")
        assert uninstall(w.node) == where.removed()
        assert where.listings(w.node) == before
