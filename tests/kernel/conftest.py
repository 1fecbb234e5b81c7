"""Kernel tests: real netfilter inside throwaway network namespaces.

They need root and Debian's iptables, nftables, iproute2 and conntrack. Without them they skip locally, but
fail when CI is set: in CI a kernel test that cannot run is a failure, never a silent skip.
"""

from __future__ import annotations

import fcntl
import os
import shutil
from collections.abc import Iterator

import pytest

from ipmasq.agent.nodelock import DEFAULT_LOCK_DIRECTORY
from ipmasq.lab.netns import Network, cleanup_stale, network

TOOLS = ("ip", "iptables", "ip6tables", "iptables-save", "iptables-restore", "nft", "conntrack")


def _missing() -> str | None:
    if os.geteuid() != 0:
        return "kernel tests need root"
    absent = [t for t in TOOLS if shutil.which(t) is None]
    if absent:
        return f"kernel tests need {', '.join(absent)}"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/kernel/" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(pytest.mark.kernel)


@pytest.fixture(scope="session", autouse=True)
def _kernel_available() -> Iterator[None]:
    reason = _missing()
    if reason is not None:
        if os.environ.get("CI"):
            pytest.fail(f"{reason} (CI is set: kernel tests must run)")
        pytest.skip(reason)
    cleanup_stale()
    before = _lock_files()
    yield
    _remove_lock_files(_lock_files() - before)


def _lock_files() -> set[str]:
    try:
        return {e.path for e in os.scandir(DEFAULT_LOCK_DIRECTORY) if e.name.endswith(".lock")}
    except OSError:
        return set()


def _remove_lock_files(paths: set[str]) -> None:
    """Agents run in the tests' namespaces lock `agent-netns-INODE.lock` on this machine (named for namespaces that
    are gone now): remove the ones this run created, unless an agent still holds one."""
    for path in paths:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.unlink(path)
        except OSError:
            pass  # held by a running agent (another test run): not ours to remove
        finally:
            os.close(fd)


@pytest.fixture
def net() -> Iterator[Network]:
    """A fresh set of namespaces for one test, deleted afterwards even when the test fails."""
    with network() as n:
        yield n
