"""What an upgrade and a rollback are proven with on the lab's cluster: the previous release's deploy/ (from the commit
CHANGELOG.md names for it), and traffic from every node's probe pod, a connection every 50 ms to the peer behind the
VPN that admits only node addresses, each answer (the source the peer saw, or FAILED) kept with when it arrived."""

from __future__ import annotations

import re
import subprocess
import threading
import time
from pathlib import Path

from ipmasq.lab.kubernetes.cluster import Cluster
from ipmasq.lab.kubernetes.layout import LAB_NAMESPACE
from ipmasq.lab.topology import ADDR, STRICT_PORT
from tests.conftest import ROOT

PROBE_INTERVAL = "0.05"  # a connection every 50 ms from every node's probe pod
PROBES_PER_PHASE = 40  # each node's connections seen after a phase's rollout before the next one starts


def previous_release_deploy(into: Path) -> tuple[str, Path]:
    """deploy/ as the previous release shipped it: the commit CHANGELOG.md names for it (what
    docs/operations/upgrade.md tells an operator to apply), checked to say that version."""
    text = (ROOT / "CHANGELOG.md").read_text()
    entries = re.findall(r"^## (\d+\.\d+\.\d+) .*?(?=^## |\Z)", text, re.MULTILINE | re.DOTALL)
    previous = entries[1]
    section = text[text.index(f"## {previous} "):]
    named = re.search(r"Made from commit `([0-9a-f]{40})`", section)
    assert named, f"CHANGELOG.md's {previous} entry names no commit"
    commit = named.group(1)
    shown = subprocess.run(["git", "-C", str(ROOT), "show", f"{commit}:src/ipmasq/__init__.py"],
                           capture_output=True, text=True)
    assert shown.returncode == 0, f"commit {commit} of {previous} is not in this clone: {shown.stderr.strip()}"
    assert f'__version__ = "{previous}"' in shown.stdout
    into.mkdir(parents=True, exist_ok=True)
    # git's own archive through Debian's tar (tarfile's extraction filters are newer than Debian 12's Python)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", commit, "deploy"], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True, capture_output=True)
    return previous, into / "deploy"


class Traffic:
    """From every node's probe pod, a connection every 50 ms to the peer behind the VPN, each line (the source the
    peer saw, or FAILED) kept with the time it arrived."""

    def __init__(self, cluster: Cluster) -> None:
        self.lines: dict[str, list[tuple[float, str]]] = {node.name: [] for node in cluster.nodes}
        pods = cluster.probe_pods()
        self.clients = {node.name: subprocess.Popen(
            [cluster.artifacts.toolchain.kubectl, f"--kubeconfig={cluster.kubeconfig}", "exec", "-n", LAB_NAMESPACE,
             pods[node.name][0], "--", "python", "-m", "ipmasq.lab.probe", "repeat", f"{ADDR.aws_db}:{STRICT_PORT}",
             "--seconds", "900", "--interval", PROBE_INTERVAL, "--timeout", "1"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) for node in cluster.nodes}
        self.readers = [threading.Thread(target=self._read, args=(name, client), daemon=True)
                        for name, client in self.clients.items()]
        for reader in self.readers:
            reader.start()

    def _read(self, name: str, client: subprocess.Popen[str]) -> None:
        assert client.stdout is not None
        for line in client.stdout:
            if line.endswith("\n"):
                self.lines[name].append((time.monotonic(), line.strip()))

    def count_since(self, since: float) -> int:
        return min(sum(1 for at, _ in lines if at >= since) for lines in self.lines.values())

    def between(self, name: str, start: float, end: float) -> list[str]:
        return [line for at, line in self.lines[name] if start <= at < end]

    def stop(self) -> None:
        for client in self.clients.values():
            client.kill()
            client.wait(timeout=30)
        for reader in self.readers:
            reader.join(timeout=30)


def phase_report(cluster: Cluster, traffic: Traffic, start: float, end: float) -> tuple[int, int, int]:
    """A phase's probes of every node, those that left with another address than their node's, those that failed."""
    probes = wrong = failed = 0
    for node in cluster.nodes:
        seen = traffic.between(node.name, start, end)
        probes += len(seen)
        failed += sum(1 for s in seen if s == "FAILED")
        wrong += sum(1 for s in seen if s not in ("FAILED", node.address))
    return probes, wrong, failed
