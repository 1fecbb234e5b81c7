"""The lab's scenarios: real outages, each a sequence of phases; every probe compares explain's prediction with
the kernel.

A phase sets the world up (the agent's config published the way kubelet does, the agent stopped, Cloud NAT's
mode), waits until the node's kernel holds what the agent should have written, then probes with real TCP. The
prediction comes from the same model `ipmasq explain` uses (Policy + the Cloud NAT path), never from the lab.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ipmasq.cloudnat import CloudNat, CloudNatMode, follow_path
from ipmasq.config import ConfigInput, config_from_bytes
from ipmasq.lab.topology import ADDR, OPEN_PORT, STRICT_PORT, Lab, Probe, ProbeResult
from ipmasq.options import PolicyOptions
from ipmasq.policy import Policy
from ipmasq.prefix import parse_address, parse_cidr

__all__ = ["NO_RULES", "SCENARIOS", "Phase", "PhaseResult", "ProbeOutcome", "Scenario", "policy_for", "predict"]

# What a node does with none of our rules (agent never ran, or was uninstalled): nothing is masqueraded.
NO_RULES = "nonMasqueradeCIDRs: [0.0.0.0/0]\n"

GKE_FLAGS = ("--masq-chain=IP-MASQ", "--nomasq-all-reserved-ranges")
GKE_OPTIONS = PolicyOptions(masq_chain="IP-MASQ", nomasq_all_reserved_ranges=True)
REFERENCE_OPTIONS = PolicyOptions()

AWS = Probe(ADDR.aws_db, STRICT_PORT)
VPC_VM = Probe(ADDR.vpc_vm, OPEN_PORT)
ONPREM = Probe(ADDR.onprem_endpoint, STRICT_PORT)
VPN = Probe(ADDR.vpn_host, STRICT_PORT)
INTERNET = Probe(ADDR.internet, OPEN_PORT)

# The ConfigMaps of the scenarios: the fix that ended the GKE 1.14 outage, a VPN range before and after it is
# carved out of 10/8, and GKE's non-masquerade ranges with one private endpoint carved out.
PRESERVE_ONLY_10_8 = "nonMasqueradeCIDRs:\n  - 10.0.0.0/8\nresyncInterval: 60s\n"
VPN_RANGE_PRESERVED = "nonMasqueradeCIDRs:\n  - 10.0.0.0/8\n"
VPN_RANGE_MASQUERADED = "nonMasqueradeCIDRs:\n  - 10.0.0.0/8\nmasqueradeCIDRs:\n  - 10.11.0.0/24\n"
PRIVATE_ENDPOINT_MASQUERADED = (
    "nonMasqueradeCIDRs: [10.0.0.0/8, 172.16.0.0/12, 192.168.0.0/16, 100.64.0.0/10, 192.0.0.0/24, "
    "192.0.2.0/24, 192.88.99.0/24, 198.18.0.0/15, 198.51.100.0/24, 203.0.113.0/24, 240.0.0.0/4]\n"
    "masqueradeCIDRs: [10.2.1.100/32]\n")


@dataclass(frozen=True)
class Phase:
    name: str
    config: str | None  # what the ConfigMap holds (None: no ConfigMap)
    options: PolicyOptions
    probes: tuple[Probe, ...]
    agent: str = "running"  # running | stopped (rules left in place) | uninstalled (no rules at all)
    cloud_nat: CloudNatMode = CloudNatMode.ALL_IP_RANGES


@dataclass(frozen=True)
class Scenario:
    name: str
    summary: str
    flags: tuple[str, ...]
    phases: tuple[Phase, ...]


@dataclass(frozen=True)
class ProbeOutcome:
    destination: str
    predicted_source: str | None
    predicted_connected: bool
    seen_source: str | None
    connected: bool

    @property
    def ok(self) -> bool:
        # the peer saw what explain predicted, and the connection's fate (firewall, NAT drop) matches too
        return self.seen_source == self.predicted_source and self.connected == self.predicted_connected

    def as_dict(self) -> dict[str, object]:
        return {"destination": self.destination, "predicted_source": self.predicted_source,
                "seen_source": self.seen_source, "connected": self.connected, "ok": self.ok}


@dataclass
class PhaseResult:
    name: str
    probes: list[ProbeOutcome] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(p.ok for p in self.probes)


def policy_for(config: str | None, options: PolicyOptions) -> Policy:
    """The Policy of a ConfigMap text (None: no ConfigMap), as the agent on the lab's node builds it."""
    files = () if config is None else (("/etc/config/ip-masq-agent", config.encode()),)
    return Policy(config_from_bytes(ConfigInput(files), options), options)


def predict(phase: Phase, probe: Probe) -> tuple[str | None, bool]:
    """explain's model: the source the destination sees (None: dropped on the way) and whether it connects."""
    policy = policy_for(NO_RULES if phase.agent == "uninstalled" else phase.config, phase.options)
    cloud_nat = CloudNat(phase.cloud_nat, ADDR.nat_ip, (parse_cidr(ADDR.node_range),), (parse_cidr(ADDR.pod_range),))
    path = follow_path(policy.verdict(probe.destination), pod_ip=ADDR.pod, node_ip=ADDR.node, cloud_nat=cloud_nat)
    seen = path.source_seen
    if seen is None:
        return None, False
    if probe.port == STRICT_PORT:
        allowed = parse_cidr(ADDR.firewall_allows)
        return seen, allowed.contains(parse_address(seen)[1])
    return seen, True


def outcome(phase: Phase, result: ProbeResult) -> ProbeOutcome:
    predicted, predicted_connected = predict(phase, result.probe)
    return ProbeOutcome(result.probe.destination, predicted, predicted_connected, result.seen_source,
                        result.connected)


SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario(
            "incident-gke-1.14",
            "GKE 1.14 default change cuts an AWS VPC behind a VPN: GKE 1.14 preserves pod IPs for 172.16.0.0/12; "
            "the AWS VPC (172.30.0.0/16) behind the VPN admits only node IPs and rejects the pods. Publishing "
            "nonMasqueradeCIDRs: [10.0.0.0/8] fixes it.",
            GKE_FLAGS,
            (
                Phase("GKE 1.14 defaults, no ConfigMap", None, GKE_OPTIONS, (AWS, VPC_VM, INTERNET)),
                Phase("ConfigMap nonMasqueradeCIDRs: [10.0.0.0/8] published", PRESERVE_ONLY_10_8, GKE_OPTIONS,
                      (AWS, VPC_VM, INTERNET)),
            ),
        ),
        Scenario(
            "vpn-inside-10-8",
            "A VPN range inside 10.0.0.0/8 must be masqueraded: 10.11.0.0/24 needs the node IP while the rest of "
            "10/8 keeps pod IPs; masqueradeCIDRs replaces the fix-nat DaemonSet.",
            (),
            (
                Phase("nonMasqueradeCIDRs: [10.0.0.0/8]", VPN_RANGE_PRESERVED, REFERENCE_OPTIONS, (VPN, VPC_VM)),
                Phase("plus masqueradeCIDRs: [10.11.0.0/24]", VPN_RANGE_MASQUERADED, REFERENCE_OPTIONS,
                      (VPN, VPC_VM)),
            ),
        ),
        Scenario(
            "private-endpoint",
            "A private endpoint needs SNAT: an on-prem private endpoint 10.2.1.100:443 inside 10.0.0.0/8 admits "
            "only node IPs.",
            GKE_FLAGS,
            (
                Phase("GKE defaults", None, GKE_OPTIONS, (ONPREM, VPC_VM)),
                Phase("masqueradeCIDRs: [10.2.1.100/32]", PRIVATE_ENDPOINT_MASQUERADED, GKE_OPTIONS,
                      (ONPREM, VPC_VM)),
            ),
        ),
        Scenario(
            "cloud-nat-ranges",
            "Cloud NAT translates only some source ranges, the ones it is told to: with the agent up, "
            "LIST_OF_SECONDARY_IP_RANGES silently drops internet traffic, with the agent down PRIMARY_IP_RANGE does.",
            (),
            tuple(
                Phase(f"agent {state}, Cloud NAT {mode.value}", None, REFERENCE_OPTIONS, (INTERNET, VPC_VM),
                      agent="running" if state == "up" else "uninstalled", cloud_nat=mode)
                for state in ("up", "down")
                for mode in CloudNatMode
            ),
        ),
        Scenario(
            "agent-down",
            "The agent stops (an upgrade): the rules stay and traffic keeps flowing; a node whose rules are gone "
            "sends pod IPs everywhere (the runbook's 'only MASQUERADE visible = ConfigMap not applied').",
            GKE_FLAGS,
            (
                Phase("agent running with the 10.0.0.0/8 fix", PRESERVE_ONLY_10_8, GKE_OPTIONS, (AWS, INTERNET)),
                Phase("agent stopped (SIGTERM): rules kept", PRESERVE_ONLY_10_8, GKE_OPTIONS, (AWS, INTERNET),
                      agent="stopped"),
                Phase("no agent rules on the node", PRESERVE_ONLY_10_8, GKE_OPTIONS, (AWS, INTERNET),
                      agent="uninstalled"),
            ),
        ),
    )
}


def run_phase(lab: Lab, phase: Phase, prepare: Callable[[Phase], None]) -> PhaseResult:
    prepare(phase)
    if lab.cloud_nat_mode is not phase.cloud_nat:
        lab.set_cloud_nat(phase.cloud_nat)
    results = lab.probe(list(phase.probes))
    return PhaseResult(phase.name, [outcome(phase, r) for r in results])
