"""Who writes the node's masquerade rules, and what they intend: one profile per agent users actually run.

A profile (`Writer`) names the chain a provider's agent writes, the flags equivalent to that agent's behaviour as
`ipmasq.options.PolicyOptions`, the ConfigMaps (and, for EKS, the DaemonSet) it reads, and the sources of every fact
it encodes. `intended(writer, sources)` turns what the API server holds (`Sources`: ConfigMap bytes by name and key,
the aws-node container's environment) into the `MasqConfig` that writer would enforce, following that writer's own
reading of it: the reference agent's lenient YAML, AKS's merger of every `ip-masq*` fragment, the VPC CNI's
environment variables, Cilium's BPF map semantics; only the keys that writer reads (`Writer.keys`: ipmasq's
masqueradeCIDRs, rules and enableIPv6 are ipmasq's alone), so that a node is compared with what its agent really
writes. `ignored(writer, files, writes)` names each key it does not read and what happens to the traffic that key
names ("10.11.0.0/24 stays un-masqueraded"): check's, lint's and observe mode's ignored-by-writer.
`unobservable(writer, facts)` is the one line said when a node's rules cannot be read at all; nothing here guesses.

Pure: values in, values out. No I/O, no clock; the callers (check, observe mode) read the API and the kernel.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ipmasq.config.document import Document, DocumentNode, Field, parse_document
from ipmasq.config.model import (
    DEFAULT_CIDR_LIMIT,
    DEFAULT_NON_MASQUERADE,
    DEFAULT_RESYNC_SECONDS,
    LINK_LOCAL_V4,
    LINK_LOCAL_V6,
    RESERVED_NON_MASQUERADE,
    Entry,
    MasqConfig,
    Origin,
    Rule,
)
from ipmasq.config.source import ConfigInput, config_from_bytes
from ipmasq.config.validate import KNOWN_KEYS, merge_settings, settings_from_document
from ipmasq.errors import ConfigError, PrefixError, clip
from ipmasq.options import PolicyOptions
from ipmasq.policy.policy import Policy
from ipmasq.policy.prefix import Family, Prefix, parse_cidr
from ipmasq.policy.ranges import Span, subtract, to_prefixes, union_of_prefixes

__all__ = [
    "AKS_CONFIGMAPS",
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
    "Ignored",
    "NodeFacts",
    "Sources",
    "Writer",
    "cilium_map_intent",
    "config_files",
    "eks_exclusions",
    "eks_external_snat",
    "ignored",
    "intended",
    "reading",
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


# --- intent -------------------------------------------------------------------------------------------------


def _source(name: str, key: str) -> str:
    """How a ConfigMap's key is named in messages, as the agent names it (configmap/NAME[KEY])."""
    return f"configmap/{name}[{key}]"


def intended(writer: Writer, sources: Sources) -> MasqConfig:
    """The config `writer` enforces given what the API holds; ConfigError when that writer would not apply it (the
    node then keeps whatever it had: the message says so)."""
    if writer.name in ("reference", "gke"):
        return _reference_intent(writer, sources)
    if writer.name == "aks":
        return _aks_intent(writer, sources)
    if writer.name == "eks":
        return _eks_intent(sources)
    if writer.name == "cilium":
        return _cilium_intent(sources)
    raise ConfigError(f"no such writer {clip(writer.name)!r} (known: {', '.join(WRITERS)})")


def _reference_intent(writer: Writer, sources: Sources) -> MasqConfig:
    data = sources.configmaps.get(REFERENCE_CONFIGMAP, {}).get(REFERENCE_KEY)
    files = () if data is None else ((_source(REFERENCE_CONFIGMAP, REFERENCE_KEY), data),)
    return reading(writer, ConfigInput(files), writer.options)


def reading(writer: Writer, config_input: ConfigInput, options: PolicyOptions) -> MasqConfig:
    """A config file as an agent of the reference's reading reads it (the reference, GKE's, or one observed under
    the flags `options`): only its keys (`writer.keys`); masqueradeCIDRs, rules and enableIPv6 are ipmasq's alone
    (`ignored` says what their absence does)."""
    return config_from_bytes(config_input, options, honoured=writer.keys)


# AKS ---------------------------------------------------------------------------------------------------------


def _aks_intent(writer: Writer, sources: Sources) -> MasqConfig:
    # kubelet projects each ConfigMap's keys as files of one directory; the merger lists it in name order
    # (os.ReadDir sorts) and keeps the names starting with ip-masq
    fragments = sorted((key, name, data) for name in AKS_CONFIGMAPS
                       for key, data in sources.configmaps.get(name, {}).items()
                       if key.startswith(AKS_FRAGMENT_PREFIX))
    cidrs: set[str] = set()
    link_local = link_local_v6 = False
    for key, name, data in fragments:
        where = _source(name, key)
        listed, masq_ll, masq_ll6 = _aks_fragment(data, where)
        cidrs.update(listed)
        link_local, link_local_v6 = link_local or masq_ll, link_local_v6 or masq_ll6
    if not fragments:
        return config_from_bytes(ConfigInput(()), writer.options)
    merged = {"nonMasqueradeCIDRs": sorted(cidrs), "masqLinkLocal": link_local, "masqLinkLocalIPv6": link_local_v6}
    shown = "azure-ip-masq-merger(" + ", ".join(_source(name, key) for key, name, _ in fragments) + ")"
    return config_from_bytes(ConfigInput(((shown, json.dumps(merged).encode()),)), writer.options)


def _aks_fragment(data: bytes, where: str) -> tuple[list[str], bool, bool]:
    """One fragment as the merger reads it; every CIDR parsed and aligned (the merger's validateCIDR)."""
    stop = "azure-ip-masq-merger stops at this fragment and the node keeps the last merged file"
    cidrs, link_local, link_local_v6 = _go_masq_fields(data, where, stop)
    for text, line in cidrs:
        try:
            parse_cidr(text)  # Go's net.ParseCIDR and the alignment test
        except PrefixError as exc:
            raise ConfigError(f"{exc} ({stop})", source=where, line=line, code="invalid-cidr") from None
    return [text for text, _ in cidrs], link_local, link_local_v6


# the three keys the merger and Cilium unmarshal, by their lower-case form: Go's encoding/json matches keys
# case-insensitively
_GO_KEYS = {"nonmasqueradecidrs": "cidrs", "masqlinklocal": "ll", "masqlinklocalipv6": "ll6"}


def _go_masq_fields(data: bytes, where: str, consequence: str) -> tuple[list[tuple[str, int | None]], bool, bool]:
    """(nonMasqueradeCIDRs with their lines, masqLinkLocal, masqLinkLocalIPv6) of a YAML or JSON file read as Go's
    YAML-to-JSON and encoding/json read it into those three fields: the last occurrence of a key wins, other keys are
    ignored, a value of the wrong type is an error (`consequence` says what the writer then does)."""
    try:
        doc = parse_document(data, where)
    except ConfigError as exc:
        raise ConfigError(f"{exc.message} ({consequence})", source=where, line=exc.line, code=exc.code) from None
    cidrs: list[tuple[str, int | None]] = []
    flags = {"ll": False, "ll6": False}
    for f in doc.fields if doc is not None else ():
        name = _GO_KEYS.get(f.key.lower())
        value = f.value
        if name is None or value.value is None:
            continue
        if name == "cidrs":
            if value.kind != "list" or not all(_is_string(item) for item in value.value):
                raise ConfigError(f"{f.key} must be a list of CIDR strings ({consequence})", source=where,
                                  line=f.line)
            cidrs = [(item.value, item.line) for item in value.value]
        elif not isinstance(value.value, bool) or value.quoted:
            raise ConfigError(f"{f.key} must be true or false ({consequence})", source=where, line=f.line)
        else:
            flags[name] = value.value
    return cidrs, flags["ll"], flags["ll6"]


def _is_string(node: DocumentNode) -> bool:
    return node.kind == "scalar" and isinstance(node.value, str)


# EKS ---------------------------------------------------------------------------------------------------------


_GO_TRUE = frozenset({"1", "t", "T", "TRUE", "true", "True"})  # strconv.ParseBool
_GO_FALSE = frozenset({"0", "f", "F", "FALSE", "false", "False"})


def eks_external_snat(env: Mapping[str, str]) -> bool:
    """AWS_VPC_K8S_CNI_EXTERNALSNAT as the CNI reads it: strconv.ParseBool, anything else (logged there) false."""
    return env.get(ENV_EXTERNAL_SNAT, "") in _GO_TRUE


def eks_exclusions(env: Mapping[str, str]) -> tuple[tuple[Prefix, ...], tuple[str, ...]]:
    """(the excluded CIDRs the CNI programs, the entries it skips): split on commas, each through net.ParseCIDR
    (no trimming: " 10.0.0.0/8" is refused there too), kept in network form. None with external SNAT."""
    if eks_external_snat(env):
        return (), ()
    text = env.get(ENV_EXCLUDE_SNAT_CIDRS, "")
    if text == "":
        return (), ()
    kept: list[Prefix] = []
    skipped: list[str] = []
    for part in text.split(","):
        prefix = _masked_cidr(part)
        if prefix is None:
            skipped.append(part)
        else:
            kept.append(prefix)
    return tuple(kept), tuple(skipped)


def _masked_cidr(text: str) -> Prefix | None:
    """Go's net.ParseCIDR, then the network (host bits dropped): None where it fails."""
    address, slash, length = text.partition("/")
    if not slash or not length.isascii() or not length.isdigit() or len(length) > 3:
        return None
    try:
        host = parse_cidr(f"{address}/{128 if ':' in address else 32}")
    except PrefixError:
        return None
    bits = int(length)
    if bits > host.family.bits:
        return None
    span = host.family.bits - bits
    return Prefix(host.family, (host.network >> span) << span, bits)


def _eks_intent(sources: Sources) -> MasqConfig:
    env = sources.env
    where = f"daemonset/{EKS_DAEMONSET} env"
    if eks_external_snat(env):
        # no node SNAT at all: every destination keeps the pod's address (an external NAT device translates)
        everything = Entry(Prefix(Family.V4, 0, 0), False, Origin.CONFIG, f"{where} {ENV_EXTERNAL_SNAT}")
        return MasqConfig((everything,), masq_link_local=True, sources=(where,))
    entries: list[Entry] = []
    for text in sources.vpc_cidrs:
        prefix = _masked_cidr(text)
        if prefix is None:
            raise ConfigError(f"VPC CIDR {clip(text)!r} is not a CIDR")
        entries.append(Entry(prefix, False, Origin.CONFIG, "VPC CIDR"))
    kept, skipped = eks_exclusions(env)
    entries.extend(Entry(p, False, Origin.CONFIG, f"{where} {ENV_EXCLUDE_SNAT_CIDRS}") for p in kept)
    warnings = tuple(f"{where}: {ENV_EXCLUDE_SNAT_CIDRS} entry {clip(s)!r} is not a CIDR: the VPC CNI skips it"
                     for s in skipped)
    # the chain has no link-local exemption: 169.254.0.0/16 is SNATed like any other non-VPC destination
    return MasqConfig(tuple(entries), masq_link_local=True, masq_link_local_ipv6=True, sources=(where,),
                      warnings=warnings)


# Cilium ------------------------------------------------------------------------------------------------------


def _cilium_intent(sources: Sources) -> MasqConfig:
    data = sources.configmaps.get(REFERENCE_CONFIGMAP, {}).get(REFERENCE_KEY)
    where = _source(REFERENCE_CONFIGMAP, REFERENCE_KEY)
    defaults = tuple(Entry(parse_cidr(t), False, Origin.DEFAULT)
                     for t in DEFAULT_NON_MASQUERADE + RESERVED_NON_MASQUERADE)
    if not data:  # a missing or zero-length file: the reserved ranges
        return MasqConfig(defaults)
    keeps = "Cilium keeps the map as it is"
    cidrs, link_local, link_local_v6 = _go_masq_fields(data, where, keeps)
    entries: list[Entry] = []
    for text, line in cidrs:
        prefix = _masked_cidr(text)  # netip.ParsePrefix, then Masked()
        if prefix is None:
            raise ConfigError(f"invalid CIDR {clip(text)!r} ({keeps})", source=where, line=line, code="invalid-cidr")
        entries.append(Entry(prefix, False, Origin.CONFIG, where, line))
    return MasqConfig(tuple(entries), masq_link_local=link_local, masq_link_local_ipv6=link_local_v6,
                      sources=(where,))


def cilium_map_intent(config: MasqConfig) -> frozenset[Prefix]:
    """The CIDRs Cilium puts in its map for this config: its non-masquerade CIDRs and the link-local ranges it
    exempts (169.254.0.0/16, fe80::/10) unless masqLinkLocal(IPv6)."""
    prefixes = {e.prefix for e in config.non_masquerade}
    if not config.masq_link_local:
        prefixes.add(LINK_LOCAL_V4)
    if not config.masq_link_local_ipv6:
        prefixes.add(LINK_LOCAL_V6)
    return frozenset(prefixes)


# --- the keys a writer ignores -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Ignored:
    """A key of a config a writer reads that the writer itself ignores (ipmasq's extensions: masqueradeCIDRs, rules,
    enableIPv6; AKS's merger and Cilium also drop cidrLimit and resyncInterval; the VPC CNI reads no config at all),
    and what that does to pod traffic, in words: "10.11.0.0/24 stays un-masqueraded"."""

    writer: str  # the profile's name
    key: str  # the documented spelling
    source: str  # the file (configmap/NAME[KEY], or the file linted)
    line: int | None
    effect: str  # what happens instead, one clause or several joined by "; "
    # the destinations whose pod traffic is treated otherwise than the key says (empty: nothing changes)
    changed: tuple[str, ...] = ()

    @property
    def changes_traffic(self) -> bool:
        return bool(self.changed)

    def where(self) -> str:
        return self.source if self.line is None else f"{self.source}:{self.line}"

    def message(self, *, located: bool = True) -> str:
        """"GKE's managed agent ignores masqueradeCIDRs (configmap/ip-masq-agent[config]:4): 10.11.0.0/24 stays
        un-masqueraded; enforce with ipmasq to use it"."""
        writer = WRITERS.get(self.writer)
        called = writer.called if writer is not None and writer.called else self.writer
        at = f" ({self.where()})" if located else ""
        tail = "; enforce with ipmasq to use it" if self.changed else ""
        return f"{called[:1].upper()}{called[1:]} ignores {self.key}{at}: {self.effect}{tail}"

    def hint(self) -> str:
        """How to act on it: enforce with ipmasq in the writer's place, or delete the key."""
        delete = "delete the key, so that the config says what the node does"
        if self.writer == "eks":
            return ("the VPC CNI reads aws-node's AWS_VPC_K8S_CNI_EXCLUDE_SNAT_CIDRS, not this ConfigMap: list the "
                    "ranges there, or set AWS_VPC_K8S_CNI_EXTERNALSNAT=true and enforce with ipmasq; otherwise "
                    + delete)
        if not self.changed:
            return delete
        return ("to have it enforced, run ipmasq in that agent's place (docs/how-to/migrate-from-ip-masq-agent.md); "
                "otherwise " + delete)


# how many destinations an effect names before "and N more" (Ignored.changed has them all)
_NAMED = 6


def config_files(writer: Writer, sources: Sources) -> tuple[tuple[str, bytes], ...]:
    """The config files among a writer's inputs whose keys ipmasq would read (configmap/NAME[KEY], bytes): the
    ip-masq-agent ConfigMap's `config` (which the VPC CNI does not read at all), AKS's ip-masq fragments."""
    if writer.name == "aks":
        return tuple(sorted((_source(name, key), data) for name in AKS_CONFIGMAPS
                            for key, data in sources.configmaps.get(name, {}).items()
                            if key.startswith(AKS_FRAGMENT_PREFIX)))
    data = sources.configmaps.get(REFERENCE_CONFIGMAP, {}).get(REFERENCE_KEY)
    return () if data is None else ((_source(REFERENCE_CONFIGMAP, REFERENCE_KEY), data),)


def ignored(writer: Writer, files: Sequence[tuple[str, bytes]], writes: MasqConfig | ConfigError,
            options: PolicyOptions | None = None) -> tuple[Ignored, ...]:
    """Every key of `files` that `writer` does not read (ipmasq reads it), with what that does to pod traffic:
    ipmasq's reading of the key against `writes`, the config the writer enforces (intended), or the error for which
    it enforces none. `options`: the writer's flags (default: its profile's)."""
    options = options or writer.options
    out: list[Ignored] = []
    if isinstance(writes, MasqConfig):
        preserved = Policy(writes, options if writer.name != "cilium" else PolicyOptions())
    else:
        preserved = None
    for where, data in files:
        try:
            doc = parse_document(data, where)
        except ConfigError:
            continue  # not a config: the writer's own error says so
        if doc is None:
            continue
        fields: dict[str, Field] = {}
        for f in doc.fields:
            canonical = KNOWN_KEYS.get(f.key.lower())
            if canonical is not None and canonical not in writer.keys and f.value.value is not None:
                fields[canonical] = f  # the last one wins, as everywhere
        if not fields:
            continue
        ours = _ipmasq_reading(doc, options)
        for key, f in fields.items():
            effect, changed = _effect(writer, key, ours, preserved, writes, options)
            out.append(Ignored(writer.name, key, where, f.line, effect, changed))
    return tuple(out)


def _ipmasq_reading(doc: Document, options: PolicyOptions) -> MasqConfig | None:
    """The file as ipmasq reads it, the node's rules aside (rules for other nodes kept: each is said); None when
    ipmasq refuses it too (lint and the agent say why)."""
    try:
        settings = settings_from_document(doc, enable_ipv6=True)
        return merge_settings([settings], all_reserved=options.nomasq_all_reserved_ranges, enable_ipv6=None)
    except ConfigError:
        return None


def _named(prefixes: Sequence[str]) -> str:
    shown = ", ".join(prefixes[:_NAMED])
    return shown + (f" and {len(prefixes) - _NAMED} more" if len(prefixes) > _NAMED else "")


def _spans_prefixes(family: Family, spans: Sequence[Span]) -> list[str]:
    return [str(p) for first, last in spans for p in to_prefixes(family, first, last)]


def _inside(a: Sequence[Span], b: Sequence[Span]) -> list[Span]:
    return subtract(a, subtract(a, b))


def _outcomes(dests: Sequence[Prefix], want: str, preserved: Policy, snat_to: str | None = None
              ) -> tuple[list[str], list[str]]:
    """What the writer does to pod traffic to `dests` where the key said `want` ("masquerade", "preserve",
    "snat"): (clauses, the destinations treated otherwise)."""
    clauses: list[str] = []
    changed: list[str] = []
    for family in Family:
        mine = union_of_prefixes([p for p in dests if p.family is family], family.bits)
        if not mine:
            continue
        kept = _inside(mine, preserved.preserved_ranges(family))
        masqueraded = subtract(mine, kept)
        kept_text, masq_text = _spans_prefixes(family, kept), _spans_prefixes(family, masqueraded)
        if want == "preserve":
            if masq_text:
                clauses.append(f"{_named(masq_text)} {'is' if len(masq_text) == 1 else 'are'} masqueraded")
                changed += masq_text
            if kept_text:
                clauses.append(f"{_named(kept_text)} {'keeps' if len(kept_text) == 1 else 'keep'} the pod's "
                               "address anyway (nothing lost)")
            continue
        if kept_text:
            clauses.append(f"{_named(kept_text)} {'stays' if len(kept_text) == 1 else 'stay'} un-masqueraded")
            changed += kept_text
        if masq_text and want == "snat":
            clauses.append(f"{_named(masq_text)} {'is' if len(masq_text) == 1 else 'are'} masqueraded to the "
                           f"node's address, not {snat_to}")
            changed += masq_text
        elif masq_text:
            clauses.append(f"{_named(masq_text)} {'is' if len(masq_text) == 1 else 'are'} masqueraded anyway "
                           "(nothing lost)")
    return clauses, changed


def _rule_traffic(rule: Rule) -> str:
    """A rule's traffic in words: "rule db (preserve, tcp port 5432 from 10.8.0.0/16)"."""
    words = [rule.action.value + (f" to {rule.snat_to}," if rule.snat_to else ",")]
    if rule.protocol:
        words.append(rule.protocol)
    if rule.ports:
        words.append("port" + ("s " if len(rule.ports) > 1 or rule.ports[0][0] != rule.ports[0][1] else " ")
                     + ",".join(str(a) if a == b else f"{a}-{b}" for a, b in rule.ports))
    if rule.sources:
        words.append("from " + _named([str(p) for p in rule.sources]))
    if rule.nodes:
        words.append("on nodes " + ",".join(rule.nodes))
    if len(words) == 1:
        words.append("any traffic")
    return f"rule {rule.name} ({' '.join(words)})"


_NOT_READ = {"cidrLimit": "its limit", "resyncInterval": "its resync"}


def _effect(writer: Writer, key: str, ours: MasqConfig | None, preserved: Policy | None,
            writes: MasqConfig | ConfigError, options: PolicyOptions) -> tuple[str, tuple[str, ...]]:
    if key == "enableIPv6" and isinstance(writes, ConfigError) and writes.code == "ipv6-disabled":
        return (f"IPv6 stays off for it, so it refuses the whole config ({writes.message}) and keeps its last good "
                "rules", ("::/0",))
    if preserved is None:
        return "it does not read it (it refuses these inputs anyway: see its error)", ()
    if key == "cidrLimit":
        if writer.name == "aks":
            return f"ip-masq-agent-v2 keeps its limit of {DEFAULT_CIDR_LIMIT} CIDRs (no traffic changes)", ()
        return "it has no CIDR limit (no traffic changes)", ()
    if key == "resyncInterval":
        if writer.name == "aks":
            return (f"ip-masq-agent-v2 re-applies its rules every {int(DEFAULT_RESYNC_SECONDS)} s (no traffic "
                    "changes)"), ()
        if writer.name == "cilium":
            return "Cilium follows the file as it changes and has no resync (no traffic changes)", ()
        return "it has no such setting (no traffic changes)", ()
    if ours is None:
        return "ipmasq refuses the file as well (lint it); what the key says is not known", ()
    clauses: list[str] = []
    changed: list[str] = []

    def add(found: tuple[list[str], list[str]], prefix: str = "") -> None:
        texts, moved = found
        if texts:
            clauses.append(prefix + ", ".join(texts))
        changed.extend(moved)

    if key == "masqueradeCIDRs":
        add(_outcomes([e.prefix for e in ours.masquerade], "masquerade", preserved))
    elif key == "nonMasqueradeCIDRs":
        add(_outcomes([e.prefix for e in ours.non_masquerade], "preserve", preserved))
    elif key in ("masqLinkLocal", "masqLinkLocalIPv6"):
        v4 = key == "masqLinkLocal"
        on = ours.masq_link_local if v4 else ours.masq_link_local_ipv6
        add(_outcomes([LINK_LOCAL_V4 if v4 else LINK_LOCAL_V6], "masquerade" if on else "preserve", preserved))
    elif key == "enableIPv6":
        if not ours.enable_ipv6:
            return "IPv6 stays off, as the key says (no traffic changes)", ()
        if Family.V6 not in preserved.families:
            return ("it writes no IPv6 rules (only its --enable-ipv6 flag would): IPv6 pod traffic stays "
                    "un-masqueraded everywhere"), ("::/0",)
        return "it manages IPv6 by its own flag (no traffic changes)", ()
    elif key == "rules":
        for number, rule in enumerate(ours.rules):
            texts, moved = _outcomes(list(rule.destinations), rule.action.value, preserved, rule.snat_to)
            if texts and number < _NAMED:
                clauses.append(f"{_rule_traffic(rule)}: " + ", ".join(texts))
            changed.extend(moved)
        if len(ours.rules) > _NAMED:
            clauses.append(f"and {len(ours.rules) - _NAMED} more rules")
    if not clauses:
        return "it lists nothing (no traffic changes)", ()
    return "; ".join(clauses), tuple(dict.fromkeys(changed))


# --- what cannot be observed ----------------------------------------------------------------------------------


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
