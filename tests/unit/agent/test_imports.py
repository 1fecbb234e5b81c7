"""What the node agent's process imports: each module it imports stays resident for the life of the pod.

The agent (build_parser("agent"), then a pass with a fake backend and a /metrics render, in a fresh interpreter)
must not hold inspect, ast, dis or opcode (about 0.9 MiB): dataclasses is imported with a stand-in for inspect
(ipmasq.agent.lean), which stays unused only while every dataclass the agent defines has its own docstring.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from ipmasq.agent.lean import _ImportedOnFirstUse

AGENT_RUN = """\
import logging
import sys
from ipmasq.cli import build_parser
args = build_parser("agent").parse_args(["agent", f"--backend={sys.argv[1]}"])
from ipmasq.agent.metrics import AgentStatus, render_metrics
from ipmasq.agent.reconcile import Reconciler
from ipmasq.backends.choose import make_backend
from ipmasq.commands.common import options_from_args
from ipmasq.config.isolated import load_config_isolated
from ipmasq.config.source import ConfigInput
from ipmasq.testing import FakeIptables, FakeNft
fake = FakeNft() if sys.argv[1] == "nftables" else FakeIptables()
options = options_from_args(args)
backend, _ = make_backend(sys.argv[1], options, fake, variant="nft")
reconciler = Reconciler(backend, options, log=logging.getLogger("agent"), load=load_config_isolated)
status = AgentStatus(version="1", backend=sys.argv[1])
status.observed(reconciler.observe(ConfigInput((("/etc/config/ip-masq-agent", sys.argv[2].encode()),))))
report = reconciler.reconcile()
assert report.readiness.ready
status.reconciled(report, 0.01)
assert b"ipmasq_syncs_total" in render_metrics(status)
import dataclasses
print(type(dataclasses.inspect).__name__, " ".join(sorted(sys.modules)))
"""
# inspect and what it brings: dataclasses' import of it is the only one on the agent's path
NOT_IN_THE_AGENT = ("inspect", "ast", "_ast", "dis", "opcode", "_opcode")


@pytest.mark.parametrize("backend", ["iptables", "nftables"])
def test_the_agent_process_holds_no_inspect_or_ast(backend: str) -> None:
    config = ("nonMasqueradeCIDRs: [10.0.0.0/8]\nmasqueradeCIDRs: [10.1.0.0/16]\n"
              "rules: [{name: vpn, destinations: [10.2.0.0/16], action: preserve}]\n")
    result = subprocess.run([sys.executable, "-c", AGENT_RUN, backend, config], capture_output=True, text=True,
                            check=True)
    inspect_kind, *modules = result.stdout.split()
    assert "ipmasq.agent.loop" in modules and "ipmasq.agent.health" in modules and "dataclasses" in modules
    held = sorted(set(modules) & set(NOT_IN_THE_AGENT))
    assert held == [], f"the agent's process imports {held} (a dataclass without a docstring on its path?)"
    assert inspect_kind == "_ImportedOnFirstUse"


def test_every_dataclass_on_the_agent_path_has_its_own_docstring() -> None:
    # the same condition, named: the class the next engineer adds without one is listed here
    script = """\
import dataclasses, sys
from ipmasq.cli import build_parser
build_parser("agent")
import ipmasq.config.isolated, ipmasq.testing
for module in list(sys.modules.values()):
    for value in list(vars(module).values()) if module else ():
        if isinstance(value, type) and dataclasses.is_dataclass(value) and value.__module__ == module.__name__ \\
                and (value.__doc__ or "").startswith(value.__name__ + "("):
            print(f"{value.__module__}.{value.__qualname__}")
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert result.stdout.split() == []


def test_the_stand_in_answers_from_the_real_module() -> None:
    stand_in = _ImportedOnFirstUse("inspect")
    assert stand_in.signature is __import__("inspect").signature


def test_dataclasses_imported_lean_still_documents_a_class_without_a_docstring() -> None:
    script = """\
import sys
from ipmasq.agent.lean import import_dataclasses_without_inspect
import_dataclasses_without_inspect()
assert "inspect" not in sys.modules
import dataclasses
@dataclasses.dataclass(frozen=True)
class Point:
    x: int
    y: int = 0
import inspect
print(Point.__doc__, "inspect" in sys.modules, type(inspect).__name__)
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "Point(x: int, y: int = 0) True module"
