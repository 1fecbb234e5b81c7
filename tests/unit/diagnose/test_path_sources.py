"""The live read of a node's routing through the Runner: the four iproute2 programs, a kernel without IPv6, a
failing program said in one line."""

from __future__ import annotations

import json
from collections.abc import Sequence

import pytest

from ipmasq.backends.base import Result
from ipmasq.diagnose.path_sources import ROUTING_COMMANDS, read_live_routing
from ipmasq.errors import BackendError
from ipmasq.testing import FakeRunner
from tests.unit.diagnose.test_path import LINKS, ROUTES, RULES

OUTPUTS = {ROUTING_COMMANDS[0]: json.dumps(RULES), ROUTING_COMMANDS[1]: json.dumps(RULES[:1]),
           ROUTING_COMMANDS[2]: json.dumps(ROUTES), ROUTING_COMMANDS[3]: json.dumps(LINKS)}


def _runner(**failing: Result) -> FakeRunner:
    asked: list[tuple[str, ...]] = []

    def answer(argv: Sequence[str], stdin: str | None) -> Result:
        key = tuple(argv)
        asked.append(key)
        if " ".join(key) in failing:
            return failing[" ".join(key)]
        return Result(0, OUTPUTS[key])

    runner = FakeRunner(answer)
    runner.asked = asked  # type: ignore[attr-defined]
    return runner


def test_the_four_programs_make_one_routing() -> None:
    runner = _runner()
    routing = read_live_routing(runner)
    assert runner.asked == list(ROUTING_COMMANDS)  # type: ignore[attr-defined]
    assert routing.read == {"rules", "routes", "links"}
    assert len(routing.rules) == len(RULES) + 1 and routing.link("eth1") is not None


def test_a_kernel_without_ipv6_has_no_ipv6_rules() -> None:
    routing = read_live_routing(_runner(**{"ip -j -6 rule": Result(2, "", "RTNETLINK answers: Address family "
                                                                      "not supported by protocol")}))
    assert len(routing.rules) == len(RULES)


def test_a_failing_program_is_a_backend_error() -> None:
    with pytest.raises(BackendError) as caught:
        read_live_routing(_runner(**{"ip -j addr": Result(1, "", "Cannot open netlink socket")}))
    assert "ip -j addr failed" in str(caught.value)
