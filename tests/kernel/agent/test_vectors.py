"""Every reference vector, applied by `ipmasq agent --once` to a real kernel, reads back as the reference left it."""

from __future__ import annotations

from pathlib import Path

import pytest

from ipmasq.lab.netns import Network
from tests.conftest import PYTHON, VECTORS

CASES = sorted((VECTORS / "cases").iterdir())
# Runs without a config file, with the flags vectors/README.md names.
FLAG_ONLY = {
    "01-no-file.out": (),
    "16-no-file-all-reserved.out": ("--nomasq-all-reserved-ranges",),
    "17-gke-chain.out": ("--masq-chain=IP-MASQ", "--nomasq-all-reserved-ranges"),
}
BUILTIN = (":PREROUTING ", ":INPUT ", ":OUTPUT ", ":POSTROUTING ")


def saved(text: str) -> list[str]:
    """`:CHAIN` and `-A` lines as iptables-save printed them (v2.9.1 predates --random-fully)."""
    return [line.replace(" --random-fully", "") for line in text.splitlines()
            if (line.startswith(":") and not line.startswith(BUILTIN)) or line.startswith("-A")]


def run_once(net: Network, config: str, flags: tuple[str, ...]) -> tuple[int, str, list[str]]:
    node = net.add("node")
    result = node.run([PYTHON, "-m", "ipmasq", "agent", "--once", "--backend=iptables", f"--config={config}",
                       *flags], check=False)
    return result.returncode, result.stderr, saved(node.run(["iptables-save", "-t", "nat"]).stdout)


@pytest.mark.parametrize("case", CASES, ids=lambda p: p.name)
def test_case(net: Network, case: Path) -> None:
    expected = (VECTORS / "expected" / f"{case.name}.out").read_text()
    code, stderr, lines = run_once(net, str(case), ())
    if expected.startswith("LOG:"):
        assert code == 1
        assert len(stderr.strip().splitlines()) == 1, stderr
        assert expected.split("error syncing configuration: ", 1)[1].strip() in stderr
        assert f"{case}:" in stderr
        assert lines == []
    else:
        assert code == 0, stderr
        assert lines == expected.splitlines()


@pytest.mark.parametrize("name", sorted(FLAG_ONLY))
def test_flag_only(net: Network, tmp_path: Path, name: str) -> None:
    code, stderr, lines = run_once(net, str(tmp_path / "absent"), FLAG_ONLY[name])
    assert code == 0, stderr
    assert lines == (VECTORS / "expected" / name).read_text().splitlines()
