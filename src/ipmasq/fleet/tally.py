"""What the ConfigMap says about the fleet: N nodes' verdicts on its current content, told in at most two Events.

Pure: the ConfigMap's content digest and the nodes' IPMasqAgentStatus values in, a tally and its summaries out. A
node has applied the content when the digest it enforces is the ConfigMap's (in observe mode: when its rules were
observed to enforce it); it does not enforce it when it observed the node's rules against that content and found
them wrong (observe mode: another program writes them); it has rejected it when its last rejection was about that
very content; else it has not said yet. Every line quoted from a status object is made one line
(ipmasq.errors.one_line): a status is written by an agent, and read here as anything could have written it. The
summaries are what one elected agent writes on the ConfigMap (ipmasq.agent.api.summary): "rejected on 998 of 1,000
nodes: <the line>" as one Warning, "enforced on 2 of 1,000 nodes" as one Normal Event, however many nodes there are.
Each node's own reason stays on its status object and its Node's Events. Where the node-trust admission policy is
not in force (ipmasq.fleet.nodetrust), every summary says right after its counts that they are unverified, and why.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from ipmasq.errors import clip, one_line
from ipmasq.kube.agentstatus import NodeStatus
from ipmasq.kube.events import MESSAGE_CHARS

__all__ = ["Summary", "Tally", "tally"]

REASONS_SHOWN = 3  # distinct rejection lines named; the others are counted


@dataclass(frozen=True, slots=True)
class Summary:
    type: Literal["Normal", "Warning"]
    reason: str
    message: str


@dataclass(frozen=True, slots=True)
class Tally:
    nodes: int
    applied: int
    rejected: int
    summaries: tuple[Summary, ...]
    not_enforced: int = 0  # observed against the content, and their rules do not enforce it

    @property
    def pending(self) -> int:
        """Nodes that have neither applied nor rejected the content (yet, or ever: an agent that is down)."""
        return self.nodes - self.applied - self.rejected - self.not_enforced


def _nodes(count: int) -> str:
    return f"{count:,} node" + ("" if count == 1 else "s")


def tally(digest: str, statuses: Sequence[NodeStatus], *, unverified: str | None = None) -> Tally:
    """The fleet's verdicts on the content with this config_digest, and what to say of them; `unverified`: why the
    statuses cannot be believed (said in every summary), None when they can."""
    qualifier = f" (unverified: {one_line(unverified)})" if unverified else ""
    total = len(statuses)
    compared = [s for s in statuses if s.config_digest == digest]
    applied = [s for s in compared if s.mismatch is None]
    wrong = [s for s in compared if s.mismatch is not None]
    rejected = [s for s in statuses if s.config_digest != digest and s.rejected_digest == digest
                and s.last_rejection]
    pending = total - len(compared) - len(rejected)
    summaries: list[Summary] = []
    if wrong:
        summaries.append(_not_enforced(wrong, total, len(applied), pending, qualifier))
    if rejected:
        message = (f"rejected on {len(rejected):,} of {_nodes(total)}{qualifier}: "
                   + _reasons([s.last_rejection or "" for s in rejected], len(applied), pending)
                   + ". They keep their last good config; each node's reason is on its status (kubectl get ipmasq "
                   "-o wide) and its Node's Events")
        # long lines are clipped from the end: the counts and the most common line come first
        summaries.append(Summary("Warning", "ConfigRejected", clip(message, MESSAGE_CHARS - 1)))  # "…" is 1
    if applied:
        hashes = Counter((s.policy_hash or "")[:12] for s in applied)
        policy = (f"policy {next(iter(hashes))}" if len(hashes) == 1
                  else f"{len(hashes)} policies (config rules for some nodes)")
        tail = f" ({pending:,} not reported yet)" if pending else ""
        summaries.append(Summary("Normal", "ConfigApplied", clip(
            f"enforced on {len(applied):,} of {_nodes(total)}{qualifier}: {policy}{tail}", MESSAGE_CHARS - 1)))
    return Tally(total, len(applied), len(rejected), tuple(summaries), not_enforced=len(wrong))


def _reasons(lines: Sequence[str], applied: int, pending: int) -> str:
    """The distinct lines, most common first (counted when they differ, the rarest summed up), one_line'd, then
    how many enforce the content and have not reported yet."""
    counted = Counter(one_line(line) for line in lines).most_common()
    shown = [line if len(counted) == 1 else f"{line} ({_nodes(count)})" for line, count in counted[:REASONS_SHOWN]]
    if len(counted) > REASONS_SHOWN:
        rest = sum(count for _line, count in counted[REASONS_SHOWN:])
        shown.append(f"{len(counted) - REASONS_SHOWN} other reasons ({_nodes(rest)})")
    others = [f"{applied:,} enforce it" if applied else "", f"{pending:,} not reported yet" if pending else ""]
    tail = "; ".join(o for o in others if o)
    return "; ".join(shown) + (f" ({tail})" if tail else "")


def _not_enforced(wrong: Sequence[NodeStatus], total: int, applied: int, pending: int, qualifier: str) -> Summary:
    """Observe mode: the nodes whose rules, written by another program, do not enforce the content."""
    writers = Counter(f"{one_line(s.writer or 'another agent')} in {one_line(s.chain or '?')}" for s in wrong)
    message = (f"not enforced on {len(wrong):,} of {_nodes(total)}{qualifier} (observed: the rules of "
               + ", ".join(writer for writer, _count in writers.most_common(REASONS_SHOWN)) + "): "
               + _reasons([s.mismatch or "" for s in wrong], applied, pending)
               + ". Each node's reason is on its status (kubectl get ipmasq -o wide)")
    return Summary("Warning", "ConfigNotEnforced", clip(message, MESSAGE_CHARS - 1))
