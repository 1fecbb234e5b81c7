"""The backend interface: the agent's loop talks to the kernel only through this.

    Runner      run(argv, stdin) -> Result         the ONE seam that executes programs (real: backends.runner;
                stream(argv, chunks) -> Result     tests: ipmasq.testing's stateful fakes that parse what they are
                read_lines(argv, consume)          given)
    Fingerprint fingerprint() -> Hashable | None   a cheap kernel fact that changes with any NAT rule (real:
                                                   backends.generation.KernelFingerprint; tests:
                                                   ipmasq.testing.FakeFingerprint); None: unknown, read everything
    Generation  generation() -> int | None         the nf_tables transaction count (real:
                                                   backends.generation.nftables_generation; tests: a fake tool's
                                                   `generation`); None: unknown, the nftables backend reads back
    Backend     name                               "iptables", "nftables", ...
                read(family, adopt) -> State       our objects as the kernel has them now, normalised
                desired(policy, family) -> State   the same objects as `policy` wants them
                apply(policy, family, current)     ONE atomic transaction turning `current` into `desired`
                                                   (including removing stale objects `current` holds)
                remove_all(adopt)                  uninstall: our objects gone, both families; nothing else touched
                rule_counters(families, reread)    the config rules' packet and byte counters, by rule name
    Removable   name, present(), survey(),         our objects in the other backend or iptables variant, which must not
                remove_all(adopt)                  stay once one is chosen (every pass looks with survey(), a cheap
                                                   read, and removes them after its own rules are verified)

Ours means written by ipmasq, and that record lives in the kernel beside the objects, per network namespace: an
ownership marker (a chain `IPMASQ-OWNS-<chain>` in the nat table, a set `ipmasq-owns-this-table` in the nftables
table, neither ever reached by a packet) written in the same transaction as what it marks, recording the digest of
what that transaction wrote. A chain or table that looks like ours (the reference agent's comments, our table's name)
without its marker is another program's (GKE's or AKS's agent writes the very same text), and so is a marked one
that no longer hashes to its marker's digest (another program rewrote it since ipmasq stopped: the reference agent
after a migration back); neither is ever removed, and the stale marker goes. `Adopt` says when a read counts one as
ours anyway: the chain the agent enforces, which its next apply takes over (marker written), and `ipmasq uninstall
--remove-unmarked`.

The loop (ipmasq.agent) is backend-agnostic: for each family of the policy it does
``current = read(f); want = desired(policy, f)``; if ``current != want`` it calls ``apply(policy, f, current)``,
then ``read(f)`` again and verifies it equals ``want``. So a backend must make `read` and `desired` produce
*equal* States when, and only when, the kernel holds exactly what the policy asks for (same objects, same
order where order matters, and no stale objects of ours, e.g. a chain left under an old --masq-chain name).
`apply` must never touch objects that are not ours; the loop calls it only on a difference, so an idle node
sees no kernel write at all.

Errors: a failing tool becomes ipmasq.errors.BackendError carrying the tool's stderr (and, where the tool names
one, the payload line it rejected); a busy xtables lock becomes LockBusyError. The loop backs off and retries.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Protocol, TypeVar

from ipmasq.errors import IpmasqError, one_line
from ipmasq.policy.policy import Policy
from ipmasq.prefix import Family

T = TypeVar("T")

__all__ = ["BACKEND_NAMES", "Adopt", "Backend", "Fingerprint", "Generation", "Ownership", "Removable", "Result",
           "Runner", "State", "take_fingerprint"]

# What `--backend` accepts; auto: see ipmasq.backends.choose.
BACKEND_NAMES: tuple[str, ...] = ("auto", "iptables", "nftables")


@dataclass(frozen=True, slots=True)
class Result:
    """What a program did: its exit status and its output, decoded as text."""

    returncode: int
    stdout: str = ""
    stderr: str = ""


class Runner(Protocol):
    """Runs programs to completion. Raises BackendError only when a program cannot be started at all (or was
    cancelled, or timed out); a program that fails is a Result with its exit status and stderr."""

    def __call__(self, argv: Sequence[str], stdin: str | None = None) -> Result:
        """Run with `stdin` (None: no input) and hand the whole output back."""
        ...

    def stream(self, argv: Sequence[str], chunks: Iterable[str]) -> Result:
        """Run with `chunks` as the input, piece by piece (a 100,000-rule restore is never built as one string)."""
        ...

    def read_lines(self, argv: Sequence[str], consume: Callable[[Iterator[str]], T]) -> tuple[Result, T | None]:
        """Run with no input and hand the output's lines to `consume`: (the Result, without stdout where the lines
        came as printed; what `consume` returned, None when the program failed: its failure is reported, not what
        reading a partial output said)."""
        ...


class Fingerprint(Protocol):
    """A cheap fact about the node's NAT rules that changes whenever any of them changes, by any program: equal
    answers mean nothing was written in between. None when it cannot be read (the caller then reads everything)."""

    def __call__(self) -> Hashable | None: ...


def take_fingerprint(fingerprint: Fingerprint | None, log: logging.Logger) -> Hashable | None:
    """The fingerprint now; None when there is none or it cannot be read (the caller then reads everything)."""
    if fingerprint is None:
        return None
    try:
        return fingerprint()
    except (OSError, IpmasqError) as exc:  # unknown: read everything, as without a fingerprint
        log.debug("reading the kernel's rule fingerprint failed: %s", exc)
        return None


class Generation(Protocol):
    """The nf_tables ruleset generation of the network namespace: the kernel adds exactly one for every transaction
    it commits, by any program, and nothing for a read or a failed transaction. None when it cannot be read."""

    def __call__(self) -> int | None: ...


@dataclass(frozen=True, slots=True)
class State:
    """Our objects for one family, normalised so that equal means "the kernel holds exactly this".

    `objects` are text lines in the backend's own canonical dialect (iptables: `:CHAIN` declarations and
    iptables-save form rules; nftables: its normalised script lines), in an order that is part of the meaning.
    """

    family: Family
    objects: tuple[str, ...]

    @property
    def empty(self) -> bool:
        return not self.objects


class Adopt(Enum):
    """Which objects that look like ours but lack their ownership marker a read counts as ours."""

    NONE = "none"  # only what carries its marker: every removal (uninstall, the clean-up of the places not used)
    # also the chain this backend enforces (--masq-chain; nftables: its table), which the next apply takes over with
    # its marker: a reference agent's chain on migration, an ipmasq 0.2.0 chain written before markers existed
    CONFIGURED = "configured"
    ALL = "all"  # everything that looks like ours (`ipmasq uninstall --remove-unmarked`, the operator's word)


@dataclass(frozen=True, slots=True)
class Ownership:
    """What one place (an iptables variant and family, or nftables) holds that is ours or looks like ours."""

    place: str  # "iptables-nft, ipv4", "nftables"
    # with their ownership marker, and still what it records: ipmasq's ("IP-MASQ-AGENT", "table inet ip-masq-agent")
    owned: tuple[str, ...]
    unmarked: tuple[str, ...]  # ipmasq's comments (our table's name) without the marker: another program's
    # marked, but their rules changed since ipmasq wrote them (or the marker records nothing): another program's now
    changed: tuple[str, ...] = ()

    @property
    def empty(self) -> bool:
        return not (self.owned or self.unmarked or self.changed)

    def lines(self, *, adopt: Adopt = Adopt.NONE) -> tuple[str, ...]:
        """What a removal under `adopt` did here: one line for ours (`removed: A, B (place)`) and one per kind of the
        rest (`kept C (place): no ipmasq ownership marker: another program wrote it`, `kept D (place): its rules
        changed since ipmasq wrote them: another program writes it now`; with Adopt.ALL they were removed too, and
        their lines say so). Names are the kernel's: escaped."""
        out = []
        if self.owned:
            out.append(f"removed: {_names(self.owned)} ({self.place})")
        if self.unmarked and adopt is Adopt.ALL:
            out.append(f"removed: {_names(self.unmarked)} ({self.place}): no ipmasq ownership marker "
                       "(--remove-unmarked)")
        elif self.unmarked:
            wrote = "it" if len(self.unmarked) == 1 else "them"
            out.append(f"kept {_names(self.unmarked)} ({self.place}): no ipmasq ownership marker: another "
                       f"program wrote {wrote}")
        one = len(self.changed) == 1
        if self.changed and adopt is Adopt.ALL:
            out.append(f"removed: {_names(self.changed)} ({self.place}): {'its' if one else 'their'} rules changed "
                       "since ipmasq wrote them (--remove-unmarked)")
        elif self.changed:
            out.append(f"kept {_names(self.changed)} ({self.place}): {'its' if one else 'their'} rules changed since "
                       f"ipmasq wrote them: another program writes {'it' if one else 'them'} now")
        return tuple(one_line(line) for line in out)


# Names a line quotes (the rest counted): five places of three lines each stay below the 4 KiB termination message
# `kubectl ipmasq uninstall` reads them from, however many chains another program wrote.
_NAMED = 5


def _names(names: tuple[str, ...]) -> str:
    shown = ", ".join(names[:_NAMED])
    return shown + (f" and {len(names) - _NAMED} more" if len(names) > _NAMED else "")


class Backend(Protocol):
    """One way of putting the policy into the kernel (see the module docstring for the contract)."""

    @property
    def name(self) -> str: ...

    def read(self, family: Family, *, adopt: Adopt = Adopt.CONFIGURED) -> State:
        """Our objects in `family`; `adopt`: which unmarked look-alikes count as ours (the agent's own read takes
        the chain it enforces; a family it does not manage is read with Adopt.NONE)."""
        ...

    def desired(self, policy: Policy, family: Family) -> State: ...

    def apply(self, policy: Policy, family: Family, current: State) -> None: ...

    def remove_all(self, *, adopt: Adopt = Adopt.NONE) -> tuple[Ownership, ...]:
        """Our objects gone (with their markers, each place in one transaction), both families, and the stale markers
        of chains another program rewrote since; what was found, per place that holds anything ours or like ours."""
        ...

    def rule_counters(self, families: Sequence[Family], *, reread: bool) -> dict[str, tuple[int, int]]:
        """The config rules' counters (ipmasq_rule_packets_total), keyed by rule name, summed over the rule's kernel
        rules. `reread` False: the counters of the reads this pass already made (taken from the same listing, no
        extra program); True: one counters-only read (the idle pass, which reads nothing else)."""
        ...


class Removable(Protocol):
    """Our objects in a backend or variant that is not the chosen one (an earlier run, or an older agent)."""

    @property
    def name(self) -> str: ...

    def present(self) -> bool:
        """Whether anything here carries our marker and still holds what it records (read-only)."""
        ...

    def survey(self) -> tuple[Ownership, ...]:
        """What is ours or like ours here, per place (read-only; a place that cannot be read holds nothing)."""
        ...

    def remove_all(self, *, adopt: Adopt = Adopt.NONE) -> tuple[Ownership, ...]: ...
