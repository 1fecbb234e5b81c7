"""Where `check` and `trace` get the node's nat rules: a dump file (or stdin), or the live node, read-only.

The live reads use the same tools and variant detection as the backends, so the tools see what the agent sees;
they go through the injected Runner and never write. Every failure is one line naming the file.
"""

from __future__ import annotations

import sys

from ipmasq.backends.base import Runner
from ipmasq.backends.choose import detect
from ipmasq.backends.iptables import Variant, detect_variant, tools
from ipmasq.diagnose.check import NodeRules
from ipmasq.errors import BackendError, IpmasqError
from ipmasq.prefix import Family
from ipmasq.rules.iptables import NatTable, RuleParseError, our_chains, parse_save
from ipmasq.rules.nft import NftParseError, NftTable, parse_list_json

__all__ = ["family_of_dump", "parse_save_dump", "read_dump_file", "read_live_rules", "read_nat_save",
           "rules_from_dump"]


def read_dump_file(path: str) -> tuple[str, str]:
    """(path shown in messages, text); `-` is stdin."""
    if path == "-":
        return "<stdin>", sys.stdin.read()
    try:
        with open(path, encoding="utf-8") as fh:
            return path, fh.read()
    except OSError as exc:
        raise IpmasqError(f"{path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise IpmasqError(f"{path}: not a text file (expected iptables-save or nft -j output)") from None


def family_of_dump(table: NatTable) -> Family:
    """iptables-save and ip6tables-save print the same syntax: the addresses tell them apart."""
    for rule in table.rules:
        for token in rule.split(" "):
            if "/" in token and ":" in token and token[0] in "0123456789abcdefABCDEF:":
                return Family.V6
    return Family.V4


def rules_from_dump(text: str, path: str) -> NodeRules:
    """A dump holding `nft -j list ruleset` output or an iptables-save (ip6tables-save) nat table."""
    if text.lstrip().startswith("{"):
        try:
            return NodeRules("nftables", {}, parse_list_json(text))
        except NftParseError as exc:
            raise IpmasqError(f"{path}: {exc}") from None
    table = parse_save_dump(text, path)
    if not table.chains and not table.rules:
        raise IpmasqError(f"{path}: no *nat table found (expected iptables-save or nft -j list ruleset output)")
    return NodeRules("iptables", {family_of_dump(table): table})


def read_live_rules(run: Runner, families: tuple[Family, ...], *, chain: str, backend: str) -> NodeRules:
    """The live node's rules for `backend` (iptables, nftables, or auto: whichever of ours the node holds, and only
    on a node with neither, the agent's own choice)."""
    tables: dict[Family, NatTable] = {}
    if backend in ("iptables", "auto"):
        tables = {family: parse_save(read_nat_save(run, family)) for family in families}
    nft: NftTable | None = None
    if backend in ("nftables", "auto"):
        try:
            nft = parse_list_json(read_nft_ruleset(run))
        except NftParseError as exc:
            raise IpmasqError(f"nft -j list ruleset: {exc}") from None
    if backend == "auto":
        if any(our_chains(t, chain) for t in tables.values()):
            backend = "iptables"
        elif nft is not None:
            backend = "nftables"
        else:
            backend = detect(run).backend
            if backend == "nftables":
                tables = {}
    return NodeRules(backend, tables, nft)


def parse_save_dump(text: str, path: str) -> NatTable:
    """The nat table of an iptables-save dump; errors name the file."""
    try:
        return parse_save(text)
    except RuleParseError as exc:
        raise RuleParseError(f"{path}: {exc}") from None


def read_nat_save(run: Runner, family: Family, *, variant: Variant | None = None) -> str:
    """`iptables-save -t nat` (or ip6tables-save) of the variant the node uses."""
    chosen = detect_variant(run) if variant is None else variant
    argv = [tools(chosen, family).save, "-t", "nat"]
    result = run(argv, None)
    if result.returncode != 0:
        raise BackendError(f"{argv[0]} -t nat failed", argv=tuple(argv), stderr=result.stderr,
                           returncode=result.returncode)
    return result.stdout


def read_nft_ruleset(run: Runner) -> str:
    """`nft -j list ruleset`, set elements included (check compares them)."""
    argv = ["nft", "-j", "list", "ruleset"]
    result = run(argv, None)
    if result.returncode != 0:
        raise BackendError("nft -j list ruleset failed", argv=tuple(argv), stderr=result.stderr,
                           returncode=result.returncode)
    return result.stdout
