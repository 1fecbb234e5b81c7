"""The lab's cgroup tree (`ipmasq-lab`, kubelet's pods below each node's part of it): every process the lab starts
joins it, so that tearing down kills the whole tree, whatever was started inside it, and a kept cluster is known by
the processes it holds."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

from ipmasq.errors import ClusterError
from ipmasq.lab.kubernetes.layout import INSTANCE
from ipmasq.lab.wait import until

__all__ = [
    "CGROUP_CONTROLLERS", "CGROUP_ROOT", "cgroup_pids", "join_cgroup", "kill_cgroup_tree", "make_cgroup",
    "move_to_cgroup",
]


CGROUP_ROOT = f"ipmasq-lab{'-' + INSTANCE if INSTANCE else ''}"
CGROUP_CONTROLLERS = ("cpu", "cpuacct", "cpuset", "memory", "devices", "freezer", "blkio", "pids", "systemd",
                      "unified")


def _cgroup(controller: str, *parts: str) -> Path:
    return Path("/sys/fs/cgroup", controller, CGROUP_ROOT, *parts)


def make_cgroup(*parts: str) -> None:
    """ipmasq-lab/PARTS in every controller; cpuset's cpus and mems copied down, as a new cpuset starts empty."""
    for controller in CGROUP_CONTROLLERS:
        if not Path("/sys/fs/cgroup", controller).is_dir():
            continue
        path = Path("/sys/fs/cgroup", controller)
        for part in (CGROUP_ROOT, *parts):
            parent, path = path, path / part
            path.mkdir(exist_ok=True)
            if controller == "cpuset":
                for name in ("cpuset.cpus", "cpuset.mems"):
                    if not (path / name).read_text().strip():
                        (path / name).write_text((parent / name).read_text())


def join_cgroup(*parts: str) -> Callable[[], None]:
    """A preexec_fn: the child joins ipmasq-lab/PARTS in every controller before it executes."""
    def join() -> None:
        for controller in CGROUP_CONTROLLERS:
            procs = _cgroup(controller, *parts, "cgroup.procs")
            if procs.exists():
                procs.write_text("0")
    return join


def move_to_cgroup(pid: int, *parts: str) -> None:
    """A process started elsewhere (the world's probe servers) joins ipmasq-lab/PARTS, so teardown takes it too."""
    for controller in CGROUP_CONTROLLERS:
        procs = _cgroup(controller, *parts, "cgroup.procs")
        if procs.exists():
            procs.write_text(str(pid))


def cgroup_pids() -> set[int]:
    pids: set[int] = set()
    root = Path("/sys/fs/cgroup", "pids", CGROUP_ROOT)
    if not root.exists():
        return pids
    for directory, _dirs, files in os.walk(root):
        if "cgroup.procs" in files:
            try:
                pids.update(int(p) for p in Path(directory, "cgroup.procs").read_text().split())
            except OSError:
                continue
    return pids


def kill_cgroup_tree(timeout: float = 20.0) -> None:
    """SIGTERM then SIGKILL every process of the lab's cgroup tree until it is empty; then remove the tree."""
    deadline = time.monotonic() + timeout
    sent_term = False
    while True:
        pids = cgroup_pids()
        if not pids:
            break
        # again and again until none is left: a shim or a restarting container may fork while the kill goes on
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL if sent_term else signal.SIGTERM)
        if not sent_term:
            sent_term = True
            with contextlib.suppress(ClusterError):  # what SIGTERM leaves after 3 s gets SIGKILL
                until(lambda: not cgroup_pids(), "the lab's processes to exit on SIGTERM", timeout=3.0,
                      error=ClusterError)
            continue
        if time.monotonic() > deadline:
            raise ClusterError(f"processes of the lab would not exit: {sorted(pids)[:10]}")
        time.sleep(0.1)
    for controller in CGROUP_CONTROLLERS:
        root = Path("/sys/fs/cgroup", controller, CGROUP_ROOT)
        if not root.exists():
            continue
        for directory, _dirs, _files in sorted(os.walk(root), key=lambda w: -len(Path(w[0]).parts)):
            with contextlib.suppress(OSError):
                os.rmdir(directory)
