"""The nftables backend over the stateful fake: our table carries its ownership marker (the set
ipmasq-owns-this-table); a table of the same name without it is another program's and is never removed."""

from __future__ import annotations

import logging
from dataclasses import replace

from ipmasq.agent.reconcile import Reconciler
from ipmasq.agent.reports import SyncResult
from ipmasq.backends.base import Adopt, Ownership
from ipmasq.backends.nftables import NftablesBackend
from ipmasq.netfilter.nft import (
    MARKER_SET,
    TABLE,
    TABLE_FAMILY,
    NftSet,
    desired_table,
    recorded_digest,
    replace_script,
    table_digest,
)
from ipmasq.netfilter.nft_json import parse_list_json
from ipmasq.options import PolicyOptions
from ipmasq.prefix import Family
from ipmasq.testing import FakeNft
from tests.configs import agent_config, policy_of

LOG = logging.getLogger("test.ownership")
CONFIG = "nonMasqueradeCIDRs: [10.0.0.0/8]\n"
KEY = (TABLE_FAMILY, TABLE)


def unmarked(fake: FakeNft) -> None:
    """A table `inet ip-masq-agent` written by another program (or ipmasq 0.2.0): our rules, no marker."""
    table = desired_table(policy_of(CONFIG, PolicyOptions()))
    table = replace(table, sets=tuple(s for s in table.sets if s.name != MARKER_SET))
    assert fake(["nft", "-f", "-"], replace_script(table)).returncode == 0


def agent(fake: FakeNft) -> Reconciler:
    rec = Reconciler(NftablesBackend(fake), PolicyOptions(), log=LOG)
    rec.take_config(agent_config(CONFIG))
    assert rec.reconcile().result is SyncResult.APPLIED
    return rec


def test_the_agent_writes_its_table_with_the_marker_in_one_transaction() -> None:
    fake = FakeNft()
    agent(fake)
    assert fake.transactions == 1 and fake.tables[KEY].set_named(MARKER_SET) is not None
    assert NftablesBackend(fake).present()


def test_a_same_named_table_without_the_marker_stays_and_is_named() -> None:
    fake = FakeNft()
    unmarked(fake)
    before, transactions = fake.tables[KEY], fake.transactions
    backend = NftablesBackend(fake)
    assert not backend.present()
    found = backend.remove_all()
    assert found == (Ownership("nftables", (), ("table inet ip-masq-agent",)),)
    assert found[0].lines() == ("kept table inet ip-masq-agent (nftables): no ipmasq ownership marker: another "
                                "program wrote it",)
    assert fake.tables[KEY] == before and fake.transactions == transactions
    assert backend.read(Family.V4, adopt=Adopt.NONE).empty and not backend.read(Family.V4).empty


def test_ours_goes_with_its_marker_in_one_transaction() -> None:
    fake = FakeNft()
    agent(fake)
    transactions = fake.transactions
    assert NftablesBackend(fake).remove_all() == (Ownership("nftables", ("table inet ip-masq-agent",), ()),)
    assert KEY not in fake.tables and fake.transactions == transactions + 1


def test_the_removal_is_refused_by_the_kernel_when_the_marker_went_since_the_read() -> None:
    fake = FakeNft()
    agent(fake)
    assert fake(["nft", "delete", "set", *KEY, MARKER_SET]).returncode == 0
    result = fake(["nft", "-f", "-"], f"delete set {TABLE_FAMILY} {TABLE} {MARKER_SET}\n"
                                      f"delete table {TABLE_FAMILY} {TABLE}\n")
    assert result.returncode == 1 and KEY in fake.tables


def test_an_unmarked_table_is_adopted_by_the_agents_first_pass_and_a_deleted_marker_is_drift() -> None:
    fake = FakeNft()
    unmarked(fake)
    rec = agent(fake)  # an ipmasq 0.2.0 table: the whole table rewritten, with its marker
    assert fake.tables[KEY].set_named(MARKER_SET) is not None
    assert rec.reconcile().result is SyncResult.IN_SYNC
    assert fake(["nft", "delete", "set", *KEY, MARKER_SET]).returncode == 0
    report = rec.reconcile()
    assert report.result is SyncResult.APPLIED and report.drift_repair
    assert fake.tables[KEY].set_named(MARKER_SET) is not None


def test_remove_unmarked_takes_the_look_alike() -> None:
    fake = FakeNft()
    unmarked(fake)
    found = NftablesBackend(fake).remove_all(adopt=Adopt.ALL)
    assert found[0].lines(adopt=Adopt.ALL) == (
        "removed: table inet ip-masq-agent (nftables): no ipmasq ownership marker (--remove-unmarked)",)
    assert KEY not in fake.tables


def test_check_never_reports_the_marker_nor_its_absence() -> None:
    from ipmasq.diagnose.check_nft import check_nft

    policy = policy_of(CONFIG, PolicyOptions())
    marked, bare = FakeNft(), FakeNft()
    agent(marked)
    unmarked(bare)
    assert check_nft(policy, marked.tables[KEY]).findings == check_nft(policy, bare.tables[KEY]).findings == ()


def test_the_marker_records_the_digest_of_the_rest_of_the_table_as_nft_lists_it() -> None:
    fake = FakeNft()
    agent(fake)
    listed = parse_list_json(fake(["nft", "-j", "-t", "list", "ruleset", "inet"]).stdout)
    assert listed is not None
    marker = listed.set_named(MARKER_SET)
    assert marker is not None and marker.comment == f"ipmasq wrote sha256:{table_digest(fake.tables[KEY])}"
    assert recorded_digest(listed) == table_digest(fake.tables[KEY])


def test_a_table_changed_since_ipmasq_wrote_it_stays_and_its_stale_marker_goes() -> None:
    fake = FakeNft()
    agent(fake)
    # an element added by hand after the agent stopped (nothing but ipmasq writes this table in place)
    table = fake.tables[KEY]
    nomasq = table.set_named("nomasq_v4")
    assert nomasq is not None
    grown = replace(nomasq, elements=(*nomasq.elements, (0xC0A80000, 0xC0A8FFFF)))
    fake.tables[KEY] = replace(table, sets=tuple(grown if s is nomasq else s for s in table.sets))
    backend = NftablesBackend(fake)
    assert not backend.present()
    found = backend.remove_all()
    assert found == (Ownership("nftables", (), (), ("table inet ip-masq-agent",)),)
    assert found[0].lines() == ("kept table inet ip-masq-agent (nftables): its rules changed since ipmasq wrote them: "
                                "another program writes it now",)
    kept = fake.tables[KEY]
    assert kept.set_named(MARKER_SET) is None and kept.set_named("nomasq_v4") == grown
    assert kept.chains == table.chains


def test_a_table_as_ipmasq_wrote_it_goes_after_a_drift_repair_too() -> None:
    fake = FakeNft()
    rec = agent(fake)
    assert fake(["nft", "flush", "set", *KEY, "nomasq_v4"]).returncode == 0
    report = rec.reconcile()
    assert report.result is SyncResult.APPLIED and report.drift_repair
    assert NftablesBackend(fake).remove_all() == (Ownership("nftables", ("table inet ip-masq-agent",), ()),)
    assert KEY not in fake.tables


def test_an_empty_marker_of_an_earlier_build_vouches_for_nothing() -> None:
    fake = FakeNft()
    table = desired_table(policy_of(CONFIG, PolicyOptions()))
    bare = tuple(replace(s, comment="") if s.name == MARKER_SET else s for s in table.sets)
    assert fake(["nft", "-f", "-"], replace_script(replace(table, sets=bare))).returncode == 0
    found = NftablesBackend(fake).remove_all()
    assert found[0].changed == ("table inet ip-masq-agent",)
    assert KEY in fake.tables and fake.tables[KEY].set_named(MARKER_SET) is None
    rec = agent(fake)  # an agent takes it over and records what it wrote
    assert rec.reconcile().result is SyncResult.IN_SYNC
    assert NftablesBackend(fake).remove_all()[0].owned == ("table inet ip-masq-agent",)


def test_remove_unmarked_takes_a_changed_table_too() -> None:
    fake = FakeNft()
    agent(fake)
    assert fake(["nft", "flush", "set", *KEY, "nomasq_v4"]).returncode == 0
    found = NftablesBackend(fake).remove_all(adopt=Adopt.ALL)
    assert found[0].lines(adopt=Adopt.ALL) == ("removed: table inet ip-masq-agent (nftables): its rules changed "
                                               "since ipmasq wrote them (--remove-unmarked)",)
    assert KEY not in fake.tables


def test_a_set_of_another_kind_added_since_is_a_change_and_never_read_as_addresses() -> None:
    fake = FakeNft()
    agent(fake)
    table = fake.tables[KEY]
    ports = NftSet("ports", "inet_service", (), ())  # another program's set in our table
    fake.tables[KEY] = replace(table, sets=tuple(sorted((*table.sets, ports), key=lambda s: s.name)))
    found = NftablesBackend(fake).remove_all()
    assert found[0].changed == ("table inet ip-masq-agent",)
    assert fake.tables[KEY].set_named("ports") == ports and fake.tables[KEY].set_named(MARKER_SET) is None
