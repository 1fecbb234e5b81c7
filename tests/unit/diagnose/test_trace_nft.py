"""check and trace over `nft -j list ruleset` with the config's `rules`: our table as the fake nft lists it after
the agent's own script, plus nat chains of other tables written by hand (iptables-nft's `ip nat`, a chain hooked
ahead of ours).

check and trace over our nftables table as the agent writes it with config rules: the rules in their own chain
(config-rules), entered from postrouting for the destinations in rules_dst_v4/rules_dst_v6 only; preserve is
`accept` there, so it ends the decision instead of falling back to the set lookups and the masquerade.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import Any

import pytest

from ipmasq.cli import main
from ipmasq.config import ConfigInput, config_from_bytes
from ipmasq.diagnose.check import FindingId
from ipmasq.diagnose.check_nft import check_nft
from ipmasq.diagnose.trace_nft import NftTracer
from ipmasq.errors import NftTraceError
from ipmasq.findings import Severity
from ipmasq.netfilter.nft import RULES_CHAIN, desired_table, format_elements, render_script
from ipmasq.netfilter.nft_json import parse_list_json
from ipmasq.options import PolicyOptions
from ipmasq.policy.packet import Outcome, Packet
from ipmasq.policy.policy import Policy
from ipmasq.prefix import parse_address, parse_cidr
from ipmasq.testing.nft import FakeNft
from tests.configs import RULES_CONFIG, policy_of
from tests.conftest import ROOT

OPTIONS = PolicyOptions(random_fully=False)
PODS = (parse_cidr("10.44.0.0/14"),)
NODE = "10.142.15.203"


def _policy(text: str = RULES_CONFIG) -> Policy:
    return policy_of(text, OPTIONS)


def _listing(policy: Policy, *foreign: dict[str, Any]) -> str:
    """What `nft -j list ruleset` prints on a node where the agent applied its script, plus foreign objects."""
    nft = FakeNft()
    assert nft(["nft", "-f", "-"], render_script(policy)).returncode == 0
    document = json.loads(nft(["nft", "-j", "list", "ruleset"]).stdout)
    document["nftables"].extend(foreign)
    return json.dumps(document)


def _daddr(prefix: str) -> dict[str, Any]:
    address, length = prefix.split("/")
    return {"match": {"op": "==", "left": {"payload": {"protocol": "ip", "field": "daddr"}},
                      "right": {"prefix": {"addr": address, "len": int(length)}}}}


def _chain(table: str, name: str, priority: int) -> list[dict[str, Any]]:
    return [{"table": {"family": "ip", "name": table, "handle": 3}},
            {"chain": {"family": "ip", "table": table, "name": name, "handle": 1, "type": "nat",
                       "hook": "postrouting", "prio": priority, "policy": "accept"}}]


def _rule(table: str, chain: str, handle: int, *expr: dict[str, Any]) -> dict[str, Any]:
    return {"rule": {"family": "ip", "table": table, "chain": chain, "handle": handle, "expr": list(expr)}}


TCP_443 = {"match": {"op": "==", "left": {"payload": {"protocol": "tcp", "field": "dport"}}, "right": 443}}


def _seen(policy: Policy, destination: str, source: str, protocol: str, port: int | None) -> str:
    family, address = parse_address(destination)
    verdict = policy.verdict_for(family, address, source=parse_address(source)[1], protocol=protocol, port=port)
    assert verdict.decided
    return verdict.snat_to or (NODE if verdict.masquerade else source)


def test_nft_trace_on_our_listing_equals_explain_packet_by_packet() -> None:
    policy = _policy()
    tracer = NftTracer(_listing(policy))
    rng = random.Random(5)
    labels = set()
    for _ in range(600):
        destination = rng.choice(["10.1.0.9", "10.2.3.4", "34.1.2.3", "8.8.8.8", "172.30.0.1", "10.200.0.1"])
        source = rng.choice(["10.44.8.1", "10.44.11.255", "10.44.12.0", "10.45.0.7"])
        protocol = rng.choice(["tcp", "udp", "icmp"])
        port = None if protocol == "icmp" else rng.choice([53, 80, 443, 8000, 8080, 8081])
        packet = Packet.of(destination, source=source, protocol=protocol, port=port, local_addresses=[NODE])
        result = tracer.trace(packet)
        assert result.outcome is not Outcome.UNDECIDED, (packet, result.undecided_reason)
        assert result.source_seen(packet, masquerade_address=NODE) == _seen(policy, destination, source, protocol,
                                                                           port), packet
        labels.add(result.decided_label)
    assert {"rule partner-snat", "rule batch-masq", "rule dns-keep"} <= labels


def test_nft_trace_names_the_missing_field_and_local_destinations() -> None:
    tracer = NftTracer(_listing(_policy()))
    no_port = tracer.trace(Packet.of("10.1.0.9", source="10.44.0.1", protocol="tcp"))
    assert no_port.outcome is Outcome.UNDECIDED and "give --port" in (no_port.undecided_reason or "")
    assert no_port.decided_label == "rule partner-snat"
    no_source = tracer.trace(Packet.of("10.2.0.9"))
    assert no_source.outcome is Outcome.UNDECIDED and "source is unknown" in (no_source.undecided_reason or "")
    local = tracer.trace(Packet.of(NODE, source="10.44.0.1", local_addresses=[NODE]))
    assert local.outcome is Outcome.PRESERVE and "fib daddr type local" in (local.decided_by or "")


def test_nft_check_is_ok_on_our_own_listing() -> None:
    policy = _policy()
    text = _listing(policy)
    assert check_nft(policy, parse_list_json(text), ruleset=text, pod_ranges=PODS).findings == ()


def test_iptables_nft_rule_behind_ours_nats_what_the_config_keeps_for_one_port() -> None:
    policy = _policy()
    text = _listing(policy, *_chain("nat", "POSTROUTING", 100),
                    _rule("nat", "POSTROUTING", 7, _daddr("172.30.0.0/16"), TCP_443, {"masquerade": None}))
    report = check_nft(policy, parse_list_json(text), ruleset=text, pod_ranges=PODS)
    assert [(f.id, f.destinations) for f in report.findings] == [(FindingId.FOREIGN_MASQUERADE, ("172.30.0.0/16",))]
    finding = report.findings[0]
    assert "(172.30.0.0/16 (tcp port 443))" in finding.message and "ip nat POSTROUTING handle 7" in finding.message
    assert "nft delete rule ip nat POSTROUTING handle 7" in finding.hint


def test_chain_ahead_of_ours_shadows_the_snat_rule_and_an_accept_there_does_not() -> None:
    policy = _policy()
    text = _listing(policy, *_chain("early", "post", 50),
                    _rule("early", "post", 4, _daddr("10.1.0.0/16"), {"accept": None}),
                    _rule("early", "post", 5, _daddr("10.1.0.0/16"), TCP_443, {"masquerade": None}))
    report = check_nft(policy, parse_list_json(text), ruleset=text, pod_ranges=PODS)
    assert report.findings == ()  # accept ends that chain only: ours still decides
    text = _listing(policy, *_chain("early", "post", 50),
                    _rule("early", "post", 5, _daddr("10.1.0.0/16"), TCP_443, {"masquerade": None}))
    report = check_nft(policy, parse_list_json(text), ruleset=text, pod_ranges=PODS)
    (finding,) = report.findings
    assert finding.id is FindingId.FOREIGN_MASQUERADE and finding.destinations == ("10.1.0.0/16",)
    assert "rule partner-snat (/c:3: snat to 10.142.0.50)" in finding.message


def test_nft_rule_missing_and_edited_by_name() -> None:
    policy = _policy()
    document = json.loads(_listing(policy))
    items = [i for i in document["nftables"] if "rule batch-masq" not in json.dumps(i)]
    for item in items:
        body = item.get("rule")
        if body is not None and body.get("comment") == "ip-masq-agent: rule dns-keep":
            body["expr"][1]["match"]["right"] = 54
    text = json.dumps({"nftables": items})
    found = {f.id: f for f in check_nft(policy, parse_list_json(text)).findings}
    assert set(found) == {FindingId.RULE_MISSING, FindingId.RULE_EDITED}
    assert "rule batch-masq (/c:9)" in found[FindingId.RULE_MISSING].message
    assert "rule dns-keep (/c:13)" in found[FindingId.RULE_EDITED].message


@pytest.mark.parametrize(("expr", "packet", "outcome", "seen"), [
    ([{"match": {"op": "!=", "left": {"payload": {"protocol": "th", "field": "dport"}},
                 "right": {"set": [53, {"range": [5000, 5100]}]}}}, {"masquerade": None}],
     {"protocol": "udp", "port": 5050}, "preserve", "10.44.0.1"),
    ([{"match": {"op": "==", "left": {"meta": {"key": "l4proto"}}, "right": {"set": ["tcp", "udp"]}}},
      {"snat": {"family": "ip", "addr": {"range": ["10.142.0.50", "10.142.0.52"]}, "port": 1024}}],
     {"protocol": "udp", "port": 9}, "snat", "10.142.0.50-10.142.0.52"),
    ([{"match": {"op": "==", "left": {"payload": {"protocol": "ip", "field": "saddr"}},
                 "right": {"prefix": {"addr": "10.44.0.0", "len": 16}}}}, {"jump": {"target": "sub"}}],
     {"protocol": "icmp"}, "masquerade", "10.142.15.203"),
])
def test_nft_matches_and_targets(expr: list[dict[str, Any]], packet: dict[str, Any], outcome: str,
                                 seen: str) -> None:
    objects = [*_chain("t", "post", 100), {"chain": {"family": "ip", "table": "t", "name": "sub"}},
               _rule("t", "sub", 9, {"masquerade": None}), _rule("t", "post", 1, *expr)]
    tracer = NftTracer(json.dumps({"nftables": objects}))
    p = Packet.of("1.1.1.1", source="10.44.0.1", **packet)
    result = tracer.trace(p)
    assert result.outcome.value == outcome, result.undecided_reason
    assert result.source_seen(p, masquerade_address=NODE) == seen


def test_trace_cli_reads_an_nft_listing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dump = tmp_path / "ruleset.json"
    dump.write_text(_listing(_policy()))
    assert main(["trace", "10.1.0.9", "--source", "10.44.0.1", "--protocol", "tcp", "--port", "443", "--dump",
                 str(dump), "-o", "json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["source_seen"] == "10.142.0.50" and document["decided_by_name"] == "rule partner-snat"
    bad = tmp_path / "bad.json"
    bad.write_text('{"nftables": 3}')
    assert main(["trace", "10.1.0.9", "--source", "10.44.0.1", "--dump", str(bad)]) == 3
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(bad) in err


@pytest.mark.parametrize("objects", [
    [{"rule": {"family": "ip", "table": "t", "chain": "post", "expr": [{"match": 3}, {"masquerade": None}]}}],
    [{"rule": {"family": "ip", "table": "t", "chain": "post",
               "expr": [{"match": {"op": "<", "left": {}, "right": 1}}]}}],
    [{"rule": {"family": "ip", "table": "t", "chain": "post", "expr": [{"xt": {"type": "match", "name": "foo"}}]}}],
    [{"rule": {"family": "ip", "table": "t", "chain": "post", "expr": [{"jump": {"target": "nowhere"}}]}}],
    [{"rule": {"family": "ip", "table": "t", "chain": "post", "expr": [_daddr("1.1.1.0/24") | {"x": 1}]}}],
    [{"rule": {"family": "ip", "table": "t", "chain": "post", "expr": [
        {"match": {"op": "==", "left": {"payload": {"protocol": "ip", "field": "daddr"}}, "right": "@nope"}}]}}],
])
def test_nft_rules_trace_cannot_read_say_so(objects: list[dict[str, Any]]) -> None:
    tracer = NftTracer(json.dumps({"nftables": [*_chain("t", "post", 100), *objects]}))
    result = tracer.trace(Packet.of("1.1.1.1", source="10.44.0.1", protocol="tcp", port=80))
    assert result.outcome is Outcome.UNDECIDED and result.undecided_reason


@pytest.mark.parametrize("text", ['{"nftables": [3]}', '{"nftables": [{"chain": 4}]}', "[]", '{"nftables": {}}'])
def test_nft_listing_of_the_wrong_shape_is_one_error(text: str) -> None:
    with pytest.raises(NftTraceError):
        NftTracer(text)


CHAIN_CONFIG = """\
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
CHAIN_OPTIONS = PolicyOptions(random_fully=False, enable_ipv6=True)
OURS = "inet ip-masq-agent"


def _chain_policy(text: str = CHAIN_CONFIG) -> Policy:
    return Policy(config_from_bytes(ConfigInput((("/c", text.encode()),)), CHAIN_OPTIONS), CHAIN_OPTIONS)


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
    tracer = NftTracer(_text(_objects(_chain_policy())))
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
    tracer = NftTracer(_text(_objects(_chain_policy())))
    other = tracer.trace(Packet.of("8.8.8.8", source="10.44.0.1"))
    assert other.outcome is Outcome.MASQUERADE and other.chains == (f"{OURS} postrouting",)
    assert not any(RULES_CHAIN in step.chain for step in other.steps)
    # in a rule's destinations, but no rule matches (udp): back from the jump to the lookups (10/8 is kept)
    fallthrough = tracer.trace(Packet.of("10.9.0.1", source="10.44.0.1", protocol="udp", port=53))
    assert fallthrough.outcome is Outcome.PRESERVE and "@nomasq_v4" in (fallthrough.decided_by or "")
    assert fallthrough.chains == (f"{OURS} postrouting", f"{OURS} {RULES_CHAIN}")


def test_check_is_ok_on_our_listing_with_the_rules_chain() -> None:
    policy = _chain_policy()
    text = _text(_objects(policy))
    assert check_nft(policy, parse_list_json(text), ruleset=text).findings == ()


def test_check_finds_a_preserve_that_returns_instead_of_accepting() -> None:
    policy = _chain_policy()
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
    policy = _chain_policy()
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
    plain = _chain_policy("nonMasqueradeCIDRs: [10.0.0.0/8]\n")
    ids = [f.id for f in check_nft(plain, parse_list_json(_text(_objects(policy)))).findings]
    assert ids.count(FindingId.RULE_EXTRA) == 4 and FindingId.UNSUPPORTED not in ids


def test_check_finds_a_rule_destination_the_jump_set_lacks() -> None:
    policy = _chain_policy()
    objects = _objects(policy)
    for o in objects:
        if o.get("set", {}).get("name") == "rules_dst_v4":
            o["set"]["elem"] = [e for e in o["set"]["elem"] if e != {"prefix": {"addr": "10.9.0.0", "len": 16}}]
    (finding,) = check_nft(policy, parse_list_json(_text(objects))).findings
    assert finding.id is FindingId.RULES_DIFFER and finding.severity is Severity.ERROR
    assert "set rules_dst_v4" in finding.message and finding.missing == ("10.9.0.0/16",)


def test_check_finds_a_missing_jump_in_postrouting() -> None:
    policy = _chain_policy()
    objects = [o for o in _objects(policy) if "rules_dst_v6" not in json.dumps(o.get("rule", {}))]
    (finding,) = check_nft(policy, parse_list_json(_text(objects))).findings
    assert finding.id is FindingId.RULES_DIFFER and "chain postrouting" in finding.message
    assert finding.missing and "@rules_dst_v6 jump config-rules" in finding.missing[0]


def test_the_rules_page_shows_the_layout_the_agent_renders() -> None:
    """The rules page's nftables layout for its HTTPS and peered-VPC examples is what render writes for them."""
    readme = (ROOT / "docs" / "concepts" / "rules.md").read_text()
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
