"""Our objects where the node's agent does not write: the other iptables variant, or the other backend.

A node moved from iptables-legacy to iptables-nft (or from iptables to nftables) can keep the old place's chain;
it goes on masquerading by its own, possibly older, config, and the rules `check` compares look right. The agent
removes such objects on every pass; `check` reports them as `other-variant-rules`.

`leftover_findings` is pure; `read_leftovers` looks at the live node through the Runner, read-only.
"""

from __future__ import annotations

from collections.abc import Sequence

from ipmasq.backends.base import Runner
from ipmasq.backends.choose import make_backend
from ipmasq.errors import IpmasqError
from ipmasq.findings import Finding, Severity
from ipmasq.options import PolicyOptions

__all__ = ["OTHER_VARIANT_RULES", "leftover_findings", "read_leftovers"]

OTHER_VARIANT_RULES = "other-variant-rules"


def leftover_findings(places: Sequence[str], using: str) -> tuple[Finding, ...]:
    """One error per place (e.g. `iptables (legacy)`) holding our objects besides `using`, the one checked."""
    return tuple(Finding(
        OTHER_VARIANT_RULES, Severity.ERROR,
        f"our objects are also in {place}, beside {using} which this check compared: they go on deciding pod "
        "traffic with their own, possibly older, config (the first masquerade of either wins)",
        "a running agent removes them on its next pass (it is not ready while they stay): if they stay, an older "
        "agent still writes them (look for a second ip-masq-agent on the node); by hand, `ipmasq uninstall` removes "
        "every backend's objects and the agent re-applies its own") for place in places)


def read_leftovers(run: Runner, options: PolicyOptions, backend: str) -> tuple[str, ...]:
    """The places other than `backend` (iptables in the variant the node uses, or nftables) holding our objects.

    A place that cannot be read (its tools are missing, the kernel lacks its tables) is taken to hold nothing."""
    _, others = make_backend(backend, options, run)
    found = []
    for other in others:
        try:
            if other.present():
                found.append(other.name)
        except IpmasqError:
            continue
    return tuple(found)
