"""The backend interface: the agent's loop talks to the kernel only through this.

    Runner      run(argv, stdin) -> Result         the ONE seam that executes programs (real: backends.runner;
                                                   tests: a stateful fake that parses what it is given)
    Backend     name                               "iptables", "nftables", ...
                read(family) -> State              our objects as the kernel has them now, normalised
                desired(policy, family) -> State   the same objects as `policy` wants them
                apply(policy, family, current)     ONE atomic transaction turning `current` into `desired`
                                                   (including removing stale objects `current` holds)
                remove_all()                       uninstall: our objects gone, both families; nothing else touched
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

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar, runtime_checkable

from ipmasq.policy import Policy
from ipmasq.prefix import Family
from ipmasq.rules.lines import iter_lines

T = TypeVar("T")

__all__ = ["BACKEND_NAMES", "Backend", "LineReadingRunner", "Removable", "Result", "RuleCounting", "Runner", "State",
           "StreamingRunner", "run_chunks", "run_parsed"]

# What `--backend` accepts; auto: see ipmasq.backends.choose.
BACKEND_NAMES: tuple[str, ...] = ("auto", "iptables", "nftables")


@dataclass(frozen=True, slots=True)
class Result:
    """What a program did: its exit status and its output, decoded as text."""

    returncode: int
    stdout: str = ""
    stderr: str = ""


class Runner(Protocol):
    """Runs one program to completion. Raises BackendError only when the program cannot be started at all."""

    def __call__(self, argv: Sequence[str], stdin: str | None = None) -> Result: ...


@runtime_checkable
class StreamingRunner(Protocol):
    """A Runner that can also feed a program its input piece by piece (a 100,000-rule restore is never built as one
    string). Backends use it when the runner has it, and join the pieces for any other runner (the test fakes)."""

    def __call__(self, argv: Sequence[str], stdin: str | None = None) -> Result: ...

    def stream(self, argv: Sequence[str], chunks: Iterable[str]) -> Result: ...


@runtime_checkable
class LineReadingRunner(Protocol):
    """A Runner that can also hand a program's output over line by line as it is printed (SubprocessRunner)."""

    def __call__(self, argv: Sequence[str], stdin: str | None = None) -> Result: ...

    def read_lines(self, argv: Sequence[str], consume: Callable[[Iterator[str]], T]) -> tuple[Result, T | None]: ...


def run_parsed(run: Runner, argv: Sequence[str], parse: Callable[[Iterator[str]], T]) -> tuple[Result, T | None]:
    """Run a program with no input and `parse` its output's lines: as they come where the runner can, from the
    whole output otherwise. (the Result, without stdout when streamed; what `parse` returned, None when the program
    failed: its failure is reported, not what parsing a partial output said)."""
    if isinstance(run, LineReadingRunner):
        return run.read_lines(argv, parse)
    result = run(argv, None)
    return result, parse(iter_lines(result.stdout)) if result.returncode == 0 else None


def run_chunks(run: Runner, argv: Sequence[str], chunks: Iterable[str]) -> Result:
    """`run` with `chunks` as the program's input: streamed where the runner can, joined otherwise."""
    if isinstance(run, StreamingRunner):
        return run.stream(argv, chunks)
    return run(argv, "".join(chunks))


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


@runtime_checkable
class RuleCounting(Protocol):
    """A backend whose config rules count their packets (ipmasq_rule_packets_total). `reread` False: the counters of
    the reads this pass already made (taken from the same listing, no extra program); True: one counters-only read
    (the idle pass, which reads nothing else). Keyed by rule name, summed over the rule's kernel rules."""

    def rule_counters(self, families: Sequence[Family], *, reread: bool) -> dict[str, tuple[int, int]]: ...


class Removable(Protocol):
    """Our objects in a backend or variant that is not the chosen one (an earlier run, or an older agent)."""

    @property
    def name(self) -> str: ...

    def present(self) -> bool: ...

    def remove_all(self) -> None: ...
