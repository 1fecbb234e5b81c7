"""The writer profiles: who writes a node's masquerade rules, with the chain, the flags equivalent to its behaviour,
the inputs it reads and the sources of every fact a profile encodes (`WRITERS`); `unobservable`, the one line said
when a node's rules cannot be read at all."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from ipmasq.options import PolicyOptions

__all__ = [
    "AKS_CONFIGMAPS",
    "AKS_FRAGMENT_PREFIX",
    "CILIUM_MAP",
    "EKS_CHAIN",
    "EKS_DAEMONSET",
    "ENV_EXCLUDE_SNAT_CIDRS",
    "ENV_EXTERNAL_SNAT",
    "MERGED_KEYS",
    "REFERENCE_CONFIGMAP",
    "REFERENCE_KEY",
    "REFERENCE_KEYS",
    "WRITERS",
    "Cited",
    "NodeFacts",
    "Sources",
    "Writer",
    "configmap_source",
    "unobservable",
]


@dataclass(frozen=True, slots=True)
class Cited:
    """One fact a profile encodes and where it is stated (a URL, or a repository path and what it says)."""

    fact: str
    source: str


@dataclass(frozen=True, slots=True)
class Writer:
    """A program that writes a node's pod masquerade rules (or its BPF map), as ipmasq compares with it."""

    name: str
    chain: str | None  # the iptables nat chain it writes; None: not iptables (Cilium's BPF map)
    options: PolicyOptions  # ipmasq's flags equivalent to that writer's behaviour
    backend_hint: str  # "iptables" (either variant) or "bpf"
    cited: tuple[Cited, ...]
    configmaps: tuple[str, ...] = ()  # kube-system ConfigMaps whose keys it reads
    daemonset: str | None = None  # a kube-system DaemonSet whose container env it reads (EKS: aws-node)
    summary: str = ""
    # the config keys it reads (documented spelling): ipmasq reads more (KNOWN_KEYS), the others it ignores
    keys: frozenset[str] = frozenset()
    called: str = ""  # how a message names it: "GKE's managed agent"


@dataclass(frozen=True, slots=True)
class Sources:
    """What the API server holds for a writer: ConfigMap data by name, then key (a missing name: no such
    ConfigMap); for EKS, the aws-node container's environment and the VPC's CIDRs (the VPC CNI learns those from
    the instance metadata service, which the API does not show: the node's own chain, or the operator, says them)."""

    configmaps: Mapping[str, Mapping[str, bytes]] = field(default_factory=dict)
    env: Mapping[str, str] = field(default_factory=dict)
    vpc_cidrs: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class NodeFacts:
    """What is known of where the observer runs: whether it can read the node's rules at all."""

    gke_autopilot: bool = False
    privileged_allowed: bool = True  # GKE Autopilot admits privileged pods only through an allowlist
    eks_auto_mode: bool = False
    dataplane_v2: bool = False  # GKE Dataplane V2: masquerade is Cilium's BPF map (anetd), not iptables
    cilium_exec: bool = True  # the observer may exec `cilium-dbg bpf ipmasq list` in the Cilium pod


# --- the facts, with their sources ------------------------------------------------------------------------------

_REFERENCE_README = "https://github.com/kubernetes-sigs/ip-masq-agent (README)"
_REFERENCE_AGENT = "kubernetes-sigs/ip-masq-agent cmd/ip-masq-agent/ip-masq-agent.go"
_GKE_ADDON = "kubernetes/kubernetes cluster/addons/ip-masq-agent/ip-masq-agent.yaml"
_GKE_CONCEPTS = "https://cloud.google.com/kubernetes-engine/docs/concepts/ip-masquerade-agent"
_AKS_MERGER = "Azure/azure-container-networking azure-ip-masq-merger/ip_masq_merger.go"
_AKS_AGENT = "Azure/ip-masq-agent-v2 cmd/ip-masq-agent-v2/ip-masq-agent.go"
_AKS_MANIFESTS = ("Azure/azure-container-networking test/integration/manifests/ip-masq-agent/config-custom.yaml and "
                  "config-reconcile.yaml (pull 2549)")
_EKS_NETWORK = "aws/amazon-vpc-cni-k8s pkg/networkutils/network.go"
_EKS_DOCS = "https://docs.aws.amazon.com/eks/latest/userguide/external-snat.html"
_CILIUM_IPMASQ = "cilium/cilium pkg/ipmasq/ipmasq.go"
_CILIUM_LIST = "cilium/cilium cilium-dbg/cmd/bpf_ipmasq_list.go"

REFERENCE_CONFIGMAP = "ip-masq-agent"
REFERENCE_KEY = "config"  # mounted as /etc/config/ip-masq-agent: the only key the agent reads
AKS_CONFIGMAPS = ("azure-ip-masq-agent-config-reconciled", "azure-ip-masq-agent-config")
AKS_FRAGMENT_PREFIX = "ip-masq"
EKS_DAEMONSET = "aws-node"
EKS_CHAIN = "AWS-SNAT-CHAIN-0"
ENV_EXTERNAL_SNAT = "AWS_VPC_K8S_CNI_EXTERNALSNAT"
ENV_EXCLUDE_SNAT_CIDRS = "AWS_VPC_K8S_CNI_EXCLUDE_SNAT_CIDRS"
CILIUM_MAP = "cilium_ipmasq_v4"

# What each agent reads of a config file: the reference's MasqConfig struct (other keys are dropped by its JSON
# unmarshal); the keys AKS's merger and Cilium unmarshal. ipmasq's masqueradeCIDRs, rules and enableIPv6 are none of
# them: read by ipmasq only.
REFERENCE_KEYS = frozenset({"nonMasqueradeCIDRs", "cidrLimit", "masqLinkLocal", "masqLinkLocalIPv6", "resyncInterval"})
MERGED_KEYS = frozenset({"nonMasqueradeCIDRs", "masqLinkLocal", "masqLinkLocalIPv6"})

_REFERENCE_FACTS = (
    Cited("chain IP-MASQ-AGENT; a POSTROUTING jump for every non-LOCAL destination; RETURN per non-masquerade CIDR "
          "and link-local 169.254.0.0/16 unless masqLinkLocal; a final MASQUERADE", _REFERENCE_README),
    Cited("without a config (or with nonMasqueradeCIDRs absent) the RFC 1918 ranges are not masqueraded",
          _REFERENCE_README),
    Cited("--random-fully defaults to true; only /etc/config/ip-masq-agent is read; a missing file means the "
          "defaults, a file that fails to parse or validate keeps the last good config", _REFERENCE_AGENT),
    Cited("the config file is unmarshalled into MasqConfig {nonMasqueradeCIDRs, cidrLimit, masqLinkLocal, "
          "masqLinkLocalIPv6, resyncInterval}: any other key is dropped; IPv6 is the --enable-ipv6 flag only, and an "
          "IPv6 CIDR without it fails validation", _REFERENCE_AGENT + " MasqConfig, syncConfig, validate"),
    Cited("the ConfigMap kube-system/ip-masq-agent, key `config`, is mounted as /etc/config/ip-masq-agent (the only "
          "file it reads)", _GKE_ADDON + " (volumes: items key config, path ip-masq-agent)"),
)

WRITERS: Mapping[str, Writer] = {
    "reference": Writer(
        "reference", "IP-MASQ-AGENT", PolicyOptions(), "iptables", _REFERENCE_FACTS,
        configmaps=(REFERENCE_CONFIGMAP,),
        summary="the reference ip-masq-agent with its default flags", keys=REFERENCE_KEYS,
        called="the reference ip-masq-agent"),
    "gke": Writer(
        "gke", "IP-MASQ", PolicyOptions(masq_chain="IP-MASQ", nomasq_all_reserved_ranges=True), "iptables",
        (
            *_REFERENCE_FACTS,
            Cited("GKE's agent runs with --masq-chain=IP-MASQ --nomasq-all-reserved-ranges, privileged, under "
                  "addonmanager.kubernetes.io/mode: Reconcile, on nodes labelled "
                  "node.kubernetes.io/masq-agent-ds-ready=true", _GKE_ADDON),
            Cited("without a custom nonMasqueradeCIDRs list (or without the ConfigMap) GKE preserves the Pod IP for a "
                  "set of default non-masquerade destinations; the ConfigMap is kube-system/ip-masq-agent",
                  _GKE_CONCEPTS),
            Cited("--nomasq-all-reserved-ranges adds 100.64.0.0/10, 192.0.0.0/24, 192.0.2.0/24, 192.88.99.0/24, "
                  "198.18.0.0/15, 198.51.100.0/24, 203.0.113.0/24, 240.0.0.0/4 to the RFC 1918 defaults",
                  _REFERENCE_AGENT + " NewMasqConfig"),
        ),
        configmaps=(REFERENCE_CONFIGMAP,),
        summary="GKE's managed ip-masq-agent (Standard, Dataplane V1)", keys=REFERENCE_KEYS,
        called="GKE's managed agent"),
    "aks": Writer(
        "aks", "IP-MASQ-AGENT", PolicyOptions(random_fully=False), "iptables", (
            Cited("azure-ip-masq-merger reads every file whose name starts with `ip-masq` in /etc/config/, converts "
                  "YAML to JSON and unmarshals nonMasqueradeCIDRs, masqLinkLocal, masqLinkLocalIPv6 (other keys are "
                  "dropped)", _AKS_MERGER),
            Cited("fragments merge as a set union of nonMasqueradeCIDRs (a fragment with an empty list adds none) and "
                  "an OR of the booleans", _AKS_MERGER + " (MasqConfig.merge, mergeCIDRs)"),
            Cited("a fragment that does not parse, or holds a CIDR that does not parse or is not aligned, returns an "
                  "error before the merged file is written: the last merged file stays", _AKS_MERGER),
            Cited("no fragment at all: the merged file is removed and the agent uses its defaults",
                  _AKS_MERGER + "; " + _AKS_AGENT + " DefaultMasqConfig"),
            Cited("the provider's fragment is ConfigMap azure-ip-masq-agent-config-reconciled (key "
                  "ip-masq-agent-reconciled), the user's azure-ip-masq-agent-config (key ip-masq-agent)",
                  _AKS_MANIFESTS),
            Cited("ip-masq-agent-v2 writes chain IP-MASQ-AGENT (--masq-chain default), MASQUERADE without "
                  "--random-fully, refuses more than 64 CIDRs and IPv6 CIDRs without --enable-ipv6 (a fatal error: "
                  "it crash-loops)", _AKS_AGENT),
        ),
        configmaps=AKS_CONFIGMAPS,
        summary="AKS's azure-ip-masq-agent (ip-masq-agent-v2) behind azure-ip-masq-merger", keys=MERGED_KEYS,
        called="AKS's ip-masq merger"),
    "eks": Writer(
        "eks", EKS_CHAIN, PolicyOptions(masq_chain=EKS_CHAIN), "iptables", (
            Cited("POSTROUTING `-m comment --comment \"AWS SNAT CHAIN\" -j AWS-SNAT-CHAIN-0`; in AWS-SNAT-CHAIN-0 one "
                  "`-d CIDR ... -j RETURN` per VPC CIDR (comment \"AWS SNAT CHAIN\") and per excluded CIDR (comment "
                  "\"AWS SNAT CHAIN EXCLUSION\"), then `! -o vlan+ -m comment --comment \"AWS, SNAT\" -m addrtype ! "
                  "--dst-type LOCAL -j SNAT --to-source PRIMARY_IP` (--random-fully by default)",
                  _EKS_NETWORK + " buildIptablesSNATRules"),
            Cited("AWS_VPC_K8S_CNI_EXCLUDE_SNAT_CIDRS is split on commas; an entry net.ParseCIDR refuses is logged and "
                  "skipped, the others are kept in network form", _EKS_NETWORK + " getExcludeSNATCIDRs"),
            Cited("AWS_VPC_K8S_CNI_EXTERNALSNAT=true: no SNAT rules on the node (every rule above has shouldExist "
                  "false) and the exclusions are ignored; a value that does not parse as a boolean means false",
                  _EKS_NETWORK + " useExternalSNAT, getExcludeSNATCIDRs; " + _EKS_DOCS),
            Cited("the VPC CIDRs come from the instance metadata service, not the API", _EKS_NETWORK
                  + " (vpcCIDRs passed in by ipamd)"),
        ),
        daemonset=EKS_DAEMONSET,
        summary="the Amazon VPC CNI's node SNAT (aws-node)", called="the VPC CNI (aws-node)"),
    "cilium": Writer(
        "cilium", None, PolicyOptions(), "bpf", (
            Cited("Cilium's ip-masq-agent mode keeps the non-masquerade CIDRs in a BPF LPM map: packets to a CIDR in "
                  "it are not masqueraded", _CILIUM_LIST + " (\"Packets sent from pods to IPs from these CIDRs avoid "
                  "masquerading\")"),
            Cited("a missing or empty config file means the 11 reserved ranges (RFC 1918 plus the reserved list); "
                  "otherwise exactly its nonMasqueradeCIDRs, each masked to its network (host bits dropped, not "
                  "refused)", _CILIUM_IPMASQ + " (defaultNonMasqCIDRs, readConfig, parseCIDR)"),
            Cited("169.254.0.0/16 and fe80::/10 are added unless masqLinkLocal / masqLinkLocalIPv6",
                  _CILIUM_IPMASQ + " (Update)"),
            Cited("a config that does not parse leaves the map as it is", _CILIUM_IPMASQ
                  + " (Update returns the error before touching the map)"),
            Cited("`cilium-dbg bpf ipmasq list` prints a header `IP PREFIX/ADDRESS` and one CIDR per line "
                  "(tabwriter, map order), or `No entries found.` on stderr; -o json prints the list",
                  _CILIUM_LIST + "; cilium/cilium cilium-dbg/cmd/helpers.go TablePrinter"),
            Cited("GKE Dataplane V2 masquerades in anetd's BPF datapath from the same ip-masq-agent ConfigMap",
                  _GKE_CONCEPTS),
        ),
        configmaps=(REFERENCE_CONFIGMAP,),
        summary="Cilium's ip-masq-agent mode and GKE Dataplane V2 (a BPF map, not iptables)", keys=MERGED_KEYS,
        called="Cilium"),
}


def configmap_source(name: str, key: str) -> str:
    """How a ConfigMap's key is named in messages, as the agent names it (configmap/NAME[KEY])."""
    return f"configmap/{name}[{key}]"


def unobservable(writer: Writer, facts: NodeFacts) -> str | None:
    """One line when this writer's rules cannot be read where the observer runs; None when they can."""
    if facts.eks_auto_mode and writer.name == "eks":
        return ("EKS Auto Mode: nodes are locked and SNAT is `random` or `disabled` only; no pod may read their nat "
                "rules: not observed")
    if facts.gke_autopilot and not facts.privileged_allowed and writer.name in ("gke", "cilium", "reference"):
        return ("GKE Autopilot without privileged pods (they need an allowlist): the node's nat rules and BPF maps "
                "cannot be read: not observed")
    if writer.name == "gke" and facts.dataplane_v2:
        return ("GKE Dataplane V2: masquerade is in anetd's BPF map, not in iptables: observe with the cilium "
                "profile (ipmasq check --writer cilium --from-dump of `cilium-dbg bpf ipmasq list`)")
    if writer.name == "cilium" and not facts.cilium_exec:
        return (f"the BPF map {CILIUM_MAP} is read only by `cilium-dbg bpf ipmasq list` inside the Cilium pod, and "
                "exec into it is not allowed here: not observed")
    return None
