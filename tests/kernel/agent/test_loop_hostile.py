"""A real agent, once per backend, whose config file is replaced one after another by hostile inputs: a YAML alias
bomb, deep nesting, a 50 MB file, a FIFO, a directory, a symlink to /dev/zero, invalid UTF-8, an overflowing
resyncInterval. For each: the same process stays alive, /readyz says not ready and why, the last good rules stay
enforced (a real TCP connection still leaves with the pod's address) and drift is still repaired, its peak memory
stays bounded, and the next good config (changed) is applied and makes it ready again.

Every input is built here. Each replaces the config in one atomic exchange (renameat2 RENAME_EXCHANGE): the agent
never sees the path missing in between, which would mean the defaults (as in the reference) instead of a hostile
input.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from ipmasq.lab.netns import Namespace, Network
from tests.eventually import eventually
from tests.kernel.agent_harness import AWS_DB, NODE, ONPREM, POD, agent, world
from tests.kernel.flavors import FLAVORS, Flavor

# 10.0.0.0/8 holds the on-prem peer, so its probes show the pod address; the two good configs differ on the AWS
# peer, so each return of a good config is a change a probe can see
GOOD = ("nonMasqueradeCIDRs: [10.0.0.0/8]\nresyncInterval: 200ms\n",
        "nonMasqueradeCIDRs: [10.0.0.0/8, 172.30.0.0/16]\nresyncInterval: 200ms\n")
AWS_SEES = (NODE, POD)  # what the AWS peer sees under each good config
PEAK_LIMIT_KIB = 64 * 1024  # the agent's VmHWM; it idles near 20 MiB
RENAME_EXCHANGE = 2
AT_FDCWD = -100


@dataclass(frozen=True)
class Hostile:
    name: str
    make: Callable[[Path], None]  # creates the hostile entry at the given path
    reason: str  # what /readyz's body must say


def _text(data: bytes) -> Callable[[Path], None]:
    def make(path: Path) -> None:
        path.write_bytes(data)
    return make


def _alias_bomb() -> bytes:
    """Billion laughs: nine levels of nine aliases each, 9**9 strings once expanded, in under 500 bytes."""
    lines = ['a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for previous, name in zip("abcdefgh", "bcdefghi", strict=True):
        key = "nonMasqueradeCIDRs" if name == "i" else name
        lines.append(f"{key}: &{name} [{', '.join([f'*{previous}'] * 9)}]")
    return ("\n".join(lines) + "\n").encode()


def _sparse(size: int) -> Callable[[Path], None]:
    def make(path: Path) -> None:
        with path.open("wb") as fh:
            fh.truncate(size)
    return make


def _directory(path: Path) -> None:
    path.mkdir()


def _fifo(path: Path) -> None:
    os.mkfifo(path)


def _to_dev_zero(path: Path) -> None:
    path.symlink_to("/dev/zero")


HOSTILE = (
    Hostile("YAML alias bomb", _text(_alias_bomb()), "YAML aliases"),
    Hostile("YAML nested 400 deep", _text(("nonMasqueradeCIDRs: " + "[" * 400 + "]" * 400 + "\n").encode()),
            "nested deeper than"),
    Hostile("JSON nested 1,000 deep", _text(('{"nonMasqueradeCIDRs": ' + "[" * 1000 + "]" * 1000 + "}").encode()),
            "nested deeper than"),
    Hostile("JSON nested 100,000 deep",
            _text(('{"nonMasqueradeCIDRs": ' + "[" * 100_000 + "]" * 100_000 + "}").encode()), "nested deeper than"),
    Hostile("50 MB file", _sparse(50_000_000), "too large"),
    Hostile("FIFO", _fifo, "a FIFO"),
    Hostile("directory", _directory, "a directory"),
    Hostile("symlink to /dev/zero", _to_dev_zero, "a character device"),
    Hostile("invalid UTF-8", _text(b"nonMasqueradeCIDRs: [10.0.0.0/8]\n# caf\xe9 \xff\xfe\n"), "not UTF-8"),
    Hostile("resyncInterval 1000000000h", _text(b"nonMasqueradeCIDRs: [10.0.0.0/8]\nresyncInterval: 1000000000h\n"),
            "invalid duration"),
)


def exchange(staged: Path, path: Path) -> None:
    """Swap two paths in one step (either may be a file, a directory, a FIFO or a symlink), then remove the old one:
    rename(2) cannot put a directory over a file, and unlink-then-rename would show the agent a missing config."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.renameat2(AT_FDCWD, os.fsencode(staged), AT_FDCWD, os.fsencode(path), RENAME_EXCHANGE) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, os.strerror(errno), str(path))
    if staged.is_dir() and not staged.is_symlink():
        shutil.rmtree(staged)
    else:
        staged.unlink()


def replace(path: Path, make: Callable[[Path], None]) -> None:
    staged = path.with_name(".staged")  # not an ip-masq* name, and the agent reads only its own path
    make(staged)
    exchange(staged, path)


def health(node: Namespace, *args: str) -> tuple[bool, str]:
    """`ipmasq health` inside the node, as the DaemonSet's exec probes run it: (ok, the reason it printed)."""
    done = node.run([sys.executable, "-m", "ipmasq", "health", *args], check=False)
    return done.returncode == 0, (done.stdout + done.stderr).strip()


def peak_kib(pid: int) -> int:
    """VmHWM: the process's resident-memory high-water mark since it started."""
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmHWM:")).split()[1])


def drift(flavor: Flavor, good: list[str]) -> list[list[str]]:
    """Delete our objects whole with the kernel tool: the chain (and its jump), or the table."""
    return flavor.drifts(good)["delete table" if flavor.backend == "nftables" else "delete chain"]


@pytest.mark.parametrize("flavor", FLAVORS, ids=str)
def test_hostile_config_files_keep_the_last_good_rules_and_the_agent_alive(net: Network, tmp_path: Path,
                                                                           flavor: Flavor) -> None:
    config_dir = tmp_path / "config"  # the agent watches this directory: its log lives elsewhere
    config_dir.mkdir()
    path = config_dir / "ip-masq-agent"
    path.write_text(GOOD[0])
    with world(net) as w, agent(w.node, tmp_path / "agent.log", f"--config={path}", flavor.flag) as running:
        pid = running.proc.pid
        assert Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[2:4] == [b"ipmasq", b"agent"]
        eventually(lambda: health(w.node)[0], lambda: f"ready\n{running.log}")
        enforced = 0
        good = flavor.ours(w.node)
        assert w.seen(ONPREM) == POD and w.seen(AWS_DB) == AWS_SEES[enforced]
        peaks = {"started": peak_kib(pid)}
        for case in HOSTILE:
            replace(path, case.make)

            def refused(reason: str = case.reason) -> bool:
                ok, why = health(w.node)
                return not ok and why.startswith("not ready: config error: ") and reason in why

            eventually(refused, lambda name=case.name: f"{name} refused: {health(w.node)[1]}\n{running.log}")
            assert running.proc.poll() is None, f"{case.name}: the agent exited\n{running.log}"
            assert health(w.node, "--live")[0], case.name  # a bad config is no reason to restart the agent

            # drift is still repaired, with the last good config
            applied = len(running.lines("applied IPv4"))
            for argv in drift(flavor, good):
                w.node.run(argv)

            # the agent may repair before we look: its log's count of writes says a repair happened
            def repaired(before: int = applied, want: list[str] = good) -> bool:
                return len(running.lines("applied IPv4")) > before and flavor.ours(w.node) == want

            eventually(repaired, lambda name=case.name: f"{name}: the drift repaired\n{running.log}")
            assert refused(), f"{case.name}: the repair made it ready"
            assert w.seen(ONPREM) == POD, case.name
            assert w.seen(AWS_DB) == AWS_SEES[enforced], case.name

            peaks[case.name] = peak_kib(pid)
            assert peaks[case.name] < PEAK_LIMIT_KIB, f"{case.name}: VmHWM {peaks}"

            # the next good config, a change: applied, and ready again
            enforced = 1 - enforced
            replace(path, _text(GOOD[enforced].encode()))
            eventually(lambda: health(w.node)[0],
                       lambda name=case.name: f"{name}: ready with the next good config: {health(w.node)[1]}\n"
                                              f"{running.log}")
            assert w.seen(AWS_DB) == AWS_SEES[enforced], case.name
            assert w.seen(ONPREM) == POD, case.name
            good = flavor.ours(w.node)
            assert running.proc.poll() is None, f"{case.name}: the agent exited\n{running.log}"
        print(f"{flavor.backend}: VmHWM KiB {peaks}")
    assert not running.lines("unexpected error"), running.log
    assert len(running.lines("config error")) == len(HOSTILE), running.log  # once per change, not per tick
