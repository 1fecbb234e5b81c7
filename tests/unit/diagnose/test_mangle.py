"""The mangle walk: the marks a pod's new connection carries into the routing decision, iptables and nftables."""

from __future__ import annotations

import json

from ipmasq.diagnose.mangle import walk_mangle
from ipmasq.netfilter.iptables import parse_save
from ipmasq.policy.packet import Packet
from tests.conftest import ROOT

# AWS VPC CNI's mangle rules (pkg/networkutils: connmark on the primary ENI, restored on the pod side) and a mark
MANGLE = """\
*mangle
:PREROUTING ACCEPT [0:0]
:INPUT ACCEPT [0:0]
:FORWARD ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
:POSTROUTING ACCEPT [0:0]
:MARKS - [0:0]
-A PREROUTING -i eth0 -m comment --comment "AWS, primary ENI" -m addrtype --dst-type LOCAL --limit-iface-in \
-j CONNMARK --set-xmark 0x80/0x80
-A PREROUTING -i vlan+ -m comment --comment "AWS, primary ENI" -j CONNMARK --restore-mark --nfmask 0x80 --ctmask 0x80
-A PREROUTING -i veth+ -m comment --comment "AWS, container-side" -j CONNMARK --restore-mark --nfmask 0x80 --ctmask 0x80
-A PREROUTING -s 10.44.0.0/14 -j MARKS
-A MARKS -p tcp -m tcp --dport 5432 -j MARK --set-xmark 0x80/0x80
-A MARKS -m conntrack --ctstate NEW -j CONNMARK --save-mark --nfmask 0xffffffff --ctmask 0xffffffff
-A MARKS -m connmark --mark 0x80/0x80 -j MARK --set-xmark 0x1/0x1
COMMIT
"""


def _packet(port: int | None = 5432, protocol: str | None = "tcp", **more: object) -> Packet:
    return Packet.of("198.51.100.10", source="10.44.0.5", protocol=protocol, port=port, in_interface="veth1",
                     **more)  # type: ignore[arg-type]


def test_iptables_marks_connmark_save_and_match() -> None:
    result = walk_mangle(parse_save(MANGLE, "mangle"), None, _packet())
    assert result.undecided is None and result.mark == 0x81 and result.ct_mark == 0x80
    assert any("CONNMARK --restore-mark" in s.decided_by and "0x0 -> 0x0" in s.result for s in result.steps)
    assert [s.result for s in result.steps][-1] == "mark 0x80 -> 0x81"
    other = walk_mangle(parse_save(MANGLE, "mangle"), None, _packet(port=80))
    assert other.mark == 0 and other.undecided is None


def test_a_field_not_given_is_named_and_a_sure_miss_still_decides() -> None:
    result = walk_mangle(parse_save(MANGLE, "mangle"), None, _packet(port=None))
    assert result.undecided is not None and "--port" in result.undecided
    # the first rule's --limit-iface-in cannot be read, but -i eth0 surely fails for the pod's packet
    assert walk_mangle(parse_save(MANGLE, "mangle"), None, _packet()).undecided is None


def test_a_match_on_a_socket_stops_the_walk() -> None:
    table = parse_save("*mangle\n:PREROUTING ACCEPT [0:0]\n-A PREROUTING -m socket --transparent -j MARK "
                       "--set-xmark 0x1/0xffffffff\nCOMMIT\n", "mangle")
    result = walk_mangle(table, None, _packet())
    assert result.undecided is not None and "-m socket" in result.undecided


def test_drop_is_said() -> None:
    table = parse_save("*mangle\n:PREROUTING ACCEPT [0:0]\n-A PREROUTING -d 198.51.100.10/32 -j DROP\nCOMMIT\n",
                       "mangle")
    assert walk_mangle(table, None, _packet()).dropped is not None


def _nft(*rules: list[object], prio: int = -150, family: str = "inet") -> str:
    items: list[object] = [{"metainfo": {"json_schema_version": 1}},
                           {"table": {"family": family, "name": "t", "handle": 1}},
                           {"chain": {"family": family, "table": "t", "name": "pre", "handle": 1, "type": "filter",
                                      "hook": "prerouting", "prio": prio, "policy": "accept"}}]
    items += [{"rule": {"family": family, "table": "t", "chain": "pre", "handle": 10 + i, "expr": expr}}
              for i, expr in enumerate(rules)]
    return json.dumps({"nftables": items})


MARK = {"meta": {"key": "mark"}}
CT_MARK = {"ct": {"key": "mark"}}


def test_nftables_meta_and_ct_marks() -> None:
    ruleset = _nft(
        [{"match": {"op": "==", "left": {"payload": {"protocol": "tcp", "field": "dport"}}, "right": 5432}},
         {"mangle": {"key": MARK, "value": {"|": [MARK, 128]}}}],
        [{"mangle": {"key": CT_MARK, "value": MARK}}],
        [{"match": {"op": "==", "left": CT_MARK, "right": 128}}, {"mangle": {"key": MARK, "value": {"|": [MARK, 1]}}}],
        [{"mangle": {"key": MARK, "value": CT_MARK}}])
    result = walk_mangle(None, ruleset, _packet())
    assert result.undecided is None and (result.mark, result.ct_mark) == (0x80, 0x80)  # the restore undoes bit 1
    assert all("handle" in s.decided_by for s in result.steps)
    assert walk_mangle(None, ruleset, _packet(port=80)).mark == 0


def test_nftables_unknown_statement_and_iptables_beside() -> None:
    ruleset = _nft([{"tproxy": {"port": 1}}])
    result = walk_mangle(None, ruleset, _packet())
    assert result.undecided is not None and "tproxy" in result.undecided
    # iptables-nft's own mangle table in the listing is walked through iptables-save only
    beside = _nft([{"xt": {"type": "target", "name": "MARK"}}], family="ip")
    beside = beside.replace('"name": "t"', '"name": "mangle"').replace('"table": "t"', '"table": "mangle"')
    assert walk_mangle(parse_save(MANGLE, "mangle"), beside, _packet(), iptables_in_nft=True).undecided is None


def test_kube_proxys_prerouting_maps_are_looked_up() -> None:
    listing = (ROOT / "tests" / "dumps" / "kube-proxy-nftables.json").read_text()
    for destination in ("10.96.0.10", "198.51.100.10"):  # a ClusterIP and elsewhere: firewall-ips is empty
        # traced as Service traffic (DEST the endpoint, --service): nat prerouting already ran, only filter here
        result = walk_mangle(None, listing, Packet.of(destination, source="10.244.1.5", protocol="tcp", port=80,
                                                      in_interface="cni0", dnat=True))
        assert result.undecided is None and result.dropped is None and result.mark == 0
    elsewhere = walk_mangle(None, listing, Packet.of("198.51.100.10", source="10.244.1.5", protocol="tcp", port=80,
                                                     in_interface="cni0"))
    assert elsewhere.undecided is None and elsewhere.mark == 0  # kube-proxy's nat prerouting: no Service there
    # a pod connecting to the ClusterIP itself: kube-proxy's nat prerouting DNATs it, and the walk says to trace
    # the endpoint with --service rather than answer for an address the packet does not keep
    service = walk_mangle(None, listing, Packet.of("10.96.0.10", source="10.244.1.5", protocol="tcp", port=80,
                                                   in_interface="cni0"))
    assert service.undecided is not None and "DNATed" in service.undecided and "--service" in service.undecided
    # no --protocol or --port: a destination no Service has surely misses every element of kube-proxy's maps, while
    # the ClusterIP's element then needs the port to be told
    bare = walk_mangle(None, listing, Packet.of("198.51.100.10", source="10.244.1.5", in_interface="cni0"))
    assert bare.undecided is None and bare.mark == 0
    unknown = walk_mangle(None, listing, Packet.of("10.96.0.10", source="10.244.1.5", protocol="tcp",
                                                   in_interface="cni0"))
    assert unknown.undecided is not None and "--port" in unknown.undecided
    key = {"concat": [{"payload": {"protocol": "ip", "field": "daddr"}}, {"meta": {"key": "l4proto"}},
                      {"payload": {"protocol": "th", "field": "dport"}}]}
    elements = [[{"concat": ["198.51.100.10", "tcp", 5432]}, {"drop": None}]]
    ruleset = _nft([{"vmap": {"key": key, "data": {"set": elements}}}], family="ip")
    assert walk_mangle(None, ruleset, _packet()).dropped is not None
    assert walk_mangle(None, ruleset, _packet(port=80)).dropped is None


# AWS VPC CNI's nat part (buildIptablesConnmarkRules): a new connection from a pod to outside the VPC gets connmark
# 0x80 in nat PREROUTING, restored there into the packet's mark, which ip rule 1024 routes through the main table
CONNMARK_NAT = """\
*nat
:PREROUTING ACCEPT [0:0]
:POSTROUTING ACCEPT [0:0]
:AWS-CONNMARK-CHAIN-0 - [0:0]
:SERVICES - [0:0]
-A PREROUTING -i eni+ -m comment --comment "AWS, outbound connections" -j AWS-CONNMARK-CHAIN-0
-A PREROUTING -m comment --comment "AWS, CONNMARK" -j CONNMARK --restore-mark --nfmask 0x80 --ctmask 0x80
-A PREROUTING -j SERVICES
-A AWS-CONNMARK-CHAIN-0 -d 192.168.0.0/16 -m comment --comment "AWS CONNMARK CHAIN, VPC CIDR" -j RETURN
-A AWS-CONNMARK-CHAIN-0 -m comment --comment "AWS, CONNMARK" -j CONNMARK --set-xmark 0x80/0x80
-A SERVICES -d 10.100.0.10/32 -p tcp -m tcp --dport 53 -j DNAT --to-destination 192.168.30.7:53
COMMIT
"""


def _pod_packet(destination: str, port: int = 53, **more: object) -> Packet:
    return Packet.of(destination, source="192.168.20.61", protocol="tcp", port=port, in_interface="eni7f8e9d0c1b2",
                     **more)  # type: ignore[arg-type]


def test_nat_prerouting_marks_a_new_connection_before_the_routing_decision() -> None:
    nat = parse_save(CONNMARK_NAT)
    marked = walk_mangle(None, None, _pod_packet("172.16.50.10"), nat=nat)
    assert marked.undecided is None and (marked.mark, marked.ct_mark) == (0x80, 0x80)
    assert [s.decided_by.split(" -m comment")[0] for s in marked.steps] == [
        "nat -A AWS-CONNMARK-CHAIN-0", "nat -A PREROUTING"]
    # the VPC returns before the connmark: no mark
    assert walk_mangle(None, None, _pod_packet("192.168.30.10"), nat=nat).mark == 0
    # the mangle table walks first (-150): its restore finds the new connection's mark 0; nat's (-100) sets it
    mangle = parse_save("*mangle\n:PREROUTING ACCEPT [0:0]\n-A PREROUTING -i eni+ -j CONNMARK --restore-mark "
                        "--nfmask 0x80 --ctmask 0x80\nCOMMIT\n", "mangle")
    both = walk_mangle(mangle, None, _pod_packet("172.16.50.10"), nat=nat)
    assert [(s.decided_by.split()[0], s.result.split(" (")[0]) for s in both.steps] == [
        ("mangle", "mark 0x0 -> 0x0"), ("nat", "connection mark 0x0 -> 0x80"), ("nat", "mark 0x0 -> 0x80")]


def test_a_dnat_in_nat_prerouting_asks_for_the_endpoint_and_service_traffic_skips_nat() -> None:
    nat = parse_save(CONNMARK_NAT)
    service = walk_mangle(None, None, _pod_packet("10.100.0.10"), nat=nat)
    assert service.undecided is not None and "DNATed" in service.undecided and "--service" in service.undecided
    # traced as the endpoint with --service: its nat prerouting ran on the Service's address, --mark says the rest
    endpoint = walk_mangle(None, None, _pod_packet("172.16.50.10", dnat=True, mark=0x4000), nat=nat)
    assert endpoint.undecided is None and endpoint.mark == 0x4000 and endpoint.steps == ()


def test_nftables_nat_prerouting_chains_are_walked_and_their_dnat_stops() -> None:
    def listing(statements: list[object]) -> str:
        return json.dumps({"nftables": [
            {"table": {"family": "inet", "name": "t", "handle": 1}},
            {"chain": {"family": "inet", "table": "t", "name": "pre", "handle": 1, "type": "nat",
                       "hook": "prerouting", "prio": -100, "policy": "accept"}},
            {"rule": {"family": "inet", "table": "t", "chain": "pre", "handle": 2, "expr": statements}}]})

    marking = listing([{"mangle": {"key": {"meta": {"key": "mark"}}, "value": 0x80}}])
    assert walk_mangle(None, marking, _pod_packet("172.16.50.10")).mark == 0x80
    assert walk_mangle(None, marking, _pod_packet("172.16.50.10", dnat=True)).mark == 0
    dnat = listing([{"dnat": {"addr": "192.168.30.7"}}])
    result = walk_mangle(None, dnat, _pod_packet("172.16.50.10"))
    assert result.undecided is not None and "--service" in result.undecided
