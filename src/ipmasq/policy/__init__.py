"""The decision and its arithmetic, pure (no I/O): what the node does to a pod's packet, and why.

    policy         Policy: the config plus the flags as the ordered entries the kernel holds; verdict(destination)
    packet         the one Packet (what is known of a pod's packet) and the one Outcome (what its destination sees)
    hash           policy_hash: one digest of what a policy makes the kernel hold
    rule_index     RuleIndex: the config rules' first match in O(log n) per field
    packet_space   exact arithmetic over every packet the rules look at (diff, lint)
    ranges         address-range arithmetic: unions, differences, first-match tables, minimal CIDR covers
    prefix         Family, Prefix: addresses and CIDRs as integers
"""
