"""Which backend the agent uses: `--backend auto` (nftables when the node already uses it for NAT or has no iptables
nat rules, else iptables), and the chosen backend built with every other place our objects can be (the other
backend and the other iptables variant), which the agent looks at and cleans on every pass.

iptables stays the drop-in choice wherever something (kube-proxy in iptables mode, a CNI) writes iptables nat
rules: our rules then sit in the same framework as theirs. Our own objects never count in the decision, so the
choice is the same whichever backend ran before.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass

from ipmasq.backends.base import Backend, Generation, Removable, Runner
from ipmasq.backends.iptables import IptablesBackend, Variant, detect_variant
from ipmasq.backends.nftables import NftablesBackend
from ipmasq.errors import BackendError
from ipmasq.netfilter.iptables import count_foreign_nat, count_rules
from ipmasq.netfilter.nft import TABLE, TABLE_FAMILY
from ipmasq.netfilter.nft import count_foreign_nat as count_foreign_nft
from ipmasq.options import PolicyOptions
from ipmasq.prefix import Family

__all__ = ["Choice", "choose", "count_foreign_masquerade", "detect", "foreign_nat_rules", "make_backend",
           "nft_nat_tables"]

# iptables-nft keeps its nat rules in nftables tables of these names; they are iptables rules, not nftables use
_IPTABLES_NFT_TABLES = {("ip", "nat"), ("ip6", "nat")}
SAVE_TOOLS = ("iptables-nft-save", "ip6tables-nft-save", "iptables-legacy-save", "ip6tables-legacy-save")


@dataclass(frozen=True, slots=True)
class Choice:
    """The backend picked for this node (--backend=auto), and why, in a phrase for the log."""

    backend: str  # "iptables" or "nftables"
    reason: str


def nft_nat_tables(chains_json: str) -> list[str]:
    """Tables (`family name`) holding a nat base chain, from `nft -j list chains`, ours and iptables-nft's aside."""
    try:
        items = json.loads(chains_json)["nftables"]
    except (ValueError, KeyError, TypeError):
        return []
    tables = []
    for item in items:
        chain = item.get("chain")
        if not chain or chain.get("type") != "nat":
            continue
        key = (chain.get("family"), chain.get("table"))
        if key == (TABLE_FAMILY, TABLE) or key in _IPTABLES_NFT_TABLES:
            continue
        name = f"{key[0]} {key[1]}"
        if name not in tables:
            tables.append(name)
    return tables


def foreign_nat_rules(save_text: str) -> int:
    """Rules in the nat table of an iptables-save dump that are not ours (ours carry an ip-masq-agent comment)."""
    return count_rules(save_text, table="nat", foreign_only=True)


def choose(*, nat_tables: Sequence[str], iptables_rules: int, nft_available: bool = True) -> Choice:
    if not nft_available:
        return Choice("iptables", "nft is not available on this node")
    if nat_tables:
        # kube-proxy's nftables mode: the node is moving off iptables, and our table sits beside kube-proxy's at the
        # same priority (srcnat), where the order does not change pod egress (README: --backend auto)
        whose = ": kube-proxy's nftables mode" if any(t.endswith(" kube-proxy") for t in nat_tables) else ""
        return Choice("nftables", f"the node already uses nftables for NAT (table {', '.join(nat_tables)}{whose})")
    if iptables_rules == 0:
        return Choice("nftables", "the node has no iptables nat rules")
    return Choice("iptables", f"the node has {iptables_rules} iptables nat rules (the drop-in choice)")


def detect(run: Runner) -> Choice:
    """Look at the node through the runner (read-only) and choose."""
    try:
        result = run(["nft", "-j", "list", "chains"], None)
    except BackendError:
        return choose(nat_tables=(), iptables_rules=0, nft_available=False)
    if result.returncode != 0:
        return choose(nat_tables=(), iptables_rules=0, nft_available=False)
    tables = nft_nat_tables(result.stdout)
    rules = 0
    if not tables:
        for tool in SAVE_TOOLS:
            try:
                save = run([tool, "-t", "nat"], None)
            except BackendError:
                continue  # a variant that is not installed holds no rules
            if save.returncode == 0:
                rules += foreign_nat_rules(save.stdout)
    return choose(nat_tables=tables, iptables_rules=rules)


def make_backend(name: str, options: PolicyOptions, run: Runner, *, variant: str = "auto",
                 log: logging.Logger | None = None,
                 generation: Generation | None = None) -> tuple[Backend, tuple[Removable, ...]]:
    """The backend `--backend NAME` asks for (auto: `detect`), and every other place our objects can be: the other
    backend and, with iptables, the other variant (a node moved from iptables-legacy to iptables-nft keeps the old
    variant's chain, which would go on deciding packets). `variant`: the iptables variant (auto: the one the node's
    rules use); `generation`: the nftables backend's proof of its own last write (see backends.nftables)."""
    if name == "auto":
        choice = detect(run)
        name = choice.backend
        if log is not None:
            log.info("backend %s chosen by --backend=auto: %s", name, choice.reason)
    both = (Family.V4, Family.V6)  # leftovers of an earlier run may hold IPv6 objects whatever this run manages
    if name == "nftables":
        others = tuple(IptablesBackend(run, chain=options.masq_chain, variant=v, families=both) for v in Variant)
        return NftablesBackend(run, generation=generation), others
    # the flag not given: the config may switch IPv6 on and off while the agent runs
    families = (Family.V4,) if options.enable_ipv6 is False else both
    chosen = detect_variant(run) if variant == "auto" else Variant(variant)
    other_variants = tuple(IptablesBackend(run, chain=options.masq_chain, variant=v, families=both)
                           for v in Variant if v is not chosen)
    backend = IptablesBackend(run, chain=options.masq_chain, variant=chosen, families=families)
    return backend, (*other_variants, NftablesBackend(run))


def count_foreign_masquerade(run: Runner) -> int:
    """NAT rules on the node that are not ours and masquerade or SNAT: every iptables variant's nat table (both
    families) and every nftables table but ours. Read-only; a tool that is missing holds none."""
    count = 0
    for tool in SAVE_TOOLS:
        try:  # counted line by line as the tool prints them: 140,000 rules are never one string here
            save, counted = run.read_lines([tool, "-t", "nat"], count_foreign_nat)
        except BackendError:
            continue
        if save.returncode == 0 and counted is not None:
            count += counted
    try:
        # terse: sets listed without their elements (ours may hold 100,000), which hold no rule to count
        listing = run(["nft", "-t", "list", "ruleset"], None)
    except BackendError:
        return count
    if listing.returncode == 0:
        count += count_foreign_nft(listing.stdout)
    return count
