"""What a writer intends: `intended(writer, sources)` turns what the API server holds into the `MasqConfig` that
writer would enforce, following its own reading: the reference agent's lenient YAML (`reading`), AKS's merger of
every `ip-masq*` fragment, the VPC CNI's environment variables, Cilium's BPF map semantics."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import replace

from ipmasq.config.document import DocumentNode, parse_document
from ipmasq.config.model import (
    DEFAULT_NON_MASQUERADE,
    LINK_LOCAL_V4,
    LINK_LOCAL_V6,
    RESERVED_NON_MASQUERADE,
    Entry,
    MasqConfig,
    Origin,
)
from ipmasq.config.source import ConfigInput, config_from_bytes
from ipmasq.errors import ConfigError, PrefixError, clip
from ipmasq.options import PolicyOptions
from ipmasq.prefix import Family, Prefix, parse_cidr
from ipmasq.writers.profiles import (
    AKS_CONFIGMAPS,
    AKS_FRAGMENT_PREFIX,
    EKS_DAEMONSET,
    ENV_EXCLUDE_SNAT_CIDRS,
    ENV_EXTERNAL_SNAT,
    REFERENCE_CONFIGMAP,
    REFERENCE_KEY,
    WRITERS,
    Sources,
    Writer,
    configmap_source,
)

__all__ = ["cilium_map_intent", "eks_exclusions", "eks_external_snat", "eks_with_vpc", "intended", "reading"]


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
    files = () if data is None else ((configmap_source(REFERENCE_CONFIGMAP, REFERENCE_KEY), data),)
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
        where = configmap_source(name, key)
        listed, masq_ll, masq_ll6 = _aks_fragment(data, where)
        cidrs.update(listed)
        link_local, link_local_v6 = link_local or masq_ll, link_local_v6 or masq_ll6
    if not fragments:
        return config_from_bytes(ConfigInput(()), writer.options)
    merged = {"nonMasqueradeCIDRs": sorted(cidrs), "masqLinkLocal": link_local, "masqLinkLocalIPv6": link_local_v6}
    shown = "azure-ip-masq-merger(" + ", ".join(configmap_source(name, key) for key, name, _ in fragments) + ")"
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
    kept, skipped = eks_exclusions(env)
    entries = tuple(Entry(p, False, Origin.CONFIG, f"{where} {ENV_EXCLUDE_SNAT_CIDRS}") for p in kept)
    warnings = tuple(f"{where}: {ENV_EXCLUDE_SNAT_CIDRS} entry {clip(s)!r} is not a CIDR: the VPC CNI skips it"
                     for s in skipped)
    # the chain has no link-local exemption: 169.254.0.0/16 is SNATed like any other non-VPC destination
    config = MasqConfig(entries, masq_link_local=True, masq_link_local_ipv6=True, sources=(where,), warnings=warnings)
    return eks_with_vpc(config, sources.vpc_cidrs)


def eks_with_vpc(config: MasqConfig, vpc_cidrs: Sequence[str]) -> MasqConfig:
    """EKS's intent with the VPC's CIDRs first (what the instance metadata service tells the CNI; observe mode takes
    them from the node's chain, known only when the rules are read, and adds them to the config it loaded)."""
    entries: list[Entry] = []
    for text in vpc_cidrs:
        prefix = _masked_cidr(text)
        if prefix is None:
            raise ConfigError(f"VPC CIDR {clip(text)!r} is not a CIDR")
        entries.append(Entry(prefix, False, Origin.CONFIG, "VPC CIDR"))
    return replace(config, non_masquerade=(*entries, *config.non_masquerade)) if entries else config


# Cilium ------------------------------------------------------------------------------------------------------


def _cilium_intent(sources: Sources) -> MasqConfig:
    data = sources.configmaps.get(REFERENCE_CONFIGMAP, {}).get(REFERENCE_KEY)
    where = configmap_source(REFERENCE_CONFIGMAP, REFERENCE_KEY)
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
