"""The lab's scenarios: real outages, each a sequence of phases; every probe compares explain's prediction with
the kernel.

A phase sets the world up (the agent's config published the way kubelet does, the agent stopped, the node
recreated under a name, a rule an operator wrote by hand, Cloud NAT's mode), waits until the node's kernel holds what
the agent should have written, then probes with real TCP. The prediction comes from the same model `ipmasq explain`
uses (Policy asked about the probe's source, protocol and port, + the Cloud NAT path), never from the lab; it names
what decided (a config rule with its file:line, a CIDR entry, the catch-all, or the rule written by hand).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from ipmasq.cloudnat import CloudNat, CloudNatMode, follow_path, is_internet
from ipmasq.config import ConfigInput, config_from_bytes
from ipmasq.config.model import Origin, Rule, RuleAction
from ipmasq.lab.topology import ADDR, OPEN_PORT, PLAIN_PORT, STRICT_PORT, Lab, Probe, ProbeResult, admits
from ipmasq.options import PolicyOptions
from ipmasq.policy.policy import Policy, PolicyVerdict, Reason
from ipmasq.prefix import parse_address, parse_cidr

__all__ = [
    "NO_RULES", "SCENARIOS", "DecidedBy", "HandWrittenRule", "Phase", "PhaseResult", "ProbeOutcome", "Scenario",
    "Vantage", "policy_for", "predict",
]

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
ONPREM_HTTP = Probe(ADDR.onprem_endpoint, PLAIN_PORT)
PARTNER = Probe(ADDR.partner, STRICT_PORT)

# The ConfigMaps of the scenarios: the fix that ended the GKE 1.14 outage, a VPN range before and after it is
# carved out of 10/8, and GKE's non-masquerade ranges with one private endpoint carved out.
PRESERVE_ONLY_10_8 = "nonMasqueradeCIDRs:\n  - 10.0.0.0/8\nresyncInterval: 60s\n"
VPN_RANGE_PRESERVED = "nonMasqueradeCIDRs:\n  - 10.0.0.0/8\n"
VPN_RANGE_MASQUERADED = "nonMasqueradeCIDRs:\n  - 10.0.0.0/8\nmasqueradeCIDRs:\n  - 10.11.0.0/24\n"
PRIVATE_ENDPOINT_MASQUERADED = (
    "nonMasqueradeCIDRs: [10.0.0.0/8, 172.16.0.0/12, 192.168.0.0/16, 100.64.0.0/10, 192.0.0.0/24, "
    "192.0.2.0/24, 192.88.99.0/24, 198.18.0.0/15, 198.51.100.0/24, 203.0.113.0/24, 240.0.0.0/4]\n"
    "masqueradeCIDRs: [10.2.1.100/32]\n")
# The rules-section scenarios: 10/8 keeps pod IPs, and one rule makes the exception an operator needs.
KEEP_10_8 = "nonMasqueradeCIDRs:\n  - 10.0.0.0/8\n"
ONPREM_RULE = (
    f"{KEEP_10_8}rules:\n  - name: onprem-endpoint-sees-node-ip\n    destinations: [{ADDR.onprem_endpoint}/32]\n"
    f"    sources: [{ADDR.node_pod_range}]\n    action: masquerade\n")
EGRESS_POOL = "gke-prod-egress-pool-*"
EGRESS_NODE = "gke-prod-egress-pool-7f3k"
GENERAL_NODE = "gke-prod-general-pool-2b9x"
PARTNER_RULE = (
    f"{KEEP_10_8}rules:\n  - name: partner-sees-egress-address\n    destinations: [{ADDR.partner}/32]\n"
    f"    nodes: [\"{EGRESS_POOL}\"]\n    action: snat\n    snatTo: {ADDR.spare_node}\n")
HTTPS_ONLY_RULE = (
    f"{KEEP_10_8}rules:\n  - name: onprem-https-sees-node-ip\n    destinations: [{ADDR.onprem_endpoint}/32]\n"
    f"    protocol: tcp\n    ports: [{STRICT_PORT}]\n    action: masquerade\n")


@dataclass(frozen=True)
class HandWrittenRule:
    """A MASQUERADE rule an operator inserted by hand at the top of the node's POSTROUTING: it lives only in that
    node's kernel, so a recreated node no longer has it.

    explain's model sees it as a masquerade rule ahead of every rule of ours: with iptables it sits ahead of our
    jump; with nftables both chains hook srcnat and NAT keeps the first binding, which is the same address as long
    as our rules do not SNAT those packets elsewhere (the scenario's keep the pod IP)."""

    sources: str
    destination: str

    @property
    def command(self) -> tuple[str, ...]:
        return ("iptables", "-t", "nat", "-I", "POSTROUTING", "-s", self.sources, "-d", self.destination,
                "-j", "MASQUERADE")

    def as_rule(self) -> Rule:
        return Rule("hand-written", parse_cidr(self.destination).family, (parse_cidr(self.destination),),
                    RuleAction.MASQUERADE, sources=(parse_cidr(self.sources),), source=" ".join(self.command))


ONPREM_BY_HAND = HandWrittenRule(ADDR.node_pod_range, f"{ADDR.onprem_endpoint}/32")


@dataclass(frozen=True)
class Phase:
    name: str
    config: str | None  # what the ConfigMap holds (None: no ConfigMap)
    options: PolicyOptions
    probes: tuple[Probe, ...]
    agent: str = "running"  # running | stopped (rules left in place) | uninstalled (no rules at all)
    cloud_nat: CloudNatMode = CloudNatMode.ALL_IP_RANGES
    # the node comes up anew before the phase (empty netfilter, a fresh agent), named options.node_name; a new
    # node name always means a recreated node
    recreate_node: bool = False
    hand_written: tuple[HandWrittenRule, ...] = ()  # inserted on the node once the agent has synced


@dataclass(frozen=True)
class DecidedBy:
    """What decided a probe's source on the node, as explain names it."""

    reason: str  # explain's reason (rule, config, default, exception, link-local, catch-all), or hand-written
    rule_name: str | None = None
    defined_at: str | None = None  # file:line of the rule or entry; the command, for a rule written by hand
    matched: str | None = None  # the destination prefix that matched

    @property
    def text(self) -> str:
        if self.reason == "hand-written":
            return f"by hand: {self.defined_at}"
        if self.rule_name is not None:
            return f"rule {self.rule_name} ({self.defined_at})"
        if self.reason == "catch-all":
            return "catch-all MASQUERADE"
        if self.reason == "no-rules":
            return "no agent rules on the node"
        where = self.reason if self.defined_at is None else f"{_ORIGIN_KEY[self.reason]} {self.defined_at}"
        return f"{self.matched} ({where})"

    def as_dict(self) -> dict[str, object]:
        return {"reason": self.reason, "rule_name": self.rule_name, "defined_at": self.defined_at,
                "matched": self.matched, "text": self.text}


# the config key an entry came from, shown with its file:line
_ORIGIN_KEY = {Reason.CONFIG.value: "nonMasqueradeCIDRs", Reason.EXCEPTION.value: "masqueradeCIDRs",
               Reason.DEFAULT.value: "default", Reason.LINK_LOCAL.value: "link-local"}


@dataclass(frozen=True)
class Scenario:
    name: str
    summary: str
    flags: tuple[str, ...]
    phases: tuple[Phase, ...]


@dataclass(frozen=True)
class ProbeOutcome:
    destination: str
    port: int
    predicted_source: str | None
    predicted_connected: bool
    seen_source: str | None
    connected: bool
    decided_by: DecidedBy
    node: str | None = None  # the node whose pod sent the probe (the Kubernetes lab has several)

    @property
    def target(self) -> str:
        return f"{self.destination}:{self.port}"

    @property
    def ok(self) -> bool:
        # the peer saw what explain predicted, and the connection's fate (firewall, NAT drop) matches too
        return self.seen_source == self.predicted_source and self.connected == self.predicted_connected

    def as_dict(self) -> dict[str, object]:
        return {"destination": self.destination, "port": self.port, "predicted_source": self.predicted_source,
                "seen_source": self.seen_source, "connected": self.connected, "ok": self.ok,
                "decided_by": self.decided_by.as_dict(), **({"node": self.node} if self.node else {})}


@dataclass
class PhaseResult:
    name: str
    probes: list[ProbeOutcome] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(p.ok for p in self.probes)


def policy_for(config: str | None, options: PolicyOptions, hand_written: tuple[HandWrittenRule, ...] = ()) -> Policy:
    """The Policy of a ConfigMap text (None: no ConfigMap), as the agent on the lab's node builds it; rules written
    by hand on the node come first (see HandWrittenRule)."""
    files = () if config is None else (("/etc/config/ip-masq-agent", config.encode()),)
    masq_config = config_from_bytes(ConfigInput(files), options)
    if hand_written:
        masq_config = replace(masq_config, rules=tuple(r.as_rule() for r in hand_written) + masq_config.rules)
    return Policy(masq_config, options)


def _decision(verdict: PolicyVerdict, hand_written: tuple[HandWrittenRule, ...]) -> DecidedBy:
    rule = verdict.rule
    if rule is not None:
        family, address = parse_address(verdict.destination)
        matched = next(str(p) for p in rule.destinations if p.family is family and p.contains(address))
        if rule in {h.as_rule() for h in hand_written}:
            return DecidedBy("hand-written", None, rule.where(), matched)
        return DecidedBy(verdict.reason.value, rule.name, rule.where(), matched)
    entry = verdict.entry
    if entry is None:
        return DecidedBy(verdict.reason.value)
    where = None if entry.origin in (Origin.DEFAULT, Origin.LINK_LOCAL) else entry.where()
    return DecidedBy(verdict.reason.value, None, where, str(entry.prefix))


@dataclass(frozen=True)
class Vantage:
    """Where a phase's probes start: the pod's address and its node's. The namespace lab has one pod on one node
    (named by the phase's options); each node of the Kubernetes lab has its own pod, name and address."""

    pod_ip: str = ADDR.pod
    node_ip: str = ADDR.node
    node_name: str | None = None  # None: the node the phase's options name

    def options(self, phase: Phase) -> PolicyOptions:
        """The agent's options on this node (a real node's agent knows its name from the downward API)."""
        return phase.options if self.node_name is None else replace(phase.options, node_name=self.node_name)


def _source_seen(verdict: PolicyVerdict, cloud_nat: CloudNat, vantage: Vantage) -> str | None:
    """explain's path: follow_path for the node's masquerade or the pod IP; a snat rule's address leaves the node
    instead, and Cloud NAT (towards the internet only) translates it or drops it by its own ranges."""
    if verdict.snat_to is None:
        return follow_path(verdict, pod_ip=vantage.pod_ip, node_ip=vantage.node_ip, cloud_nat=cloud_nat).source_seen
    if not is_internet(verdict.destination):
        return verdict.snat_to
    return cloud_nat.nat_ip if cloud_nat.translates(verdict.snat_to) else None


def predict(phase: Phase, probe: Probe, vantage: Vantage = Vantage()) -> tuple[str | None, bool, DecidedBy]:
    """explain's model: the source the destination sees (None: dropped on the way), whether it connects, and what
    decided on the node."""
    uninstalled = phase.agent == "uninstalled"
    options = vantage.options(phase)
    policy = policy_for(NO_RULES if uninstalled else phase.config, options, phase.hand_written)
    cloud_nat = CloudNat(phase.cloud_nat, ADDR.nat_ip, (parse_cidr(ADDR.node_range),), (parse_cidr(ADDR.pod_range),))
    family, destination = parse_address(probe.destination)
    verdict = policy.verdict_for(family, destination, text=probe.destination, source=parse_address(vantage.pod_ip)[1],
                                 protocol="tcp", port=probe.port)
    decision = DecidedBy("no-rules") if uninstalled else _decision(verdict, phase.hand_written)
    seen = _source_seen(verdict, cloud_nat, vantage)
    if seen is None:
        return None, False, decision
    return seen, admits(probe, seen), decision


def outcome(phase: Phase, result: ProbeResult, vantage: Vantage = Vantage()) -> ProbeOutcome:
    predicted, predicted_connected, decision = predict(phase, result.probe, vantage)
    return ProbeOutcome(result.probe.destination, result.probe.port, predicted, predicted_connected,
                        result.seen_source, result.connected, decision, vantage.node_name)


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
        Scenario(
            "hand-written-rule-lost",
            f"A rule written by hand is lost with its node: an operator's '{' '.join(ONPREM_BY_HAND.command)}' "
            "makes the on-prem endpoint (node IPs only) reachable until the node is recreated; declared in the "
            "ConfigMap's rules section, the agent restores it on every new node.",
            (),
            (
                Phase("rule written by hand on the node", KEEP_10_8, REFERENCE_OPTIONS, (ONPREM, VPC_VM),
                      hand_written=(ONPREM_BY_HAND,)),
                Phase("node recreated: the hand-written rule is gone", KEEP_10_8, REFERENCE_OPTIONS,
                      (ONPREM, VPC_VM), recreate_node=True),
                Phase("the same rule declared in the ConfigMap's rules section", ONPREM_RULE, REFERENCE_OPTIONS,
                      (ONPREM, VPC_VM)),
                Phase("node recreated: the agent restores the declared rule", ONPREM_RULE, REFERENCE_OPTIONS,
                      (ONPREM, VPC_VM), recreate_node=True),
            ),
        ),
        Scenario(
            "partner-firewall-snat",
            f"A partner's firewall admits one egress address: {ADDR.partner}:443 accepts only {ADDR.spare_node}, a "
            f"spare address of the egress pool's nodes; a snat rule with nodes: [{EGRESS_POOL}] gives "
            "it to their pods, while nodes of other pools keep masquerading to their own address and are refused.",
            (),
            (
                Phase(f"node {EGRESS_NODE} (matches the rule's nodes)", PARTNER_RULE,
                      replace(REFERENCE_OPTIONS, node_name=EGRESS_NODE), (PARTNER, VPC_VM)),
                Phase(f"node {GENERAL_NODE} (matches none of the rule's nodes)", PARTNER_RULE,
                      replace(REFERENCE_OPTIONS, node_name=GENERAL_NODE), (PARTNER, VPC_VM), recreate_node=True),
            ),
        ),
        Scenario(
            "one-port-masquerade",
            f"Only HTTPS to an endpoint needs the node IP: {ADDR.onprem_endpoint}:443 admits only node IPs while its "
            "port 80 must keep seeing pod IPs; a rule with protocol tcp and ports [443] masquerades that port alone.",
            (),
            (
                Phase("nonMasqueradeCIDRs: [10.0.0.0/8]", KEEP_10_8, REFERENCE_OPTIONS, (ONPREM, ONPREM_HTTP)),
                Phase("rule: tcp 443 to the endpoint masqueraded", HTTPS_ONLY_RULE, REFERENCE_OPTIONS,
                      (ONPREM, ONPREM_HTTP)),
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
