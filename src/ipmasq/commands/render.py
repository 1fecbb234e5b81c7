"""`ipmasq render`: print the exact rules the agent would apply.

Print exactly the payload the agent would apply on a node that has none of our rules yet (iptables-restore text
including the POSTROUTING jump, or the nft script that replaces our table `inet ip-masq-agent`, every family at
once). The iptables text is the reference agent's, byte for byte; the agent's own transaction also declares the
chain's ownership marker (`:IPMASQ-OWNS-<chain> - [0:0]`) and writes its one rule, the digest of what it wrote. Needs
no root.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from ipmasq.commands.common import add_policy_flags, command_parser
from ipmasq.commands.policy_source import load_policy
from ipmasq.errors import UsageError
from ipmasq.netfilter.iptables import render_restore
from ipmasq.netfilter.nft import render_script
from ipmasq.policy.hash import config_hash, policy_hash
from ipmasq.prefix import Family


def register(subparsers: Any) -> None:
    parser = command_parser(subparsers, __doc__)
    add_policy_flags(parser, config_help="config file or directory, ConfigMap manifest, or - for standard input "
                                         "(default: none, the built-in defaults)")
    parser.add_argument("--backend", choices=["iptables", "nftables"], default="iptables",
                        help="whose payload (default %(default)s)")
    parser.add_argument("--family", choices=["4", "6"], default="4",
                        help="IP family of the iptables payload (6 needs --enable-ipv6 or the config's enableIPv6: "
                             "true); the nft script holds both")
    parser.add_argument("--node-name", default=os.environ.get("NODE_NAME") or None, metavar="NAME",
                        help="the node's name: selects config rules with nodes, as the agent's --node-name does "
                             "(default: $NODE_NAME)")
    parser.add_argument("--print-hash", action="store_true",
                        help="print only the config's identity, the short policy hash the agent exports as "
                             "ipmasq_enforced_config_info{config_hash=...} once the kernel enforces it")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    family = Family(int(args.family))
    if family is Family.V6 and args.enable_ipv6 is False:  # a usage error before any config error
        raise UsageError("--family 6 needs --enable-ipv6 (without it the agent writes no IPv6 rules)")
    policy = load_policy(args, "render")
    if family not in policy.families:
        raise UsageError("--family 6 needs IPv6 enabled: --enable-ipv6, or enableIPv6: true in the config (without "
                         "either the agent writes no IPv6 rules)")
    if args.print_hash:
        print(config_hash(policy_hash(policy)))
        return 0
    if args.backend == "nftables":
        sys.stdout.write(render_script(policy))
    else:
        sys.stdout.write(render_restore(policy, family))
    return 0
