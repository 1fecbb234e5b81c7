"""`ipmasq uninstall`: remove the rules ipmasq wrote on this node (both backends, both families).

Remove every chain ipmasq wrote, by its ownership marker (our --masq-chain and chains left under an earlier name,
their POSTROUTING jumps, in both iptables variants, IPv4 and IPv6), and our nftables table `inet ip-masq-agent` if it
carries its marker; each place in one transaction with its markers. The marker records a digest of what ipmasq
wrote: a marked chain whose rules no longer hash to it was rewritten since by another program (the reference agent
after a migration back) and is left exactly as it is, its stale marker removed; so is a chain with the reference
agent's comments but no marker (GKE's or AKS's agent). Prints one line per place and kind: `removed: IP-MASQ-AGENT
(iptables-nft, ipv4)`, `kept IP-MASQ (iptables-nft, ipv4): no ipmasq ownership marker: another program wrote it`,
`kept IP-MASQ-AGENT (iptables-nft, ipv4): its rules changed since ipmasq wrote them: another program writes it now`,
and `nothing to remove` when it removed nothing; `kubectl ipmasq uninstall` reports them per node.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from ipmasq.backends.base import Adopt, Removable, Runner
from ipmasq.backends.iptables import IptablesBackend, Variant
from ipmasq.backends.nftables import NftablesBackend
from ipmasq.backends.runner import SubprocessRunner
from ipmasq.commands.common import add_backend_flags, command_parser
from ipmasq.options import DEFAULT_CHAIN, check_chain_name
from ipmasq.prefix import Family


def register(subparsers: Any) -> None:
    parser = command_parser(subparsers, __doc__)
    parser.add_argument("--masq-chain", default=DEFAULT_CHAIN, metavar="NAME", help="our chain (default %(default)s)")
    parser.add_argument("--remove-unmarked", action="store_true",
                        help="also remove what carries ip-masq-agent's comments (our table's name) without ipmasq's "
                             "ownership marker, or whose rules changed since ipmasq wrote them: a node last run by "
                             "ipmasq 0.2.0, or by the reference agent. Only when no other agent writes NAT rules on "
                             "this node: GKE's and AKS's write the same text")
    # accepted for symmetry with the agent's flags; whatever they say, every backend's objects are removed
    add_backend_flags(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    chain = check_chain_name(args.masq_chain)  # a usage error before anything runs
    adopt = Adopt.ALL if args.remove_unmarked else Adopt.NONE
    # each line as its place is done: a later failure (exit 3, one line) does not hide what was removed
    uninstall(SubprocessRunner(), chain, adopt, say=lambda line: print(line, flush=True))
    return 0


def uninstall(run: Runner, chain: str, adopt: Adopt, *, say: Callable[[str], None]) -> None:
    """Remove what ipmasq wrote from every place (both iptables variants, both families; nftables), `say`ing one
    line per place and kind (removed, kept), then `nothing to remove` if nothing was."""
    places: list[Removable] = [IptablesBackend(run, chain=chain, variant=v, families=(Family.V4, Family.V6))
                               for v in Variant]
    places.append(NftablesBackend(run))
    removed = False
    for place in places:
        for ownership in place.remove_all(adopt=adopt):
            removed = removed or bool(ownership.owned) or adopt is Adopt.ALL
            for line in ownership.lines(adopt=adopt):
                say(line)
    if not removed:
        say("nothing to remove")
