"""The setup scripts the README's two commands run: on a fresh machine a busy package manager (unattended-upgrades at
boot) is waited for, not met with apt's raw lock error; any other apt failure is apt's own, at once."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

from tests.conftest import ROOT

WAITING = ROOT / "scripts" / "apt-get-waiting.sh"
LOCKED = ("E: Could not get lock /var/lib/dpkg/lock-frontend. It is held by process 4242 (unattended-upgr)\n"
          "E: Unable to acquire the dpkg frontend lock (/var/lib/dpkg/lock-frontend), is another process using it?")


def _fake_apt(tmp_path: Path, failures: int, message: str) -> Path:
    """An apt-get on PATH that fails `failures` times with `message`, then succeeds; it logs each call."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "apt-get"
    script.write_text(f"""#!/bin/sh
echo "$*" >>{tmp_path}/calls
n=$(wc -l <{tmp_path}/calls)
if [ "$n" -le {failures} ]; then
  printf '%s\\n' "{message}" >&2
  exit 100
fi
echo installed
""")
    script.chmod(0o755)
    return bin_dir


def _run(tmp_path: Path, bin_dir: Path, seconds: str = "60") -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "APT_WAIT_SECONDS": seconds,
           "APT_WAIT_INTERVAL": "0"}
    return subprocess.run(["bash", str(WAITING), "install", "-y", "nftables"], capture_output=True, text=True,
                          env=env, timeout=60)


def test_a_held_lock_is_waited_for_and_said_once(tmp_path: Path) -> None:
    done = _run(tmp_path, _fake_apt(tmp_path, 3, LOCKED))
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("waiting for it") == 1, done.stderr
    assert "held by process 4242 (unattended-upgr)" in done.stderr
    calls = (tmp_path / "calls").read_text().splitlines()
    assert len(calls) == 4 and all(c == "-o DPkg::Lock::Timeout=60 install -y nftables" for c in calls), calls


def test_another_failure_is_apts_own_at_once(tmp_path: Path) -> None:
    done = _run(tmp_path, _fake_apt(tmp_path, 5, "E: Unable to locate package nftabels"))
    assert done.returncode == 100
    assert "Unable to locate package nftabels" in done.stderr and "waiting" not in done.stderr
    assert len((tmp_path / "calls").read_text().splitlines()) == 1


def test_a_lock_held_past_the_limit_ends_in_one_line_that_says_so(tmp_path: Path) -> None:
    done = _run(tmp_path, _fake_apt(tmp_path, 10**6, LOCKED), seconds="0")
    assert done.returncode == 100
    assert done.stderr.strip().splitlines()[-1].startswith("apt-get-waiting: another package manager held the lock")


def test_bootstrap_installs_through_the_waiting_apt() -> None:
    text = (ROOT / "scripts" / "bootstrap.sh").read_text()
    runs = re.findall(r"apt-get(?:-waiting\.sh)? (?:update|install)", text)
    assert runs and all(run.startswith("apt-get-waiting.sh") for run in runs), runs
