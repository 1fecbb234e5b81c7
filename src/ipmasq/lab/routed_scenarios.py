"""Nodes whose routing decides the source a destination sees: the topologies users run, as namespace-lab scenarios
(ipmasq.lab.routed runs them).

On these nodes the nat rules alone do not answer "which address will the partner's firewall see": ip rules pick a
route table by source, destination or firewall mark, mangle marks connections, and MASQUERADE takes the address of
whichever interface the route chose. Each scenario builds such a node with real routes, rules and netfilter, real
TCP peers that record the source they saw, and states what each peer must see and why. Before each probe the lab
asks `ipmasq trace` on the node, as an operator would (DEST --source POD --protocol tcp --port P, trace reading the
node's routes and rules itself), and a probe is ok only when the peer saw what the scenario says and trace predicted
it:

    two-uplinks   a node with a second uplink toward a VPN: `from 10.44.0.0/14 to 172.30.0.0/16 lookup 100`,
                  `fwmark 0x80/0x80 lookup 200` (its default route says `src 192.168.20.99`), a mangle rule marking
                  the pod's TCP to port 5432, the agent masquerading outside 10/8, and a multipath route over both
                  uplinks (the one probe trace must answer "one of", each hop named)
    eks-secondary-eni
                  an EKS node as the Amazon VPC CNI programs it (a stand-in, not ipmasq): a pod on the primary ENI and
                  one on a secondary ENI, per-ENI route tables, ip rules of the CNI's priorities, the CONNMARK that
                  sends non-VPC traffic to the main table, AWS-SNAT-CHAIN-0; the VPC checks each ENI's sources
    gke-multi-nic a GKE node with a second network interface and a pod attached to both networks: the second
                  network's pod range has its own route table; the agent masquerades outside 10/8

Every address lives only in the lab's namespaces. `dump_node_facts` (ipmasq.lab.facts) writes what a node holds so
that trace can be run on it offline.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ipmasq.lab.netns import Namespace, Network
from ipmasq.lab.routed import (
    Expect,
    RoutedLab,
    RoutedPhase,
    RoutedScenario,
    add_peers,
    add_pod,
    forwarding,
    node_interface,
    start_agent,
    uplink_router,
)
from ipmasq.lab.topology import Lab
from ipmasq.testing.writers import aws_snat_rules

__all__ = ["EKS_SECONDARY_ENI", "GKE_MULTI_NIC", "ROUTED_SCENARIOS", "TWO_UPLINKS"]

KEEP_10_8 = "nonMasqueradeCIDRs:\n  - 10.0.0.0/8\n"


# ---- two uplinks: a second one toward a VPN ---------------------------------------------------------------------

UPLINK_POD = "10.44.14.15"
UPLINK_POD6 = "fd00:44:0:14::15"
INTERNET_PEER = "203.0.113.10"
INTERNET_PEER6 = "2001:db8:30::10"
VPN_HOST6 = "fd00:20:5::5"  # inside the ULA range the config keeps
AWS_DB = "172.30.12.110"
VPN_HOST = "10.20.0.5"
ECMP_PEER = "198.51.100.20"  # reached by a multipath route over both uplinks
DB_PORT = 5432
WEB_PORT = 80


def _build_two_uplinks(lab: Lab) -> RoutedLab:
    """Both families: IPv4 as measured on the node this reproduces, IPv6 beside it (eth0 fd00:10::2/64, eth1
    fd00:20::2/64 and a second fd00:20::99/64, the same mark rule and table 200 with `src fd00:20::99`)."""
    net = lab.net
    world = RoutedLab(lab)
    node = net.add("node")
    forwarding(node)
    node.sysctl("net.ipv6.conf.all.forwarding", "1")
    add_pod(net, "pod", node, f"{UPLINK_POD}/24", "10.44.14.1/24")
    net["pod"].run(["ip", "addr", "add", f"{UPLINK_POD6}/64", "dev", "eth0", "nodad"])
    node.run(["ip", "addr", "add", "fd00:44:0:14::1/64", "dev", node_interface(node, UPLINK_POD), "nodad"])
    net["pod"].run(["ip", "route", "add", "default", "via", "10.44.14.1"])
    net["pod"].run(["ip", "-6", "route", "add", "default", "via", "fd00:44:0:14::1"])
    peers = add_peers(lab, (INTERNET_PEER, AWS_DB, VPN_HOST, ECMP_PEER, INTERNET_PEER6, VPN_HOST6), (WEB_PORT, DB_PORT))
    uplink_router(net, "uplink", node, "eth0", ["192.168.10.2/24", "fd00:10::2/64"],
                  ["192.168.10.1/24", "fd00:10::1/64"], peers,
                  [("10.251.0.1/30", "10.251.0.2/30"), ("fd00:251::1/64", "fd00:251::2/64")],
                  ["10.44.0.0/14", "fd00:44::/48"])
    # the VPN uplink: its second address is the one table 200's route names as the source
    uplink_router(net, "vpn", node, "eth1", ["192.168.20.2/24", "192.168.20.99/24", "fd00:20::2/64", "fd00:20::99/64"],
                  ["192.168.20.1/24", "fd00:20::1/64"], peers,
                  [("10.252.0.1/30", "10.252.0.2/30"), ("fd00:252::1/64", "fd00:252::2/64")],
                  ["10.44.0.0/14", "fd00:44::/48"])
    for prefix, via in (("192.168.10.0/24", "10.251.0.1"), ("192.168.20.0/24", "10.252.0.1"),
                        ("10.44.0.0/14", "10.251.0.1"), ("fd00:10::/64", "fd00:251::1"),
                        ("fd00:20::/64", "fd00:252::1"), ("fd00:44::/48", "fd00:251::1")):
        peers.run(["ip", "route", "add", prefix, "via", via])
    for family, default_via, vpn_gateway, source in (("-4", "192.168.10.1", "192.168.20.1", "192.168.20.99"),
                                                     ("-6", "fd00:10::1", "fd00:20::1", "fd00:20::99")):
        node.run(["ip", family, "route", "add", "default", "via", default_via, "dev", "eth0"])
        node.run(["ip", family, "route", "add", "default", "via", vpn_gateway, "dev", "eth1", "src", source,
                  "table", "200"])
        node.run(["ip", family, "rule", "add", "fwmark", "0x80/0x80", "lookup", "200"])
    node.run(["ip", "route", "add", "default", "via", "192.168.20.1", "dev", "eth1", "table", "100"])
    # a range reached over both uplinks at once: which one a connection takes is the kernel's hash of the flow
    node.run(["ip", "route", "add", "198.51.100.0/24", "nexthop", "via", "192.168.10.1", "dev", "eth0",
              "nexthop", "via", "192.168.20.1", "dev", "eth1"])
    node.run(["ip", "rule", "add", "from", "10.44.0.0/14", "to", "172.30.0.0/16", "lookup", "100"])
    for tool, pod in (("iptables", UPLINK_POD), ("ip6tables", UPLINK_POD6)):
        node.run([tool, "-t", "mangle", "-A", "PREROUTING", "-s", pod, "-p", "tcp", "--dport", str(DB_PORT),
                  "-j", "MARK", "--set-xmark", "0x80/0x80"])
    return world


def _agent_keeping_10_8(world: RoutedLab) -> None:
    start_agent(world, KEEP_10_8, world.lab.workdir)


KEEP_PRIVATE_BOTH = "enableIPv6: true\nnonMasqueradeCIDRs:\n  - 10.0.0.0/8\n  - fd00::/8\n"


def _agent_keeping_private_space(world: RoutedLab) -> None:
    start_agent(world, KEEP_PRIVATE_BOTH, world.lab.workdir)


TWO_UPLINKS = RoutedScenario(
    "two-uplinks",
    "A node with a second uplink toward a VPN: ip rules send the pod's traffic to 172.30.0.0/16 and every "
    f"connection the mangle table marks (the pod's TCP to port {DB_PORT}) out of eth1, whose route names the "
    "secondary 192.168.20.99 as source; the agent masquerades outside 10/8 and fd00::/8. IPv4 MASQUERADE takes "
    "eth1's primary address, not the route's src; IPv6 MASQUERADE takes the newer of eth1's two addresses; the "
    "private ranges keep the pod's address whichever uplink carries it; a range routed over both uplinks at once "
    "leaves by the one the kernel's hash of the flow picks.",
    _build_two_uplinks,
    (RoutedPhase("agent: enableIPv6, nonMasqueradeCIDRs [10.0.0.0/8, fd00::/8]", _agent_keeping_private_space, (
        Expect("pod", INTERNET_PEER, WEB_PORT, "192.168.10.2",
               "main table: default via eth0; masqueraded to eth0's address", leaves_by="eth0"),
        Expect("pod", AWS_DB, WEB_PORT, "192.168.20.2",
               "rule from 10.44.0.0/14 to 172.30.0.0/16 lookup 100: eth1; masqueraded to eth1's primary address",
               leaves_by="eth1"),
        Expect("pod", INTERNET_PEER, DB_PORT, "192.168.20.2",
               "mangle marks 0x80, rule fwmark 0x80/0x80 lookup 200: eth1; MASQUERADE ignores the route's src "
               "192.168.20.99", leaves_by="eth1"),
        Expect("pod", AWS_DB, DB_PORT, "192.168.20.2",
               "eth1 (marked, and to 172.30.0.0/16); masqueraded", leaves_by="eth1"),
        Expect("pod", VPN_HOST, WEB_PORT, UPLINK_POD,
               "main table: eth0; 10/8 keeps the pod's address", leaves_by="eth0"),
        Expect("pod", VPN_HOST, DB_PORT, UPLINK_POD,
               "marked: table 200, eth1; 10/8 keeps the pod's address", leaves_by="eth1"),
        Expect("pod", INTERNET_PEER6, WEB_PORT, "fd00:10::2",
               "main table: eth0; masqueraded to eth0's address", leaves_by="eth0"),
        Expect("pod", INTERNET_PEER6, DB_PORT, "fd00:20::99",
               "marked: table 200, eth1; IPv6 MASQUERADE's source selection ties between eth1's two addresses and "
               "takes the newer, fd00:20::99 (added second); not the route's src", leaves_by="eth1"),
        Expect("pod", VPN_HOST6, WEB_PORT, UPLINK_POD6,
               "main table: eth0; fd00::/8 keeps the pod's address", leaves_by="eth0"),
        Expect("pod", VPN_HOST6, DB_PORT, UPLINK_POD6,
               "marked: table 200, eth1; fd00::/8 keeps the pod's address", leaves_by="eth1"),
        Expect("pod", ECMP_PEER, WEB_PORT, None,
               "main table: 198.51.100.0/24 is a multipath route over both uplinks, the kernel's hash of the flow "
               "picks one; masqueraded to that uplink's address",
               hops=(("eth0", "192.168.10.2"), ("eth1", "192.168.20.2"))),
    )),),
)


# ---- EKS: a pod on a secondary ENI, as the Amazon VPC CNI programs the node --------------------------------------

EKS_VPC = "192.168.0.0/16"
EKS_PRIMARY_IP = "192.168.10.20"  # eth0, the primary ENI's primary address: the SNAT address
EKS_SECONDARY_ENI_IP = "192.168.20.30"  # eth1, device 1: route table 2
EKS_POD_PRIMARY = "192.168.10.51"  # a secondary address of the primary ENI, given to a pod
EKS_POD_SECONDARY = "192.168.20.61"  # a secondary address of the secondary ENI, given to a pod
EKS_VPC_PEER = "192.168.30.10"
EKS_ONPREM = "172.16.50.10"  # over a transit gateway: outside the VPC
EKS_ENI_TABLE = "2"
CONNMARK = "0x80"


def _connmark_rules(vpc: str, exclusions: Sequence[str]) -> str:
    """The VPC CNI's connmark part (buildIptablesConnmarkRules and the mangle rules of buildIptablesSNATRules): a new
    connection from a pod (`-i eni+`) to a non-VPC, non-excluded destination gets connmark 0x80, copied to the packet
    mark, so that ip rule 1024 sends it to the main table (the primary ENI) ahead of the pod's rule 1536."""
    returns = "".join(f'-A AWS-CONNMARK-CHAIN-0 -d {cidr} -m comment --comment "AWS CONNMARK CHAIN, EXCLUDED CIDR" '
                      "-j RETURN\n" for cidr in exclusions)
    restore = f"-j CONNMARK --restore-mark --nfmask {CONNMARK} --ctmask {CONNMARK}"
    return ("*mangle\n"
            '-A PREROUTING -i eth0 -m comment --comment "AWS, primary ENI" -m addrtype --dst-type LOCAL '
            f"--limit-iface-in -j CONNMARK --set-xmark {CONNMARK}/{CONNMARK}\n"
            f'-A PREROUTING -i eni+ -m comment --comment "AWS, primary ENI" {restore}\n'
            "COMMIT\n"
            "*nat\n:AWS-CONNMARK-CHAIN-0 - [0:0]\n"
            '-A PREROUTING -i eni+ -m comment --comment "AWS, outbound connections" -j AWS-CONNMARK-CHAIN-0\n'
            f'-A PREROUTING -m comment --comment "AWS, CONNMARK" {restore}\n'
            f"{returns}"
            f'-A AWS-CONNMARK-CHAIN-0 -d {vpc} -m comment --comment "AWS CONNMARK CHAIN, VPC CIDR" -j RETURN\n'
            f'-A AWS-CONNMARK-CHAIN-0 -m comment --comment "AWS, CONNMARK" -j CONNMARK '
            f"--set-xmark {CONNMARK}/{CONNMARK}\n"
            "COMMIT\n")


def _eks_pod(net: Network, role: str, node: Namespace, address: str, host_if: str, table: str | None) -> None:
    """A pod as the VPC CNI wires it: its address /32, a default route via 169.254.1.1 whose neighbour entry is the
    host veth's MAC; on the node a /32 route to it in main, `to POD lookup main` at 512 and, on a secondary ENI,
    `from POD lookup TABLE` at 1536."""
    pod = net.add(role)
    net.link(pod, [f"{address}/32"], node, [], names=("eth0", host_if))
    mac = node.run(["cat", f"/sys/class/net/{host_if}/address"]).stdout.strip()
    pod.run(["ip", "route", "add", "169.254.1.1", "dev", "eth0", "scope", "link"])
    pod.run(["ip", "route", "add", "default", "via", "169.254.1.1", "dev", "eth0"])
    pod.run(["ip", "neigh", "add", "169.254.1.1", "lladdr", mac, "dev", "eth0", "nud", "permanent"])
    node.run(["ip", "route", "add", f"{address}/32", "dev", host_if, "scope", "link"])
    node.run(["ip", "rule", "add", "pref", "512", "to", f"{address}/32", "lookup", "main"])
    if table is not None:
        node.run(["ip", "rule", "add", "pref", "1536", "from", f"{address}/32", "lookup", table])


def _build_eks(lab: Lab) -> RoutedLab:
    net = lab.net
    world = RoutedLab(lab)
    node = net.add("node")
    forwarding(node)
    peers = add_peers(lab, (EKS_VPC_PEER, EKS_ONPREM, INTERNET_PEER), (WEB_PORT,))
    vpc = net.add("vpc")
    forwarding(vpc)
    net.link(node, [f"{EKS_PRIMARY_IP}/24"], vpc, ["192.168.10.1/24"], names=("eth0", "subnet-a"))
    net.link(node, [f"{EKS_SECONDARY_ENI_IP}/24"], vpc, ["192.168.20.1/24"], names=("eth1", "subnet-b"))
    net.link(vpc, ["10.253.0.1/30"], peers, ["10.253.0.2/30"])
    vpc.run(["ip", "route", "add", "default", "via", "10.253.0.2"])
    peers.run(["ip", "route", "add", EKS_VPC, "via", "10.253.0.1"])
    # the VPC delivers a pod's address to the ENI it belongs to, and drops what an ENI sends from an address that is
    # not its own (EC2's source/destination check)
    vpc.run(["ip", "route", "add", f"{EKS_POD_PRIMARY}/32", "via", EKS_PRIMARY_IP])
    vpc.run(["ip", "route", "add", f"{EKS_POD_SECONDARY}/32", "via", EKS_SECONDARY_ENI_IP])
    vpc.run(["iptables-restore"], stdin="\n".join([
        "*filter", ":FORWARD ACCEPT [0:0]",
        f"-A FORWARD -i subnet-a -s {EKS_PRIMARY_IP},{EKS_POD_PRIMARY} -j ACCEPT",
        f"-A FORWARD -i subnet-b -s {EKS_SECONDARY_ENI_IP},{EKS_POD_SECONDARY} -j ACCEPT",
        "-A FORWARD -i subnet-a -j DROP", "-A FORWARD -i subnet-b -j DROP", "COMMIT", ""]))
    # SetupENINetwork for eth1 (device 1): its table 2, and its subnet route gone from main
    node.run(["ip", "route", "add", "default", "via", "192.168.10.1", "dev", "eth0"])
    node.run(["ip", "route", "del", "192.168.20.0/24", "dev", "eth1"])
    node.run(["ip", "route", "add", "192.168.20.1", "dev", "eth1", "scope", "link", "table", EKS_ENI_TABLE])
    node.run(["ip", "route", "add", "default", "via", "192.168.20.1", "dev", "eth1", "table", EKS_ENI_TABLE])
    # SetupHostNetwork: marked connections use the main table, at 1024
    node.run(["ip", "rule", "add", "pref", "1024", "fwmark", f"{CONNMARK}/{CONNMARK}", "lookup", "main"])
    _eks_pod(net, "pod-primary-eni", node, EKS_POD_PRIMARY, "eni1a2b3c4d5e6", None)
    _eks_pod(net, "pod-secondary-eni", node, EKS_POD_SECONDARY, "eni7f8e9d0c1b2", EKS_ENI_TABLE)
    return world


def _vpc_cni(exclusions: tuple[str, ...], *, connmark: bool = True) -> Callable[[RoutedLab], None]:
    """The VPC CNI's iptables on the node (AWS_VPC_K8S_CNI_EXCLUDE_SNAT_CIDRS = `exclusions`), written anew."""
    def configure(world: RoutedLab) -> None:
        node = world.node
        node.run(["iptables", "-t", "nat", "-F"])
        node.run(["iptables", "-t", "nat", "-X"])
        node.run(["iptables", "-t", "mangle", "-F"])
        node.run(["iptables-restore", "--noflush"], stdin=aws_snat_rules(EKS_VPC, exclusions, EKS_PRIMARY_IP))
        if connmark:
            node.run(["iptables-restore", "--noflush"], stdin=_connmark_rules(EKS_VPC, exclusions))
    return configure


_EKS_TO_VPC = (
    Expect("pod-primary-eni", EKS_VPC_PEER, WEB_PORT, EKS_POD_PRIMARY,
           "main table, eth0; AWS-SNAT-CHAIN-0 returns for the VPC", leaves_by="eth0"),
    Expect("pod-secondary-eni", EKS_VPC_PEER, WEB_PORT, EKS_POD_SECONDARY,
           "rule 1536 from the pod lookup 2: eth1; the VPC keeps the pod's address", leaves_by="eth1"),
)
EKS_SECONDARY_ENI = RoutedScenario(
    "eks-secondary-eni",
    "An EKS node as the Amazon VPC CNI programs it: a pod on the primary ENI and one on a secondary ENI (table 2, "
    "rule 1536). Traffic leaving the VPC is SNATed to the primary ENI's address by AWS-SNAT-CHAIN-0, and the "
    "CONNMARK (rule 1024) sends the secondary ENI's pod out of the primary ENI for it; an excluded CIDR keeps the "
    "pod's address and leaves by the pod's own ENI. Without the connmark rules that pod's SNATed traffic leaves the "
    "secondary ENI and the VPC drops it.",
    _build_eks,
    (
        RoutedPhase("VPC CNI defaults", _vpc_cni(()), (
            *_EKS_TO_VPC,
            Expect("pod-primary-eni", EKS_ONPREM, WEB_PORT, EKS_PRIMARY_IP,
                   "not the VPC: SNAT to the primary ENI", leaves_by="eth0"),
            Expect("pod-secondary-eni", EKS_ONPREM, WEB_PORT, EKS_PRIMARY_IP,
                   "connmark 0x80, rule 1024 fwmark lookup main: eth0; SNAT to the primary ENI", leaves_by="eth0"),
            Expect("pod-secondary-eni", INTERNET_PEER, WEB_PORT, EKS_PRIMARY_IP,
                   "connmark 0x80, rule 1024: eth0; SNAT to the primary ENI", leaves_by="eth0"),
        )),
        RoutedPhase("AWS_VPC_K8S_CNI_EXCLUDE_SNAT_CIDRS=172.16.0.0/12", _vpc_cni(("172.16.0.0/12",)), (
            *_EKS_TO_VPC,
            Expect("pod-primary-eni", EKS_ONPREM, WEB_PORT, EKS_POD_PRIMARY,
                   "excluded: no SNAT, eth0", leaves_by="eth0"),
            Expect("pod-secondary-eni", EKS_ONPREM, WEB_PORT, EKS_POD_SECONDARY,
                   "excluded: no connmark, rule 1536 lookup 2: eth1, no SNAT", leaves_by="eth1"),
            Expect("pod-secondary-eni", INTERNET_PEER, WEB_PORT, EKS_PRIMARY_IP,
                   "connmark 0x80, rule 1024: eth0; SNAT to the primary ENI", leaves_by="eth0"),
        )),
        RoutedPhase("the connmark rules gone (a flushed mangle table, a hand-made SNAT setup)",
                    _vpc_cni((), connmark=False), (
            *_EKS_TO_VPC,
            Expect("pod-primary-eni", EKS_ONPREM, WEB_PORT, EKS_PRIMARY_IP, "main table, eth0; SNAT", leaves_by="eth0"),
            Expect("pod-secondary-eni", EKS_ONPREM, WEB_PORT, None,
                   "no mark: rule 1536 lookup 2, eth1, SNAT to the primary ENI's address: the VPC's source check "
                   "drops it", leaves_with=EKS_PRIMARY_IP, leaves_by="eth1"),
        )),
    ),
)


# ---- GKE multi-NIC: a pod attached to a second network -----------------------------------------------------------

MULTI_NIC_POD = "10.44.14.15"  # eth0, the default network
MULTI_NIC_POD_DATA = "10.160.14.15"  # eth1, the second network's pod range
MULTI_NIC_NODE = "10.142.15.203"
MULTI_NIC_NODE_DATA = "10.150.0.2"
DEFAULT_VPC_VM = "10.130.0.6"
DATA_VPC_VM = "10.150.1.50"  # another subnet of the second network
DATA_PARTNER = "172.16.5.5"  # a partner reached over the second network's interconnect
MULTI_NIC_TABLE = "101"


def _build_multi_nic(lab: Lab) -> RoutedLab:
    net = lab.net
    world = RoutedLab(lab)
    node = net.add("node")
    forwarding(node)
    pod, _ = add_pod(net, "pod", node, f"{MULTI_NIC_POD}/24", "10.44.14.1/24")
    add_pod(net, "pod", node, f"{MULTI_NIC_POD_DATA}/24", "10.160.14.1/24", pod_if="eth1")
    pod.run(["ip", "route", "add", "default", "via", "10.44.14.1", "dev", "eth0"])
    for prefix in ("10.150.0.0/16", "172.16.0.0/12"):  # the second network's routes, on the pod's second interface
        pod.run(["ip", "route", "add", prefix, "via", "10.160.14.1", "dev", "eth1"])
    peers = add_peers(lab, (DEFAULT_VPC_VM, INTERNET_PEER, DATA_VPC_VM, DATA_PARTNER), (WEB_PORT,))
    uplink_router(net, "vpc-default", node, "eth0", [f"{MULTI_NIC_NODE}/20"], ["10.142.0.1/20"], peers,
                  [("10.251.0.1/30", "10.251.0.2/30")], ["10.44.14.0/24"])
    uplink_router(net, "vpc-data", node, "eth1", [f"{MULTI_NIC_NODE_DATA}/24"], ["10.150.0.1/24"], peers,
                  [("10.252.0.1/30", "10.252.0.2/30")], ["10.160.14.0/24"])
    for prefix, via in (("10.142.0.0/20", "10.251.0.1"), ("10.44.0.0/14", "10.251.0.1"),
                        ("10.150.0.0/24", "10.252.0.1"), ("10.160.0.0/16", "10.252.0.1")):
        peers.run(["ip", "route", "add", prefix, "via", via])
    node.run(["ip", "route", "add", "default", "via", "10.142.0.1", "dev", "eth0"])
    node.run(["ip", "route", "add", "default", "via", "10.150.0.1", "dev", "eth1", "table", MULTI_NIC_TABLE])
    node.run(["ip", "rule", "add", "from", "10.160.14.0/24", "lookup", MULTI_NIC_TABLE])
    return world


GKE_MULTI_NIC = RoutedScenario(
    "gke-multi-nic",
    "A GKE node with a second network interface (eth1, 10.150.0.2) and a pod attached to both networks: the "
    "second network's pod range has a route table of its own. The agent keeps 10/8 and masquerades the rest: to "
    "a partner reached over the second network the pod is masqueraded to eth1's address, not the node's "
    f"{MULTI_NIC_NODE} that explain names.",
    _build_multi_nic,
    (RoutedPhase("agent: nonMasqueradeCIDRs [10.0.0.0/8]", _agent_keeping_10_8, (
        Expect("pod", DEFAULT_VPC_VM, WEB_PORT, MULTI_NIC_POD,
               "pod's eth0, main table, eth0; 10/8 kept", leaves_by="eth0"),
        Expect("pod", INTERNET_PEER, WEB_PORT, MULTI_NIC_NODE,
               "main table, eth0; masqueraded to eth0's address", leaves_by="eth0"),
        Expect("pod", DATA_VPC_VM, WEB_PORT, MULTI_NIC_POD_DATA,
               "pod's eth1, rule from 10.160.14.0/24 lookup 101: eth1; 10/8 kept", leaves_by="eth1"),
        Expect("pod", DATA_PARTNER, WEB_PORT, MULTI_NIC_NODE_DATA,
               "pod's eth1, table 101: eth1; masqueraded to eth1's address", leaves_by="eth1"),
    )),),
)

ROUTED_SCENARIOS: dict[str, RoutedScenario] = {s.name: s for s in (TWO_UPLINKS, EKS_SECONDARY_ENI, GKE_MULTI_NIC)}
