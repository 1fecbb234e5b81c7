"""Every reference vector, applied by `ipmasq agent --once` to a real kernel, reads back as the reference left it:
the same chain, jump and rules byte for byte, and beside them one object the reference never writes, the chain's
ownership marker (an empty chain no rule jumps to)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ipmasq.lab.netns import Network
from ipmasq.netfilter.iptables import marker_chain
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
    lines = saved(node.run(["iptables-save", "-t", "nat"]).stdout)
    chain = next((flag.split("=", 1)[1] for flag in flags if flag.startswith("--masq-chain=")), "IP-MASQ-AGENT")
    marker = marker_chain(chain)
    if result.returncode == 0:
        # written with the chain, in the same transaction: the marker and its one rule
        assert lines.count(f":{marker} - [0:0]") == 1, lines
        assert sum(line.startswith(f"-A {marker} ") for line in lines) == 1, lines
    return result.returncode, result.stderr, [line for line in lines if marker not in line]


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
