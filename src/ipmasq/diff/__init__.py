"""`ipmasq diff`: what changes between two configs, and the named configs to compare against.

    diff        the destinations whose verdict flips (CIDR lists), and with config rules the exact regions of
                destination x source x protocol x port x node whose outcome differs; probes of single CIDRs
    baselines   named default sets (the reference agent's built-in list, GKE's, ...) to diff a config against
"""
