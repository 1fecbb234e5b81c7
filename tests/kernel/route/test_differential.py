"""The path model against the kernel on generated nodes (tests/kernel/route/differential.py): for every probe of
every generated topology, the model's routing decision is the kernel's (`ip route get`: the same device and
gateway, or the same refusal) and the source the model says the destination sees is the one a real TCP peer saw,
out of the uplink the model names. An undecided answer must say why; only that probe is skipped.

Repeatable in CI: a fixed derandomized run, no example database; a failure prints the topology as the commands that
build it (and hypothesis shrinks it to the fewest rules, routes and probes that still fail).
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, note, settings

from ipmasq.prefix import Family
from tests.kernel.route.differential import Topology, topologies
from tests.kernel.route.differential_kernel import run_case

# about 0.3 s a topology here (0.6 s on a loaded 2-core machine): 20 to 40 s a family
EXAMPLES = 60

_SETTINGS = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None, print_blob=False,
                     suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _differential(topology: Topology) -> None:
    note(topology.script())
    result = run_case(topology)
    if result.rejected:
        note("refused by the kernel (not part of the node): " + "; ".join(result.rejected))
    if result.skipped:
        note("undecided, skipped: " + "; ".join(result.skipped))
    assert not result.mismatches, "\n".join(result.mismatches)
    # something was compared: a probe the model cannot decide is skipped, never the whole topology silently
    assert result.routes_checked + result.sources_checked + len(result.skipped) > 0


@pytest.mark.parametrize("family", [Family.V4, Family.V6], ids=["v4", "v6"])
def test_the_model_agrees_with_the_kernel_on_generated_nodes(family: Family) -> None:
    @_SETTINGS
    @given(topologies(family))
    def differential(topology: Topology) -> None:
        _differential(topology)

    differential()
