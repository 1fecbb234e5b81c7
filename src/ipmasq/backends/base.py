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
                read(family) -> State              our objects as the kernel has them now, normalised
                desired(policy, family) -> State   the same objects as `policy` wants them
                apply(policy, family, current)     ONE atomic transaction turning `current` into `desired`
                                                   (including removing stale objects `current` holds)
                remove_all()                       uninstall: our objects gone, both families; nothing else touched
                rule_counters(families, reread)    the config rules' packet and byte counters, by rule name
    Removable   name, present(), remove_all()      our objects in the other backend or iptables variant, which must not
                                                   stay once one is chosen (every pass looks with present(), a cheap
                                                   read, and removes them after its own rules are verified)

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
from typing import Protocol, TypeVar

from ipmasq.errors import IpmasqError
from ipmasq.policy.policy import Policy
from ipmasq.policy.prefix import Family

T = TypeVar("T")

__all__ = ["BACKEND_NAMES", "Backend", "Fingerprint", "Generation", "Removable", "Result", "Runner", "State",
           "take_fingerprint"]

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


class Backend(Protocol):
    """One way of putting the policy into the kernel (see the module docstring for the contract)."""

    @property
    def name(self) -> str: ...

    def read(self, family: Family) -> State: ...

    def desired(self, policy: Policy, family: Family) -> State: ...

    def apply(self, policy: Policy, family: Family, current: State) -> None: ...

    def remove_all(self) -> None: ...

    def rule_counters(self, families: Sequence[Family], *, reread: bool) -> dict[str, tuple[int, int]]:
        """The config rules' counters (ipmasq_rule_packets_total), keyed by rule name, summed over the rule's kernel
        rules. `reread` False: the counters of the reads this pass already made (taken from the same listing, no
        extra program); True: one counters-only read (the idle pass, which reads nothing else)."""
        ...


class Removable(Protocol):
    """Our objects in a backend or variant that is not the chosen one (an earlier run, or an older agent)."""

    @property
    def name(self) -> str: ...

    def present(self) -> bool: ...

    def remove_all(self) -> None: ...
