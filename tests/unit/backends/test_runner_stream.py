"""SubprocessRunner.stream: input written piece by piece from a generator, to a slow reader, a program that stops
reading early, a program that never reads; cancellation and timeouts as with a whole input; and the iptables
backend's restore through it is byte for byte the payload restore_payload builds."""

from __future__ import annotations

import hashlib
import sys
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from ipmasq.backends.base import Result
from ipmasq.backends.iptables import IptablesBackend, Variant, restore_payload
from ipmasq.backends.runner import SubprocessRunner
from ipmasq.config import ConfigInput, config_from_bytes
from ipmasq.errors import BackendError
from ipmasq.options import PolicyOptions
from ipmasq.policy.policy import Policy
from ipmasq.prefix import Family
from ipmasq.testing import FakeIptables, FakeRunner
from tests.unit.backends.sleepers import cancel_once_asleep, killed_in_its_sleep, sleeper
from tests.unit.backends.test_runner import SLOW_READER

SHA256_OF_STDIN = "import hashlib, sys; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest())"


def lines(count: int) -> Iterator[str]:
    for i in range(count):
        yield f"-A CHAIN -d 10.{i % 256}.0.0/16 -j RETURN\n"


def test_a_generated_input_reaches_a_slow_reader_whole() -> None:
    result = SubprocessRunner(cancel=threading.Event(), timeout=30).stream([sys.executable, "-c", SLOW_READER],
                                                                           lines(200_000))
    assert result.returncode == 0 and result.stdout.strip() == "200000"


def test_a_program_that_stops_reading_early_is_reported_not_hung() -> None:
    result = SubprocessRunner(timeout=10).stream(
        [sys.executable, "-c", "import sys; sys.stdin.readline(); sys.exit('rejected line 1')"], lines(500_000))
    assert result.returncode == 1 and "rejected line 1" in result.stderr


def test_cancel_and_timeout(tmp_path: Path) -> None:
    cancel = threading.Event()
    cancel_once_asleep(tmp_path / "a", cancel)
    with pytest.raises(BackendError, match="cancelled"):
        SubprocessRunner(cancel=cancel).stream([sys.executable, "-c", sleeper(tmp_path / "a")], lines(1))
    assert killed_in_its_sleep(tmp_path / "a")
    with pytest.raises(BackendError, match=r"timed out after 0s"):
        SubprocessRunner(timeout=0.3).stream([sys.executable, "-c", sleeper(tmp_path / "b")], lines(500_000))
    assert killed_in_its_sleep(tmp_path / "b")
    with pytest.raises(BackendError, match="cannot run"):
        SubprocessRunner().stream(["/nonexistent/program"], lines(1))


def test_the_restore_streamed_is_the_payload_byte_for_byte() -> None:
    """What iptables-restore receives through the streaming runner equals restore_payload's text."""
    text = ("cidrLimit: 10000\nnonMasqueradeCIDRs: ["
            + ", ".join(f"10.{i >> 8}.{i & 255}.0/24" for i in range(0, 20_000, 2)) + "]\n")
    options = PolicyOptions()
    config = config_from_bytes(ConfigInput((("/etc/config/ip-masq-agent", text.encode()),)), options)
    policy = Policy(config, options)
    fake = FakeIptables()
    backend = IptablesBackend(fake, chain="IP-MASQ-AGENT", variant=Variant.NFT)
    current = backend.read(Family.V4)
    expected = hashlib.sha256(restore_payload(policy, Family.V4, current).encode()).hexdigest()
    received: list[str] = []

    class Recording(FakeRunner):
        """The fake, with the restore replaced by the real runner streaming to a program that hashes its input."""

        def __init__(self) -> None:
            super().__init__(fake)
            self.real = SubprocessRunner(timeout=30)

        def stream(self, argv: Sequence[str], chunks: Iterator[str]) -> Result:
            result = self.real.stream([sys.executable, "-c", SHA256_OF_STDIN], chunks)
            received.append(result.stdout.strip())
            return Result(0)

    recording = Recording()
    IptablesBackend(recording, chain="IP-MASQ-AGENT", variant=Variant.NFT).apply(policy, Family.V4, current)
    assert received == [expected]


def test_a_fake_gets_a_streamed_input_joined() -> None:
    seen: list[str | None] = []

    def plain(argv: Sequence[str], stdin: str | None = None) -> Result:
        seen.append(stdin)
        return Result(0)

    FakeRunner(plain).stream(["cat"], iter(["a\n", "b\n"]))
    assert seen == ["a\nb\n"]
