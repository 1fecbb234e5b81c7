"""check: every finding id on a dump that shows it, and ok on the agent's own output.

check and trace with the config's `rules`: dumps rendered by our own renderer for a config with source-, port-
and SNAT rules, and foreign rules written by hand in front of and behind ours.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from ipmasq.cli import main
from ipmasq.diagnose.check import FindingId
from ipmasq.diagnose.check_iptables import check_iptables
from ipmasq.diagnose.check_nft import check_nft
from ipmasq.diagnose.sources import family_of_dump
from ipmasq.diagnose.trace import Tracer, trace
from ipmasq.findings import Finding, Severity
from ipmasq.netfilter.iptables import NatTable, chain_digest, marker_chain, marker_rule, parse_save, render_restore
from ipmasq.netfilter.nft import desired_table
from ipmasq.netfilter.nft_json import parse_list_json
from ipmasq.options import PolicyOptions
from ipmasq.policy.packet import Outcome, Packet
from ipmasq.policy.policy import Policy
from ipmasq.prefix import Family, parse_address, parse_cidr
from ipmasq.testing.nft import list_json
from tests.configs import RULES_CONFIG, policy_of
from tests.conftest import ROOT

DUMPS = ROOT / "tests" / "dumps"
GKE = PolicyOptions(masq_chain="IP-MASQ", nomasq_all_reserved_ranges=True, random_fully=False)
REFERENCE_2_9 = PolicyOptions(random_fully=False)  # the vectors' reference agent predates --random-fully
# the config of vector 03 (nonMasqueradeCIDRs [10.0.0.0/8], masqLinkLocal), whose output several dumps hold
TEN = "nonMasqueradeCIDRs: [10.0.0.0/8]\nmasqLinkLocal: true\n"


def _ids(name: str, policy: Policy, **kw: object) -> dict[str, Finding]:
    table = parse_save((DUMPS / name).read_text())
    report = check_iptables(policy, table, Family.V4, **kw)  # type: ignore[arg-type]
    return {f.id: f for f in report.findings}


def test_agent_output_is_ok() -> None:
    policy = policy_of("nonMasqueradeCIDRs: [10.0.0.0/8]\nmasqueradeCIDRs: [10.11.0.0/24]\n", PolicyOptions())
    table = parse_save(render_restore(policy, Family.V4))
    report = check_iptables(policy, table, Family.V4)
    assert report.ok and report.findings == ()


def test_gke_1_14_chain_is_ok_for_gke_flags() -> None:
    assert _ids("gke-1.14-aws-vpn.save", policy_of("", GKE)) == {}


def test_gke_1_14_chain_against_the_upgrade_fix_lists_the_exact_extra_destinations() -> None:
    found = _ids("gke-1.14-aws-vpn.save", policy_of("nonMasqueradeCIDRs: [10.0.0.0/8]\n", GKE))
    assert set(found) == {FindingId.RULES_DIFFER}
    differ = found[FindingId.RULES_DIFFER]
    assert differ.missing == ()
    assert "-d 172.16.0.0/12 -j RETURN" in differ.extra
    assert len(differ.extra) == 10


def test_config_not_applied() -> None:
    found = _ids("catch-all-only.save", policy_of(TEN, REFERENCE_2_9))
    assert set(found) == {FindingId.CONFIG_NOT_APPLIED}


def test_kubenet_rule_is_foreign_masquerade_with_its_destinations() -> None:
    found = _ids("gke-kubenet.save", policy_of("", GKE))
    assert set(found) == {FindingId.FOREIGN_MASQUERADE}
    finding = found[FindingId.FOREIGN_MASQUERADE]
    assert finding.rule is not None and "kubenet" in finding.rule
    assert "172.16.0.0/12" in finding.destinations
    assert "10.0.0.0/8" not in finding.destinations
    assert "--non-masquerade-cidr" in finding.hint


def test_fix_nat_daemonset_rule() -> None:
    found = _ids("fix-nat-daemonset.save", policy_of(TEN, REFERENCE_2_9))
    assert set(found) == {FindingId.FOREIGN_MASQUERADE}
    assert found[FindingId.FOREIGN_MASQUERADE].destinations == ("10.11.0.0/24",)
    # the same intent said in the config: the rule no longer changes an outcome
    intent = policy_of(TEN + "masqueradeCIDRs: [10.11.0.0/24]\n", REFERENCE_2_9)
    assert set(_ids("fix-nat-daemonset.save", intent)) == {FindingId.RULES_DIFFER}


def test_hand_written_snat_rule_needs_the_pod_range() -> None:
    policy = policy_of("", GKE)
    assert set(_ids("manual-private-endpoint.save", policy)) == {FindingId.UNSUPPORTED}
    found = _ids("manual-private-endpoint.save", policy, pod_ranges=(parse_cidr("100.64.0.0/16"),))
    assert set(found) == {FindingId.FOREIGN_MASQUERADE}
    assert found[FindingId.FOREIGN_MASQUERADE].destinations == ("10.1.2.100/32",)
    # pods elsewhere: the rule never applies to them
    assert _ids("manual-private-endpoint.save", policy, pod_ranges=(parse_cidr("10.44.0.0/14"),)) == {}


def test_renamed_chain_is_stale() -> None:
    found = _ids("renamed-chain.save", policy_of(TEN, REFERENCE_2_9))
    assert set(found) == {FindingId.STALE_CHAIN}
    assert found[FindingId.STALE_CHAIN].severity is Severity.ERROR
    # no ownership marker beside it: another program may write it, and ipmasq's agent never removes it
    assert "ipmasq's agent never removes it" in found[FindingId.STALE_CHAIN].hint


def _marked_as_written(text: str, chain: str) -> str:
    """`text` with `chain`'s ownership marker recording the chain as the dump holds it (ipmasq wrote it so)."""
    table = parse_save(text)
    jumps = [r for r in table.rules_of("POSTROUTING") if r.endswith(f" -j {chain}")]
    digest = chain_digest(chain, jumps, table.rules_of(chain))
    return text.replace("COMMIT", f":{marker_chain(chain)} - [0:0]\n{marker_rule(chain, digest)}\nCOMMIT")


def test_a_stale_chain_with_ipmasqs_marker_is_one_the_agent_removes() -> None:
    text = _marked_as_written((DUMPS / "renamed-chain.save").read_text(), "IP-MASQ")
    report = check_iptables(policy_of(TEN, REFERENCE_2_9), parse_save(text), Family.V4)
    (stale,) = [f for f in report.findings if f.id == FindingId.STALE_CHAIN]
    assert "iptables -t nat -F IPMASQ-OWNS-IP-MASQ; iptables -t nat -X IPMASQ-OWNS-IP-MASQ" in stale.hint
    assert "on its next sync" in stale.hint


def test_a_stale_chain_rewritten_since_ipmasq_wrote_it_is_one_the_agent_keeps() -> None:
    text = _marked_as_written((DUMPS / "renamed-chain.save").read_text(), "IP-MASQ")
    text = text.replace("-A IP-MASQ -d 10.0.0.0/8 ", "-A IP-MASQ -d 10.0.0.0/9 ")  # another agent's CIDRs now
    report = check_iptables(policy_of(TEN, REFERENCE_2_9), parse_save(text), Family.V4)
    (stale,) = [f for f in report.findings if f.id == FindingId.STALE_CHAIN]
    assert "its rules changed since ipmasq wrote them" in stale.hint and "never removes it" in stale.hint
    assert "on its next sync" not in stale.hint


def test_a_node_running_another_chain_name_is_not_told_to_delete_it() -> None:
    # a GKE node (chain IP-MASQ) checked without --masq-chain=IP-MASQ: its live chain is not stale, and advising
    # `iptables -X IP-MASQ` would tear down the node's working rules
    missing = _ids("gke-1.14-aws-vpn.save", policy_of("", PolicyOptions(nomasq_all_reserved_ranges=True)))
    assert set(missing) == {FindingId.CHAIN_MISSING}
    assert "this node uses chain IP-MASQ" in missing[FindingId.CHAIN_MISSING].message
    assert "--masq-chain=IP-MASQ" in missing[FindingId.CHAIN_MISSING].hint
    assert "-X" not in missing[FindingId.CHAIN_MISSING].hint + missing[FindingId.CHAIN_MISSING].message


def test_jump_missing() -> None:
    policy = policy_of("", PolicyOptions())
    text = "\n".join(line for line in render_restore(policy, Family.V4).splitlines()
                     if not line.startswith("-A POSTROUTING"))
    report = check_iptables(policy, parse_save(text), Family.V4)
    assert [f.id for f in report.findings] == [FindingId.JUMP_MISSING]


def test_jump_shadowed() -> None:
    found = _ids("shadowed-jump.save", policy_of(TEN, REFERENCE_2_9))
    assert set(found) == {FindingId.JUMP_SHADOWED}
    assert found[FindingId.JUMP_SHADOWED].destinations == ("172.30.0.0/16",)


def test_port_scoped_snat_is_decided_for_its_port_only() -> None:
    policy = policy_of(TEN, REFERENCE_2_9)
    found = _ids("unsupported.save", policy, pod_ranges=(parse_cidr("10.44.0.0/14"),))
    assert set(found) == {FindingId.FOREIGN_MASQUERADE}
    snat = found[FindingId.FOREIGN_MASQUERADE]
    assert snat.rule is not None and "--dport 5432" in snat.rule
    assert snat.destinations == ("10.9.0.0/16",) and "(tcp port 5432)" in snat.message
    assert "POSTROUTING:3 " in snat.message  # the jump, docker's rule, then this one


def test_unsupported_quotes_the_rule() -> None:
    policy = policy_of(TEN, REFERENCE_2_9)
    dump = (DUMPS / "unsupported.save").read_text().replace("-p tcp -m tcp --dport 5432",
                                                            "-m statistic --mode random --probability 0.5")
    report = check_iptables(policy, parse_save(dump), Family.V4, pod_ranges=(parse_cidr("10.44.0.0/14"),))
    found = {f.id: f for f in report.findings}
    assert set(found) == {FindingId.UNSUPPORTED}
    unsupported = found[FindingId.UNSUPPORTED].rule
    assert unsupported is not None and "-m statistic" in unsupported


def test_random_fully_only_is_a_warning() -> None:
    found = _ids("fix-nat-daemonset.save", policy_of(TEN + "masqueradeCIDRs: [10.11.0.0/24]\n", PolicyOptions()))
    assert found[FindingId.RULES_DIFFER].severity is Severity.ERROR
    policy = policy_of(TEN, PolicyOptions())
    table = parse_save((DUMPS / "fix-nat-daemonset.save").read_text().replace(
        '-A POSTROUTING -d 10.11.0.0/24 -m comment --comment "NAT-VPN: SNAT for outbound traffic through VPN" '
        '-m addrtype ! --dst-type LOCAL -j MASQUERADE\n', ""))
    report = check_iptables(policy, table, Family.V4)
    assert report.ok and [(f.id, f.severity) for f in report.findings] == [(FindingId.RULES_DIFFER, Severity.WARNING)]
    # the fix names the flag in the direction the node differs, and none beside a provider's agent (its own flags)
    assert "pass --random-fully=false" in report.findings[0].hint
    with_it = check_iptables(policy_of(TEN, PolicyOptions(random_fully=False)), NatTable(
        table.chains, [r.replace("-j MASQUERADE", "-j MASQUERADE --random-fully") for r in table.rules]), Family.V4)
    assert [f.id for f in with_it.findings] == [FindingId.RULES_DIFFER]
    assert "drop --random-fully=false" in with_it.findings[0].hint
    provider = check_iptables(policy, table, Family.V4, writer="GKE's managed agent")
    assert provider.findings[0].hint.startswith("nothing to do: the agent behind GKE's managed agent")


def test_family_of_dump() -> None:
    assert family_of_dump(parse_save("*nat\n:X - [0:0]\n-A X -d fd00::/8 -j RETURN\nCOMMIT\n")) is Family.V6
    assert family_of_dump(parse_save((DUMPS / "gke-1.14-aws-vpn.save").read_text())) is Family.V4


def test_nft_table_against_policy() -> None:
    policy = policy_of("nonMasqueradeCIDRs: [10.0.0.0/8, 172.16.0.0/12]\n", PolicyOptions())
    listing = json.dumps({"nftables": list_json(desired_table(policy))})
    assert check_nft(policy, parse_list_json(listing)).findings == ()
    fixed = policy_of("nonMasqueradeCIDRs: [10.0.0.0/8]\n", PolicyOptions())
    report = check_nft(fixed, parse_list_json(listing))
    assert [f.id for f in report.findings] == [FindingId.RULES_DIFFER]
    assert report.findings[0].extra == ("172.16.0.0/12",)
    assert check_nft(policy, None).findings[0].id is FindingId.CHAIN_MISSING


def test_cli_json_and_exit_codes(capsys: pytest.CaptureFixture[str]) -> None:
    ok = main(["check", "--from-dump", str(DUMPS / "gke-1.14-aws-vpn.save"), "--masq-chain=IP-MASQ",
               "--nomasq-all-reserved-ranges", "--random-fully=false", "-o", "json"])
    assert ok == 0 and json.loads(capsys.readouterr().out) == {
        "apiVersion": "ipmasq.io/v1", "kind": "CheckReport", "ok": True, "findings": []}
    bad = main(["check", "--from-dump", str(DUMPS / "gke-kubenet.save"), "--masq-chain=IP-MASQ",
                "--nomasq-all-reserved-ranges", "--random-fully=false", "-o", "json"])
    document = json.loads(capsys.readouterr().out)
    assert bad == 1 and document["ok"] is False
    assert [(f["id"], f["severity"]) for f in document["findings"]] == [("foreign-masquerade", "error")]
    assert {"id", "severity", "message"} <= set(document["findings"][0])


def test_cli_bad_dump(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    junk = tmp_path / "junk.txt"
    junk.write_text("hello\n")
    assert main(["check", "--from-dump", str(junk)]) == 3  # could not read it
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no *nat table" in err
    bad_json = tmp_path / "bad.json"
    bad_json.write_text("{not json")
    assert main(["check", "--from-dump", str(bad_json)]) == 3
    assert str(bad_json) in capsys.readouterr().err


OPTIONS = PolicyOptions(random_fully=False)
PODS = (parse_cidr("10.44.0.0/14"),)
NODE = "10.142.15.203"


def _rules_policy(text: str = RULES_CONFIG) -> Policy:
    return policy_of(text, OPTIONS)


def _dump(policy: Policy, *, edit: str = "", before: str = "", after: str = "") -> str:
    """The agent's dump for the policy, with lines of ours dropped/replaced (`edit`: OLD=>NEW per line) and foreign
    rules put in front of our jump (`before`) or behind it (`after`)."""
    text = render_restore(policy, Family.V4)
    for pair in filter(None, edit.split("\n")):
        old, new = pair.split("=>")
        assert old in text, old
        text = text.replace(old, new)
    lines = text.splitlines()
    jump = next(i for i, line in enumerate(lines) if line.startswith("-A POSTROUTING"))
    lines[jump:jump] = [":POSTROUTING ACCEPT [0:0]", *filter(None, before.split("\n"))]
    lines[-1:-1] = list(filter(None, after.split("\n")))
    return "\n".join(lines) + "\n"


def _findings(policy: Policy, dump: str) -> dict[str, list[Finding]]:
    out: dict[str, list[Finding]] = {}
    for f in check_iptables(policy, parse_save(dump), Family.V4, pod_ranges=PODS).findings:
        out.setdefault(str(f.id), []).append(f)
    return out


def _expected_seen(policy: Policy, packet: Packet, source: str) -> str:
    verdict = policy.verdict_for(packet.family, packet.destination, source=parse_address(source)[1],
                                 protocol=packet.protocol, port=packet.port)
    assert verdict.decided
    return verdict.snat_to or (NODE if verdict.masquerade else source)


def test_trace_on_our_rendered_rules_equals_explain_packet_by_packet() -> None:
    policy = _rules_policy()
    tracer = Tracer(parse_save(_dump(policy)))
    rng = random.Random(7)
    destinations = ["10.1.0.9", "10.1.255.255", "10.2.3.4", "10.3.0.200", "10.3.1.1", "34.1.2.3", "8.8.8.8",
                    "10.200.0.1"]
    sources = ["10.44.8.1", "10.44.11.255", "10.44.12.0", "10.45.0.7"]
    decided_by_rule = set()
    for _ in range(600):
        destination, source = rng.choice(destinations), rng.choice(sources)
        protocol = rng.choice(["tcp", "udp", "icmp"])
        port = rng.choice([53, 80, 443, 7999, 8000, 8080, 8081]) if protocol != "icmp" else None
        packet = Packet.of(destination, source=source, protocol=protocol, port=port, local_addresses=[NODE])
        result = tracer.trace(packet)
        assert result.outcome is not Outcome.UNDECIDED, (packet, result.undecided_reason)
        assert result.source_seen(packet, masquerade_address=NODE) == _expected_seen(policy, packet, source), packet
        if result.decided_label and result.decided_label.startswith("rule "):
            decided_by_rule.add(result.decided_label)
    assert decided_by_rule == {"rule partner-snat", "rule batch-masq", "rule dns-keep"}


def test_trace_says_which_field_it_needs() -> None:
    table = parse_save(_dump(_rules_policy()))
    no_protocol = trace(table, Packet.of("10.1.0.9", source="10.44.0.1"))
    assert no_protocol.outcome is Outcome.UNDECIDED and "give --protocol" in (no_protocol.undecided_reason or "")
    assert no_protocol.decided_label == "rule partner-snat"
    no_port = trace(table, Packet.of("10.1.0.9", source="10.44.0.1", protocol="tcp"))
    assert no_port.outcome is Outcome.UNDECIDED and "give --port" in (no_port.undecided_reason or "")
    assert "443,8000:8080" in (no_port.undecided_reason or "")
    # a rule whose destinations do not hold the packet needs neither: the destination test fails first
    elsewhere = trace(table, Packet.of("10.7.0.1", source="10.44.0.1"))
    assert elsewhere.outcome is Outcome.PRESERVE


@pytest.mark.parametrize(("rule", "packet", "outcome"), [
    ("-p udp -m multiport ! --dports 53,5000:5100 -j MASQUERADE", {"protocol": "udp", "port": 5050}, "preserve"),
    ("-p udp -m multiport ! --dports 53,5000:5100 -j MASQUERADE", {"protocol": "udp", "port": 5101}, "masquerade"),
    ("-p tcp -m tcp ! --dport 1024: -j MASQUERADE", {"protocol": "tcp", "port": 1023}, "masquerade"),
    ("-p tcp -m tcp --sport 30000:32767 -j MASQUERADE", {"protocol": "tcp", "port": 80, "source_port": 31000},
     "masquerade"),
    ("-p tcp -m multiport --ports 80 -j MASQUERADE", {"protocol": "tcp", "port": 81, "source_port": 80},
     "masquerade"),
    ("! -p tcp -j MASQUERADE", {"protocol": "udp"}, "masquerade"),
    ("! -p tcp -j MASQUERADE", {"protocol": "tcp"}, "preserve"),
    ("-p 17 -j MASQUERADE", {"protocol": "udp"}, "masquerade"),
])
def test_port_and_protocol_matches(rule: str, packet: dict[str, object], outcome: str) -> None:
    dump = f"*nat\n:POSTROUTING ACCEPT [0:0]\n-A POSTROUTING {rule}\nCOMMIT\n"
    result = trace(parse_save(dump), Packet.of("1.1.1.1", source="10.44.0.1", **packet))  # type: ignore[arg-type]
    assert result.outcome.value == outcome, result.undecided_reason


def test_source_port_not_given_is_named() -> None:
    dump = "*nat\n:POSTROUTING ACCEPT [0:0]\n-A POSTROUTING -p tcp -m tcp --sport 53 -j MASQUERADE\nCOMMIT\n"
    result = trace(parse_save(dump), Packet.of("1.1.1.1", source="10.44.0.1", protocol="tcp", port=80))
    assert result.outcome is Outcome.UNDECIDED and "give --source-port" in (result.undecided_reason or "")


@pytest.mark.parametrize(("to", "seen"), [
    ("10.142.0.50", "10.142.0.50"),
    ("10.142.0.50:1024-2048", "10.142.0.50"),
    ("10.142.0.50-10.142.0.52", "10.142.0.50-10.142.0.52"),
    ("10.142.0.50-10.142.0.52:1024", "10.142.0.50-10.142.0.52"),
])
def test_snat_address_ranges_and_ports(to: str, seen: str) -> None:
    dump = f"*nat\n:POSTROUTING ACCEPT [0:0]\n-A POSTROUTING -d 1.1.1.0/24 -j SNAT --to-source {to}\nCOMMIT\n"
    packet = Packet.of("1.1.1.1", source="10.44.0.1")
    result = trace(parse_save(dump), packet)
    assert result.outcome is Outcome.SNAT and result.source_seen(packet, masquerade_address=NODE) == seen
    assert result.decided_label == "POSTROUTING:1"


def test_check_is_ok_on_our_own_rules() -> None:
    policy = _rules_policy()
    report = check_iptables(policy, parse_save(_dump(policy)), Family.V4, pod_ranges=PODS)
    assert report.findings == ()
    # without --pod-range too: the config rules' sources make the source classes
    assert check_iptables(policy, parse_save(_dump(policy)), Family.V4).findings == ()


def test_missing_rule_is_named_with_its_line() -> None:
    policy = _rules_policy()
    dump = "\n".join(line for line in _dump(policy).splitlines() if "rule batch-masq" not in line) + "\n"
    found = _findings(policy, dump)
    assert set(found) == {"rule-missing"}
    (missing,) = found["rule-missing"]
    assert "rule batch-masq (/c:9)" in missing.message and len(missing.missing) == 2


def test_edited_rule_names_the_lines() -> None:
    policy = _rules_policy()
    found = _findings(policy, _dump(policy, edit="--dports 443,8000:8080=>--dports 444,8000:8080"))
    assert set(found) == {"rule-edited"}
    (edited,) = found["rule-edited"]
    assert "rule partner-snat (/c:3)" in edited.message
    assert any("443,8000:8080" in r for r in edited.missing) and any("444,8000:8080" in r for r in edited.extra)


def test_extra_rule_from_another_config() -> None:
    policy = _rules_policy()
    extra = ('-A IP-MASQ-AGENT -d 10.9.0.0/16 -m comment --comment "ip-masq-agent: rule old-partner" '
             "-j MASQUERADE")
    text = _dump(policy).replace("-A IP-MASQ-AGENT", extra + "\n-A IP-MASQ-AGENT", 1)
    found = _findings(policy, text)
    assert "rule-extra" in found and "rule old-partner" in found["rule-extra"][0].message
    assert "rule-order" not in found


def test_reordered_rules() -> None:
    policy = _rules_policy()
    lines = _dump(policy).splitlines()
    dns = [line for line in lines if "rule dns-keep" in line]
    rest = [line for line in lines if "rule dns-keep" not in line]
    at = next(i for i, line in enumerate(rest) if "rule partner-snat" in line)
    found = _findings(policy, "\n".join(rest[:at] + dns + rest[at:]) + "\n")
    assert set(found) == {"rule-order"}
    assert "dns-keep, partner-snat, batch-masq" in found["rule-order"][0].message


def test_rule_behind_the_cidr_entries() -> None:
    policy = _rules_policy()
    lines = _dump(policy).splitlines()
    dns = [line for line in lines if "rule dns-keep" in line]
    rest = [line for line in lines if "rule dns-keep" not in line]
    at = next(i for i, line in enumerate(rest) if "-d 10.0.0.0/8" in line) + 1
    found = _findings(policy, "\n".join(rest[:at] + dns + rest[at:]) + "\n")
    assert set(found) == {"rule-order"} and "after the CIDR entries" in found["rule-order"][0].message


def test_foreign_port_rule_shadows_the_snat_rule_for_its_port_only() -> None:
    policy = _rules_policy()
    dump = _dump(policy, before="-A POSTROUTING -d 10.1.0.0/16 -p tcp -m tcp --dport 443 -j MASQUERADE")
    found = _findings(policy, dump)
    assert set(found) == {"foreign-masquerade"}
    (finding,) = found["foreign-masquerade"]
    assert finding.destinations == ("10.1.0.0/16",)
    assert "(tcp port 443)" in finding.message and "POSTROUTING:1 " in finding.message
    assert "rule partner-snat (/c:3: snat to 10.142.0.50)" in finding.message


def test_foreign_source_rule_shadows_the_source_scoped_rule() -> None:
    policy = _rules_policy()
    dump = _dump(policy, before="-A POSTROUTING -s 10.44.8.0/24 -d 10.2.0.0/16 -j RETURN")
    found = _findings(policy, dump)
    assert set(found) == {"jump-shadowed"}
    (finding,) = found["jump-shadowed"]
    assert finding.destinations == ("10.2.0.0/16",) and "from 10.44.8.0/24" in finding.message
    assert "rule batch-masq" in finding.message


def test_foreign_rule_behind_ours_nats_what_dns_keep_preserves() -> None:
    policy = _rules_policy()
    dump = _dump(policy, after="-A POSTROUTING -p udp -m multiport --dports 50:60 -j MASQUERADE")
    found = _findings(policy, dump)
    assert set(found) == {"foreign-masquerade"}
    (finding,) = found["foreign-masquerade"]
    # the config keeps 10/8 (but batch-masq's part) and 172.16/12, dns-keep keeps 34/8 udp 53: the foreign rule NATs
    # them
    assert set(finding.destinations) == {"10.0.0.0/8", "34.0.0.0/8", "169.254.0.0/16",  # link-local: kept
                                         "172.16.0.0/12"}
    # exact: port 53 is kept for 34/8 too, and batch-masq's sources masquerade 10.2/16 and 10.3.0/24 anyway
    assert ("10.0.0.0/8, 169.254.0.0/16, 172.16.0.0/12 (udp ports 50-52 from all but 10.44.8.0/22; udp ports 54-60"
            in finding.message)
    assert ("10.0.0.0/8, 34.0.0.0/8, 169.254.0.0/16, 172.16.0.0/12 (udp port 53 from all but 10.44.8.0/22)"
            in finding.message)


def test_wrong_snat_address_on_the_node_is_edited() -> None:
    policy = _rules_policy()
    found = _findings(policy, _dump(policy, edit="--to-source 10.142.0.50=>--to-source 10.142.0.51"))
    assert set(found) == {"rule-edited"}


def test_trace_cli_names_the_rule_and_the_source_seen(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dump = tmp_path / "node.save"
    dump.write_text(_dump(_rules_policy()))
    assert main(["trace", "10.1.0.9", "--source", "10.44.0.1", "--protocol", "tcp", "--port", "8080", "--dump",
                 str(dump), "--local-address", NODE, "-o", "json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["source_seen"] == "10.142.0.50" and document["decided_by_name"] == "rule partner-snat"
    assert main(["trace", "10.1.0.9", "--source", "10.44.0.1", "--dump", str(dump)]) == 1
    assert "give --protocol" in capsys.readouterr().out
    assert main(["trace", "10.1.0.9", "--source", "10.44.0.1", "--port", "80", "--dump", str(dump)]) == 2
    assert "--port and --source-port need --protocol" in capsys.readouterr().err
    assert main(["trace", "8.8.8.8", "--source", "10.44.0.1", "--protocol", "icmp", "--dump", str(dump),
                 "--local-address", NODE]) == 0
    assert f"the destination sees {NODE}; decided by: IP-MASQ-AGENT:" in capsys.readouterr().out


def test_the_traffic_no_rule_names_a_protocol_of_is_said_as_such_and_others_by_name() -> None:
    head = (":PREROUTING ACCEPT [0:0]\n:INPUT ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\n:POSTROUTING ACCEPT [0:0]\n"
            ":IP-MASQ-AGENT - [0:0]\n")
    ours = render_restore(policy_of("", PolicyOptions()), Family.V4).split("\n", 2)[2].rsplit("COMMIT", 1)[0]
    cases = (("tcp", "protocols other than tcp"), ("47", "protocols other than gre"))
    for foreign, said in ((f"-A POSTROUTING -d 10.0.0.0/8 -p {proto} -j RETURN\n", words) for proto, words in cases):
        text = "*nat\n" + head + foreign + "-A POSTROUTING -d 10.0.0.0/8 -j MASQUERADE\n" + ours + "COMMIT\n"
        report = check_iptables(policy_of("", PolicyOptions()), parse_save(text), Family.V4)
        (finding,) = report.findings
        assert finding.id is FindingId.FOREIGN_MASQUERADE and f"10.0.0.0/8 ({said})" in finding.message, finding
        assert "253" not in finding.message
