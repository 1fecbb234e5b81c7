"""The nftables backend against the stateful fake nft: the loop's contract (read == desired exactly when the
table is right), drift repair, no writes when idle, family changes, removal, and tool errors as one line."""

from __future__ import annotations

import pytest

from ipmasq.backends.base import Result
from ipmasq.backends.nftables import NftablesBackend
from ipmasq.errors import BackendError
from ipmasq.netfilter.nft import MARKER_SET
from ipmasq.options import PolicyOptions
from ipmasq.policy.policy import Policy
from ipmasq.prefix import Family
from ipmasq.testing import FakeNft
from tests.configs import policy_of

V4 = PolicyOptions()
DUAL = PolicyOptions(enable_ipv6=True)
CONFIG = "nonMasqueradeCIDRs: [10.0.0.0/8, 'fd00::/8']\nmasqueradeCIDRs: [10.11.0.0/24]\n"


def policy(text: str = CONFIG, options: PolicyOptions = DUAL) -> Policy:
    return policy_of(text, options)


def reconcile(backend: NftablesBackend, p: Policy) -> int:
    """The loop's contract from backends.base: read, compare, apply on a difference, read back, verify."""
    writes = 0
    for family in p.families:
        want = backend.desired(p, family)
        current = backend.read(family)
        if current != want:
            backend.apply(p, family, current)
            writes += 1
            assert backend.read(family) == want
    return writes


@pytest.fixture
def fake() -> FakeNft:
    return FakeNft()


def test_first_apply_then_idle(fake: FakeNft) -> None:
    backend = NftablesBackend(fake)
    assert backend.read(Family.V4).empty
    assert reconcile(backend, policy()) == 1  # one transaction writes both families
    assert fake.transactions == 1
    assert reconcile(backend, policy()) == 0
    assert fake.transactions == 1
    # a fresh backend (a restarted agent) reads everything in full and still sees nothing to do
    assert reconcile(NftablesBackend(fake), policy()) == 0
    state = backend.read(Family.V4).objects
    assert "element nomasq_v4 10.0.0.0-10.10.255.255" in state and "element nomasq_v4 10.11.1.0-10.255.255.255" in state
    assert not any("nomasq_v6" in line and line.startswith(("set", "element")) for line in state)


@pytest.mark.parametrize("drift", [
    ["nft", "delete", "table", "inet", "ip-masq-agent"],
    ["nft", "flush", "chain", "inet", "ip-masq-agent", "postrouting"],
    ["nft", "flush", "set", "inet", "ip-masq-agent", "nomasq_v4"],
    ["nft", "flush", "set", "inet", "ip-masq-agent", "nomasq_v6"],
    ["nft", "add", "rule", "inet", "ip-masq-agent", "postrouting", "ip", "daddr", "1.2.3.4", "return"],
])
def test_drift_is_seen_and_repaired(fake: FakeNft, drift: list[str]) -> None:
    backend = NftablesBackend(fake)
    reconcile(backend, policy())
    assert fake(drift).returncode == 0
    assert reconcile(backend, policy()) == 1
    assert reconcile(backend, policy()) == 0


def test_policy_changes_and_disabling_ipv6_remove_the_ipv6_set(fake: FakeNft) -> None:
    backend = NftablesBackend(fake)
    reconcile(backend, policy())
    assert reconcile(backend, policy("nonMasqueradeCIDRs: [10.0.0.0/8]\n")) == 1
    assert reconcile(backend, policy("nonMasqueradeCIDRs: [10.0.0.0/8]\n", V4)) == 1
    (table,) = fake.tables.values()
    assert [s.name for s in table.sets] == [MARKER_SET, "nomasq_v4"]


def test_foreign_tables_are_left_alone(fake: FakeNft) -> None:
    kube_proxy = ("table ip kube-proxy {\n\tchain nat-postrouting {\n"
                  "\t\ttype nat hook postrouting priority srcnat; policy accept;\n\t\tmasquerade\n\t}\n}\n")
    assert fake(["nft", "-f", "-"], kube_proxy).returncode == 0
    backend = NftablesBackend(fake)
    reconcile(backend, policy())
    backend.remove_all()
    assert list(fake.tables) == [("ip", "kube-proxy")]
    assert backend.read(Family.V4).empty
    backend.remove_all()  # removing what is not there is fine


def test_a_failing_nft_is_one_line_with_its_stderr() -> None:
    def broken(argv: object, stdin: str | None = None) -> Result:
        return Result(1, "", "Error: Could not process rule: Operation not supported\nline 2\n")

    with pytest.raises(BackendError) as info:
        NftablesBackend(broken).apply(policy(), Family.V4, NftablesBackend(FakeNft()).read(Family.V4))
    assert "\n" not in str(info.value) and "Operation not supported" in str(info.value)


def test_the_fake_refuses_what_nft_would_refuse(fake: FakeNft) -> None:
    # a statement outside our dialect (`counter` is in it now: config rules count their packets)
    assert fake(["nft", "-f", "-"], "table inet t {\n\tchain c {\n\t\tlimit rate 1/second\n\t}\n}\n").returncode == 1
    assert fake.tables == {}


def _set_listings(fake: FakeNft) -> int:
    return sum(1 for argv in fake.listings if argv[2:4] == ["list", "set"])


def test_the_generation_vouches_for_our_own_transaction_until_anyone_commits(fake: FakeNft) -> None:
    backend = NftablesBackend(fake, generation=lambda: fake.generation)
    p = policy()
    assert reconcile(backend, p) == 1
    assert _set_listings(fake) == 0  # the read that verified the write took the elements from the transaction
    assert reconcile(backend, p) == 0
    assert _set_listings(fake) == 0
    assert fake(["nft", "flush", "set", "inet", "ip-masq-agent", "nomasq_v4"]).returncode == 0
    assert reconcile(backend, p) == 1  # the flush moved the generation: the sets were listed, the drift seen
    assert _set_listings(fake) > 0
    # what the kernel holds reads the same either way: a backend without a generation lists every set
    assert NftablesBackend(fake).read(Family.V4) == backend.read(Family.V4) == backend.desired(p, Family.V4)


def test_a_commit_by_someone_else_around_ours_sends_reads_back_to_the_kernel(fake: FakeNft) -> None:
    def generation_with_a_foreign_commit() -> int:
        if fake.transactions == 1 and fake.generation == 1:
            fake.generation += 1  # someone committed to another table right after our transaction
        return fake.generation

    backend = NftablesBackend(fake, generation=generation_with_a_foreign_commit)
    assert reconcile(backend, policy()) == 1
    assert _set_listings(fake) > 0


def test_without_a_readable_generation_every_read_lists_the_sets(fake: FakeNft) -> None:
    backend = NftablesBackend(fake, generation=lambda: None)
    assert reconcile(backend, policy()) == 1
    assert _set_listings(fake) > 0
