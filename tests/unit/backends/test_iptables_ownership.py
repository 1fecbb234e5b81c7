"""The iptables backend over the stateful fake: it writes the ownership marker with its chain, takes over the chain it
enforces, and removes only what carries the marker (another program's look-alike stays byte for byte)."""

from __future__ import annotations

import logging

import pytest

from ipmasq.agent.reconcile import Reconciler
from ipmasq.agent.reports import SyncResult
from ipmasq.backends.base import Adopt, Ownership
from ipmasq.backends.iptables import IptablesBackend, Variant, removal_payload, restore_payload, state_from_save
from ipmasq.config import ConfigInput
from ipmasq.netfilter.iptables import chain_digest, marker_chain, marker_rule, parse_save, render_restore
from ipmasq.options import PolicyOptions
from ipmasq.prefix import Family
from ipmasq.testing import FakeIptables
from tests.configs import agent_config, policy_of

LOG = logging.getLogger("test.ownership")
FOREIGN = (
    "*nat\n:KUBE-POSTROUTING - [0:0]\n"
    '-A POSTROUTING -m comment --comment "kubernetes postrouting rules" -j KUBE-POSTROUTING\n'
    "-A KUBE-POSTROUTING -j MARK --xor-mark 0x4000\nCOMMIT\n"
)
GKE = PolicyOptions(masq_chain="IP-MASQ", nomasq_all_reserved_ranges=True)
AKS = PolicyOptions()  # AKS's agent writes IP-MASQ-AGENT, the reference's default chain
CONFIG = "nonMasqueradeCIDRs: [10.0.0.0/8]\n"
UNMARK = "*nat\n-F IPMASQ-OWNS-IP-MASQ-AGENT\n-X IPMASQ-OWNS-IP-MASQ-AGENT\nCOMMIT\n"


def reference(fake: FakeIptables, options: PolicyOptions, tool: str = "iptables") -> None:
    """Another program's chain: the reference agent's exact restore text (GKE's, AKS's agent), no marker."""
    text = render_restore(policy_of(CONFIG, options), Family.V4 if tool == "iptables" else Family.V6)
    assert fake.restore(tool, text).returncode == 0


def agent(fake: FakeIptables, options: PolicyOptions = AKS) -> Reconciler:
    rec = Reconciler(IptablesBackend(fake, chain=options.masq_chain, variant=Variant.NFT), options, log=LOG)
    rec.take_config(agent_config(CONFIG))
    assert rec.reconcile().result is SyncResult.APPLIED
    return rec


def backend(fake: FakeIptables, chain: str = "IP-MASQ-AGENT") -> IptablesBackend:
    return IptablesBackend(fake, chain=chain, variant=Variant.NFT, families=(Family.V4, Family.V6))


@pytest.fixture
def fake() -> FakeIptables:
    f = FakeIptables()
    assert f.restore("iptables", FOREIGN).returncode == 0
    return f


def test_the_agent_writes_the_marker_in_the_same_transaction_and_the_reference_text_unchanged(
        fake: FakeIptables) -> None:
    writes = fake.writes
    agent(fake)
    assert fake.writes == writes + 1  # one transaction: the chain, its jump, its rules and its marker
    table = fake.table()
    # one rule, the digest of the jump and the rules as written, and no rule jumps to it
    jumps = [r for r in table.rules("POSTROUTING") if r.endswith("-j IP-MASQ-AGENT")]
    digest = chain_digest("IP-MASQ-AGENT", jumps, table.rules("IP-MASQ-AGENT"))
    assert table.rules("IPMASQ-OWNS-IP-MASQ-AGENT") == [marker_rule("IP-MASQ-AGENT", digest)]
    assert not any("-j IPMASQ-OWNS" in rule for rules in table.chains.values() for rule in map(str, rules))
    kept = [line for line in fake.save("iptables", "nat").splitlines()
            if line.startswith("-A") and "ip-masq-agent" in line]
    reference_text = [line for line in parse_save(render_restore(policy_of(CONFIG, AKS), Family.V4)).rules]
    assert kept == reference_text  # the chain's rules and the jump: the reference's, byte for byte


@pytest.mark.parametrize("options", [GKE, AKS], ids=["gke", "aks"])
def test_another_programs_chain_survives_remove_all_byte_for_byte(fake: FakeIptables,
                                                                  options: PolicyOptions) -> None:
    reference(fake, options)
    reference(fake, options, "ip6tables")
    before = {tool: fake.save(tool, "nat") for tool in ("iptables", "ip6tables")}
    writes = fake.writes
    found = backend(fake, options.masq_chain).remove_all()
    assert fake.writes == writes  # nothing written at all
    assert {tool: fake.save(tool, "nat") for tool in before} == before
    chain = options.masq_chain
    assert found == (Ownership("iptables-nft, ipv4", (), (chain,)), Ownership("iptables-nft, ipv6", (), (chain,)))
    assert found[0].lines() == (f"kept {chain} (iptables-nft, ipv4): no ipmasq ownership marker: another program "
                                "wrote it",)
    assert not backend(fake, chain).present()


def test_what_the_agent_wrote_goes_with_its_marker_and_nothing_else(fake: FakeIptables) -> None:
    reference(fake, GKE)  # GKE's chain beside ours: it stays
    gke = fake.table().rules("IP-MASQ")
    agent(fake)
    assert backend(fake).present()
    found = backend(fake).remove_all()
    assert found == (Ownership("iptables-nft, ipv4", ("IP-MASQ-AGENT",), ("IP-MASQ",)),)
    assert found[0].lines() == ("removed: IP-MASQ-AGENT (iptables-nft, ipv4)",
                                "kept IP-MASQ (iptables-nft, ipv4): no ipmasq ownership marker: another program "
                                "wrote it")
    table = fake.table()
    assert set(table.chains) == {"PREROUTING", "INPUT", "OUTPUT", "POSTROUTING", "KUBE-POSTROUTING", "IP-MASQ"}
    assert table.rules("IP-MASQ") == gke and sum("-j IP-MASQ" in r for r in table.rules("POSTROUTING")) == 1


def test_migration_takes_the_reference_chain_over_in_one_transaction_then_uninstall_removes_it(
        fake: FakeIptables) -> None:
    reference(fake, AKS, "iptables")
    assert not backend(fake).present()
    rec = agent(fake)  # the same chain name: enforced, so taken over
    table = fake.table()
    assert marker_chain("IP-MASQ-AGENT") in table.chains
    assert sum("-j IP-MASQ-AGENT" in r for r in table.rules("POSTROUTING")) == 1  # its jump kept, not doubled
    assert rec.reconcile().result is SyncResult.IN_SYNC
    backend(fake).remove_all()
    assert not [c for c in fake.table().chains if "MASQ" in c]


def test_an_unmarked_0_2_0_chain_is_adopted_by_the_first_pass_as_drift_of_one_object(fake: FakeIptables) -> None:
    rec = agent(fake)
    # what ipmasq 0.2.0 left: the same chain without a marker
    del fake.table().chains[marker_chain("IP-MASQ-AGENT")]
    before = fake.table().rules("IP-MASQ-AGENT")
    upgraded = Reconciler(IptablesBackend(fake, chain="IP-MASQ-AGENT", variant=Variant.NFT), AKS, log=LOG)
    upgraded.take_config(agent_config(CONFIG))
    report = upgraded.reconcile()
    # the marker and its record: two objects added
    assert report.result is SyncResult.APPLIED and (report.writes[0].added, report.writes[0].removed) == (2, 0)
    assert marker_chain("IP-MASQ-AGENT") in fake.table().chains and fake.table().rules("IP-MASQ-AGENT") == before
    assert rec.reconcile().result is SyncResult.IN_SYNC


def test_a_deleted_marker_is_drift_the_agent_repairs(fake: FakeIptables) -> None:
    rec = agent(fake)
    assert fake.restore("iptables", UNMARK).returncode == 0
    report = rec.reconcile()
    assert report.result is SyncResult.APPLIED and report.drift_repair
    assert marker_chain("IP-MASQ-AGENT") in fake.table().chains


def test_a_chain_whose_marker_went_after_the_read_is_not_removed(fake: FakeIptables) -> None:
    agent(fake)
    stale = backend(fake).read(Family.V4, adopt=Adopt.NONE)  # read while marked
    assert fake.restore("iptables", UNMARK).returncode == 0
    before = fake.save("iptables", "nat")
    payload = removal_payload(stale)
    assert payload is not None and "-F IPMASQ-OWNS-IP-MASQ-AGENT\n" in payload
    assert fake.restore("iptables", payload).returncode != 0  # refused whole: the marker is not there
    assert fake.save("iptables", "nat") == before


def test_remove_unmarked_takes_every_look_alike(fake: FakeIptables) -> None:
    reference(fake, GKE)
    found = backend(fake).remove_all(adopt=Adopt.ALL)
    assert found[0].lines(adopt=Adopt.ALL) == (
        "removed: IP-MASQ (iptables-nft, ipv4): no ipmasq ownership marker (--remove-unmarked)",)
    assert "IP-MASQ" not in fake.table().chains and fake.table().rules("KUBE-POSTROUTING")


def test_a_chain_under_an_earlier_name_goes_only_with_its_marker(fake: FakeIptables) -> None:
    agent(fake, GKE)  # ipmasq once ran under GKE's name: IP-MASQ is marked
    reference(fake, PolicyOptions(masq_chain="OLD-MASQ"))  # someone else's look-alike under a third name
    old = fake.table().rules("OLD-MASQ")
    agent(fake)  # now under the default name: IP-MASQ (marked) goes in the same pass, OLD-MASQ stays
    chains = fake.table().chains
    assert "IP-MASQ" not in chains and marker_chain("IP-MASQ") not in chains
    assert fake.table().rules("OLD-MASQ") == old and marker_chain("IP-MASQ-AGENT") in chains


def test_an_orphan_marker_is_ours_and_goes_with_uninstall(fake: FakeIptables) -> None:
    assert fake.restore("iptables", "*nat\n:IPMASQ-OWNS-GONE - [0:0]\nCOMMIT\n").returncode == 0
    found = backend(fake).remove_all()
    assert found == (Ownership("iptables-nft, ipv4", ("IPMASQ-OWNS-GONE",), ()),)
    assert "IPMASQ-OWNS-GONE" not in fake.table().chains


def test_a_long_chain_name_has_a_hashed_marker_the_kernel_takes(fake: FakeIptables) -> None:
    long = PolicyOptions(masq_chain="IP-MASQ-AGENT-TENANT-BLUE-01")
    agent(fake, long)
    assert marker_chain(long.masq_chain) in fake.table().chains and len(marker_chain(long.masq_chain)) == 28
    assert backend(fake, long.masq_chain).remove_all()[0].owned == (long.masq_chain,)
    assert not [c for c in fake.table().chains if "MASQ" in c]


def test_an_unmanaged_family_loses_only_what_is_marked(fake: FakeIptables) -> None:
    reference(fake, AKS, "ip6tables")  # AKS's IPv6 chain, beside an agent that does not manage IPv6
    v6 = fake.save("ip6tables", "nat")
    rec = Reconciler(IptablesBackend(fake, chain="IP-MASQ-AGENT", variant=Variant.NFT), AKS, log=LOG)
    rec.take_config(ConfigInput((("/etc/config/ip-masq-agent", CONFIG.encode()),)))
    assert rec.reconcile().result is SyncResult.APPLIED and rec.ready
    assert fake.save("ip6tables", "nat") == v6


def test_the_payload_declares_the_marker_right_after_the_chain() -> None:
    policy = policy_of(CONFIG, AKS)
    empty = state_from_save(parse_save("*nat\nCOMMIT\n"), "IP-MASQ-AGENT", Family.V4)
    payload = restore_payload(policy, Family.V4, empty)
    assert payload == render_restore(policy, Family.V4, with_marker=True)
    assert payload.splitlines()[1:3] == [":IP-MASQ-AGENT - [0:0]", ":IPMASQ-OWNS-IP-MASQ-AGENT - [0:0]"]


def test_check_never_reports_the_marker_nor_its_absence(fake: FakeIptables) -> None:
    from ipmasq.diagnose.check_iptables import check_iptables

    policy = policy_of(CONFIG, AKS)
    agent(fake)
    marked = parse_save(fake.save("iptables", "nat"))
    aks = FakeIptables()
    reference(aks, AKS)  # AKS's agent: the same chain, no marker
    unmarked = parse_save(aks.save("iptables", "nat"))
    assert marker_chain("IP-MASQ-AGENT") in marked.chains and marker_chain("IP-MASQ-AGENT") not in unmarked.chains
    assert check_iptables(policy, marked, Family.V4).findings == check_iptables(policy, unmarked, Family.V4).findings \
        == ()


def rewrite(fake: FakeIptables, config: str, tool: str = "iptables") -> None:
    """The reference agent's sync after ipmasq's agent stopped: its restore of the chain alone, the jump it finds
    already there left as it is (its EnsureRule checks with -C)."""
    family = Family.V4 if tool == "iptables" else Family.V6
    options = PolicyOptions(enable_ipv6=True)
    assert fake.restore(tool, render_restore(policy_of(config, options), family, with_jump=False)).returncode == 0


def test_a_chain_another_program_rewrote_since_is_kept_byte_for_byte_and_its_stale_marker_goes(
        fake: FakeIptables) -> None:
    agent(fake)
    rewrite(fake, "nonMasqueradeCIDRs: [10.0.0.0/8, 192.168.0.0/16]\n")  # a migration back to the reference agent
    chain, jumps = fake.table().rules("IP-MASQ-AGENT"), fake.table().rules("POSTROUTING")
    found = backend(fake).remove_all()
    assert found == (Ownership("iptables-nft, ipv4", (), (), ("IP-MASQ-AGENT",)),)
    assert found[0].lines() == ("kept IP-MASQ-AGENT (iptables-nft, ipv4): its rules changed since ipmasq wrote them: "
                                "another program writes it now",)
    table = fake.table()
    assert table.rules("IP-MASQ-AGENT") == chain and table.rules("POSTROUTING") == jumps
    assert marker_chain("IP-MASQ-AGENT") not in table.chains  # it no longer told the truth
    # from now on the chain is plainly another program's
    assert backend(fake).remove_all()[0].lines() == (
        "kept IP-MASQ-AGENT (iptables-nft, ipv4): no ipmasq ownership marker: another program wrote it",)
    assert fake.table().rules("IP-MASQ-AGENT") == chain


def test_a_chain_rewritten_with_exactly_what_ipmasq_wrote_cannot_be_told_apart_and_goes(fake: FakeIptables) -> None:
    agent(fake)
    written = fake.table().rules("IP-MASQ-AGENT")
    # another program's restore of the very same rules (flushed and written again): the same content
    text = "*nat\n:IP-MASQ-AGENT - [0:0]\n" + "".join(f"{rule}\n" for rule in written) + "COMMIT\n"
    assert fake.restore("iptables", text).returncode == 0
    assert backend(fake).remove_all()[0].lines() == ("removed: IP-MASQ-AGENT (iptables-nft, ipv4)",)
    assert not [c for c in fake.table().chains if "MASQ" in c]


def test_a_drift_repair_records_what_it_wrote_so_uninstall_removes_the_chain(fake: FakeIptables) -> None:
    rec = agent(fake)
    rewrite(fake, "nonMasqueradeCIDRs: [10.0.0.0/9]\n")  # someone else's rules in our chain while the agent runs
    report = rec.reconcile()
    assert report.result is SyncResult.APPLIED and report.drift_repair
    assert backend(fake).remove_all()[0].lines() == ("removed: IP-MASQ-AGENT (iptables-nft, ipv4)",)


def test_a_config_change_records_the_new_digest(fake: FakeIptables) -> None:
    rec = agent(fake)
    rec.take_config(agent_config("nonMasqueradeCIDRs: [10.0.0.0/8, 192.168.0.0/16]\n"))
    assert rec.reconcile().result is SyncResult.APPLIED
    assert backend(fake).remove_all()[0].owned == ("IP-MASQ-AGENT",)


def test_the_agent_takes_its_chain_back_whatever_another_program_wrote_there(fake: FakeIptables) -> None:
    agent(fake)
    rewrite(fake, "nonMasqueradeCIDRs: [10.0.0.0/9]\n")
    again = Reconciler(IptablesBackend(fake, chain="IP-MASQ-AGENT", variant=Variant.NFT), AKS, log=LOG)
    again.take_config(agent_config(CONFIG))  # ipmasq installed again: the chain it enforces is taken, repaired, marked
    assert again.reconcile().result is SyncResult.APPLIED and again.reconcile().result is SyncResult.IN_SYNC
    assert backend(fake).remove_all()[0].owned == ("IP-MASQ-AGENT",)


def test_an_empty_marker_of_an_earlier_build_vouches_for_nothing(fake: FakeIptables) -> None:
    rec = agent(fake)
    empty = "*nat\n-F IPMASQ-OWNS-IP-MASQ-AGENT\nCOMMIT\n"  # what this release's development builds wrote
    assert fake.restore("iptables", empty).returncode == 0
    chain = fake.table().rules("IP-MASQ-AGENT")
    assert backend(fake).remove_all()[0].changed == ("IP-MASQ-AGENT",)
    assert fake.table().rules("IP-MASQ-AGENT") == chain and marker_chain("IP-MASQ-AGENT") not in fake.table().chains
    # while an agent runs, its first pass records the digest instead (drift: the marker differs)
    assert fake.restore("iptables", "*nat\n:IPMASQ-OWNS-IP-MASQ-AGENT - [0:0]\nCOMMIT\n").returncode == 0
    assert rec.reconcile().result is SyncResult.APPLIED
    assert backend(fake).remove_all()[0].owned == ("IP-MASQ-AGENT",)


def test_remove_unmarked_takes_a_changed_chain_too(fake: FakeIptables) -> None:
    agent(fake)
    rewrite(fake, "nonMasqueradeCIDRs: [10.0.0.0/9]\n")
    found = backend(fake).remove_all(adopt=Adopt.ALL)
    assert found[0].lines(adopt=Adopt.ALL) == (
        "removed: IP-MASQ-AGENT (iptables-nft, ipv4): its rules changed since ipmasq wrote them (--remove-unmarked)",)
    assert not [c for c in fake.table().chains if "MASQ" in c] and fake.table().rules("KUBE-POSTROUTING")


def test_a_chain_under_an_earlier_name_that_another_program_rewrote_stays(fake: FakeIptables) -> None:
    agent(fake, GKE)  # ipmasq once ran under GKE's name: IP-MASQ is marked
    text = render_restore(policy_of("nonMasqueradeCIDRs: [10.0.0.0/9]\n", GKE), Family.V4, with_jump=False)
    assert fake.restore("iptables", text).returncode == 0  # GKE's agent writes it now
    gke = fake.table().rules("IP-MASQ")
    agent(fake)  # now under the default name: IP-MASQ stays, its stale marker goes
    chains = fake.table().chains
    assert fake.table().rules("IP-MASQ") == gke and marker_chain("IP-MASQ") not in chains
    assert sum(r.endswith("-j IP-MASQ") for r in fake.table().rules("POSTROUTING")) == 1


def test_the_marker_is_never_counted_as_a_foreign_rule_nor_as_one_of_ours(fake: FakeIptables) -> None:
    from ipmasq.backends.choose import foreign_nat_rules

    before = foreign_nat_rules(fake.save("iptables", "nat"))
    rec = agent(fake)
    assert foreign_nat_rules(fake.save("iptables", "nat")) == before  # --backend auto decides as before
    report = rec.reconcile()
    assert report.objects[0].rules == 1 + len(fake.table().rules("IP-MASQ-AGENT"))  # the jump and the chain's
