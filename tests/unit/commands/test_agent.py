"""`ipmasq agent` imports what the node agent runs and no offline tool: every module it holds is resident memory on
every node (docs/measurements.md). (ipmasq.diff.diff is the agent's too: --flush-conntrack finds the flipped verdicts
with it.)"""

from __future__ import annotations

import subprocess

from tests.conftest import PYTHON

OFFLINE_ONLY = ("ipmasq.lint", "ipmasq.diagnose", "ipmasq.audit", "ipmasq.lab", "ipmasq.commands.diff",
                "ipmasq.commands.policy_source", "difflib")


def test_the_agent_imports_no_offline_tool() -> None:
    script = ("import sys\n"
              "from ipmasq.cli import _go_flags_normalised, build_parser\n"
              "build_parser('agent').parse_args(_go_flags_normalised('agent', ['agent', '--once']))\n"
              f"print(sorted(m for m in sys.modules if m.startswith({OFFLINE_ONLY!r})))\n")
    result = subprocess.run([PYTHON, "-c", script], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def test_the_agent_does_not_map_openssl_for_its_digests() -> None:
    # hashlib and ssl map libcrypto (about 3.4 MiB resident); the agent's digests are of a few KiB (ipmasq.sha256)
    script = ("import sys\n"
              "from ipmasq.cli import build_parser\n"
              "from ipmasq.config.source import config_digest\n"
              "from ipmasq.policy.hash import policy_hash\n"
              "build_parser('agent')\n"
              "config_digest((b'nonMasqueradeCIDRs: [10.0.0.0/8]\\n',))\n"
              "print(sorted(m for m in sys.modules if m in ('hashlib', '_hashlib', 'ssl', '_ssl')))\n")
    result = subprocess.run([PYTHON, "-c", script], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def test_observing_aks_or_eks_refuses_what_that_agent_does_not_run_with_in_one_line() -> None:
    """Their chain, flags and inputs are the provider's (ipmasq.writers); the inputs only the API server holds."""
    for args, said in ((("--observe", "eks", "--masq-chain", "X"), "drop --masq-chain"),
                       (("--observe", "aks", "--configmaps", "a"), "drop --configmaps"),
                       (("--observe", "aks", "--once"), "--once cannot go with it"),
                       (("--observe", "eks", "--api", "off"), "--api off cannot go with it")):
        result = subprocess.run([PYTHON, "-m", "ipmasq", "agent", *args, "--metrics-address="], capture_output=True,
                                text=True, timeout=60)
        assert result.returncode == 2 and said in result.stderr and len(result.stderr.splitlines()) == 1, result
