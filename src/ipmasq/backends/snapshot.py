"""Read-only snapshots of the node's nat rules for `check` and `trace` (they never write).

The same tools and variant detection as the iptables backend, so the tools see what the agent sees.
"""

from __future__ import annotations

from ipmasq.backends.base import Runner
from ipmasq.backends.iptables import Variant, detect_variant, tools
from ipmasq.errors import BackendError
from ipmasq.prefix import Family

__all__ = ["read_nat_save", "read_nft_ruleset"]


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
