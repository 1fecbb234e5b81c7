"""Configs with rules that several features' tests share, and the policy of a config's text.

One text each, so that a rule's place (findings, traces and errors cite it as file:line) is the same in every test
that reads it. A test that needs one more rule or CIDR writes its own config around these pieces.
"""

from __future__ import annotations

from ipmasq.config import ConfigInput, config_from_bytes
from ipmasq.options import PolicyOptions
from ipmasq.policy.policy import Policy

__all__ = ["AGENT_CONFIG", "DEFAULTS", "PARTNER_ENDPOINT_RULE", "RULES_CONFIG", "agent_config", "policy_of"]

# Three rules, one per action, for the tools that read the node's rules back (check, trace): `partner-snat` is at
# line 3, `batch-masq` at 9, `dns-keep` at 13.
RULES_CONFIG = """\
nonMasqueradeCIDRs: [10.0.0.0/8, 172.16.0.0/12]
rules:
  - name: partner-snat
    destinations: [10.1.0.0/16]
    protocol: tcp
    ports: [443, "8000-8080"]
    action: snat
    snatTo: 10.142.0.50
  - name: batch-masq
    destinations: [10.2.0.0/16, 10.3.0.0/24]
    sources: [10.44.8.0/22]
    action: masquerade
  - name: dns-keep
    destinations: [34.0.0.0/8]
    protocol: udp
    ports: [53]
    action: preserve
"""

# A rule with every field, scoped to one node pool: the first rule of a config (`rules:` on line 2) is at line 3.
PARTNER_ENDPOINT_RULE = """\
  - name: partner-endpoint
    destinations: [10.1.2.100/32]
    sources: [100.64.0.0/16]
    protocol: tcp
    ports: [443, "8000-8080"]
    nodes: ["gke-prod-egress-*"]
    action: snat
    snatTo: 10.142.0.50
"""


AGENT_CONFIG = "/etc/config/ip-masq-agent"  # where the DaemonSet mounts the ConfigMap
DEFAULTS = PolicyOptions()  # the agent's flags left at their defaults


def policy_of(text: str, options: PolicyOptions = DEFAULTS, *, source: str = "/c") -> Policy:
    """The policy of one config file's text, named `source` (where errors and findings say it is)."""
    return Policy(config_from_bytes(ConfigInput(((source, text.encode()),)), options), options)


def agent_config(text: str) -> ConfigInput:
    """What the agent reads when its mounted config holds `text`."""
    return ConfigInput(((AGENT_CONFIG, text.encode()),))
