"""The iptables backend: read with `iptables-save -t nat`, write with one `iptables-restore --noflush -w` transaction.

Our objects (ipmasq.netfilter.iptables.our_chains, found by the reference agent's comments, so a chain left under an old
--masq-chain is ours too): the POSTROUTING jumps carrying our jump comment, the chains they target, the chain named
by --masq-chain, and any chain holding a rule with an `ip-masq-agent:` comment. Nothing else is read or written.

The variant (legacy or nft) is the one the node uses, detected like kubernetes-sigs/iptables-wrappers does:
kubelet's/kube-proxy's hint chains first, then whichever variant holds more rules.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from enum import Enum

from ipmasq.backends.base import Result, Runner, State
from ipmasq.errors import BackendError, LockBusyError
from ipmasq.netfilter.iptables import (
    RULE_COMMENT_PREFIX,
    NatTable,
    canonical,
    chain_rules,
    count_rules,
    is_our_jump,
    jump_rule,
    our_chains,
    parse_save,
)
from ipmasq.policy.policy import Policy
from ipmasq.policy.prefix import Family

__all__ = ["IptablesBackend", "Variant", "choose_variant", "detect_variant", "tools"]

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


def state_from_save(table: NatTable, chain: str, family: Family) -> State:
    """Our objects in an iptables-save table: our jumps in order, then each of our chains and its rules."""
    objects = [r for r in table.rules if is_our_jump(r)]
    for name in our_chains(table, chain):
        objects.append(f":{name}")
        objects.extend(table.rules_of(name))
    return State(family, tuple(objects))


def desired_state(policy: Policy, family: Family) -> State:
    rules = chain_rules(policy, family)
    objects = [canonical(jump_rule(rules.chain)), f":{rules.chain}"]
    objects.extend(canonical(r) for r in rules.rules)
    return State(family, tuple(objects))


def restore_payload(policy: Policy, family: Family, current: State) -> str:
    """The one transaction from `current` to the policy: our chain rewritten, our jump ensured, stale ones gone."""
    return "".join(restore_lines(policy, family, current))


def restore_lines(policy: Policy, family: Family, current: State) -> Iterator[str]:
    """restore_payload's lines (each ending in a newline), made as they are written: 100,000 rules are never one
    string."""
    rules = chain_rules(policy, family)
    chain = rules.chain
    want_jump = canonical(jump_rule(chain))
    jumps = [o for o in current.objects if o.startswith("-A POSTROUTING ")]
    stale_chains = [o[1:] for o in current.objects if o.startswith(":") and o[1:] != chain]
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
    for stale in stale_chains:
        yield f":{stale} - [0:0]\n-X {stale}\n"
    if not kept:
        yield jump_rule(chain) + "\n"
    for rule in rules.rules:
        yield rule + "\n"
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


def removal_payload(current: State) -> str | None:
    """The transaction removing every object of ours in `current`; None when there is nothing of ours."""
    if current.empty:
        return None
    lines = ["*nat"]
    lines.extend(o.replace("-A POSTROUTING", "-D POSTROUTING", 1) for o in current.objects
                 if o.startswith("-A POSTROUTING "))
    for name in (o[1:] for o in current.objects if o.startswith(":")):
        lines.extend((f":{name} - [0:0]", f"-X {name}"))
    lines.append("COMMIT")
    return "\n".join(lines) + "\n"


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

    @property
    def name(self) -> str:
        return f"iptables ({self.variant.value})"

    def read(self, family: Family) -> State:
        return self._read_state(family)

    def _read_state(self, family: Family) -> State:
        """Our objects, parsed from iptables-save's output line by line as it prints them; with -c where the policy
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
        return state_from_save(table, self._chain, family)

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
        if family not in policy.families:
            return State(family, ())  # IPv6 off (flag or config): none of our objects in that family
        return desired_state(policy, family)

    def apply(self, policy: Policy, family: Family, current: State) -> None:
        if family not in policy.families:
            payload = removal_payload(current)
            if payload is not None:
                self._restore(family, _once(payload))
            return
        self._restore(family, lambda: restore_lines(policy, family, current))

    def remove_all(self) -> None:
        for family in self._families:
            current = self._read_if_runnable(family)
            payload = None if current is None else removal_payload(current)
            if payload is not None:
                self._restore(family, _once(payload))

    def present(self) -> bool:
        """Whether any family holds an object of ours (read-only; an unreadable variant holds none)."""
        for family in self._families:
            try:
                current = self._read_if_runnable(family)
            except BackendError:
                continue  # e.g. a legacy table the kernel cannot provide: nothing of ours can be in it
            if current is not None and not current.empty:
                return True
        return False

    def _read_if_runnable(self, family: Family) -> State | None:
        """read(), or None when the save tool is not installed (nothing of ours can exist through it)."""
        try:
            return self._read_state(family)
        except BackendError as exc:
            if exc.returncode is None:  # the runner's own error (not installed...): the tool printed nothing
                return None
            raise

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

