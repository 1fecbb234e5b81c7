"""Test doubles for ipmasq's seam to the kernel (the Runner and the Fingerprint): stateful fakes of the kernel
tools, in the spirit of knftables' Fake and kubernetes' FakeIPTables. They parse what they are given (our dialect
only, refusing the rest as the real tool would), keep the tables, and answer the listings the backends read. Never
used by the agent or the tools; the kernel tests prove them against real netfilter.

    FakeIptables     iptables-save / iptables-restore (both variants, both families)
    FakeNft          nft -f / nft -j list ...
    FakeRunner       a Runner of one function, and what every fake tool shares
    FakeFingerprint  the ruleset fingerprint of fake tools: moves with every write they take

ipmasq.testing.first_match holds the reference the config rules' index is tested and measured against.
"""

from ipmasq.testing.fingerprint import FakeFingerprint
from ipmasq.testing.iptables import FakeIptables
from ipmasq.testing.nft import FakeNft
from ipmasq.testing.runner import FakeRunner

__all__ = ["FakeFingerprint", "FakeIptables", "FakeNft", "FakeRunner"]
