"""Flags shared by several subcommands, accepted the way the reference agent (Go's flag package) accepts them."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ipmasq.backends.base import BACKEND_NAMES
from ipmasq.backends.iptables import Variant
from ipmasq.documents import API_VERSION, OUTPUTS
from ipmasq.errors import PrefixError, UsageError
from ipmasq.goflags import go_bool
from ipmasq.options import DEFAULT_CHAIN, PolicyOptions, check_chain_name, parse_to_ports
from ipmasq.prefix import Family, Prefix, parse_address, parse_cidr

__all__ = ["add_backend_flags", "add_policy_flags", "options_from_args"]

def add_policy_flags(parser: argparse.ArgumentParser, *, config_help: str | None) -> None:
    """The agent's policy flags; config_help None: no --config (lint and diff take files as arguments)."""
    group = parser.add_argument_group("policy (the reference agent's flags)")
    if config_help is not None:
        group.add_argument("--config", metavar="PATH", help=config_help)
    group.add_argument("--masq-chain", default=DEFAULT_CHAIN, metavar="NAME",
                       help="name of our nat chain (default %(default)s; GKE runs IP-MASQ)")
    group.add_argument("--nomasq-all-reserved-ranges", type=go_bool, default=False, metavar="BOOL",
                       help="also preserve pod IPs for all reserved IPv4 ranges by default (what GKE runs)")
    group.add_argument("--enable-ipv6", type=go_bool, default=None, metavar="BOOL",
                       help="also manage IPv6; when given, wins over the config's enableIPv6 (default: the config's "
                            "enableIPv6, off when absent)")
    group.add_argument("--random-fully", type=go_bool, default=True, metavar="BOOL",
                       help="add --random-fully to MASQUERADE (default true)")
    group.add_argument("--to-ports", default="", metavar="RANGES",
                       help="masquerade to these source ports, e.g. 32768-60999,61000-65535")


def refuse_policy_flags(args: argparse.Namespace, why: str) -> None:
    """A provider's profile (--writer) runs with that agent's own flags: any policy flag given is a usage error."""
    given = [flag for flag, value, default in (("--masq-chain", args.masq_chain, DEFAULT_CHAIN),
                                               ("--nomasq-all-reserved-ranges", args.nomasq_all_reserved_ranges, False),
                                               ("--enable-ipv6", args.enable_ipv6, None),
                                               ("--random-fully", args.random_fully, True),
                                               ("--to-ports", args.to_ports, "")) if value != default]
    if given:
        raise UsageError(f"{why} runs with that agent's own flags: drop {', '.join(given)}")


def options_from_args(args: argparse.Namespace) -> PolicyOptions:
    return PolicyOptions(
        masq_chain=check_chain_name(args.masq_chain),
        nomasq_all_reserved_ranges=args.nomasq_all_reserved_ranges,
        enable_ipv6=args.enable_ipv6,
        random_fully=args.random_fully,
        to_ports=parse_to_ports(args.to_ports),
        node_name=getattr(args, "node_name", None),  # only commands that take --node-name (agent, explain)
    )


# --- the running agent's settings: `kubectl exec ... -- ipmasq check` compares with what the agent enforces ----

AGENT_POLICY_FLAGS = ("masq_chain", "nomasq_all_reserved_ranges", "enable_ipv6", "random_fully", "to_ports")


def agent_settings(args: argparse.Namespace, config_path: str) -> dict[str, object]:
    """What the agent enforces from, as /settings serves it: its config path, policy flags and node name."""
    return {"config": config_path, "node_name": args.node_name,
            **{name: getattr(args, name) for name in AGENT_POLICY_FLAGS}}


def add_agent_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--agent", default="auto", metavar="ADDRESS",
                        help="with no --config and no policy flag, compare with the config and flags of the agent "
                        "answering at ADDRESS (/settings); auto (default): the DaemonSet's 127.0.0.1:9847 if an "
                        "agent answers there, else the built-in defaults; none: the built-in defaults")


def adopt_agent_settings(args: argparse.Namespace, command: str) -> dict[str, object] | None:
    """Inside the agent's container (kubectl exec) or on its node: with no --config and no policy flag given, take
    the running agent's config path, flags and node name, so a healthy node is not compared with the defaults.
    Returns the settings taken (None: the command line's own)."""
    from ipmasq.agent.health_probe import DEFAULT_METRICS_ADDRESS, query

    defaults = {"masq_chain": DEFAULT_CHAIN, "nomasq_all_reserved_ranges": False, "enable_ipv6": None,
                "random_fully": True, "to_ports": ""}
    given = args.config is not None or any(getattr(args, k) != v for k, v in defaults.items())
    if args.agent == "none" or given:
        return None
    address = DEFAULT_METRICS_ADDRESS if args.agent == "auto" else args.agent
    answer = query(address, "/settings", timeout=2.0)
    try:
        settings = json.loads(answer.why) if answer.ok else None
    except ValueError:
        settings = None
    if not isinstance(settings, dict) or not isinstance(settings.get("config"), str):
        if args.agent != "auto":
            raise UsageError(f"--agent {address}: no agent settings there ({answer.why})")
        return None
    args.config = settings["config"]
    args.config_missing_ok = True  # as the agent reads it: no ConfigMap mounted means the defaults
    for name in AGENT_POLICY_FLAGS:
        if name in settings:
            setattr(args, name, settings[name])
    args.node_name = settings.get("node_name")
    flags = [f"--config={args.config}"] + [f"--{k.replace('_', '-')}={settings[k]}" for k in AGENT_POLICY_FLAGS
                                             if k in settings and settings[k] != defaults[k]]
    if args.node_name:
        flags.append(f"--node-name={args.node_name}")
    print(f"ipmasq {command}: comparing with the running agent's settings ({address}): {' '.join(flags)}",
          file=sys.stderr)
    return settings


def cidr_flag(flag: str, texts: list[str]) -> tuple[Prefix, ...]:
    """The CIDRs given to a repeatable flag (--pod-range ...); a bad one is a usage error naming the flag."""
    try:
        return tuple(parse_cidr(t) for t in texts)
    except PrefixError as exc:
        raise UsageError(f"{flag}: {exc}") from None


def address_flag(flag: str, text: str) -> tuple[Family, int]:
    """An IP address given to a flag (--source, --local-address ...)."""
    try:
        return parse_address(text)
    except ValueError:
        raise UsageError(f"{flag}: {text!r} is not an IP address") from None


def add_backend_flags(parser: argparse.ArgumentParser) -> None:
    """`--backend` and `--iptables-variant` (the agent's; uninstall accepts them for symmetry)."""
    parser.add_argument("--backend", choices=BACKEND_NAMES, default="auto",
                        help="how rules reach the kernel; auto: nftables when the node already uses nftables "
                             "for NAT or has no iptables nat rules, else iptables, the drop-in choice "
                             "(default %(default)s)")
    parser.add_argument("--iptables-variant", choices=["auto", *(v.value for v in Variant)], default="auto",
                        help="iptables variant; auto: the one the node's rules use, as kube-proxy's wrapper "
                             "detects it (default %(default)s)")


# --- what the offline tools share: text or JSON on standard output ---------------------------------------------


def add_output_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-o", "--output", choices=OUTPUTS, default="text",
                        help="text (default), json or yaml: json and yaml are the same document, with its "
                        f"apiVersion ({API_VERSION}) and kind")


# --- standard input: `-` wherever an input may come from it, one input at most -------------------------------

STDIN = "-"
STDIN_NAME = "<stdin>"  # how messages, findings and reports name standard input


def at_most_one_stdin(*inputs: tuple[str, str | None]) -> None:
    """Refuse two inputs given as `-` ((label, value) pairs, e.g. ("--config", args.config)), before any is read.

    Standard input holds one input: the first reader would take all of it and the second would find it empty,
    reported as an error in the wrong input (an empty dump, a config of defaults).
    """
    readers = [label for label, value in inputs if value == STDIN]
    if len(readers) < 2:
        return
    labels = list(dict.fromkeys(readers))  # FILE given twice is said once
    detail = ""
    if len(labels) > 1:
        detail = f": {', '.join(labels[:-1])} and {labels[-1]} {'both' if len(labels) == 2 else 'all'} ask for it"
    raise UsageError(f"- (standard input) can be given once{detail}")


def shown_input(path: str) -> str:
    """How a report names an input given on the command line: `-` is <stdin>."""
    return STDIN_NAME if path == STDIN else path


def command_parser(subparsers: Any, doc: str | None) -> argparse.ArgumentParser:
    """A subcommand's parser from its module's docstring, the one place its help lives: the first line,
    "`ipmasq NAME`: summary.", names it and gives its line in `ipmasq --help`; the rest is its own --help text."""
    assert doc is not None, "a command module documents itself"
    head, _, rest = doc.strip().partition("\n")
    name, _, summary = head.partition(": ")
    parser: argparse.ArgumentParser = subparsers.add_parser(
        name.strip("`").removeprefix("ipmasq "), help=summary.rstrip("."), description=" ".join(rest.split()))
    return parser
