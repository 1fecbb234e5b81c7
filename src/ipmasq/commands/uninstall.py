"""`ipmasq uninstall`: remove the agent's rules (both backends, both families).

Remove our nat chain and POSTROUTING jump for IPv4 and IPv6 (in both iptables variants, including chains left under
an earlier --masq-chain, found by the agent's comments) and our nftables table `inet ip-masq-agent`. Other rules and
tables are not touched. Prints one line per place it removed something (`removed: iptables (nft)`), or that there
was nothing to remove: `kubectl ipmasq uninstall` reports it per node.
"""

from __future__ import annotations

import argparse
from typing import Any

from ipmasq.backends.base import Removable
from ipmasq.backends.iptables import IptablesBackend, Variant
from ipmasq.backends.nftables import NftablesBackend
from ipmasq.backends.runner import SubprocessRunner
from ipmasq.commands.common import add_backend_flags, command_parser
from ipmasq.options import DEFAULT_CHAIN, check_chain_name
from ipmasq.policy.prefix import Family


def register(subparsers: Any) -> None:
    parser = command_parser(subparsers, __doc__)
    parser.add_argument("--masq-chain", default=DEFAULT_CHAIN, metavar="NAME", help="our chain (default %(default)s)")
    # accepted for symmetry with the agent's flags; whatever they say, every backend's objects are removed
    add_backend_flags(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    chain = check_chain_name(args.masq_chain)  # a usage error before anything runs
    runner = SubprocessRunner()
    backends: list[Removable] = [IptablesBackend(runner, chain=chain, variant=v, families=(Family.V4, Family.V6))
                                 for v in Variant]
    backends.append(NftablesBackend(runner))
    removed = []
    for backend in backends:
        if backend.present():
            backend.remove_all()
            removed.append(backend.name)
    print("\n".join(f"removed: {name}" for name in removed) if removed else "nothing to remove")
    return 0
