"""The fleet's verdict on one content in at most two Events, however many nodes: the tally is pure."""

from __future__ import annotations

from dataclasses import replace

from ipmasq.fleet.tally import tally
from ipmasq.kube.agentstatus import NodeStatus
from ipmasq.kube.events import MESSAGE_CHARS

NEW, OLD = "n" * 64, "o" * 64
LINE = "configmap/ip-masq-agent[config]:3: nonMasqueradeCIDRs[0]: invalid CIDR '10.0.0.0/33'"
BASE = NodeStatus(node="", pod=None, version="0.1.0", backend="iptables-nft", ready=True, reason="ready",
                  policy_hash="a" * 64, config_digest=OLD, config_source="api", configmaps=(), last_rejection=None,
                  last_rejection_time=None, drift_repairs=0, foreign_masquerade_rules=0, updated="")


def node(i: int, *, applied: bool = False, rejected: str | None = None, about: str = NEW) -> NodeStatus:
    status = replace(BASE, node=f"node-{i:04d}")
    if applied:
        return replace(status, config_digest=NEW, policy_hash="b" * 64)
    if rejected is not None:
        return replace(status, ready=False, last_rejection=rejected, rejected_digest=about)
    return status


def test_a_bad_edit_on_a_thousand_nodes_is_one_warning_with_the_line_and_the_counts() -> None:
    fleet = [node(i, rejected=LINE) for i in range(998)] + [node(998, applied=True), node(999)]
    result = tally(NEW, fleet)
    assert (result.nodes, result.applied, result.rejected, result.pending) == (1000, 1, 998, 1)
    warning, normal = result.summaries
    assert (warning.type, warning.reason) == ("Warning", "ConfigRejected")
    assert warning.message.startswith(f"rejected on 998 of 1,000 nodes: {LINE} (1 enforce it; 1 not reported yet)")
    assert "kubectl get ipmasq -o wide" in warning.message
    assert (normal.type, normal.reason, normal.message) == (
        "Normal", "ConfigApplied", "enforced on 1 of 1,000 nodes: policy bbbbbbbbbbbb (1 not reported yet)")


def test_distinct_reasons_are_counted_most_common_first_and_the_message_stays_bounded() -> None:
    fleet = ([node(i, rejected=LINE) for i in range(5)] + [node(5 + i, rejected=f"x:{i}: " + "y" * 400)
                                                           for i in range(6)])
    (warning,) = tally(NEW, fleet).summaries
    assert warning.message.startswith(f"rejected on 11 of 11 nodes: {LINE} (5 nodes); x:0: ")
    assert len(warning.message) <= MESSAGE_CHARS


def test_a_rejection_of_an_older_content_and_a_node_not_reporting_are_pending_not_rejected() -> None:
    fleet = [node(0, rejected=LINE, about=OLD), node(1), node(2, applied=True)]
    result = tally(NEW, fleet)
    assert (result.applied, result.rejected, result.pending) == (1, 0, 2)
    (normal,) = result.summaries
    assert normal.message == "enforced on 1 of 3 nodes: policy bbbbbbbbbbbb (2 not reported yet)"


def test_every_node_applied_and_per_node_policies_are_counted_not_listed() -> None:
    fleet = [node(i, applied=True) for i in range(3)]
    fleet[0] = replace(fleet[0], policy_hash="c" * 64)
    (normal,) = tally(NEW, fleet).summaries
    assert normal.message == "enforced on 3 of 3 nodes: 2 policies (config rules for some nodes)"
    assert tally(NEW, []).summaries == () and tally(NEW, [node(0)]).summaries == ()
