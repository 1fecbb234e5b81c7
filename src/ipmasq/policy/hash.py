"""A policy's identity: one stable hash of what the kernel is told (config + flags), equal across processes.

Hashed is the canonical rendering of the *effective* policy, not the config bytes: the ordered rule entries per
managed family (what the chain's RETURN/MASQUERADE rules or the nftables sets hold), the flags that shape the rules
(chain name, --random-fully, --to-ports) and the resync interval. So comments, key case, list order where it does
not change the rules, the file's path or a flag whose effect the config overrides (--nomasq-all-reserved-ranges
next to an explicit nonMasqueradeCIDRs) leave it unchanged, while anything that changes what a packet gets or how
often the agent checks does change it. Python's own hash() is salted per process: sha256 is not.
"""

from __future__ import annotations

from ipmasq.config.model import Rule
from ipmasq.policy.policy import Policy
from ipmasq.sha256 import sha256

__all__ = ["CONFIG_HASH_CHARS", "POLICY_HASH_VERSION", "config_hash", "policy_hash"]

# Part of the hashed text: bump it when the canonical rendering changes, so old and new hashes never collide.
POLICY_HASH_VERSION = "ipmasq-policy-v1"


def canonical_policy(policy: Policy) -> str:
    """The text policy_hash hashes: one line per fact, entries in the order the kernel evaluates them."""
    options = policy.options
    lines = [
        POLICY_HASH_VERSION,
        f"chain {options.masq_chain}",
        f"random-fully {str(options.random_fully).lower()}",
        f"to-ports {','.join(str(r) for r in options.to_ports)}",
        f"resync-interval {policy.config.resync_interval!r}",
    ]
    for family in policy.families:
        lines.append(f"family {family.value}")
        # the config's rules on this node, ahead of the entries as in the chain; none: the text (and hash) of before
        lines.extend(_rule_line(rule) for rule in policy.rules(family))
        lines.extend(f"{entry.prefix} {'masquerade' if entry.masquerade else 'preserve'}"
                     for entry in policy.rule_entries(family))
    return "\n".join(lines) + "\n"


def _rule_line(rule: Rule) -> str:
    ports = ",".join(f"{low}-{high}" for low, high in rule.ports)
    return (f"rule {rule.name} to {','.join(map(str, rule.destinations))} from {','.join(map(str, rule.sources))} "
            f"protocol {rule.protocol or ''} ports {ports} {rule.action.value} {rule.snat_to or ''}")


def policy_hash(policy: Policy) -> str:
    """sha256 (hex) of canonical_policy: the same effective policy gives the same value in any process."""
    return sha256(canonical_policy(policy).encode()).hexdigest()


# The config identity operators compare across a fleet (the metrics' config_hash label, `ipmasq render --print-hash`):
# a prefix of the sha256, like a short git commit id; 64 bits make a collision among a cluster's configs negligible.
CONFIG_HASH_CHARS = 16


def config_hash(policy_hash_hex: str) -> str:
    """The short form of a policy_hash, as metrics and `ipmasq render --print-hash` show it."""
    return policy_hash_hex[:CONFIG_HASH_CHARS]
