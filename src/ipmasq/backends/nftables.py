"""The nftables backend: our one table `inet ip-masq-agent`, read with `nft -j`, written as one `nft -f -` transaction.

State lines per family (ipmasq.backends.base.State), in the table's canonical text:

    table inet ip-masq-agent
    chain postrouting { type nat hook postrouting priority 100; policy accept; }
    rule postrouting <rule as `nft list` prints it>          (the shared chains: in every family's State)
    chain config-rules                                        (the config's rules, when it has some)
    rule config-rules <rule as `nft list` prints it>
    set nomasq_v4 { type ipv4_addr; flags interval; }        (this family's sets; IPv4's State also holds any
    element nomasq_v4 10.0.0.0/8                              set or object that is nobody's, so it is repaired)
    set rules_dst_v4 { type ipv4_addr; flags interval; }     (every destination of this family's config rules)

The chain's rules depend on which families the policy manages, so a change of --enable-ipv6 shows in every State.
`apply` rewrites the whole table whatever the difference, so drift of any kind (table deleted, chain flushed,
set emptied, a rule added) is repaired by the same atomic transaction.

Ownership: the table carries its marker, the empty set `ipmasq-owns-this-table` (ipmasq.netfilter.nft.MARKER_SET)
whose comment records the digest of the rest of the table as written (in IPv4's State, so a table without it, or
with a digest of other content, differs and the next apply, which rewrites the whole table, writes it: an ipmasq
0.2.0 table is taken over on the first pass, a drift repair records what it wrote). A table `inet ip-masq-agent`
without it, or whose content no longer hashes to its digest, is another program's: the clean-up of a backend not
used and `ipmasq uninstall` leave it alone (survey, remove_all; the stale marker goes).

Reading is cheap where it can be: the structure comes from `nft -j -t list ruleset inet`, which does not fetch set
elements (instant even with 100,000 of them); the elements of a family's set are read with `nft -j list set` only
when the structure is ours and the kernel cannot vouch for them otherwise. It can when the backend has a Generation
(backends.base): our transaction replaces the whole table, so when the generation moved by exactly one across our
successful `nft -f` (ours was the only commit in between) and has not moved since, the sets hold exactly the
elements that transaction wrote, and a read takes them from the plan instead of listing and parsing them again
(at 100,000 elements, more than the `nft -f` itself: docs/measurements.md). Every other part of a read, the
chains, rules and set declarations, still comes from the kernel, and any commit by anyone since ours (a flushed
set, one element deleted) moves the generation and sends the next read back to listing the elements.

Building is done once per policy (`plan`): the table, its elements as text, each family's State and the script
are kept while the loop holds the same Policy object, so a 100,000-element set is formatted once, not per use.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ipmasq.backends.base import Adopt, Generation, Ownership, Result, Runner, State
from ipmasq.errors import BackendError, NftParseError
from ipmasq.netfilter.nft import (
    MARKER_SET,
    OUR_SET_NAMES,
    RULES_SET_NAMES,
    SET_NAMES,
    SET_TYPES,
    TABLE,
    TABLE_FAMILY,
    NftSet,
    NftTable,
    delete_script,
    desired_table_and_elements,
    format_elements,
    is_marked,
    marked_delete_script,
    marker_delete_script,
    recorded_digest,
    replace_script,
    table_digest,
)
from ipmasq.netfilter.nft_json import parse_list_json
from ipmasq.netfilter.nft_set import parse_set_json
from ipmasq.policy.policy import Policy
from ipmasq.prefix import Family

__all__ = ["NFT", "NftablesBackend", "state_from_table"]

NFT = "nft"
PLACE = "nftables"  # where, in the words `ipmasq uninstall` prints
OBJECT = f"table {TABLE_FAMILY} {TABLE}"
# nft exits 1 with this when the object listed does not exist
_ABSENT = "No such file or directory"


def _set_header(s: NftSet) -> str:
    flags = f" flags {', '.join(s.flags)};" if s.flags else ""
    comment = f' comment "{s.comment}";' if s.comment else ""
    return f"set {s.name} {{ type {s.type};{flags}{comment} }}"


def state_from_table(table: NftTable | None, family: Family, *, elements: dict[str, tuple[tuple[int, int], ...]]
             | None = None, formatted: Mapping[str, Sequence[str]] | None = None) -> State:
    """A table's lines for one family; `elements` overrides the sets' elements (when read separately),
    `formatted` supplies them already as text (format_elements)."""
    if table is None:
        return State(family, ())
    lines = [f"table {TABLE_FAMILY} {TABLE}"]
    for c in table.chains:
        if c.type:
            lines.append(f"chain {c.name} {{ type {c.type} hook {c.hook} priority {c.priority}; policy {c.policy}; }}")
        else:
            lines.append(f"chain {c.name}")
        lines.extend(f"rule {c.name} {r}" for r in c.rules)
    for s in table.sets:
        # a family's State holds its own sets; IPv4's also holds every set that is neither family's
        if _in_state(s.name, family):
            lines.append(_set_header(s))
            prefix = f"element {s.name} "
            if formatted is not None and s.name in formatted:
                texts: Sequence[str] = formatted[s.name]
            else:
                values = s.elements if elements is None or s.name not in elements else elements[s.name]
                texts = format_elements(s.family, values)
            lines.extend([prefix + text for text in texts])
    return State(family, tuple(lines))


def _in_state(set_name: str, family: Family) -> bool:
    """Whether a set of our table belongs in this family's State (the marker, and sets that are not ours, go in
    IPv4's)."""
    return set_name in (SET_NAMES[family], RULES_SET_NAMES[family]) or (
        family is Family.V4 and set_name not in OUR_SET_NAMES)


def _counters_of(table: NftTable | None) -> dict[str, tuple[int, int]]:
    """The config rules' counters a listing carried, by rule name, summed (a rule is one nft rule; summed anyway)."""
    out: dict[str, tuple[int, int]] = {}
    for name, packets, octets in table.counters if table is not None else ():
        before = out.get(name, (0, 0))
        out[name] = (before[0] + packets, before[1] + octets)
    return out


@dataclass(frozen=True, slots=True)
class _Plan:
    """Everything one policy needs, built once: the table, its elements as text, each family's State, the script."""

    policy: Policy
    table: NftTable
    formatted: Mapping[str, Sequence[str]]  # each set's elements as text, by set name
    states: Mapping[Family, State]
    script: str


def _plan(policy: Policy) -> _Plan:
    table, formatted = desired_table_and_elements(policy)
    # every family, managed or not: an unmanaged family's State is the shared chain without its set, so a set left
    # from when it was managed (IPv6 switched off) differs and is removed with the rest of the old table
    states = {f: state_from_table(table, f, formatted=formatted) for f in Family}
    return _Plan(policy, table, formatted, states, replace_script(table, formatted=formatted))


@dataclass(frozen=True, slots=True)
class _Written:
    """Our last transaction, proven to be the only commit between the generations read around it: while the
    generation stays `generation`, the table's sets hold exactly `plan`'s elements."""

    plan: _Plan
    generation: int


class NftablesBackend:
    """Backend over `nft` (see the module docstring); `run` is the one seam that executes programs."""

    def __init__(self, run: Runner, *, nft: str = NFT, generation: Generation | None = None) -> None:
        self._run = run
        self._nft = nft
        # None: every read lists the sets' elements (the offline tools, a read that must not trust this process)
        self._generation = generation
        self._written: _Written | None = None
        self._plan: _Plan | None = None  # the last policy's, reused while the loop holds the same Policy object
        self._counted: dict[str, tuple[int, int]] | None = None  # config rules' counters, from the last read

    @property
    def name(self) -> str:
        return "nftables"

    def _call(self, argv: list[str], stdin: str | None = None, *, what: str) -> Result:
        result = self._run(argv, stdin)
        if result.returncode != 0:
            raise BackendError(f"{what} failed ({' '.join(argv)})", argv=tuple(argv), stderr=result.stderr,
                               returncode=result.returncode)
        return result

    def read_structure(self) -> NftTable | None:
        """Our table without set elements (sets listed empty); None when there is no table."""
        return self._parse_structure(self._call(self._structure_argv(), what="reading nftables"))

    def _structure_argv(self) -> list[str]:
        return [self._nft, "-j", "-t", "list", "ruleset", TABLE_FAMILY]

    def _parse_structure(self, result: Result) -> NftTable | None:
        try:
            return parse_list_json(result.stdout)
        except NftParseError as exc:
            raise BackendError(f"cannot read nft's listing: {exc}", argv=(self._nft, "-j", "-t")) from None

    def _read_set(self, name: str) -> NftSet | None:
        argv = [self._nft, "-j", "list", "set", TABLE_FAMILY, TABLE, name]
        result = self._run(argv, None)
        if result.returncode != 0 and _ABSENT in result.stderr:
            return None  # deleted between the two reads: the next read sees the difference
        if result.returncode != 0:
            raise BackendError("reading an nftables set failed", argv=tuple(argv), stderr=result.stderr)
        try:
            # element by element, never nft's whole JSON tree: 100,000 elements would be the agent's peak memory
            return parse_set_json(result.stdout, name)
        except NftParseError as exc:
            raise BackendError(f"cannot read nft's listing of set {name}: {exc}", argv=tuple(argv)) from None

    def read(self, family: Family, *, adopt: Adopt = Adopt.CONFIGURED) -> State:
        structure = self.read_structure()
        self._counted = _counters_of(structure)
        if structure is None or (adopt is Adopt.NONE and not is_marked(structure)):
            return State(family, ())
        written = self._still_written()  # taken after the structure: the generation held while it was listed
        if written is not None:
            return state_from_table(structure, family, formatted=written.plan.formatted)
        elements: dict[str, tuple[tuple[int, int], ...]] = {}
        for s in structure.sets:
            # the marker's presence is the fact, not what it holds: its elements are not listed (one call saved)
            if not _in_state(s.name, family) or s.name == MARKER_SET:
                continue
            full = self._read_set(s.name)
            elements[s.name] = full.elements if full is not None else ()
        return state_from_table(structure, family, elements=elements)

    def rule_counters(self, families: Sequence[Family], *, reread: bool) -> dict[str, tuple[int, int]]:
        """See Backend.rule_counters: one table holds both families; a reread is the terse structure listing (`nft -j
        list chain` would fetch every set's elements too: docs/measurements.md)."""
        if reread or self._counted is None:
            self._counted = _counters_of(self.read_structure())
        return dict(self._counted)

    def plan(self, policy: Policy) -> _Plan:
        if self._plan is None or self._plan.policy is not policy:
            self._plan = _plan(policy)
        return self._plan

    def desired(self, policy: Policy, family: Family) -> State:
        return self.plan(policy).states[family]

    def apply(self, policy: Policy, family: Family, current: State) -> None:
        """Replace the whole table (every family of the policy) in one transaction, whatever `current` holds."""
        plan = self.plan(policy)
        self._written = None
        before = self._read_generation()
        self._call([self._nft, "-f", "-"], plan.script, what="applying the nftables table")
        after = self._read_generation()
        if before is not None and after == before + 1:
            self._written = _Written(plan, after)

    def _read_generation(self) -> int | None:
        return self._generation() if self._generation is not None else None

    def _still_written(self) -> _Written | None:
        """Our last transaction while nothing was committed after it; None: the sets must be listed."""
        written = self._written
        if written is not None and self._read_generation() != written.generation:
            self._written = written = None
        return written

    def survey(self) -> tuple[Ownership, ...]:
        """Our table, if there is one, by whose it is (one terse listing; a marked table's sets are then listed with
        their elements, to hash it as its marker's digest was made); nothing without nft."""
        try:
            result = self._run(self._structure_argv(), None)
        except BackendError:
            return ()  # nft is not installed: no table of ours can exist
        if result.returncode != 0:
            raise BackendError("reading nftables failed", argv=tuple(self._structure_argv()), stderr=result.stderr,
                               returncode=result.returncode)
        table = self._parse_structure(result)
        if table is None:
            return ()
        if not is_marked(table):
            return (Ownership(PLACE, (), (OBJECT,)),)
        return (Ownership(PLACE, (OBJECT,), ()) if self._as_recorded(table) else Ownership(PLACE, (), (), (OBJECT,)),)

    def _as_recorded(self, structure: NftTable) -> bool:
        """The marked table, its elements listed, hashes to the digest its marker records."""
        recorded = recorded_digest(structure)
        if recorded is None or any(s.type not in SET_TYPES.values() for s in structure.sets):
            return False  # ipmasq writes address sets only: another program's set is a change, never read here
        formatted: dict[str, Sequence[str]] = {}
        for s in structure.sets:
            if s.name != MARKER_SET:
                full = self._read_set(s.name)
                formatted[s.name] = format_elements(s.family, full.elements if full is not None else ())
        return table_digest(structure, formatted=formatted) == recorded

    def remove_all(self, *, adopt: Adopt = Adopt.NONE) -> tuple[Ownership, ...]:
        """Our table gone with its marker in one transaction that the kernel refuses if the marker is not there; a
        table without it, or whose content changed since ipmasq wrote it, stays unless `adopt` takes it (the changed
        one's marker goes: it no longer tells the truth). What was there (before)."""
        found = self.survey()
        for ownership in found:
            self._written = None
            if ownership.owned:
                self._call([self._nft, "-f", "-"], marked_delete_script(), what="removing the nftables table")
            elif adopt is not Adopt.NONE:
                self._call([self._nft, "-f", "-"], delete_script(), what="removing the nftables table")
            elif ownership.changed:
                self._call([self._nft, "-f", "-"], marker_delete_script(), what="removing a stale ownership marker")
        return found

    def present(self) -> bool:
        """Whether our table exists with its marker (read-only)."""
        return any(ownership.owned for ownership in self.survey())
