"""Switching backends and iptables variants over the stateful fakes: every pass, once its own rules are verified,
the agent removes our objects from every other backend and variant, and never anything that is not ours;
`make_backend` wires --backend (auto included)."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import pytest

from ipmasq.agent.reconcile import Reconciler
from ipmasq.agent.reports import SyncResult
from ipmasq.backends.base import Result
from ipmasq.backends.choose import make_backend
from ipmasq.backends.iptables import IptablesBackend, Variant
from ipmasq.backends.nftables import NftablesBackend
from ipmasq.config import ConfigInput
from ipmasq.errors import BackendError
from ipmasq.options import PolicyOptions
from ipmasq.prefix import Family
from ipmasq.testing import FakeIptables, FakeNft, FakeRunner

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
V4_ONLY = ConfigInput((("/etc/config/ip-masq-agent", b"nonMasqueradeCIDRs: [10.0.0.0/8]\n"),))


class Node(FakeRunner):
    """One node's kernel: nft and both iptables variants, each its own stateful fake (the plain `iptables-save`
    is the nft variant, as on today's Debian)."""

    def __init__(self) -> None:
        super().__init__()
        self.nft = FakeNft()
        self.legacy = FakeIptables()
        self.iptables = FakeIptables()  # the nft variant
        self.missing: set[str] = set()
        self.log: list[tuple[str, ...]] = []  # every write, in order: (tool, first line of what it was given)

    def __call__(self, argv: Sequence[str], stdin: str | None = None) -> Result:
        if argv[0] in self.missing:
            raise BackendError(f"cannot run {argv[0]}: No such file or directory", argv=tuple(argv))
        if stdin is not None:
            self.log.append((argv[0], *[line for line in stdin.splitlines() if line.startswith(("-D", "delete"))]))
        if argv[0] == "nft":
            return self.nft(argv, stdin)
        return (self.legacy if "-legacy-" in argv[0] else self.iptables)(argv, stdin)

    def ours_in_iptables(self, variant: FakeIptables | None = None) -> list[str]:
        fakes = (self.legacy, self.iptables) if variant is None else (variant,)
        return [line for fake in fakes for tool in ("iptables", "ip6tables") for line in fake.save(tool, "nat")
                .splitlines() if "ip-masq-agent" in line or "IP-MASQ" in line]


def iptables_pass(node: Node, options: PolicyOptions = DUAL, *, variant: Variant = Variant.NFT,
                  config: ConfigInput = CONFIG) -> None:
    """What an earlier agent (no node lock, no look at the other variant) left behind."""
    rec = Reconciler(IptablesBackend(node, chain=options.masq_chain, variant=variant), options, log=LOG)
    rec.take_config(config)
    assert rec.reconcile().result is SyncResult.APPLIED


def nft_pass(node: Node, options: PolicyOptions = DUAL) -> None:
    rec = Reconciler(NftablesBackend(node), options, log=LOG)
    rec.take_config(CONFIG)
    assert rec.reconcile().result is SyncResult.APPLIED


@pytest.fixture
def node() -> Node:
    n = Node()
    assert n.iptables.restore("iptables", FOREIGN).returncode == 0
    assert n.nft(["nft", "-f", "-"], KUBE_PROXY).returncode == 0
    return n


def test_nftables_removes_both_iptables_variants_on_every_pass(node: Node, caplog: pytest.LogCaptureFixture) -> None:
    # earlier runs under GKE's chain name, both families, in both variants
    for variant in Variant:
        iptables_pass(node, PolicyOptions(enable_ipv6=True, masq_chain="IP-MASQ"), variant=variant)
    assert any(":IP-MASQ" in line for line in node.ours_in_iptables(node.legacy))
    assert any(":IP-MASQ" in line for line in node.ours_in_iptables(node.iptables))
    foreign_before = node.iptables.save("iptables", "nat")
    backend, others = make_backend("nftables", DUAL, node, variant="nft")
    rec = Reconciler(backend, DUAL, log=LOG, others=others)
    rec.take_config(CONFIG)
    with caplog.at_level(logging.INFO):
        report = rec.reconcile()
    assert report.result is SyncResult.APPLIED
    assert report.removed_leftovers == ("iptables (legacy)", "iptables (nft)") and report.leftovers == ()
    assert node.ours_in_iptables() == []
    # what is left of the nat table is exactly the foreign part
    left = node.iptables.save("iptables", "nat")
    assert [line for line in left.splitlines() if "KUBE" in line] == \
           [line for line in foreign_before.splitlines() if "KUBE" in line]
    assert ("inet", "ip-masq-agent") in node.nft.tables and ("ip", "kube-proxy") in node.nft.tables
    assert sum("removed the objects of" in r.message for r in caplog.records) == 2
    # every pass looks again, cheaply: one save per variant and family, and an idle pass writes nothing
    reads = len(node.legacy.calls) + len(node.iptables.calls)
    writes = (node.legacy.writes, node.iptables.writes, node.nft.transactions)
    assert rec.reconcile().result is SyncResult.IN_SYNC
    assert len(node.legacy.calls) + len(node.iptables.calls) - reads == 4
    assert (node.legacy.writes, node.iptables.writes, node.nft.transactions) == writes
    # an old agent re-creates its chain: the next pass finds and removes it again
    iptables_pass(node, variant=Variant.LEGACY)
    report = rec.reconcile()
    assert report.result is SyncResult.IN_SYNC and report.removed_leftovers == ("iptables (legacy)",)
    assert node.ours_in_iptables() == [] and report.readiness.ok


def test_iptables_removes_an_earlier_nftables_table_and_only_it(node: Node) -> None:
    nft_pass(node)
    backend, others = make_backend("iptables", DUAL, node, variant="nft")
    rec = Reconciler(backend, DUAL, log=LOG, others=others)
    rec.take_config(CONFIG)
    assert rec.reconcile().result is SyncResult.APPLIED
    assert list(node.nft.tables) == [("ip", "kube-proxy")]
    assert any("-j IP-MASQ-AGENT" in line for line in node.ours_in_iptables())
    assert rec.reconcile().result is SyncResult.IN_SYNC


def test_nothing_left_over_means_no_removal_write(node: Node) -> None:
    backend, others = make_backend("nftables", DUAL, node, variant="nft")
    rec = Reconciler(backend, DUAL, log=LOG, others=others)
    rec.take_config(CONFIG)
    report = rec.reconcile()
    assert report.result is SyncResult.APPLIED
    assert node.iptables.writes == 1  # only the FOREIGN fixture's restore
    assert report.removed_leftovers == () and len(report.writes) == 1  # the inet table holds both families


def test_a_missing_tool_holds_no_leftovers(node: Node) -> None:
    node.missing = {"iptables-legacy-save", "ip6tables-legacy-save"}
    iptables_pass(node)
    backend, others = make_backend("nftables", DUAL, node, variant="nft")
    rec = Reconciler(backend, DUAL, log=LOG, others=others)
    rec.take_config(CONFIG)
    assert rec.reconcile().result is SyncResult.APPLIED
    assert node.ours_in_iptables() == []
    node.missing = {"nft"}
    assert not NftablesBackend(node).present()


def test_the_new_backend_is_installed_before_the_old_one_is_removed(node: Node) -> None:
    iptables_pass(node)
    node.log.clear()
    backend, others = make_backend("nftables", DUAL, node, variant="nft")
    rec = Reconciler(backend, DUAL, log=LOG, others=others)
    rec.take_config(CONFIG)
    assert rec.reconcile().result is SyncResult.APPLIED
    # make before break: our table first (the only write to nft), then the removal of the iptables objects
    assert [entry[0] for entry in node.log] == ["nft", "iptables-nft-restore", "ip6tables-nft-restore"]
    assert all(line.startswith("-D POSTROUTING") for entry in node.log[1:] for line in entry[1:])


def test_a_failing_install_leaves_the_old_rules_in_place(node: Node) -> None:
    iptables_pass(node)
    before = node.ours_in_iptables()
    backend, others = make_backend("nftables", DUAL, node, variant="nft")
    rec = Reconciler(backend, DUAL, log=LOG, others=others)
    rec.take_config(CONFIG)
    node.missing = {"nft"}
    report = rec.reconcile()
    assert report.result is SyncResult.FAILED and not report.readiness.ok
    assert node.ours_in_iptables() == before  # never a moment without rules
    node.missing = set()
    assert rec.reconcile().result is SyncResult.APPLIED
    assert node.ours_in_iptables() == []


def test_a_failing_removal_is_named_keeps_the_agent_not_ready_and_is_retried(node: Node) -> None:
    iptables_pass(node)
    node.iptables.reject = "-X IP-MASQ-AGENT"
    backend, others = make_backend("nftables", DUAL, node, variant="nft")
    rec = Reconciler(backend, DUAL, log=LOG, others=others)
    rec.take_config(CONFIG)
    report = rec.reconcile()
    assert report.result is SyncResult.FAILED
    assert ("inet", "ip-masq-agent") in node.nft.tables  # ours are in place: the same policy decides in both
    assert report.leftovers == ("iptables (nft)",) and report.removed_leftovers == ()
    assert not report.readiness.ok
    assert "our objects are still in iptables (nft)" in report.readiness.why
    assert "simulated rejection" in report.readiness.why
    node.iptables.reject = None
    report = rec.reconcile()
    assert report.result is SyncResult.IN_SYNC and report.removed_leftovers == ("iptables (nft)",)
    assert report.leftovers == () and report.readiness.ok
    assert node.ours_in_iptables() == []


def test_a_changed_variant_removes_the_old_variants_chain(node: Node) -> None:
    """A node moved from iptables-legacy to iptables-nft: the legacy chain masqueraded 8.8.8.0/24 forever."""
    iptables_pass(node, PolicyOptions(), variant=Variant.LEGACY, config=V4_ONLY)
    assert any("-j MASQUERADE" in line for line in node.ours_in_iptables(node.legacy))
    options = PolicyOptions()
    backend, others = make_backend("iptables", options, node, variant="nft")
    assert [o.name for o in others] == ["iptables (legacy)", "nftables"]
    rec = Reconciler(backend, options, log=LOG, others=others)
    rec.take_config(ConfigInput((("/etc/config/ip-masq-agent", b"nonMasqueradeCIDRs: [10.0.0.0/8, 8.8.8.0/24]\n"),)))
    report = rec.reconcile()
    assert report.result is SyncResult.APPLIED and report.removed_leftovers == ("iptables (legacy)",)
    assert node.ours_in_iptables(node.legacy) == []
    assert any("8.8.8.0/24" in line for line in node.ours_in_iptables(node.iptables))
    # and the other way round: an agent told to use legacy removes what the nft variant holds
    backend, others = make_backend("iptables", options, node, variant="legacy")
    assert [o.name for o in others] == ["iptables (nft)", "nftables"]
    rec = Reconciler(backend, options, log=LOG, others=others)
    rec.take_config(V4_ONLY)
    assert rec.reconcile().removed_leftovers == ("iptables (nft)",)
    assert node.ours_in_iptables(node.iptables) == [] and node.ours_in_iptables(node.legacy)


def test_auto_follows_the_node(node: Node) -> None:
    backend, _ = make_backend("auto", DUAL, node, variant="nft")
    assert backend.name == "nftables"  # the kube-proxy table: the node uses nftables for NAT
    del node.nft.tables[("ip", "kube-proxy")]
    backend, others = make_backend("auto", DUAL, node, variant="nft")
    assert backend.name == "iptables (nft)"  # the KUBE-POSTROUTING rules: the drop-in choice
    assert [o.name for o in others] == ["iptables (legacy)", "nftables"]
    plain = Node()
    backend, _ = make_backend("auto", PolicyOptions(), plain, variant="nft")
    assert backend.name == "nftables"
    # our own iptables rules do not count: the choice does not flip-flop after a switch
    iptables_pass(plain)
    backend, _ = make_backend("auto", PolicyOptions(), plain, variant="nft")
    assert backend.name == "nftables"
    assert IptablesBackend(plain, chain="IP-MASQ-AGENT", variant=Variant.NFT).read(Family.V4).objects
