"""The agent's command-line policy flags, as values (the reference agent's flags plus ours).

A bad flag value is a UsageError (exit 2, one line): it is the command line that is wrong, not a config file.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace

from ipmasq.errors import UsageError, clip

__all__ = ["DEFAULT_CHAIN", "MARKER_CHAIN_PREFIX", "PolicyOptions", "PortRange", "check_chain_name", "parse_to_ports",
           "quoted"]

DEFAULT_CHAIN = "IP-MASQ-AGENT"
# The names of ipmasq's ownership markers in the nat table (ipmasq.netfilter.iptables.marker_chain): a --masq-chain
# may not take one, or a chain could pass for the record of another.
MARKER_CHAIN_PREFIX = "IPMASQ-OWNS-"


@dataclass(frozen=True, slots=True)
class PortRange:
    """An inclusive range of ports, low to high (one port when they are equal)."""

    low: int
    high: int

    def __str__(self) -> str:
        return str(self.low) if self.low == self.high else f"{self.low}-{self.high}"


@dataclass(frozen=True, slots=True)
class PolicyOptions:
    """Flags that change what the rules are (not how the agent runs)."""

    masq_chain: str = DEFAULT_CHAIN
    nomasq_all_reserved_ranges: bool = False
    # --enable-ipv6; None: not given, so the config's `enableIPv6` decides (absent: off). A Policy holds the resolved
    # value (resolve_ipv6), so policy.options.enable_ipv6 is always a bool.
    enable_ipv6: bool | None = None
    random_fully: bool = True
    to_ports: tuple[PortRange, ...] = ()
    node_name: str | None = None  # selects the config rules that have `nodes`; None: unknown (such a rule is an error)


    def resolve_ipv6(self, configured: bool | None) -> PolicyOptions:
        """These options with IPv6 decided: the flag when given (it wins), else the config's enableIPv6, else off."""
        if self.enable_ipv6 is not None:
            return self
        return replace(self, enable_ipv6=bool(configured))


_PORT_RANGE = re.compile(r"(\d{1,5})(?:-(\d{1,5}))?\Z")
# iptables chain names: at most 28 characters; we also refuse characters that would need quoting.
_CHAIN_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,28}\Z")


def quoted(value: str) -> str:
    """A flag value for a one-line error: in double quotes, escaped (a newline stays on the line), truncated."""
    return json.dumps(clip(value), ensure_ascii=False)


def parse_to_ports(text: str) -> tuple[PortRange, ...]:
    """`--to-ports 32768-60999,61000-65535`: comma-separated ports or port ranges."""
    if not text.strip():
        return ()
    ranges = []
    for part in text.split(","):
        m = _PORT_RANGE.match(part.strip())
        if m is None:
            raise UsageError(f"--to-ports: {quoted(part)} is not a port or a port range like 32768-65535")
        low = int(m.group(1))
        high = int(m.group(2) or low)
        if not 1 <= low <= high <= 65535:
            raise UsageError(f"--to-ports: {quoted(part)} must be ports between 1 and 65535, low before high")
        ranges.append(PortRange(low, high))
    return tuple(ranges)


def check_chain_name(name: str) -> str:
    if _CHAIN_NAME.match(name) is None or name in {"POSTROUTING", "PREROUTING", "INPUT", "OUTPUT", "FORWARD"}:
        raise UsageError(f'--masq-chain: {quoted(name)} is not a usable chain name (1-28 letters, digits, "-", "_", '
                         '"."; not a built-in chain)')
    if name.startswith(MARKER_CHAIN_PREFIX):
        raise UsageError(f"--masq-chain: {quoted(name)} starts with {MARKER_CHAIN_PREFIX}, the names of ipmasq's "
                         "ownership markers")
    return name
