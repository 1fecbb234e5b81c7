"""Named default sets for `ipmasq diff`: what a node did before a change, without a config file to show it.

Each set says exactly which destinations keep the pod IP, and where that comes from:

- ``reference``: kubernetes-sigs/ip-masq-agent with no config file: RFC 1918 (10/8, 172.16/12, 192.168/16) plus
  link-local 169.254.0.0/16 (vectors/expected/01-no-file.out).
- ``reference-all-reserved``: the same agent with ``--nomasq-all-reserved-ranges``: also 100.64/10,
  192.0.0/24, 192.0.2/24, 192.88.99/24, 198.18/15, 198.51.100/24, 203.0.113/24, 240/4
  (vectors/expected/16-no-file-all-reserved.out).
- ``gke``: what a GKE node runs since 1.14 (its IP-MASQ chain, as read from a node after the upgrade): all reserved
  ranges and link-local preserved, everything else masqueraded (vectors/expected/17-gke-chain.out).
- ``kubenet``: before 1.14, kubenet's one rule
  ``-A POSTROUTING ! -d 10.0.0.0/8 -m addrtype ! --dst-type LOCAL -j MASQUERADE``: only 10.0.0.0/8 keeps the
  pod IP; link-local is masqueraded too (the rule has no exemption for it); IPv6 is not touched (iptables only).
- ``cilium``: Cilium's BPF ip-masq-agent with an empty config: ``defaultNonMasqCIDRs`` in cilium/cilium
  pkg/ipmasq/ipmasq.go (the reference's list with all reserved ranges), link-local 169.254.0.0/16 and fe80::/10
  preserved unless masqLinkLocal / masqLinkLocalIPv6. Verdicts equal ``reference-all-reserved``; it is named so
  that a migration between the two reads as what it is.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ipmasq.config.model import (
    DEFAULT_NON_MASQUERADE,
    RESERVED_NON_MASQUERADE,
    Entry,
    MasqConfig,
    Origin,
)
from ipmasq.errors import clip
from ipmasq.options import PolicyOptions
from ipmasq.policy.policy import Policy
from ipmasq.prefix import parse_cidr

__all__ = ["BASELINES", "BUILTIN_PREFIX", "Baseline", "baseline_policy", "builtin_set"]

# `builtin:gke` always names the set, whatever files the current directory holds.
BUILTIN_PREFIX = "builtin:"


@dataclass(frozen=True, slots=True)
class Baseline:
    name: str
    summary: str
    non_masquerade: tuple[str, ...]
    masq_link_local: bool = False
    ipv6: bool = True  # False: the set writes no IPv6 rules at all, whatever --enable-ipv6 says


_ALL_RESERVED = DEFAULT_NON_MASQUERADE + RESERVED_NON_MASQUERADE

BASELINES: dict[str, Baseline] = {b.name: b for b in (
    Baseline("reference", "ip-masq-agent without a config: RFC 1918 and link-local keep the pod IP",
             DEFAULT_NON_MASQUERADE),
    Baseline("reference-all-reserved", "ip-masq-agent --nomasq-all-reserved-ranges without a config",
             _ALL_RESERVED),
    Baseline("gke", "a GKE node since 1.14: all reserved ranges and link-local keep the pod IP",
             _ALL_RESERVED),
    Baseline("kubenet", "kubenet before GKE 1.14: only 10.0.0.0/8 keeps the pod IP",
             ("10.0.0.0/8",), masq_link_local=True, ipv6=False),
    Baseline("cilium", "Cilium's ip-masq-agent without a config: its defaultNonMasqCIDRs and link-local",
             _ALL_RESERVED),
)}


def baseline_policy(name: str, options: PolicyOptions) -> Policy:
    """The policy of a named set; `options` only decides whether IPv6 is managed (KeyError for an unknown name)."""
    baseline = BASELINES[name]
    entries = tuple(Entry(parse_cidr(t), False, Origin.DEFAULT) for t in baseline.non_masquerade)
    config = MasqConfig(non_masquerade=entries, masq_link_local=baseline.masq_link_local,
                        sources=(f"<{name}>",))
    # these sets are built-in lists, not files: the flag that picks the default list must not change them
    options = replace(options, nomasq_all_reserved_ranges=False,
                      enable_ipv6=options.enable_ipv6 and baseline.ipv6)
    return Policy(config, options)


def builtin_set(spec: str, *, path_exists: bool) -> str | None:
    """The built-in set an OLD or NEW argument names, or None when it names a file (or `-`, standard input).

    `builtin:NAME` is always the set; a path with a "/" always the file; a bare NAME is the set, or the file when
    no set has that name. A bare name that is both an existing path and a set is ambiguous, and neither reading is
    taken silently: ValueError, naming both spellings, as it does for a name that is neither.
    """
    names = ", ".join(BASELINES)
    if spec.startswith(BUILTIN_PREFIX):
        name = spec[len(BUILTIN_PREFIX):]
        if name not in BASELINES:
            raise ValueError(f"{clip(repr(spec))}: no built-in set {clip(repr(name))} (sets: {names})")
        return name
    if spec == "-" or "/" in spec:
        return None
    if spec in BASELINES:
        if path_exists:
            raise ValueError(f"{spec!r} is both a path here and a built-in set: write ./{spec} for the file or "
                             f"{BUILTIN_PREFIX}{spec} for the set")
        return spec
    if not path_exists:
        raise ValueError(f"{clip(repr(spec))} is neither a file nor a built-in set ({names}; "
                         f"{BUILTIN_PREFIX}NAME always means the set)")
    return None
