"""`check`: the intent (a Policy) against the node's real nat rules, as findings with stable ids and fix hints.

`check_node` is the entry point: every family of an iptables node, or our nftables table. The passes live by name:
the structural pass on an iptables nat table in ipmasq.diagnose.check_iptables, on our nftables table in
ipmasq.diagnose.check_nft, the config's `rules` one by one in ipmasq.diagnose.check_rules, the semantic pass (a pod
packet traced through the whole nat postrouting per class of packets, against the policy's verdict) in
ipmasq.diagnose.check_semantic, and the finding ids and the report in ipmasq.diagnose.check_report.

Pure: tables and policies in, findings (ipmasq.findings) out (ipmasq.diagnose.sources reads the tables).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from ipmasq.diagnose.check_iptables import check_iptables
from ipmasq.diagnose.check_nft import check_nft
from ipmasq.diagnose.check_report import CheckReport, FindingId
from ipmasq.diagnose.trace_nft import NftTracer
from ipmasq.errors import NftTraceError
from ipmasq.findings import Finding, Severity
from ipmasq.netfilter.iptables import NatTable
from ipmasq.netfilter.nft import NftTable
from ipmasq.policy.policy import Policy
from ipmasq.prefix import Family, Prefix
from ipmasq.writers import Ignored

# FindingId and CheckReport are named here too: what check_node returns and its findings' ids
__all__ = ["CheckReport", "FindingId", "NodeRules", "check_node", "ignored_findings", "tracer_beside"]


@dataclass(frozen=True, slots=True)
class NodeRules:
    """The nat rules `check` compares with the intent: iptables nat tables by family, or our nftables table."""

    backend: str  # "iptables" or "nftables"
    # iptables: the nat table of each family read; nftables: iptables-nft's nat tables beside ours (kube-proxy's
    # iptables mode), walked in iptables' terms with the nftables chains
    tables: Mapping[Family, NatTable]
    nft: NftTable | None = None  # nftables: our table, None when the node has none
    # the whole `nft -j list ruleset`, for the semantic pass: on nftables every nat chain; on iptables the nftables
    # nat chains beside iptables' (kube-proxy's nftables mode, others), iptables-nft's own tables aside
    nft_ruleset: str | None = None


def ignored_findings(ignored: Iterable[Ignored]) -> list[Finding]:
    """One finding per key the writer does not read: an error when pod traffic is treated otherwise than the key
    says (never rules-differ: the writer will not write it, on any sync), a warning when nothing changes."""
    return [Finding(FindingId.IGNORED_BY_WRITER, Severity.ERROR if item.changes_traffic else Severity.WARNING,
                    item.message(), item.hint(), destinations=item.changed) for item in ignored]


def tracer_beside(rules: NodeRules) -> tuple[NftTracer | None, list[Finding]]:
    """The nftables nat chains beside iptables' (kube-proxy's nftables mode, others), walked with them; a listing the
    tracer cannot read is a warning, and the comparison goes on without them."""
    if rules.nft_ruleset is None:
        return None, []
    try:
        return NftTracer(rules.nft_ruleset), []
    except NftTraceError as exc:
        return None, [Finding(FindingId.UNSUPPORTED, Severity.WARNING,
                              f"the nftables nat chains beside iptables are not compared: {exc}",
                              "read them by hand: nft list ruleset")]


def check_node(policy: Policy, rules: NodeRules, *, pod_ranges: tuple[Prefix, ...] = (),
               local_addresses: tuple[tuple[Family, int], ...] = (), writer: str | None = None) -> CheckReport:
    """Every family the rules hold (iptables), or our nftables table, against the policy. `writer`: the provider's
    agent whose flags the policy's options are (check_iptables)."""
    if rules.backend == "nftables":
        return check_nft(policy, rules.nft, ruleset=rules.nft_ruleset, pod_ranges=pod_ranges,
                         local_addresses=local_addresses, iptables=rules.tables)
    beside, findings = tracer_beside(rules)
    for family, table in rules.tables.items():
        local = tuple(address for f, address in local_addresses if f is family)
        findings.extend(check_iptables(policy, table, family, pod_ranges=pod_ranges, local_addresses=local,
                                       beside=beside, writer=writer).findings)
    return CheckReport(tuple(findings))
