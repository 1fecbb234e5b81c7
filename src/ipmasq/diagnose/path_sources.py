"""Where the path model gets a node's facts: the live node through the Runner (iproute2's JSON, iptables-save of
the nat and mangle tables, nft -j list ruleset), read-only, or dump files.

The live read runs `ip -j -4 rule`, `ip -j -6 rule`, `ip -j route show table all` and `ip -j addr`: four short
programs, each the kernel's own netlink dump as iproute2 prints it; the same text a routing dump holds, so the
live node and a dump are read by one parser (ipmasq.route.iproute2).
"""

from __future__ import annotations

import json

from ipmasq.backends.base import Runner
from ipmasq.backends.iptables import Variant, detect_variant, tools
from ipmasq.diagnose.path import PathFacts
from ipmasq.diagnose.sources import iptables_nft_families, read_nft_ruleset
from ipmasq.errors import BackendError, IpmasqError
from ipmasq.netfilter.iptables import NatTable, parse_save
from ipmasq.prefix import Family
from ipmasq.route.facts import Routing
from ipmasq.route.iproute2 import parse_routing

__all__ = ["ROUTING_COMMANDS", "read_live_facts", "read_live_routing", "read_mangle_save"]

# what a routing dump holds, in this order (ipmasq.route.iproute2); the docs give it as one shell line
ROUTING_COMMANDS = (("ip", "-j", "-4", "rule"), ("ip", "-j", "-6", "rule"), ("ip", "-j", "route", "show", "table",
                                                                              "all"), ("ip", "-j", "addr"))


def read_live_routing(run: Runner) -> Routing:
    """The node's rules, routes, links and addresses, read now."""
    outputs = []
    for argv in ROUTING_COMMANDS:
        result = run(argv, None)
        if result.returncode != 0:
            if argv[2] == "-6" and ("not supported" in result.stderr or "Address family" in result.stderr):
                continue  # a kernel without IPv6: no IPv6 rules to read
            raise BackendError(f"{' '.join(argv)} failed", argv=tuple(argv), stderr=result.stderr,
                               returncode=result.returncode)
        outputs.append(result.stdout if result.stdout.strip() else "[]")
    return parse_routing("\n".join(outputs), "ip -j")


def _save(run: Runner, family: Family, variant: Variant, table: str) -> NatTable | None:
    argv = [tools(variant, family).save, "-t", table]
    result = run(argv, None)
    if result.returncode != 0:
        if table == "mangle" and "does not exist" in result.stderr:
            return None  # the mangle table was never loaded: nothing marks packets there
        raise BackendError(f"{argv[0]} -t {table} failed", argv=tuple(argv), stderr=result.stderr,
                           returncode=result.returncode)
    return parse_save(result.stdout, table)


def read_live_facts(run: Runner, family: Family) -> PathFacts:
    """Everything the path of a packet of `family` depends on, read from the live node: its routing, iptables'
    nat and mangle tables (the variant the node uses), and its nftables ruleset (None where nft cannot list)."""
    routing = read_live_routing(run)
    variant = detect_variant(run)
    nat = _save(run, family, variant, "nat")
    mangle = _save(run, family, variant, "mangle")
    try:
        ruleset: str | None = read_nft_ruleset(run)
    except (IpmasqError, OSError):
        ruleset = None
    in_nft = variant is Variant.NFT or (ruleset is not None and family in iptables_nft_families(ruleset))
    return PathFacts(routing, {} if nat is None else {family: nat}, {} if mangle is None else {family: mangle},
                     ruleset, iptables_in_nft=in_nft)


def read_mangle_save(run: Runner, family: Family, variant: Variant, *, ruleset: str | None = None) -> NatTable | None:
    """iptables' mangle table of `family` (None where the node never loaded it); on an nftables node (`ruleset`
    given) only iptables-nft's, read when the listing holds its `ip mangle` or `ip6 mangle` table."""
    if ruleset is not None:
        wanted = ("ip" if family is Family.V4 else "ip6", "mangle")
        try:
            listing = json.loads(ruleset).get("nftables", [])
        except (ValueError, AttributeError, RecursionError):
            return None
        if not any(isinstance(item, dict) and isinstance(item.get("table"), dict)
                   and (item["table"].get("family"), item["table"].get("name")) == wanted for item in listing):
            return None
    return _save(run, family, variant, "mangle")
