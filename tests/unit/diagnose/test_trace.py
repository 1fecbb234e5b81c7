"""trace: the walk through POSTROUTING over dumps of real nodes, and "cannot decide" instead of a guess."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ipmasq.cli import main
from ipmasq.diagnose.trace import Tracer, trace
from ipmasq.netfilter.iptables import parse_save
from ipmasq.policy.packet import Outcome, Packet
from tests.conftest import ROOT

DUMPS = ROOT / "tests" / "dumps"
POD, NODE = "10.44.14.15", "10.142.15.203"


def _dump(name: str) -> str:
    return (DUMPS / name).read_text()


def _trace(name: str, dest: str, **kw: object) -> tuple[Outcome, str | None, str | None]:
    packet = Packet.of(dest, source=kw.pop("source", POD), local_addresses=[NODE], **kw)  # type: ignore[arg-type]
    result = trace(parse_save(_dump(name)), packet)
    return result.outcome, result.decided_by, result.source_seen(packet, masquerade_address=NODE)


def test_gke_1_14_chain_keeps_the_pod_ip_for_the_aws_vpc() -> None:
    outcome, rule, seen = _trace("gke-1.14-aws-vpn.save", "172.30.12.110")
    assert outcome is Outcome.PRESERVE and seen == POD
    assert rule is not None and "-d 172.16.0.0/12" in rule and "-j RETURN" in rule  # the RETURN, then the policy


def test_catch_all_masquerades_the_internet() -> None:
    outcome, rule, seen = _trace("gke-1.14-aws-vpn.save", "8.8.8.8")
    assert outcome is Outcome.MASQUERADE and seen == NODE
    assert rule is not None and rule.startswith("-A IP-MASQ -m comment")


def test_kubenet_rule_after_our_return_masquerades() -> None:
    outcome, rule, _ = _trace("gke-kubenet.save", "172.30.12.110")
    assert outcome is Outcome.MASQUERADE and rule is not None and "kubenet" in rule
    assert _trace("gke-kubenet.save", "10.2.1.100")[0] is Outcome.PRESERVE


def test_node_local_destination_skips_our_chain() -> None:
    packet = Packet.of(NODE, source=POD, local_addresses=[NODE])
    result = trace(parse_save(_dump("gke-1.14-aws-vpn.save")), packet)
    assert result.outcome is Outcome.PRESERVE
    assert [s.matched for s in result.steps] == [False]  # the jump's ! --dst-type LOCAL fails


def test_kube_proxy_mark_and_return() -> None:
    # a service-hairpin packet (mark 0x4000) is masqueraded by KUBE-POSTROUTING whatever the destination
    outcome, rule, _ = _trace("gke-kubenet.save", "10.2.1.100", mark=0x4000)
    assert outcome is Outcome.MASQUERADE and rule is not None and "KUBE-POSTROUTING" in rule


def test_fix_nat_daemonset_rule() -> None:
    assert _trace("fix-nat-daemonset.save", "10.11.0.5")[0] is Outcome.MASQUERADE
    assert _trace("fix-nat-daemonset.save", "10.12.0.5")[0] is Outcome.PRESERVE


def test_hand_written_rule_source_condition() -> None:
    assert _trace("manual-private-endpoint.save", "10.1.2.100", source="100.64.3.4")[0] is Outcome.MASQUERADE
    # same destination, a source outside -s 100.64.0.0/16: GKE's chain keeps it (10.0.0.0/8)
    assert _trace("manual-private-endpoint.save", "10.1.2.100", source=POD)[0] is Outcome.PRESERVE


def test_snat_target() -> None:
    dump = "*nat\n:POSTROUTING ACCEPT [0:0]\n:X - [0:0]\n-A POSTROUTING -j X\n" \
           "-A X -d 10.9.0.0/16 -j SNAT --to-source 10.142.15.9:1024-65535\nCOMMIT\n"
    packet = Packet.of("10.9.1.1", source=POD)
    result = trace(parse_save(dump), packet)
    assert result.outcome is Outcome.SNAT and result.source_seen(packet, masquerade_address=None) == "10.142.15.9"


def test_goto_returns_past_the_caller() -> None:
    dump = ("*nat\n:POSTROUTING ACCEPT [0:0]\n:A - [0:0]\n:B - [0:0]\n-A POSTROUTING -j A\n"
            "-A POSTROUTING -j MASQUERADE\n-A A -g B\n-A A -j ACCEPT\n-A B -j RETURN\nCOMMIT\n")
    result = trace(parse_save(dump), Packet.of("1.1.1.1", source=POD))
    # RETURN from B (reached by -g) resumes POSTROUTING, not A: A's ACCEPT is skipped
    assert result.outcome is Outcome.MASQUERADE
    assert [s.chain for s in result.steps] == ["POSTROUTING", "A", "B", "POSTROUTING"]


@pytest.mark.parametrize(("rule", "why"), [
    ("-A POSTROUTING -o eth0 -j MASQUERADE", "interface"),
    ("-A POSTROUTING -p tcp -m tcp --dport 443 -j MASQUERADE", "give --protocol"),
    ("-A POSTROUTING -m statistic --mode random --probability 0.5 -j MASQUERADE", "-m statistic"),
    ("-A POSTROUTING -j CONNMARK --set-mark 1", "CONNMARK"),
    ("-A POSTROUTING -m addrtype --dst-type UNICAST -j MASQUERADE", "addrtype"),
])
def test_cannot_decide_instead_of_guessing(rule: str, why: str) -> None:
    dump = f"*nat\n:POSTROUTING ACCEPT [0:0]\n{rule}\nCOMMIT\n"
    result = trace(parse_save(dump), Packet.of("1.1.1.1", source=POD))
    assert result.outcome is Outcome.UNDECIDED
    assert result.undecided_reason is not None and why in result.undecided_reason
    assert result.decided_by == parse_save(dump).rules[0]


def test_a_condition_that_surely_fails_decides_despite_an_unknown_one() -> None:
    dump = "*nat\n:POSTROUTING ACCEPT [0:0]\n-A POSTROUTING -d 10.0.0.0/8 -o eth0 -j MASQUERADE\nCOMMIT\n"
    assert trace(parse_save(dump), Packet.of("1.1.1.1", source=POD)).outcome is Outcome.PRESERVE
    assert trace(parse_save(dump), Packet.of("10.1.1.1", source=POD)).outcome is Outcome.UNDECIDED
    assert trace(parse_save(dump), Packet.of("10.1.1.1", source=POD, out_interface="eth1")).outcome \
        is Outcome.PRESERVE


def test_loop_is_reported() -> None:
    dump = ("*nat\n:POSTROUTING ACCEPT [0:0]\n:A - [0:0]\n:B - [0:0]\n-A POSTROUTING -j A\n-A A -j B\n-A B -j A\n"
            "COMMIT\n")
    result = trace(parse_save(dump), Packet.of("1.1.1.1", source=POD))
    assert result.outcome is Outcome.UNDECIDED and "loops" in (result.undecided_reason or "")


def test_goto_loop_is_reported_not_walked_forever() -> None:
    dump = ("*nat\n:POSTROUTING ACCEPT [0:0]\n:A - [0:0]\n:B - [0:0]\n-A POSTROUTING -j A\n-A A -g B\n-A B -g A\n"
            "COMMIT\n")
    result = trace(parse_save(dump), Packet.of("1.1.1.1", source=POD))
    assert result.outcome is Outcome.UNDECIDED
    assert (result.undecided_reason or "").startswith("loop: chain A loops back into itself (A -> B -> A)")


def test_a_chain_that_jumps_to_itself_is_a_loop() -> None:
    dump = "*nat\n:POSTROUTING ACCEPT [0:0]\n:A - [0:0]\n-A POSTROUTING -j A\n-A A -d 9.9.9.9/32 -j A\nCOMMIT\n"
    result = trace(parse_save(dump), Packet.of("1.1.1.1", source=POD))
    assert result.outcome is Outcome.UNDECIDED and "(A -> A)" in (result.undecided_reason or "")


def test_a_5000_deep_chain_of_jumps_is_followed_to_the_end() -> None:
    depth = 5000
    lines = ["*nat", ":POSTROUTING ACCEPT [0:0]", *(f":C{i} - [0:0]" for i in range(depth)), "-A POSTROUTING -j C0"]
    lines += [f"-A C{i} -j C{i + 1}" for i in range(depth - 1)]
    lines += [f"-A C{depth - 1} -j MASQUERADE", "COMMIT"]
    result = trace(parse_save("\n".join(lines) + "\n"), Packet.of("1.1.1.1", source=POD))
    assert result.outcome is Outcome.MASQUERADE and result.decided_in == f"C{depth - 1}"
    assert len(result.chains) == depth + 1


def test_an_exponential_walk_stops_at_the_depth_limit() -> None:
    # each chain calls the next twice: 2^40 rules to walk, no loop; the budget turns it into "depth limit"
    depth = 40
    lines = ["*nat", ":POSTROUTING ACCEPT [0:0]", *(f":C{i} - [0:0]" for i in range(depth)), "-A POSTROUTING -j C0"]
    for i in range(depth - 1):
        lines += [f"-A C{i} -j C{i + 1}", f"-A C{i} -j C{i + 1}"]
    lines += [f"-A C{depth - 1} -d 9.9.9.9/32 -j MASQUERADE", "COMMIT"]
    result = trace(parse_save("\n".join(lines) + "\n"), Packet.of("1.1.1.1", source=POD))
    assert result.outcome is Outcome.UNDECIDED and (result.undecided_reason or "").startswith("depth limit")


def test_check_mode_lookup_agrees_with_the_rule_by_rule_walk() -> None:
    # chains that test only destinations are looked up, not walked, when steps are not recorded: same answers
    rules = [f"-A IP-MASQ -d 10.{i}.0.0/16 -j RETURN" for i in range(0, 200, 3)]
    rules += ["-A IP-MASQ -d 10.0.0.0/8 -j MASQUERADE", "-A IP-MASQ -d 172.16.0.0/12 -j RETURN",
              "-A IP-MASQ -j MASQUERADE"]
    dump = "\n".join(["*nat", ":POSTROUTING ACCEPT [0:0]", ":IP-MASQ - [0:0]", "-A POSTROUTING -j IP-MASQ", *rules,
                      "COMMIT"]) + "\n"
    tracer = Tracer(parse_save(dump))
    for destination in ("10.0.0.1", "10.3.9.9", "10.4.0.1", "10.199.255.255", "172.20.0.1", "8.8.8.8", "10.198.0.0"):
        packet = Packet.of(destination, source=POD)
        walked, looked_up = tracer.trace(packet), tracer.trace(packet, record_steps=False)
        assert (looked_up.outcome, looked_up.decided_by) == (walked.outcome, walked.decided_by), destination
        assert looked_up.steps == () and looked_up.chains == walked.chains == ("POSTROUTING", "IP-MASQ")


def test_cli_json_contract(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["trace", "172.30.12.110", "--source", POD, "--dump", str(DUMPS / "gke-kubenet.save"),
                 "--local-address", NODE, "-o", "json"])
    document = json.loads(capsys.readouterr().out)
    assert code == 0
    assert document["outcome"] == "masqueraded" and document["source_seen"] == NODE
    assert {"chain", "rule", "matched"} <= set(document["steps"][0])
    assert document["steps"][-1]["matched"] is True


def test_cli_cannot_decide_exits_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dump = tmp_path / "d.save"
    dump.write_text("*nat\n:POSTROUTING ACCEPT [0:0]\n-A POSTROUTING -o eth0 -j MASQUERADE\nCOMMIT\n")
    assert main(["trace", "1.1.1.1", "--source", POD, "--dump", str(dump)]) == 1
    assert "CANNOT DECIDE" in capsys.readouterr().out


def test_cli_bad_dump_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dump = tmp_path / "d.save"
    dump.write_text("*nat\n:POSTROUTING ACCEPT [0:0]\n-A POSTROUTING -j \"unterminated\nCOMMIT\n")
    assert main(["trace", "1.1.1.1", "--source", POD, "--dump", str(dump)]) == 3  # could not read it
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(dump) in err and "line 3" in err
