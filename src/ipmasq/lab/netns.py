"""Throwaway network namespaces, linked only to each other, and always cleaned up.

Nothing here touches the machine's own network: namespaces are connected with veth pairs between themselves
only, so no packet can leave. Names carry a per-process prefix so parallel runs do not collide, and
`cleanup_stale` removes namespaces whose creating process is gone.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TypeVar

from ipmasq.backends.base import Result
from ipmasq.errors import NetnsError

__all__ = [
    "LAB_PREFIX", "Namespace", "NamespaceRunner", "Network", "cleanup_stale", "network", "stop_process",
]

LAB_PREFIX = "ipmq"
T = TypeVar("T")


def _ip(*args: str) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True)
    if result.returncode != 0:
        raise NetnsError(f"ip {' '.join(args)}: {result.stderr.strip()}")


@dataclass(frozen=True)
class Namespace:
    name: str

    def argv(self, argv: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.name, *argv]

    def run(self, argv: Sequence[str], *, stdin: str | None = None, check: bool = True,
            timeout: float = 30.0, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(self.argv(argv), input=stdin, capture_output=True, text=True, timeout=timeout,
                                env=env)
        if check and result.returncode != 0:
            raise NetnsError(f"[{self.name}] {' '.join(argv)} exited {result.returncode}: {result.stderr.strip()}")
        return result

    def popen(self, argv: Sequence[str], **kwargs: object) -> subprocess.Popen[str]:
        return subprocess.Popen(self.argv(argv), text=True, **kwargs)  # type: ignore[call-overload, no-any-return]

    def sysctl(self, key: str, value: str) -> None:
        self.run(["sysctl", "-qw", f"{key}={value}"])


@dataclass
class Network:
    """A set of namespaces created together and deleted together."""

    prefix: str
    namespaces: dict[str, Namespace] = field(default_factory=dict)
    _links: int = 0

    def add(self, role: str) -> Namespace:
        ns = Namespace(f"{self.prefix}-{role}")
        _ip("netns", "add", ns.name)
        self.namespaces[role] = ns
        ns.run(["ip", "link", "set", "lo", "up"])
        return ns

    def __getitem__(self, role: str) -> Namespace:
        return self.namespaces[role]

    def link(
        self, a: Namespace, a_addresses: Sequence[str], b: Namespace, b_addresses: Sequence[str], *,
        names: tuple[str | None, str | None] = (None, None),
    ) -> tuple[str, str]:
        """A veth pair between two of our namespaces; returns the interface names (a side, b side): vNa and vNb
        unless `names` gives one (a node's eth1, rules that name it)."""
        self._links += 1
        a_if, b_if = names[0] or f"v{self._links}a", names[1] or f"v{self._links}b"
        tmp_a, tmp_b = f"{self.prefix[-6:]}{self._links}a", f"{self.prefix[-6:]}{self._links}b"
        # created directly inside the namespaces: the veth never exists in the machine's own namespace
        _ip("-n", a.name, "link", "add", tmp_a, "type", "veth", "peer", "name", tmp_b, "netns", b.name)
        a.run(["ip", "link", "set", tmp_a, "name", a_if])
        b.run(["ip", "link", "set", tmp_b, "name", b_if])
        for ns, ifname, addresses in ((a, a_if, a_addresses), (b, b_if, b_addresses)):
            for address in addresses:
                ns.run(["ip", "addr", "add", address, "dev", ifname, "nodad"] if ":" in address
                       else ["ip", "addr", "add", address, "dev", ifname])
            ns.run(["ip", "link", "set", ifname, "up"])
        return a_if, b_if

    def delete(self) -> None:
        errors = []
        for ns in reversed(list(self.namespaces.values())):
            result = subprocess.run(["ip", "netns", "del", ns.name], capture_output=True, text=True)
            if result.returncode != 0 and "No such file" not in result.stderr:
                errors.append(result.stderr.strip())
        self.namespaces.clear()
        if errors:
            raise NetnsError("; ".join(errors))


def new_prefix() -> str:
    # pid lets cleanup_stale tell whether the creator is still alive
    return f"{LAB_PREFIX}{os.getpid()}x{secrets.token_hex(2)}"


@contextmanager
def network() -> Iterator[Network]:
    net = Network(new_prefix())
    try:
        yield net
    finally:
        net.delete()


def cleanup_stale() -> list[str]:
    """Delete lab namespaces left by processes that no longer exist (a killed test run)."""
    result = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    removed = []
    for line in result.stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        if not name.startswith(LAB_PREFIX):
            continue
        pid_text = name[len(LAB_PREFIX):].split("x", 1)[0]
        if pid_text.isdigit() and os.path.exists(f"/proc/{pid_text}"):
            continue
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
        removed.append(name)
    return removed


class NamespaceRunner:
    """The backends' runner seam, executing inside a namespace (reading a lab node's kernel from outside it)."""

    def __init__(self, namespace: Namespace, *, timeout: float = 30.0) -> None:
        from ipmasq.backends.runner import SubprocessRunner  # the lab's other users need no backend code

        self._namespace = namespace
        self._run = SubprocessRunner(timeout=timeout)

    def __call__(self, argv: Sequence[str], stdin: str | None = None) -> Result:
        return self._run(self._namespace.argv(argv), stdin)

    def stream(self, argv: Sequence[str], chunks: Iterable[str]) -> Result:
        return self._run.stream(self._namespace.argv(argv), chunks)

    def read_lines(self, argv: Sequence[str], consume: Callable[[Iterator[str]], T]) -> tuple[Result, T | None]:
        return self._run.read_lines(self._namespace.argv(argv), consume)


def stop_process(proc: subprocess.Popen[str], *, timeout: float = 5.0) -> None:
    """SIGTERM (the agent then exits and leaves its rules), SIGKILL if it does not within `timeout`."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
