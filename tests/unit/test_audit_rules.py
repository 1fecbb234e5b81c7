"""audit with config rules: each flow is evaluated with its own source, so a source-scoped rule decides the flows it
matches; a rule on protocol or port, which the flow logs read here do not hand to the policy, says so."""

from __future__ import annotations

from ipmasq.audit import RawCounts, audit
from ipmasq.config import ConfigInput, config_from_bytes
from ipmasq.options import PolicyOptions
from ipmasq.policy.policy import Policy

RULES = """\
nonMasqueradeCIDRs: [10.0.0.0/8]
rules:
  - name: vpn-pods-keep-ip
    destinations: [172.30.0.0/16]
    sources: [10.44.1.0/24]
    action: preserve
"""


def _policy(text: str) -> Policy:
    options = PolicyOptions()
    return Policy(config_from_bytes(ConfigInput((("/c", text.encode()),)), options), options)


def _raw(*flows: tuple[str, str, str]) -> RawCounts:
    return RawCounts({flow: [1, "flows.log", n] for n, flow in enumerate(flows, start=1)}, records=len(flows))


def test_the_flows_source_decides_a_source_scoped_rule() -> None:
    policy = _policy(RULES)
    matched = audit(_raw(("10.44.1.5", "172.30.12.110", "REJECT")), policy).groups[0]
    assert matched.masquerade is False and matched.matched == ("rule vpn-pods-keep-ip",)
    assert matched.still_failing and matched.reasons == ("rule",)
    other = audit(_raw(("10.44.2.5", "172.30.12.110", "REJECT")), policy).groups[0]
    assert other.masquerade is True and other.matched == ("catch-all",) and not other.still_failing
    both = audit(_raw(("10.44.1.5", "172.30.12.110", "REJECT"), ("10.44.2.5", "172.30.12.110", "ACCEPT")),
                 policy).groups[0]
    assert both.masquerade is None and both.with_config == "some masqueraded, some not"
    assert both.matched == ("catch-all", "rule vpn-pods-keep-ip")


def test_a_port_rule_leaves_the_verdict_depending_on_the_port() -> None:
    policy = _policy("nonMasqueradeCIDRs: [10.0.0.0/8]\nrules:\n  - name: https-keeps-ip\n"
                     "    destinations: [172.30.0.0/16]\n    protocol: tcp\n    ports: [443]\n    action: preserve\n")
    group = audit(_raw(("10.44.1.5", "172.30.12.110", "REJECT")), policy).groups[0]
    assert group.masquerade is None and "depends on protocol, port" in group.reasons


def test_without_rules_the_destination_alone_decides() -> None:
    group = audit(_raw(("10.44.1.5", "172.30.12.110", "REJECT"), ("10.44.2.5", "172.30.12.110", "REJECT")),
                  _policy("nonMasqueradeCIDRs: [10.0.0.0/8]\n")).groups[0]
    assert group.masquerade is True and group.matched == ("catch-all",)
