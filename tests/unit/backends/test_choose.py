"""`--backend auto`: the decision from what the node shows, through the stateful fake nft."""

from __future__ import annotations

import json
from collections.abc import Sequence

from ipmasq.backends.base import Result
from ipmasq.backends.choose import Choice, choose, detect, foreign_nat_rules
from ipmasq.backends.nftables import NftablesBackend
from ipmasq.config import ConfigInput, config_from_bytes
from ipmasq.options import PolicyOptions
from ipmasq.policy.policy import Policy
from ipmasq.testing import FakeNft
from tests.conftest import ROOT

KUBE_PROXY = ("table ip kube-proxy {\n\tchain nat-postrouting {\n"
              "\t\ttype nat hook postrouting priority srcnat; policy accept;\n\t\tmasquerade\n\t}\n}\n")
SAVE_WITH_KUBE = "*nat\n:POSTROUTING ACCEPT [0:0]\n-A POSTROUTING -m comment --comment \"kube\" -j KUBE-POSTROUTING\n" \
                 "-A POSTROUTING -m comment --comment \"ip-masq-agent: ensure\" -j IP-MASQ-AGENT\nCOMMIT\n"


def node(fake: FakeNft, iptables_save: str = "") -> object:
    def run(argv: Sequence[str], stdin: str | None = None) -> Result:
        if argv[0] == "nft":
            return fake(argv, stdin)
        return Result(0, iptables_save if argv[0] == "iptables-nft-save" else "")
    return run


def test_rules_of_ours_do_not_count() -> None:
    assert foreign_nat_rules(SAVE_WITH_KUBE) == 1


def test_a_bare_node_gets_nftables_and_keeps_it_after_our_table_exists() -> None:
    fake = FakeNft()
    assert detect(node(fake)).backend == "nftables"  # type: ignore[arg-type]
    options = PolicyOptions()
    policy = Policy(config_from_bytes(ConfigInput(()), options), options)
    backend = NftablesBackend(fake)
    backend.apply(policy, policy.families[0], backend.read(policy.families[0]))
    assert fake.tables
    assert detect(node(fake)).backend == "nftables"  # type: ignore[arg-type]


def test_kube_proxy_in_nftables_mode_wins_over_iptables_rules() -> None:
    fake = FakeNft()
    fake(["nft", "-f", "-"], KUBE_PROXY)
    choice = detect(node(fake, SAVE_WITH_KUBE))  # type: ignore[arg-type]
    assert choice.backend == "nftables" and "ip kube-proxy" in choice.reason


def test_iptables_nat_rules_keep_iptables() -> None:
    choice = detect(node(FakeNft(), SAVE_WITH_KUBE))  # type: ignore[arg-type]
    assert choice.backend == "iptables" and "1 iptables nat rules" in choice.reason
    assert choose(nat_tables=(), iptables_rules=0, nft_available=False).backend == "iptables"


def test_kube_proxy_1_37_in_nftables_mode_picks_nftables_and_says_why() -> None:
    """kube-proxy's real tables (both families, as nft -j lists their chains) beside iptables nat rules."""
    listing = json.loads((ROOT / "tests" / "dumps" / "kube-proxy-nftables.json").read_text())["nftables"]
    chains = json.dumps({"nftables": [o for o in listing if "chain" in o or "table" in o]})

    def run(argv: Sequence[str], stdin: str | None = None) -> Result:
        if list(argv) == ["nft", "-j", "list", "chains"]:
            return Result(0, chains)
        return Result(0, SAVE_WITH_KUBE if argv[0] == "iptables-nft-save" else "")
    choice = detect(run)  # type: ignore[arg-type]
    assert choice == Choice("nftables", "the node already uses nftables for NAT (table ip kube-proxy, ip6 kube-proxy: "
                                        "kube-proxy's nftables mode)")
