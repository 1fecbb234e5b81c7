"""Switching backends over the stateful fakes: the agent removes the other backend's objects once, before its
first write, and never anything that is not ours; `make_backend` wires --backend (auto included)."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import pytest

from ipmasq.agent.reconcile import Reconciler, SyncResult
from ipmasq.backends.base import Result
from ipmasq.backends.choose import make_backend
from ipmasq.backends.iptables import IptablesBackend, Variant
from ipmasq.backends.nftables import NftablesBackend
from ipmasq.config import ConfigInput
from ipmasq.errors import BackendError
from ipmasq.options import PolicyOptions
from ipmasq.prefix import Family
from ipmasq.testing import FakeIptables, FakeNft

LOG = logging.getLogger("test.switch")
FOREIGN = (
    "*nat\n:KUBE-POSTROUTING - [0:0]\n"
    '-A POSTROUTING -m comment --comment "kubernetes postrouting rules" -j KUBE-POSTROUTING\n'
    "-A KUBE-POSTROUTING -j MARK --xor-mark 0x4000\nCOMMIT\n"
)
KUBE_PROXY = ("table ip kube-proxy {\n\tchain nat-postrouting {\n"
              "\t\ttype nat hook postrouting priority srcnat; policy accept;\n\t\tmasquerade\n\t}\n}\n")
CONFIG = ConfigInput((("/etc/config/ip-masq-agent", b"nonMasqueradeCIDRs: [10.0.0.0/8, 'fd00::/8']\n"),))
DUAL = PolicyOptions(enable_ipv6=True)


class Node:
    """One node's kernel: nft and every iptables tool, each answered by its stateful fake."""

    def __init__(self) -> None:
        self.nft = FakeNft()
        self.iptables = FakeIptables()
        self.missing: set[str] = set()

    def __call__(self, argv: Sequence[str], stdin: str | None = None) -> Result:
        if argv[0] in self.missing:
            raise BackendError(f"cannot run {argv[0]}: No such file or directory", argv=tuple(argv))
        return self.nft(argv, stdin) if argv[0] == "nft" else self.iptables(argv, stdin)

    def ours_in_iptables(self) -> list[str]:
        return [line for tool in ("iptables", "ip6tables") for line in self.iptables.save(tool, "nat").splitlines()
                if "ip-masq-agent" in line or "IP-MASQ" in line]


def iptables_pass(node: Node, options: PolicyOptions = DUAL) -> None:
    rec = Reconciler(IptablesBackend(node, chain=options.masq_chain, variant=Variant.NFT), options, log=LOG)
    rec.observe(CONFIG)
    assert rec.reconcile().result is SyncResult.APPLIED


def nft_pass(node: Node, options: PolicyOptions = DUAL) -> None:
    rec = Reconciler(NftablesBackend(node), options, log=LOG)
    rec.observe(CONFIG)
    assert rec.reconcile().result is SyncResult.APPLIED


@pytest.fixture
def node() -> Node:
    n = Node()
    assert n.iptables.restore("iptables", FOREIGN).returncode == 0
    assert n.nft(["nft", "-f", "-"], KUBE_PROXY).returncode == 0
    return n


def test_nftables_removes_an_earlier_iptables_run_once(node: Node, caplog: pytest.LogCaptureFixture) -> None:
    # an earlier run under GKE's chain name, both families
    iptables_pass(node, PolicyOptions(enable_ipv6=True, masq_chain="IP-MASQ"))
    assert any(":IP-MASQ" in line for line in node.ours_in_iptables())
    foreign_before = node.iptables.save("iptables", "nat")
    backend, others = make_backend("nftables", DUAL, node, variant="nft")
    rec = Reconciler(backend, DUAL, log=LOG, others=others)
    rec.observe(CONFIG)
    with caplog.at_level(logging.INFO):
        report = rec.reconcile()
    assert report.result is SyncResult.APPLIED
    # one removal: the fake answers both iptables variants from one table, so the first variant checked holds it
    assert report.removed_leftovers == ("iptables (legacy)",)
    assert node.ours_in_iptables() == []
    # what is left of the nat table is exactly the foreign part
    left = node.iptables.save("iptables", "nat")
    assert [line for line in left.splitlines() if "KUBE" in line] == \
           [line for line in foreign_before.splitlines() if "KUBE" in line]
    assert ("inet", "ip-masq-agent") in node.nft.tables and ("ip", "kube-proxy") in node.nft.tables
    assert sum("left by an earlier run" in r.message for r in caplog.records) == 1
    # once: later passes do not look at iptables again, and an idle pass writes nothing
    calls, writes = len(node.iptables.calls), node.nft.transactions
    assert rec.reconcile().result is SyncResult.IN_SYNC
    assert len(node.iptables.calls) == calls and node.nft.transactions == writes


def test_iptables_removes_an_earlier_nftables_table_and_only_it(node: Node) -> None:
    nft_pass(node)
    backend, others = make_backend("iptables", DUAL, node, variant="nft")
    rec = Reconciler(backend, DUAL, log=LOG, others=others)
    rec.observe(CONFIG)
    assert rec.reconcile().result is SyncResult.APPLIED
    assert list(node.nft.tables) == [("ip", "kube-proxy")]
    assert any("-j IP-MASQ-AGENT" in line for line in node.ours_in_iptables())
    assert rec.reconcile().result is SyncResult.IN_SYNC


def test_nothing_left_over_means_no_removal_write(node: Node) -> None:
    backend, others = make_backend("nftables", DUAL, node, variant="nft")
    rec = Reconciler(backend, DUAL, log=LOG, others=others)
    rec.observe(CONFIG)
    report = rec.reconcile()
    assert report.result is SyncResult.APPLIED
    assert node.iptables.writes == 1  # only the FOREIGN fixture's restore
    assert report.removed_leftovers == () and len(report.writes) == 1  # the inet table holds both families


def test_a_missing_tool_holds_no_leftovers(node: Node) -> None:
    node.missing = {"iptables-legacy-save", "ip6tables-legacy-save"}
    iptables_pass(node)
    backend, others = make_backend("nftables", DUAL, node, variant="nft")
    rec = Reconciler(backend, DUAL, log=LOG, others=others)
    rec.observe(CONFIG)
    assert rec.reconcile().result is SyncResult.APPLIED
    assert node.ours_in_iptables() == []
    node.missing = {"nft"}
    assert not NftablesBackend(node).present()


def test_a_failing_removal_is_retried_before_any_write(node: Node) -> None:
    iptables_pass(node)
    node.iptables.reject = "-X IP-MASQ-AGENT"
    backend, others = make_backend("nftables", DUAL, node, variant="nft")
    rec = Reconciler(backend, DUAL, log=LOG, others=others)
    rec.observe(CONFIG)
    assert rec.reconcile().result is SyncResult.FAILED
    assert ("inet", "ip-masq-agent") not in node.nft.tables  # never two sets of our rules at once
    node.iptables.reject = None
    assert rec.reconcile().result is SyncResult.APPLIED
    assert node.ours_in_iptables() == [] and ("inet", "ip-masq-agent") in node.nft.tables


def test_auto_follows_the_node(node: Node) -> None:
    backend, _ = make_backend("auto", DUAL, node, variant="nft")
    assert backend.name == "nftables"  # the kube-proxy table: the node uses nftables for NAT
    del node.nft.tables[("ip", "kube-proxy")]
    backend, others = make_backend("auto", DUAL, node, variant="nft")
    assert backend.name == "iptables (nft)"  # the KUBE-POSTROUTING rules: the drop-in choice
    assert [o.name for o in others] == ["nftables"]
    plain = Node()
    backend, _ = make_backend("auto", PolicyOptions(), plain, variant="nft")
    assert backend.name == "nftables"
    # our own iptables rules do not count: the choice does not flip-flop after a switch
    iptables_pass(plain)
    backend, _ = make_backend("auto", PolicyOptions(), plain, variant="nft")
    assert backend.name == "nftables"
    assert IptablesBackend(plain, chain="IP-MASQ-AGENT", variant=Variant.NFT).read(Family.V4).objects
