"""check and trace over `nft -j list ruleset` of a node where kube-proxy runs in nftables mode.

The input: the agent's table as the fake nft lists it, plus kube-proxy 1.37's tables as the real nft lists them
(tests/dumps/kube-proxy-nftables.json; the kernel tests prove it is nft's listing of kube-proxy-nftables.nft).
kube-proxy's nat-postrouting shares priority 100 with the agent's chain (and with iptables' nat POSTROUTING), and
masquerades what it marked 0x4000 and an endpoint reaching itself through its Service (`ct status dnat` and the
hairpin-connections set).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ipmasq.cli import main
from ipmasq.diagnose.check import FindingId
from ipmasq.diagnose.check_iptables import check_iptables
from ipmasq.diagnose.check_nft import check_nft
from ipmasq.diagnose.hooks import NatHook, walk_hooks
from ipmasq.diagnose.trace import Step, TraceResult
from ipmasq.diagnose.trace_nft import NftTracer
from ipmasq.netfilter.iptables import NatTable, parse_save, render_restore
from ipmasq.netfilter.nft import render_script
from ipmasq.netfilter.nft_json import parse_list_json, rule_from_json
from ipmasq.options import PolicyOptions
from ipmasq.policy.packet import Outcome, Packet
from ipmasq.policy.policy import Policy
from ipmasq.prefix import Family, parse_cidr
from ipmasq.testing.nft import FakeNft
from tests.configs import policy_of
from tests.conftest import ROOT

DUMPS = ROOT / "tests" / "dumps"
KUBE_PROXY = [o for o in json.loads((DUMPS / "kube-proxy-nftables.json").read_text())["nftables"]
              if "metainfo" not in o]
PODS = (parse_cidr("10.244.0.0/16"), parse_cidr("fd00:10:244::/56"))
POD, ENDPOINT, CLIENT = "10.244.2.6", "10.244.1.5", "192.168.0.1"
SNAT_CONFIG = """\
nonMasqueradeCIDRs: [10.0.0.0/8]
rules:
  - name: partner-snat
    destinations: [198.51.100.0/24]
    action: snat
    snatTo: 192.168.0.50
"""


def _listing(policy: Policy, *, kube_proxy_first: bool = False) -> str:
    nft = FakeNft()
    assert nft(["nft", "-f", "-"], render_script(policy)).returncode == 0
    ours = json.loads(nft(["nft", "-j", "list", "ruleset"]).stdout)["nftables"]
    return json.dumps({"nftables": [*KUBE_PROXY, *ours] if kube_proxy_first else [*ours, *KUBE_PROXY]})


def _policy(text: str = "nonMasqueradeCIDRs: [10.0.0.0/8]\n", **options: Any) -> Policy:
    return policy_of(text, PolicyOptions(**options))


def _service(destination: str, source: str, *, mark: int = 0x4000, port: int = 8080) -> Packet:
    return Packet.of(destination, source=source, protocol="tcp", port=port, mark=mark, dnat=True)


@pytest.mark.parametrize("enable_ipv6", [False, True])
@pytest.mark.parametrize("kube_proxy_first", [False, True])
def test_check_finds_nothing_beside_kube_proxy(enable_ipv6: bool, kube_proxy_first: bool) -> None:
    for policy in (_policy(enable_ipv6=enable_ipv6), policy_of(SNAT_CONFIG, PolicyOptions(enable_ipv6=enable_ipv6))):
        text = _listing(policy, kube_proxy_first=kube_proxy_first)
        assert check_nft(policy, parse_list_json(text), ruleset=text, pod_ranges=PODS).findings == ()


def test_pod_egress_is_the_agents_decision_and_kube_proxy_hands_it_on() -> None:
    tracer = NftTracer(_listing(_policy()))
    internet = tracer.trace(Packet.of("203.0.113.10", source=POD))
    assert internet.outcome is Outcome.MASQUERADE and internet.decided_in == "inet ip-masq-agent postrouting"
    assert internet.chains == ("inet ip-masq-agent postrouting", "ip kube-proxy nat-postrouting",
                               "ip kube-proxy masquerading")
    (note,) = internet.notes
    assert "share priority 100" in note and "only inet ip-masq-agent postrouting NATs" in note
    kept = tracer.trace(Packet.of("10.20.0.5", source=POD))
    assert kept.outcome is Outcome.PRESERVE and kept.notes == ()
    assert [s.matched for s in kept.steps if s.chain == "ip kube-proxy masquerading"] == [False, False]


def test_marked_service_traffic_is_kube_proxys_masquerade() -> None:
    tracer = NftTracer(_listing(_policy()))
    nodeport = tracer.trace(_service(ENDPOINT, CLIENT))
    assert nodeport.outcome is Outcome.MASQUERADE
    assert nodeport.decided_label is not None and nodeport.decided_label.startswith("ip kube-proxy masquerading handle")
    assert nodeport.decided_by == ("ip kube-proxy masquerading: meta mark & 0x00004000 != 0x00000000 "
                                   "meta mark set meta mark ^ 0x00004000 masquerade fully-random")
    assert nodeport.mark == 0  # kube-proxy clears its bit as it masquerades
    # not marked (a pod reaching a ClusterIP from inside the cluster CIDR): the agent's decision, unchanged
    assert tracer.trace(_service(ENDPOINT, POD, mark=0)).outcome is Outcome.PRESERVE
    # other bits of the mark do not count, the bit alone does
    assert tracer.trace(_service(ENDPOINT, CLIENT, mark=0x4001)).outcome is Outcome.MASQUERADE
    assert tracer.trace(_service(ENDPOINT, CLIENT, mark=0x8000)).outcome is Outcome.PRESERVE


def test_both_masquerade_a_marked_packet_the_agent_masquerades_too() -> None:
    result = NftTracer(_listing(_policy())).trace(_service("203.0.113.10", CLIENT))
    assert result.outcome is Outcome.MASQUERADE
    (note,) = result.notes
    assert note.startswith("ip kube-proxy nat-postrouting (same priority 100) would masquerade it too")


def test_an_snat_rule_against_kube_proxys_masquerade_at_the_same_priority_cannot_be_decided() -> None:
    tracer = NftTracer(_listing(policy_of(SNAT_CONFIG, PolicyOptions())))
    unmarked = tracer.trace(Packet.of("198.51.100.7", source=POD))
    assert unmarked.outcome is Outcome.SNAT and unmarked.snat_to == "192.168.0.50"
    marked = tracer.trace(_service("198.51.100.7", CLIENT))
    assert marked.outcome is Outcome.UNDECIDED and marked.undecided_reason is not None
    assert "chains of the same priority 100 NAT this packet differently" in marked.undecided_reason
    assert "snat to 192.168.0.50 (rule partner-snat)" in marked.undecided_reason
    assert "ip kube-proxy nat-postrouting: masquerade" in marked.undecided_reason


def test_hairpin_an_endpoint_reaching_itself_through_its_service() -> None:
    tracer = NftTracer(_listing(_policy()))
    hairpin = tracer.trace(_service(ENDPOINT, ENDPOINT, mark=0))
    assert hairpin.outcome is Outcome.MASQUERADE and "@hairpin-connections" in (hairpin.decided_by or "")
    # the set holds tcp port 8080 only; without --service the connection was not DNATed: no hairpin
    assert tracer.trace(_service(ENDPOINT, ENDPOINT, mark=0, port=80)).outcome is Outcome.PRESERVE
    assert tracer.trace(Packet.of(ENDPOINT, source=ENDPOINT, protocol="tcp", port=8080)).outcome is Outcome.PRESERVE
    v6 = tracer.trace(_service("fd00:10:244:1::5", "fd00:10:244:1::5", mark=0))
    assert v6.outcome is Outcome.MASQUERADE and v6.decided_in == "ip6 kube-proxy masquerading"
    # what the set needs and the packet description lacks is named, not guessed
    unknown = tracer.trace(Packet(Packet.of(ENDPOINT).family, Packet.of(ENDPOINT).destination, (PODS[0],), "tcp",
                                  8080, dnat=True))
    assert unknown.outcome is Outcome.UNDECIDED and "not one address" in (unknown.undecided_reason or "")
    no_port = tracer.trace(Packet.of(ENDPOINT, source=ENDPOINT, protocol="tcp", dnat=True))
    assert no_port.outcome is Outcome.UNDECIDED and "give --port" in (no_port.undecided_reason or "")


def test_rule_text_is_nft_s_own() -> None:
    """Every rule of kube-proxy's listing reads as `nft list ruleset` prints it (the .nft fixture is its output)."""
    printed = {line.strip() for line in (DUMPS / "kube-proxy-nftables.nft").read_text().splitlines()}
    nat = {"nat-postrouting", "masquerading"}
    texts = [rule_from_json(o["rule"]) for o in KUBE_PROXY if "rule" in o and o["rule"]["chain"] in nat]
    assert len(texts) == 6 and all(text in printed for text in texts), texts


def _hook(priority: int, name: str, outcome: Outcome, *, snat_to: str | None = None,
          mark: int | None = None) -> NatHook:
    def walk(packet: Packet, record_steps: bool) -> TraceResult:
        return TraceResult((Step(name, f"{name} rule", True),), outcome, f"{name} rule", name, snat_to=snat_to,
                           mark=packet.mark if mark is None else mark, chains=(name,), named=name)
    return NatHook(priority, name, walk)


PACKET = Packet.of("8.8.8.8", source=POD)


def test_walk_hooks_lower_priority_first_and_ties_only_when_they_disagree() -> None:
    masq, snat, keep = Outcome.MASQUERADE, Outcome.SNAT, Outcome.PRESERVE
    first = walk_hooks([_hook(100, "late", masq), _hook(50, "early", snat, snat_to="1.2.3.4")], PACKET)
    assert (first.outcome, first.decided_in, first.notes) == (snat, "early", ())
    assert first.chains == ("early",)  # a NAT is final: the later chain never sees the packet
    tie = walk_hooks([_hook(100, "a", snat, snat_to="1.2.3.4"), _hook(100, "b", snat, snat_to="1.2.3.5")], PACKET)
    assert tie.outcome is Outcome.UNDECIDED and tie.chains == ("a", "b")
    same = walk_hooks([_hook(100, "a", snat, snat_to="1.2.3.4"), _hook(100, "b", snat, snat_to="1.2.3.4")], PACKET)
    assert same.outcome is snat and len(same.notes) == 1
    handed = walk_hooks([_hook(100, "a", keep), _hook(100, "b", keep), _hook(200, "c", masq)], PACKET)
    assert handed.outcome is masq and handed.decided_in == "c" and handed.chains == ("a", "b", "c")
    nothing = walk_hooks([_hook(100, "a", keep)], PACKET)
    assert (nothing.outcome, nothing.decided_in) == (keep, "a")
    assert walk_hooks([], PACKET).outcome is keep


def test_walk_hooks_marks_flow_on_and_conflicting_marks_of_a_tie_cannot_be_decided() -> None:
    keep = Outcome.PRESERVE
    seen: list[int] = []

    def recording(packet: Packet, record_steps: bool) -> TraceResult:
        seen.append(packet.mark)
        return TraceResult((), keep, None, None, mark=packet.mark)
    walk_hooks([_hook(10, "marks", keep, mark=0x10), NatHook(20, "reads", recording)], PACKET)
    assert seen == [0x10]
    conflict = walk_hooks([_hook(10, "a", keep, mark=1), _hook(10, "b", keep, mark=2)], PACKET)
    assert conflict.outcome is Outcome.UNDECIDED and "set different marks" in (conflict.undecided_reason or "")


def test_cli_walks_an_iptables_dump_and_kube_proxys_listing_together(tmp_path: Any,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    listing = tmp_path / "ruleset.json"
    listing.write_text(json.dumps({"nftables": KUBE_PROXY}))
    save = str(DUMPS / "gke-kubenet.save")
    args = ["trace", ENDPOINT, "--source", CLIENT, "--protocol", "tcp", "--port", "8080", "--dump", save,
            "--dump", str(listing), "-o", "json"]
    assert main([*args, "--service", "--mark", "0x4000"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["outcome"] == "masqueraded"
    assert {s["chain"] for s in document["steps"]} >= {"POSTROUTING", "ip kube-proxy masquerading"}
    assert any("would masquerade it too" in n for n in document["notes"])
    assert main(args) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["outcome"] == "unchanged"
    assert any("--service --mark 0x4000" in n for n in document["notes"])  # how to trace the Service traffic
    assert main(["trace", ENDPOINT, "--source", CLIENT, "--dump", str(listing), "--dump", str(listing)]) == 2
    assert main(["trace", ENDPOINT, "--source", CLIENT, "--dump", save, "--dump", save]) == 2
    assert main(["trace", ENDPOINT, "--source", CLIENT, "--dump", save, "--dump", save, "--dump", save]) == 2
    capsys.readouterr()


_PIECES: list[Any] = [
    {"ct": {"key": "status"}}, {"ct": {"key": "state"}}, {"ct": "status"}, {"ct": {"key": "mark", "dir": 1}},
    "dnat", "new", "expected", ["dnat", "snat"], ["established", 3], {"set": ["dnat"]}, 0, 16384, -1, None,
    {"concat": [{"payload": {"protocol": "ip", "field": "saddr"}}, {"meta": {"key": "l4proto"}}]},
    {"concat": []}, {"concat": "x"}, "@hairpin-connections", "@missing", {"set": [{"concat": ["10.244.1.5", "tcp"]}]},
    {"set": [{"concat": [{"prefix": {"addr": "10.0.0.0", "len": 8}}, {"range": ["tcp", "udp"]}]}]},
    {"^": [{"meta": {"key": "mark"}}, 16384]}, {"%": [{"meta": {"key": "mark"}}, 1]}, {"|": [1, 2]},
    {"meta": {"key": "mark"}}, {"&": [{"meta": {"key": "mark"}}, "x"]}, {"&": []}, {"^": "mark"},
]
_OPS = ["==", "!=", "in", "<", None]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["match", "mangle", "masquerade"]), st.sampled_from(_PIECES),
                          st.sampled_from(_PIECES), st.sampled_from(_OPS)), min_size=1, max_size=4))
def test_any_shape_of_ct_concat_and_mark_ends_in_an_answer(statements: list[tuple[str, Any, Any, Any]]) -> None:
    expr: list[Any] = []
    for kind, left, right, op in statements:
        if kind == "match":
            expr.append({"match": {"op": op, "left": left, "right": right}})
        elif kind == "mangle":
            expr.append({"mangle": {"key": {"meta": {"key": "mark"}}, "value": right}})
        else:
            expr.append({"masquerade": left if isinstance(left, dict) else None})
    objects = [o for o in KUBE_PROXY if not ("rule" in o and o["rule"]["chain"] == "masquerading")]
    objects.append({"rule": {"family": "ip", "table": "kube-proxy", "chain": "masquerading", "handle": 99,
                             "expr": expr}})
    tracer = NftTracer(json.dumps({"nftables": objects}))
    packets: list[Callable[[], Packet]] = [
        lambda: _service(ENDPOINT, ENDPOINT), lambda: Packet.of(ENDPOINT, source=POD),
        lambda: Packet(PACKET.family, PACKET.destination, (PODS[0],), dnat=True)]
    for make in packets:
        result = tracer.trace(make())
        assert result.outcome in (Outcome.PRESERVE, Outcome.MASQUERADE, Outcome.UNDECIDED)
        rule_from_json(objects[-1]["rule"])  # the text of any shape: nft's, or "unrecognised: ..."


# --- the agent on iptables: check walks the nftables nat chains beside iptables' nat POSTROUTING ---------------

HANDWRITTEN = [{"table": {"family": "ip", "name": "handwritten", "handle": 9}},
               {"chain": {"family": "ip", "table": "handwritten", "name": "post", "handle": 1, "type": "nat",
                          "hook": "postrouting", "prio": 100, "policy": "accept"}},
               {"rule": {"family": "ip", "table": "handwritten", "chain": "post", "handle": 2, "expr": [
                   {"match": {"op": "==", "left": {"payload": {"protocol": "ip", "field": "daddr"}},
                              "right": {"prefix": {"addr": "10.20.0.0", "len": 16}}}},
                   {"masquerade": None}]}}]


def _iptables_node(policy: Policy) -> NatTable:
    return parse_save(render_restore(policy, Family.V4))


def test_check_on_iptables_walks_kube_proxys_nftables_chains_beside_and_finds_nothing() -> None:
    for policy in (_policy(), policy_of(SNAT_CONFIG, PolicyOptions())):
        beside = NftTracer(json.dumps({"nftables": KUBE_PROXY}))
        report = check_iptables(policy, _iptables_node(policy), Family.V4, pod_ranges=PODS[:1], beside=beside)
        assert report.findings == ()


def test_check_on_iptables_names_an_nftables_masquerade_beside_it() -> None:
    policy = _policy()
    beside = NftTracer(json.dumps({"nftables": [*KUBE_PROXY, *HANDWRITTEN]}))
    report = check_iptables(policy, _iptables_node(policy), Family.V4, pod_ranges=PODS[:1], beside=beside)
    (finding,) = report.findings
    assert finding.id is FindingId.FOREIGN_MASQUERADE and finding.destinations == ("10.20.0.0/16",)
    assert "ip handwritten post handle 2" in finding.message
    assert "nft delete rule ip handwritten post handle 2" in finding.hint


def test_check_cli_takes_an_iptables_dump_and_a_listing_of_one_node(tmp_path: Any,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    policy = _policy()
    save = tmp_path / "nat.save"
    save.write_text(render_restore(policy, Family.V4))
    config = tmp_path / "config.yaml"
    config.write_text("nonMasqueradeCIDRs: [10.0.0.0/8]\n")
    clean, dirty = tmp_path / "clean.json", tmp_path / "dirty.json"
    clean.write_text(json.dumps({"nftables": KUBE_PROXY}))
    dirty.write_text(json.dumps({"nftables": [*KUBE_PROXY, *HANDWRITTEN]}))
    base = ["check", "--config", str(config), "--pod-range", "10.244.0.0/16", "-o", "json", "--from-dump", str(save)]
    assert main([*base, "--from-dump", str(clean)]) == 0
    assert json.loads(capsys.readouterr().out) == {
        "apiVersion": "ipmasq.io/v1", "kind": "CheckReport", "ok": True, "findings": []}
    assert main([*base, "--from-dump", str(dirty)]) == 1
    (finding,) = json.loads(capsys.readouterr().out)["findings"]
    assert finding["id"] == "foreign-masquerade" and finding["destinations"] == ["10.20.0.0/16"]
    assert main([*base, "--from-dump", str(save)]) == 2  # two of one kind
    assert main([*base, "--from-dump", str(clean), "--from-dump", str(dirty)]) == 2  # three
    capsys.readouterr()
