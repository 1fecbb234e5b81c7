"""`check --writer eks`: the Amazon VPC CNI's AWS-SNAT-CHAIN-0 against the aws-node DaemonSet's environment.

The structural part names what the CNI should have written and did not (the chain or its POSTROUTING jump, an
exclusion the env lists, SNAT left on with AWS_VPC_K8S_CNI_EXTERNALSNAT=true); the semantic part is check's own
packet-space comparison (ipmasq.diagnose.check_semantic.semantic_findings) of every class of pod packets traced through
POSTROUTING, the CNI's chain included, against the intent of ipmasq.writers (VPC CIDRs and exclusions keep the pod's
address, everything else is SNATed to the node). IPv4 only: the CNI writes no SNAT rules for IPv6.
Pure: tables, intent and env in, findings out.
"""

from __future__ import annotations

from collections.abc import Mapping

from ipmasq.diagnose.check import CheckReport, FindingId, NodeRules, tracer_beside
from ipmasq.diagnose.check_semantic import semantic_findings
from ipmasq.errors import clip
from ipmasq.findings import Finding, Severity, named
from ipmasq.netfilter.aws_snat import CHAIN, AwsSnatChain, read_aws_snat_chain
from ipmasq.policy.policy import Policy
from ipmasq.prefix import Family, Prefix
from ipmasq.writers import ENV_EXCLUDE_SNAT_CIDRS, ENV_EXTERNAL_SNAT, eks_exclusions, eks_external_snat

__all__ = ["DEFAULT_OUT_INTERFACE", "check_eks", "node_chain"]

# Pod traffic leaves by the primary ENI; the CNI's SNAT rule skips vlan+ (branch ENIs of pods with security groups)
DEFAULT_OUT_INTERFACE = "eth0"
_RESTART = "ipamd reads its env at start: `kubectl -n kube-system rollout restart ds/aws-node` after changing it"


def node_chain(rules: NodeRules) -> AwsSnatChain | None:
    table = rules.tables.get(Family.V4)
    return None if table is None else read_aws_snat_chain(table)


def check_eks(policy: Policy, rules: NodeRules, env: Mapping[str, str], *, pod_ranges: tuple[Prefix, ...] = (),
              local_addresses: tuple[int, ...] = (), out_interface: str = DEFAULT_OUT_INTERFACE) -> CheckReport:
    """`policy`: ipmasq.writers.intended for eks with the VPC's CIDRs, under the eks profile's options."""
    table = rules.tables.get(Family.V4)
    if table is None:
        return CheckReport((Finding(FindingId.UNSUPPORTED, Severity.ERROR,
                                    "no IPv4 iptables nat table to compare: the VPC CNI writes AWS-SNAT-CHAIN-0 with "
                                    "iptables (give iptables-save output)", "iptables-save -t nat > node.save"),))
    beside, unread = tracer_beside(rules)
    findings = _structure(read_aws_snat_chain(table), env) + unread
    findings.extend(semantic_findings(policy, table, Family.V4, ours=set(), pod_ranges=pod_ranges,
                                      local=local_addresses, beside=beside, out_interface=out_interface))
    return CheckReport(tuple(findings))


def _structure(chain: AwsSnatChain | None, env: Mapping[str, str]) -> list[Finding]:
    findings: list[Finding] = []
    kept, skipped = eks_exclusions(env)
    for entry in skipped:
        findings.append(Finding(FindingId.UNSUPPORTED, Severity.WARNING,
                                f"aws-node's {ENV_EXCLUDE_SNAT_CIDRS} entry {clip(entry)!r} is not a CIDR: the CNI "
                                "skips it (logging only), so that traffic is SNATed",
                                "write it as a CIDR, comma-separated without blanks (10.8.0.0/16,192.168.0.0/16)"))
    if eks_external_snat(env):
        if chain is not None and (chain.jump or chain.snat_to is not None):
            findings.append(Finding(FindingId.RULES_DIFFER, Severity.ERROR,
                                    f"aws-node has {ENV_EXTERNAL_SNAT}=true (no SNAT on the node), but {CHAIN} is "
                                    "still there" + (f" and SNATs to {chain.snat_to}" if chain.snat_to else ""),
                                    _RESTART))
        return findings
    if chain is None or not chain.jump:
        what = f"the nat table has no {CHAIN}" if chain is None else f"POSTROUTING has no jump to {CHAIN}"
        findings.append(Finding(FindingId.CHAIN_MISSING if chain is None else FindingId.JUMP_MISSING,
                                Severity.ERROR, f"{what}: the VPC CNI's node SNAT is not in place",
                                "is aws-node running on this node? `kubectl -n kube-system get pods -l "
                                "k8s-app=aws-node -o wide` and its logs (ipamd.log)"))
        return findings
    have = set(chain.exclusions)
    missing = [str(p) for p in kept if p not in have]
    extra = [str(p) for p in chain.exclusions if p not in set(kept)]
    if missing:
        findings.append(Finding(FindingId.CONFIG_NOT_APPLIED, Severity.ERROR,
                                f"aws-node's {ENV_EXCLUDE_SNAT_CIDRS} excludes {named(missing)} from SNAT, but "
                                f"{CHAIN} has no RETURN for it: that traffic is SNATed to the node", _RESTART,
                                missing=tuple(missing)))
    if extra:
        findings.append(Finding(FindingId.RULES_DIFFER, Severity.ERROR,
                                f"{CHAIN} excludes {named(extra)} from SNAT, which aws-node's "
                                f"{ENV_EXCLUDE_SNAT_CIDRS} does not list (an older env): that traffic keeps the pod's "
                                "address", _RESTART, extra=tuple(extra)))
    if chain.snat_to is None:
        findings.append(Finding(FindingId.CONFIG_NOT_APPLIED, Severity.ERROR,
                                f"{CHAIN} has no SNAT rule: pod traffic leaving the VPC keeps the pod's address",
                                _RESTART))
    return findings
