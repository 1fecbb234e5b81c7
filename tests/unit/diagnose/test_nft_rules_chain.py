"""check and trace over our nftables table as the agent writes it with config rules: the rules in their own chain
(config-rules), entered from postrouting for the destinations in rules_dst_v4/rules_dst_v6 only; preserve is
`accept` there, so it ends the decision instead of falling back to the set lookups and the masquerade."""

from __future__ import annotations

import json
import re
from typing import Any

from ipmasq.config import ConfigInput, config_from_bytes
from ipmasq.diagnose.check import FindingId, Severity, check_nft
from ipmasq.diagnose.trace_nft import NftTracer
from ipmasq.netfilter.nft import RULES_CHAIN, desired_table, format_elements, parse_list_json, render_script
from ipmasq.options import PolicyOptions
from ipmasq.policy.packet import Outcome, Packet
from ipmasq.policy.policy import Policy
from ipmasq.testing.nft import FakeNft
from tests.conftest import ROOT

CONFIG = """\
nonMasqueradeCIDRs: [10.0.0.0/8]
rules:
  - name: partner-keep
    destinations: [34.10.0.0/16]
    action: preserve
  - name: partner-rest
    destinations: [34.0.0.0/8]
    action: masquerade
  - name: vpn-snat
    destinations: [10.9.0.0/16]
    protocol: tcp
    action: snat
    snatTo: 10.142.0.50
  - name: v6-keep
    destinations: ["2600:1900::/28"]
    action: preserve
"""
OPTIONS = PolicyOptions(random_fully=False, enable_ipv6=True)
NODE = "10.142.15.203"
OURS = "inet ip-masq-agent"


def _policy(text: str = CONFIG) -> Policy:
    return Policy(config_from_bytes(ConfigInput((("/c", text.encode()),)), OPTIONS), OPTIONS)


def _objects(policy: Policy) -> list[dict[str, Any]]:
    nft = FakeNft()
    assert nft(["nft", "-f", "-"], render_script(policy)).returncode == 0
    objects: list[dict[str, Any]] = json.loads(nft(["nft", "-j", "list", "ruleset"]).stdout)["nftables"]
    return objects


def _text(objects: list[dict[str, Any]]) -> str:
    return json.dumps({"nftables": objects})


def _rule_named(objects: list[dict[str, Any]], name: str) -> dict[str, Any]:
    return next(o["rule"] for o in objects if o.get("rule", {}).get("comment") == f"ip-masq-agent: rule {name}")


def test_trace_enters_the_rules_chain_and_a_preserve_there_ends_the_decision() -> None:
    tracer = NftTracer(_text(_objects(_policy())))
    keep = tracer.trace(Packet.of("34.10.1.1", source="10.44.0.1", local_addresses=[NODE]))
    assert keep.outcome is Outcome.PRESERVE and keep.decided_label == "rule partner-keep"
    assert keep.chains == (f"{OURS} postrouting", f"{OURS} {RULES_CHAIN}")
    # nothing after the accept ran: not the set lookups, not the masquerade
    assert keep.steps[-1].chain == f"{OURS} {RULES_CHAIN}" and keep.steps[-1].matched
    v6 = tracer.trace(Packet.of("2600:1900::1", source="fd00::1"))
    assert v6.outcome is Outcome.PRESERVE and v6.decided_label == "rule v6-keep"
    rest = tracer.trace(Packet.of("34.99.0.1", source="10.44.0.1"))
    assert rest.outcome is Outcome.MASQUERADE and rest.decided_label == "rule partner-rest"
    snat = tracer.trace(Packet.of("10.9.0.1", source="10.44.0.1", protocol="tcp"))
    assert snat.outcome is Outcome.SNAT and snat.snat_to == "10.142.0.50"


def test_trace_of_a_destination_no_rule_names_never_enters_the_rules_chain() -> None:
    tracer = NftTracer(_text(_objects(_policy())))
    other = tracer.trace(Packet.of("8.8.8.8", source="10.44.0.1"))
    assert other.outcome is Outcome.MASQUERADE and other.chains == (f"{OURS} postrouting",)
    assert not any(RULES_CHAIN in step.chain for step in other.steps)
    # in a rule's destinations, but no rule matches (udp): back from the jump to the lookups (10/8 is kept)
    fallthrough = tracer.trace(Packet.of("10.9.0.1", source="10.44.0.1", protocol="udp", port=53))
    assert fallthrough.outcome is Outcome.PRESERVE and "@nomasq_v4" in (fallthrough.decided_by or "")
    assert fallthrough.chains == (f"{OURS} postrouting", f"{OURS} {RULES_CHAIN}")


def test_check_is_ok_on_our_listing_with_the_rules_chain() -> None:
    policy = _policy()
    text = _text(_objects(policy))
    assert check_nft(policy, parse_list_json(text), ruleset=text).findings == ()


def test_check_finds_a_preserve_that_returns_instead_of_accepting() -> None:
    policy = _policy()
    objects = _objects(policy)
    rule = _rule_named(objects, "partner-keep")
    rule["expr"][-1] = {"return": None}  # would resume postrouting: the lookups, then masquerade
    text = _text(objects)
    (finding,) = check_nft(policy, parse_list_json(text), ruleset=text).findings
    assert finding.id is FindingId.RULE_EDITED and f"chain {RULES_CHAIN}" in finding.message
    assert "counter return" in finding.message
    # and trace shows what that table does: masqueraded
    result = NftTracer(text).trace(Packet.of("34.10.1.1", source="10.44.0.1"))
    assert result.outcome is Outcome.MASQUERADE


def test_check_finds_rules_missing_reordered_and_extra_in_the_rules_chain() -> None:
    policy = _policy()
    objects = [o for o in _objects(policy) if o.get("rule", {}).get("comment") != "ip-masq-agent: rule vpn-snat"]
    found = {f.id for f in check_nft(policy, parse_list_json(_text(objects))).findings}
    assert found == {FindingId.RULE_MISSING}
    objects = _objects(policy)
    keep, rest = (objects.index({"rule": _rule_named(objects, n)}) for n in ("partner-keep", "partner-rest"))
    objects[keep], objects[rest] = objects[rest], objects[keep]
    (finding,) = check_nft(policy, parse_list_json(_text(objects))).findings
    assert finding.id is FindingId.RULE_ORDER and "partner-rest, partner-keep" in finding.message
    # a table written for a config with rules, checked against one without: every rule is extra, the chain not
    # foreign
    plain = _policy("nonMasqueradeCIDRs: [10.0.0.0/8]\n")
    ids = [f.id for f in check_nft(plain, parse_list_json(_text(_objects(policy)))).findings]
    assert ids.count(FindingId.RULE_EXTRA) == 4 and FindingId.UNSUPPORTED not in ids


def test_check_finds_a_rule_destination_the_jump_set_lacks() -> None:
    policy = _policy()
    objects = _objects(policy)
    for o in objects:
        if o.get("set", {}).get("name") == "rules_dst_v4":
            o["set"]["elem"] = [e for e in o["set"]["elem"] if e != {"prefix": {"addr": "10.9.0.0", "len": 16}}]
    (finding,) = check_nft(policy, parse_list_json(_text(objects))).findings
    assert finding.id is FindingId.RULES_DIFFER and finding.severity is Severity.ERROR
    assert "set rules_dst_v4" in finding.message and finding.missing == ("10.9.0.0/16",)


def test_check_finds_a_missing_jump_in_postrouting() -> None:
    policy = _policy()
    objects = [o for o in _objects(policy) if "rules_dst_v6" not in json.dumps(o.get("rule", {}))]
    (finding,) = check_nft(policy, parse_list_json(_text(objects))).findings
    assert finding.id is FindingId.RULES_DIFFER and "chain postrouting" in finding.message
    assert finding.missing and "@rules_dst_v6 jump config-rules" in finding.missing[0]


def test_the_readme_shows_the_layout_the_agent_renders() -> None:
    """README's nftables layout for its HTTPS and peered-VPC rules examples is what render writes for them."""
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```yaml\n((?:.*\n)*?)```", readme)
    wanted = ("onprem-https-sees-node-ip", "peered-vpc-sees-pod-ips")
    rules = ["rules:"]
    for name in wanted:
        block = next(b for b in blocks if f"name: {name}" in b)
        rules.extend(block[block.index("rules:\n") + len("rules:\n"):].rstrip("\n").splitlines())
    options = PolicyOptions()
    policy = Policy(config_from_bytes(ConfigInput((("/c", "\n".join(rules).encode() + b"\n"),)), options), options)
    table = desired_table(policy)
    start = readme.index("The nftables layout for the HTTPS and the peered-VPC examples")
    shown = readme[readme.index("\n\n    ", start) + 2:].split("\n\n")[0].splitlines()
    uncommented = {c.name: [re.sub(r' comment "[^"]*"$', "", r) for r in c.rules] for c in table.chains}
    chains: dict[str, list[str]] = {}
    current = None
    for line in shown:
        text = line.strip()
        if text.startswith("set "):
            name = text.split()[1]
            found = table.set_named(name)
            assert found is not None, line
            elements = ", ".join(format_elements(found.family, found.elements))
            assert text == (f"set {name} {{ type {found.type}; flags {', '.join(found.flags)}; "
                            f"elements = {{ {elements} }} }}")
        elif text.startswith("chain "):
            current = text.split()[1]
            chains[current] = []
        elif text != "}" and not text.startswith("type ") and current is not None:
            chains[current].append(text)
    assert chains == uncommented
    base = table.chain_named("postrouting")
    assert base is not None and any(line.strip() == f"type {base.type} hook {base.hook} priority srcnat; policy "
                                    f"{base.policy};" for line in shown)
