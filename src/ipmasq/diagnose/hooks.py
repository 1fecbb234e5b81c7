"""The nat postrouting hook as the kernel runs it: every nat base chain of the packet's family, by priority.

Whatever wrote them (iptables-legacy's nat table, iptables-nft's `ip nat` table, nftables tables such as the agent's
`inet ip-masq-agent` or kube-proxy's `ip kube-proxy`), the kernel keeps one list of nat chains per hook, sorted by
priority, and runs them until one sets up the connection's source NAT: a masquerade or snat there is final for the
connection (conntrack keeps it), an accept or the chain's end hands the packet to the next chain. iptables' nat
POSTROUTING sits at priority 100 (srcnat), as kube-proxy's `nat-postrouting` and the agent's nftables chain do.

Chains of equal priority run newest hook first (measured: of two chains at 100, the one created last NATs the
packet), and no listing shows when a hook was registered (kube-proxy re-creates its base chains on every restart).
So chains of one priority are walked each on its own: when at most one of them NATs the packet, or all NAT it the
same way, the outcome does not depend on their order; when they NAT it differently the answer is "cannot decide",
naming them.

Pure: each chain's walk is given as a function (the iptables or the nftables tracer), the packet and the walks'
results in, one TraceResult out.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from itertools import groupby

from ipmasq.diagnose.trace import Step, Tracer, TraceResult
from ipmasq.policy.packet import Outcome, Packet

__all__ = ["IPTABLES_NAT_PRIORITY", "IPTABLES_NFT_TABLES", "NatHook", "iptables_hook", "walk_hooks"]

# NF_IP_PRI_NAT_SRC: where iptables' nat POSTROUTING runs, legacy (iptable_nat) and nft (`ip nat`'s chain) alike
IPTABLES_NAT_PRIORITY = 100
# the nftables tables iptables-nft keeps its nat rules in: read with iptables-save, they are walked in iptables' terms
IPTABLES_NFT_TABLES = frozenset({("ip", "nat"), ("ip6", "nat")})
_NAT = (Outcome.MASQUERADE, Outcome.SNAT)


@dataclass(frozen=True, slots=True)
class NatHook:
    """One nat base chain at postrouting: its priority, its name as a person reads it ("ip kube-proxy
    nat-postrouting", "iptables nat POSTROUTING") and the walk of a packet through it alone (PRESERVE: the chain
    hands the packet on; the result's mark is the packet's mark after the chain)."""

    priority: int
    name: str
    walk: Callable[[Packet, bool], TraceResult]


def iptables_hook(tracer: Tracer) -> NatHook | None:
    """iptables' nat POSTROUTING (an iptables-save reading, as a Tracer) as one hook; None when the table has no
    POSTROUTING (iptables never used on the node: no hook is registered)."""
    if "POSTROUTING" not in tracer.chains:
        return None
    return NatHook(IPTABLES_NAT_PRIORITY, "iptables nat POSTROUTING",
                   lambda packet, record_steps: tracer.trace(packet, record_steps=record_steps))


def _what(result: TraceResult) -> str:
    if result.outcome is Outcome.SNAT:
        return f"snat to {result.snat_to}"
    return "masquerade"


def walk_hooks(hooks: Sequence[NatHook], packet: Packet, *, record_steps: bool = True) -> TraceResult:
    """The packet's walk through every chain of `hooks` (in any order: sorted here, by priority, stably)."""
    steps: list[Step] = []
    chains: list[str] = []
    notes: list[str] = []
    mark = packet.mark
    handed_on: TraceResult | None = None  # the last chain that let the packet go on, for "decided by"

    def joined(result: TraceResult, *, undecided: str | None = None, mark: int | None = None) -> TraceResult:
        """The deciding chain's result over the whole walk (one copy: check walks thousands of packets);
        `undecided`: the walk cannot decide, why; `mark`: the mark after the walk, when not the result's."""
        if undecided is not None:
            return replace(result, steps=tuple(steps), chains=tuple(chains), notes=tuple(notes),
                           outcome=Outcome.UNDECIDED, snat_to=None, undecided_reason=undecided)
        return replace(result, steps=tuple(steps), chains=tuple(chains), notes=tuple(notes),
                       mark=result.mark if mark is None else mark)

    for priority, grouped in groupby(sorted(hooks, key=lambda h: h.priority), key=lambda h: h.priority):
        group = list(grouped)
        arriving = packet if mark == packet.mark else replace(packet, mark=mark)
        walked = [(hook, hook.walk(arriving, record_steps)) for hook in group]
        for _, result in walked:
            steps.extend(result.steps)
            chains.extend(result.chains)
        for hook, result in walked:
            if result.outcome is Outcome.UNDECIDED:
                if len(group) > 1:
                    notes.append(f"{hook.name} shares priority {priority} with "
                                 f"{', '.join(h.name for h in group if h is not hook)}")
                return joined(result)
        natting = [(hook, result) for hook, result in walked if result.outcome in _NAT]
        if natting:
            first = natting[0][1]
            others = natting[1:]
            if any((r.outcome, r.snat_to) != (first.outcome, first.snat_to) for _, r in others):
                ways = "; ".join(f"{h.name}: {_what(r)} ({r.decided_label})" for h, r in natting)
                return joined(first, undecided=(
                    f"chains of the same priority {priority} NAT this packet differently ({ways}): the kernel runs "
                    "the one whose hook was registered last first, which no listing shows"))
            if len(group) > 1 and not others:
                names = " and ".join(h.name for h in group)
                notes.append(f"{names} share priority {priority}: each was walked (no listing shows which the "
                             f"kernel runs first); only {natting[0][0].name} NATs this packet, so the order does not "
                             "change the outcome")
            for hook, result in others:
                notes.append(f"{hook.name} (same priority {priority}) would {_what(result)} it too "
                             f"({result.decided_label}): whichever of them the kernel runs first, the destination "
                             "sees the same source")
            return joined(first)
        marks = {result.mark for _, result in walked} - {mark}
        if len(marks) > 1:
            return joined(walked[0][1], undecided=(
                f"chains of the same priority {priority} set different marks "
                f"({', '.join(f'{m:#x}' for m in sorted(marks))}) and their order is unknown"))
        if marks:
            mark = marks.pop()
        for _, result in walked:
            if result.decided_by is not None:
                handed_on = result
    if handed_on is None:
        return TraceResult(tuple(steps), Outcome.PRESERVE, None, None, mark=mark, chains=tuple(chains),
                           notes=tuple(notes))
    return joined(handed_on, mark=mark)
