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

The profiles are in ipmasq.writers.profiles, each writer's reading in ipmasq.writers.intent, the keys it ignores in
ipmasq.writers.ignored_keys; this package names them all. Pure: values in, values out. No I/O, no clock; the callers
(check, observe mode) read the API and the kernel.
"""

from __future__ import annotations

from ipmasq.writers.ignored_keys import Ignored, config_files, ignored
from ipmasq.writers.intent import (
    cilium_map_intent,
    eks_exclusions,
    eks_external_snat,
    eks_with_vpc,
    intended,
    reading,
)
from ipmasq.writers.profiles import (
    AKS_CONFIGMAPS,
    CILIUM_MAP,
    EKS_CHAIN,
    EKS_DAEMONSET,
    ENV_EXCLUDE_SNAT_CIDRS,
    ENV_EXTERNAL_SNAT,
    MERGED_KEYS,
    REFERENCE_CONFIGMAP,
    REFERENCE_KEY,
    REFERENCE_KEYS,
    WRITERS,
    Cited,
    NodeFacts,
    Sources,
    Writer,
    unobservable,
)

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
    "eks_with_vpc",
    "ignored",
    "intended",
    "reading",
    "unobservable",
]
