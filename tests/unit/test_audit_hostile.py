"""Flow logs nobody should write, and standard input: one line naming the place, never a traceback."""

from __future__ import annotations

import gzip
import subprocess
import sys
from pathlib import Path

import pytest

from ipmasq.cli import main

RECORD = '{"connection": {"src_ip": "10.44.14.15", "dest_ip": "172.30.12.110"}, "disposition": "DENIED"}\n'


@pytest.mark.parametrize("line", [
    '{"connection": {"src_ip": 5, "dest_ip": "1.1.1.1"}}',
    '{"connection": {"src_ip": ["10.44.0.1"], "dest_ip": "1.1.1.1"}}',
    '{"connection": {"src_ip": "10.44.0.1", "dest_ip": null}}',
    '{"connection": null}',
    "[1, 2, 3]",
    '{"connection": {"src_ip": "' + "9" * 1_000_000 + '", "dest_ip": "1.1.1.1"}}',
])
def test_malformed_gcp_record_is_one_line(tmp_path: Path, line: str, capsys: pytest.CaptureFixture[str]) -> None:
    log = tmp_path / "flows.jsonl"
    log.write_text(RECORD + line + "\n")
    assert main(["audit", str(log), "--pod-range", "10.44.0.0/14"]) == 3  # could not read it
    err = capsys.readouterr().err
    assert err.startswith(f"ipmasq audit: {log}:2: ") and err.count("\n") == 1 and len(err.replace(str(log), "")) < 400


def _audit_stdin(data: bytes, *args: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([sys.executable, "-m", "ipmasq", "audit", *args, "--pod-range", "10.44.0.0/14"],
                          input=data, capture_output=True, timeout=60, check=False)


@pytest.mark.parametrize("compress", [False, True])
def test_flow_log_from_stdin_plain_or_gzip(compress: bool) -> None:
    data = RECORD.encode()
    done = _audit_stdin(gzip.compress(data) if compress else data, "-")
    assert done.returncode == 1, done.stderr  # the rejected pod flow still leaves with the pod IP
    assert b"172.30.12.110: pod source, rejected" in done.stdout


def test_stdin_errors_name_stdin() -> None:
    done = _audit_stdin(b"not a record at all\n", "-")
    assert done.returncode == 3 and done.stderr.decode().startswith("ipmasq audit: <stdin>:1: ")


def test_two_stdins_are_a_usage_error() -> None:
    done = _audit_stdin(RECORD.encode(), "-", "-")
    assert done.returncode == 2 and done.stderr.decode() == "ipmasq audit: - (standard input) can be given once\n"
