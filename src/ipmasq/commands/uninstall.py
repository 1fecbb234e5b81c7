"""`ipmasq uninstall`: remove our chain(s) and POSTROUTING jump for both families; nothing else is touched."""

from __future__ import annotations

import argparse
from typing import Any

from ipmasq.backends.iptables import IptablesBackend, Variant, detect_variant
from ipmasq.backends.runner import SubprocessRunner
from ipmasq.commands.agent import add_backend_flags
from ipmasq.options import DEFAULT_CHAIN, check_chain_name
from ipmasq.prefix import Family


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "uninstall", help="remove the agent's rules (both families)",
        description="Remove our nat chain and POSTROUTING jump for IPv4 and IPv6, including chains left under an "
        "earlier --masq-chain (found by the agent's comments). Other rules are not touched.",
    )
    parser.add_argument("--masq-chain", default=DEFAULT_CHAIN, metavar="NAME", help="our chain (default %(default)s)")
    add_backend_flags(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    runner = SubprocessRunner()
    variant = detect_variant(runner) if args.iptables_variant == "auto" else Variant(args.iptables_variant)
    backend = IptablesBackend(runner, chain=check_chain_name(args.masq_chain), variant=variant,
                              families=(Family.V4, Family.V6))
    backend.remove_all()
    return 0
