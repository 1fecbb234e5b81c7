"""The second translation layer: what a destination sees after the node's SNAT *and* a Cloud NAT gateway.

Two translations behind Cloud NAT: pod IP (secondary range) --[ip-masq-agent]--> node IP (primary range)
--[Cloud NAT]--> public IP. Cloud NAT translates only the source ranges it is configured for and drops other
private sources, so "secondary ranges only" fails silently while the agent is up (it already rewrote the pod IP
to the node IP). Pure: the lab proves it against real namespaces.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from enum import Enum

from ipmasq.policy.policy import PolicyVerdict
from ipmasq.prefix import Prefix, parse_address

__all__ = ["CloudNat", "CloudNatMode", "PathResult", "follow_path", "is_internet"]


class CloudNatMode(Enum):
    ALL_IP_RANGES = "ALL_IP_RANGES"
    PRIMARY_IP_RANGE = "PRIMARY_IP_RANGE"
    LIST_OF_SECONDARY_IP_RANGES = "LIST_OF_SECONDARY_IP_RANGES"


@dataclass(frozen=True, slots=True)
class CloudNat:
    mode: CloudNatMode
    nat_ip: str
    node_ranges: tuple[Prefix, ...]  # the subnet's primary range
    pod_ranges: tuple[Prefix, ...]  # the secondary range(s) pods take their IPs from

    def translates(self, source: str) -> bool:
        family, address = parse_address(source)
        in_node = any(p.family == family and p.contains(address) for p in self.node_ranges)
        in_pod = any(p.family == family and p.contains(address) for p in self.pod_ranges)
        if self.mode is CloudNatMode.ALL_IP_RANGES:
            return in_node or in_pod
        if self.mode is CloudNatMode.PRIMARY_IP_RANGE:
            return in_node
        return in_pod


@dataclass(frozen=True, slots=True)
class PathResult:
    source_after_node: str  # "pod"/"node" or an address
    source_seen: str | None  # None: dropped before the destination
    hops: tuple[str, ...]
    dropped_because: str | None = None


def is_internet(destination: str) -> bool:
    """Traffic to globally routable addresses leaves through the NAT gateway; private ones stay in the VPC."""
    address = ipaddress.ip_address(destination)
    if address.version == 6 and address.ipv4_mapped is not None:
        address = address.ipv4_mapped  # the IPv4 packet an IPv6 socket shows as ::ffff:a.b.c.d
    return address.is_global


def follow_path(verdict: PolicyVerdict, *, pod_ip: str | None, node_ip: str | None,
                cloud_nat: CloudNat | None) -> PathResult:
    """The source address after the node (the node's, the pod's, or a snat rule's) and after a Cloud NAT gateway
    behind it, for traffic to the internet; a source the gateway does not translate is dropped there."""
    known: str | None  # the source the gateway sees, when the flags name it
    if verdict.snat_to is not None:
        after_node = known = verdict.snat_to
        hops = [f"node: SNAT to {verdict.snat_to} (rule {verdict.rule.name if verdict.rule else '?'})"]
    else:
        after_node = (node_ip or "node") if verdict.masquerade else (pod_ip or "pod")
        known = node_ip if verdict.masquerade else pod_ip
        hops = [f"node: {'masquerade to the node IP' if verdict.masquerade else 'source unchanged (pod IP)'}"]
    if cloud_nat is None or not is_internet(verdict.destination):
        return PathResult(after_node, after_node, tuple(hops))
    if known is None:
        raise ValueError("--cloud-nat needs --source and --node-ip to tell which range the packet comes from")
    if cloud_nat.translates(known):
        hops.append(f"Cloud NAT ({cloud_nat.mode.value}): {known} -> {cloud_nat.nat_ip}")
        return PathResult(after_node, cloud_nat.nat_ip, tuple(hops))
    hops.append(f"Cloud NAT ({cloud_nat.mode.value}): {known} not translated -> dropped")
    if verdict.snat_to is not None:
        reason = f"Cloud NAT is set to {cloud_nat.mode.value}, which does not translate {known}; the packet is dropped"
    else:
        which = "node (primary)" if verdict.masquerade else "pod (secondary)"
        reason = (f"Cloud NAT is set to {cloud_nat.mode.value}, which does not translate the {which} range of "
                  f"{known}; a private source cannot reach the internet, so the packet is dropped")
    return PathResult(after_node, None, tuple(hops), reason)
