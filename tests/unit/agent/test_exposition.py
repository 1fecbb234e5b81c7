"""The hand-written Prometheus text format, checked against prometheus-client's parser (the oracle)."""

from __future__ import annotations

import math

import pytest
from prometheus_client.parser import text_string_to_metric_families

from ipmasq.agent import exposition
from ipmasq.agent.exposition import format_value, render


def parsed(text: bytes) -> dict[str, tuple[str, list[tuple[str, dict[str, str], float]]]]:
    return {f.name: (f.type, [(s.name, s.labels, s.value) for s in f.samples])
            for f in text_string_to_metric_families(text.decode())}


def test_each_kind_round_trips_through_the_parser() -> None:
    text = render([
        exposition.counter("jobs_total", "Jobs.", [({"result": "ok"}, 3), ({"result": "failed"}, 1)]),
        exposition.gauge("temperature", "Now.", -1.5),
        exposition.histogram("wait_seconds", "Waits.", (0.1, 1.0), (2, 5, 6), 7.25),
        exposition.info("thing", "What it is.", {"version": "1.2", "backend": "nftables"}),
    ])
    assert parsed(text) == {
        "jobs": ("counter", [("jobs_total", {"result": "ok"}, 3.0), ("jobs_total", {"result": "failed"}, 1.0)]),
        "temperature": ("gauge", [("temperature", {}, -1.5)]),
        "wait_seconds": ("histogram", [
            ("wait_seconds_bucket", {"le": "0.1"}, 2.0), ("wait_seconds_bucket", {"le": "1.0"}, 5.0),
            ("wait_seconds_bucket", {"le": "+Inf"}, 6.0), ("wait_seconds_sum", {}, 7.25),
            ("wait_seconds_count", {}, 6.0)]),
        "thing_info": ("gauge", [("thing_info", {"backend": "nftables", "version": "1.2"}, 1.0)]),
    }
    assert text.startswith(b"# HELP jobs_total Jobs.\n# TYPE jobs_total counter\n")
    assert text.endswith(b"\n")


def test_help_and_label_escaping() -> None:
    text = render([exposition.gauge("g", 'a \\ b\nc "d"', [({"path": 'C:\\x\n"y"'}, 1)])])
    assert text.splitlines()[0] == b'# HELP g a \\\\ b\\nc "d"'
    (family,) = text_string_to_metric_families(text.decode())
    assert family.documentation == 'a \\ b\nc "d"'
    assert family.samples[0].labels == {"path": 'C:\\x\n"y"'}


@pytest.mark.parametrize(("value", "text"), [(3, "3"), (True, "1"), (0.25, "0.25"), (1.7e9, "1700000000.0"),
                                             (1e22, "1e+22"), (math.inf, "+Inf"), (-math.inf, "-Inf"),
                                             (math.nan, "NaN")])
def test_values_use_go_float_syntax(value: float, text: str) -> None:
    assert format_value(value) == text
    parsed_back = next(iter(text_string_to_metric_families(f"# TYPE x gauge\nx {text}\n"))).samples[0].value
    assert parsed_back == value or (math.isnan(value) and math.isnan(parsed_back))


def test_programming_errors_fail_at_once() -> None:
    with pytest.raises(ValueError, match="must end with _total"):
        exposition.counter("jobs", "Jobs.", 1)
    with pytest.raises(ValueError, match="invalid metric family"):
        exposition.gauge("bad-name", "x", 1)
    with pytest.raises(ValueError, match="invalid sample"):
        exposition.gauge("g", "x", [({"bad-label": "v"}, 1)])
    with pytest.raises(ValueError, match="cumulative counts"):
        exposition.histogram("h", "x", (1.0,), (3, 2), 0.0)  # not cumulative
    with pytest.raises(ValueError, match="cumulative counts"):
        exposition.histogram("h", "x", (1.0, 2.0), (1, 2), 0.0)  # no +Inf bucket


def test_nothing_renders_to_nothing() -> None:
    assert render([]) == b""
