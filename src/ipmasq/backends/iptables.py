"""The iptables backend: read with `iptables-save -t nat`, write with one `iptables-restore --noflush -w` transaction.

Our objects are the chains ipmasq wrote, as the kernel records it (ipmasq.netfilter.iptables.chain_ownership): each
such chain has its ownership marker, a chain `IPMASQ-OWNS-<chain>` declared in the same transaction, never jumped
to, whose one rule records the digest of the chain's jump and rules as written. Ours: every marked chain whose rules
still hash to that digest (so one left under an old --masq-chain is ours too), its POSTROUTING jumps that carry our
jump comment, and every marker (one whose chain another program rewrote since no longer tells the truth: it goes,
the chain stays). The agent's own read also takes the chain named by --masq-chain, marked or not, whatever it holds
(Adopt.CONFIGURED: a reference agent's chain on migration, an ipmasq 0.2.0 chain, drift) and its next write marks it
with the digest of what it wrote. A chain with the reference agent's comments and no marker, or whose rules changed
since ipmasq wrote them, is another program's (GKE's `IP-MASQ`, AKS's `IP-MASQ-AGENT`, the reference agent's after
a migration back): it is never read as ours, rewritten or removed. Nothing else is read or written.

The variant (legacy or nft) is the one the node uses, detected like kubernetes-sigs/iptables-wrappers does:
kubelet's/kube-proxy's hint chains first, then whichever variant holds more rules.
"""

from __future__ import annotations

import functools
import itertools
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from enum import Enum

from ipmasq.backends.base import Adopt, Ownership, Result, Runner, State
from ipmasq.errors import BackendError, LockBusyError
from ipmasq.netfilter.iptables import (
    RULE_COMMENT_PREFIX,
    NatTable,
    canonical,
    chain_digest,
    chain_ownership,
    chain_rules,
    count_rules,
    is_marker,
    is_our_jump,
    jump_rule,
    marker_chain,
    marker_rule,
    parse_save,
    recorded_digest,
    rule_target,
    written_digest,
)
from ipmasq.policy.policy import Policy
from ipmasq.prefix import Family

__all__ = ["IptablesBackend", "Variant", "choose_variant", "detect_variant", "ownership_of", "tools"]

# The xtables lock is only taken by the legacy variant; waiting 1 s keeps SIGTERM prompt, the loop retries.
_LOCK_WAIT = ("-w", "1")
# iptables-restore exits 4 (RESOURCE_PROBLEM) when it gave up waiting for the xtables lock.
_LOCK_EXIT = 4
_FAILED_LINE = re.compile(r"(?:Error occurred at line|line):? (\d+)")
_HINTS = ("KUBE-IPTABLES-HINT", "KUBE-KUBELET-CANARY")
# `iptables-save -c`: "[packets:bytes] -A ..." on a config rule's line (the comment names the rule)
_RULE_COUNTERS = re.compile(r'\[(\d+):(\d+)\] -A .*--comment "' + re.escape(RULE_COMMENT_PREFIX) + r'([a-z0-9-]+)"')


class Variant(Enum):
    LEGACY = "legacy"
    NFT = "nft"


@dataclass(frozen=True, slots=True)
class Tools:
    """The save and restore programs of one iptables variant and address family."""

    save: str
    restore: str


def tools(variant: Variant, family: Family) -> Tools:
    base = "iptables" if family is Family.V4 else "ip6tables"
    return Tools(f"{base}-{variant.value}-save", f"{base}-{variant.value}-restore")


def choose_variant(*, legacy_dump: str, nft_dump: str) -> Variant:
    """Pure: which variant the node uses, from both variants' iptables-save output (all tables, both families)."""
    if any(h in nft_dump for h in _HINTS):
        return Variant.NFT
    if any(h in legacy_dump for h in _HINTS):
        return Variant.LEGACY
    # iptables-wrappers: the variant with more rules; a tie (an empty node) goes to nft, today's default
    return Variant.LEGACY if count_rules(legacy_dump) > count_rules(nft_dump) else Variant.NFT


def detect_variant(run: Runner) -> Variant:
    dumps = {}
    for variant in Variant:
        text = []
        for family in Family:
            try:
                result = run([tools(variant, family).save])
            except BackendError:
                continue  # the variant's tools are not installed: it holds no rules of the node
            if result.returncode == 0:  # a variant whose tables cannot be read holds no rules of the node
                text.append(result.stdout)
        dumps[variant] = "".join(text)
    return choose_variant(legacy_dump=dumps[Variant.LEGACY], nft_dump=dumps[Variant.NFT])


def state_from_save(table: NatTable, chain: str, family: Family, *, adopt: Adopt = Adopt.CONFIGURED) -> State:
    """Our objects in an iptables-save table: our jumps (to our chains) in order, then each of our chains and its
    rules (`chain` first), then every ownership marker (sorted) with whatever it holds (a marker whose chain changed
    since ipmasq wrote it too: it no longer tells the truth, and goes)."""
    ownership = chain_ownership(table, chain, taken=chain if adopt is Adopt.CONFIGURED else None)
    names = list(ownership.owned)
    if adopt is Adopt.ALL:
        names.extend((*ownership.unmarked, *ownership.changed))
    elif adopt is Adopt.CONFIGURED and chain in ownership.unmarked:
        names.append(chain)
    names.sort(key=lambda name: (name != chain, name))
    mine = set(names)
    objects = [r for r in table.rules if is_our_jump(r) and rule_target(r) in mine]
    for name in (*names, *ownership.markers):
        objects.append(f":{name}")
        objects.extend(table.rules_of(name))
    return State(family, tuple(objects))


def ownership_of(table: NatTable, chain: str, place: str) -> Ownership:
    """The place's chains by who wrote them (a marker whose chain is gone is named itself: it is ours)."""
    ownership = chain_ownership(table, chain)
    return Ownership(place, ownership.owned + ownership.orphans, ownership.unmarked, ownership.changed)


def desired_state(policy: Policy, family: Family) -> State:
    """The jump, the chain and its rules, then the marker and its rule recording their digest (all canonical)."""
    rules = chain_rules(policy, family)
    objects = [canonical(jump_rule(rules.chain)), f":{rules.chain}"]
    objects.extend(canonical(r) for r in rules.rules)
    digest = chain_digest(rules.chain, objects[:1], itertools.islice(objects, 2, None), count=len(rules.rules))
    objects.append(f":{marker_chain(rules.chain)}")
    objects.append(marker_rule(rules.chain, digest))
    return State(family, tuple(objects))


def restore_payload(policy: Policy, family: Family, current: State) -> str:
    """The one transaction from `current` to the policy: our chain rewritten, our jump ensured, stale ones gone."""
    return "".join(restore_lines(policy, family, current))


def restore_lines(policy: Policy, family: Family, current: State, *, digest: str | None = None) -> Iterator[str]:
    """restore_payload's lines (each ending in a newline), made as they are written: 100,000 rules are never one
    string. The chain's ownership marker is declared in the same transaction, right after the chain, and its rule,
    recording the digest of what this transaction writes (`digest`: already known, from desired_state), last."""
    rules = chain_rules(policy, family)
    chain = rules.chain
    marker = marker_chain(chain)
    want_jump = canonical(jump_rule(chain))
    jumps = [o for o in current.objects if o.startswith("-A POSTROUTING ")]
    stale_chains = [o[1:] for o in current.objects if o.startswith(":") and o[1:] not in (chain, marker)]
    yield "*nat\n"
    # a stale or duplicate jump goes first: a chain cannot be deleted while a rule still jumps to it
    kept = False
    for jump in jumps:
        if jump == want_jump and not kept:
            kept = True
            continue
        yield jump.replace("-A POSTROUTING", "-D POSTROUTING", 1) + "\n"
    # declaring a chain in a --noflush restore creates it, or flushes it if it exists
    yield f":{chain} - [0:0]\n"
    yield f":{marker} - [0:0]\n"
    for stale in stale_chains:
        yield _deletion(stale)
    if not kept:
        yield jump_rule(chain) + "\n"
    for rule in rules.rules:
        yield rule + "\n"
    yield marker_rule(chain, digest if digest is not None else written_digest(rules)) + "\n"
    yield "COMMIT\n"


def counted_lines(lines: Iterable[str], into: dict[str, tuple[int, int]]) -> Iterator[str]:
    """`lines` of `iptables-save -c` passed on unchanged, each config rule's counters added up into `into` on the
    way (a rule is several lines: one per source, destination and port group)."""
    for line in lines:
        if line.startswith("[") and RULE_COMMENT_PREFIX in line:
            match = _RULE_COUNTERS.match(line)
            if match is not None:
                name = match.group(3)
                packets, octets = into.get(name, (0, 0))
                into[name] = (packets + int(match.group(1)), octets + int(match.group(2)))
        yield line


def _scan_counters(lines: Iterable[str], *, into: dict[str, tuple[int, int]]) -> int:
    """The config rules' counters of a whole `iptables-save -c` output, without parsing its rules."""
    return sum(1 for _ in counted_lines(lines, into))


def _once(text: str) -> Callable[[], Iterable[str]]:
    return lambda: (text,)


def _chunks(lines: Iterable[str], size: int = 1 << 16) -> Iterator[str]:
    """Lines gathered into pieces of about `size` characters: one write per piece, not per line."""
    piece: list[str] = []
    length = 0
    for line in lines:
        piece.append(line)
        length += len(line)
        if length >= size:
            yield "".join(piece)
            piece, length = [], 0
    if piece:
        yield "".join(piece)


def _deletion(name: str) -> str:
    """The lines deleting one of our chains: flushed by declaring it, then deleted. A marker is flushed by -F, which
    fails on a missing chain: iptables-restore then refuses the whole transaction, so a chain whose marker went
    since it was read (another program took it over) is never removed on the strength of a stale read."""
    if is_marker(name):
        return f"-F {name}\n-X {name}\n"
    return f":{name} - [0:0]\n-X {name}\n"


def removal_payload(current: State) -> str | None:
    """The transaction removing every object of ours in `current`, markers included; None when there is nothing."""
    if current.empty:
        return None
    lines = ["*nat\n"]
    lines.extend(o.replace("-A POSTROUTING", "-D POSTROUTING", 1) + "\n" for o in current.objects
                 if o.startswith("-A POSTROUTING "))
    lines.extend(_deletion(o[1:]) for o in current.objects if o.startswith(":"))
    lines.append("COMMIT\n")
    return "".join(lines)


def _rejected_line(stderr: str, payload: str) -> str | None:
    match = _FAILED_LINE.search(stderr)
    if match is None:
        return None
    number = int(match.group(1))
    lines = payload.splitlines()
    return lines[number - 1] if 1 <= number <= len(lines) else None


class IptablesBackend:
    """Backend over iptables-save/iptables-restore of one variant (see backends.base for the contract)."""

    def __init__(self, run: Runner, *, chain: str, variant: Variant,
                 families: Iterable[Family] = (Family.V4, Family.V6)) -> None:
        self._run = run
        self._chain = chain
        self.variant = variant
        self._families = tuple(families)
        self._counted: dict[Family, dict[str, tuple[int, int]]] = {}  # config rules' counters, from the last read
        # families whose policy (as last asked for in desired) has config rules: only their reads take counters
        # (-c makes the parse dearer; a config without rules reads exactly as before)
        self._counting: set[Family] = set()
        # the digest the last desired() recorded per family, for the policy it was made for (apply writes it without
        # hashing the chain again)
        self._digests: dict[Family, tuple[Policy, str]] = {}

    @property
    def name(self) -> str:
        return f"iptables ({self.variant.value})"

    def read(self, family: Family, *, adopt: Adopt = Adopt.CONFIGURED) -> State:
        return state_from_save(self._read_table(family), self._chain, family, adopt=adopt)

    def _read_table(self, family: Family) -> NatTable:
        """The nat table, parsed from iptables-save's output line by line as it prints it; with -c where the policy
        has config rules, so that their counters come from this very read (parse_save drops them from the rules)."""
        counting = family in self._counting
        argv = [tools(self.variant, family).save, *(["-c"] if counting else []), "-t", "nat"]
        counts: dict[str, tuple[int, int]] = {}
        parse: Callable[[Iterator[str]], NatTable] = (
            (lambda lines: parse_save(counted_lines(lines, counts))) if counting else parse_save)
        result, table = self._run.read_lines(argv, parse)
        if result.returncode != 0 or table is None:
            raise _error(f"{' '.join(argv)} failed", argv, result)
        if counting:
            self._counted[family] = counts
        else:
            self._counted.pop(family, None)
        return table

    def rule_counters(self, families: Sequence[Family], *, reread: bool) -> dict[str, tuple[int, int]]:
        """See Backend.rule_counters; a reread is one `iptables-save -c -t nat` per family, scanned, not parsed into
        rules."""
        out: dict[str, tuple[int, int]] = {}
        for family in families:
            if reread or family not in self._counted:
                argv = [tools(self.variant, family).save, "-c", "-t", "nat"]
                counts: dict[str, tuple[int, int]] = {}
                result, _ = self._run.read_lines(argv, functools.partial(_scan_counters, into=counts))
                if result.returncode != 0:
                    raise _error(f"{' '.join(argv)} failed", argv, result)
                self._counted[family] = counts
            out.update(self._counted[family])
        return out

    def desired(self, policy: Policy, family: Family) -> State:
        if policy.rules(family):
            self._counting.add(family)
        else:
            self._counting.discard(family)
        self._digests.pop(family, None)
        if family not in policy.families:
            return State(family, ())  # IPv6 off (flag or config): none of our objects in that family
        state = desired_state(policy, family)
        digest = recorded_digest(marker_chain(policy.options.masq_chain), list(state.objects[-1:]))
        if digest is not None:
            self._digests[family] = (policy, digest)
        return state

    def apply(self, policy: Policy, family: Family, current: State) -> None:
        if family not in policy.families:
            payload = removal_payload(current)
            if payload is not None:
                self._restore(family, _once(payload))
            return
        known = self._digests.get(family)
        digest = known[1] if known is not None and known[0] is policy else None
        self._restore(family, lambda: restore_lines(policy, family, current, digest=digest))

    def place(self, family: Family) -> str:
        """Where, in the words `ipmasq uninstall` prints: `iptables-nft, ipv4`."""
        return f"iptables-{self.variant.value}, ipv{family.value}"

    def survey(self) -> tuple[Ownership, ...]:
        """Per family holding anything ours or like ours: whose it is (read-only)."""
        found = []
        for family in self._families:
            table = self._readable_table(family)
            ownership = None if table is None else ownership_of(table, self._chain, self.place(family))
            if ownership is not None and not ownership.empty:
                found.append(ownership)
        return tuple(found)

    def remove_all(self, *, adopt: Adopt = Adopt.NONE) -> tuple[Ownership, ...]:
        """Our chains, their jumps and markers gone, one transaction per family; a chain without its marker, or whose
        rules changed since ipmasq wrote them, stays unless `adopt` takes it (the changed one's marker goes: it no
        longer tells the truth). What each family held (before), for those holding anything ours or like ours."""
        found = []
        for family in self._families:
            table = self._readable_table(family)
            if table is None:
                continue
            ownership = ownership_of(table, self._chain, self.place(family))
            if ownership.empty:
                continue
            payload = removal_payload(state_from_save(table, self._chain, family, adopt=adopt))
            if payload is not None:
                self._restore(family, _once(payload))
            found.append(ownership)
        return tuple(found)

    def present(self) -> bool:
        """Whether any family holds a chain of ours, by its marker (read-only; an unreadable variant holds none)."""
        return any(ownership.owned for ownership in self.survey())

    def _readable_table(self, family: Family) -> NatTable | None:
        """The nat table, or None when it cannot be read: the save tool is not installed, or the kernel cannot
        provide the variant's table (nothing of ours can be in it)."""
        try:
            return self._read_table(family)
        except BackendError:
            return None

    def _restore(self, family: Family, payload: Callable[[], Iterable[str]]) -> None:
        """One iptables-restore of `payload()` (made again, only to name the line it rejected, when it fails)."""
        argv = [tools(self.variant, family).restore, "--noflush", *_LOCK_WAIT]
        result = self._run.stream(argv, _chunks(payload()))
        if result.returncode == 0:
            return
        if result.returncode == _LOCK_EXIT and "xtables lock" in result.stderr:
            raise LockBusyError(f"{argv[0]}: the xtables lock is held by another program", argv=tuple(argv),
                                stderr=result.stderr, returncode=result.returncode)
        rejected = _rejected_line(result.stderr, "".join(payload()))
        where = f" (rejected payload line: {rejected})" if rejected is not None else ""
        raise _error(f"{argv[0]} failed{where}", argv, result)


def _error(message: str, argv: list[str], result: Result) -> BackendError:
    return BackendError(message, argv=tuple(argv), stderr=result.stderr, returncode=result.returncode)

