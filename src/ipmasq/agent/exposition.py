"""The Prometheus text exposition format, version 0.0.4, written by hand: what /metrics answers.

Why not prometheus-client: the agent needs a dozen samples per scrape, and the library's import chain is several
MiB of resident memory on an agent that should stay small. The format is small and fixed:

    # HELP ipmasq_syncs_total Reconcile passes, by result.
    # TYPE ipmasq_syncs_total counter
    ipmasq_syncs_total{result="applied"} 3
    # TYPE ipmasq_sync_duration_seconds histogram
    ipmasq_sync_duration_seconds_bucket{le="0.005"} 6      cumulative, ending with le="+Inf"
    ipmasq_sync_duration_seconds_sum 0.018
    ipmasq_sync_duration_seconds_count 6
    ipmasq_build_info{backend="iptables",version="0.1.0"} 1   an "info" is a gauge named *_info, always 1

Label values escape backslash, double quote and newline; HELP text escapes backslash and newline. Values are Go
float syntax: integers as they are, other floats as Python's repr (shortest round-trip), +Inf, -Inf, NaN.
Everything here is pure; the tests parse the output with prometheus-client's own parser.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

__all__ = ["CONTENT_TYPE", "MetricFamily", "Sample", "counter", "format_value", "gauge", "histogram", "info",
           "render"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*\Z")
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*\Z")
KINDS = ("counter", "gauge", "histogram", "untyped")

Labels = tuple[tuple[str, str], ...]


@dataclass(frozen=True, slots=True)
class Sample:
    """One exposition line: a sample's name, its labels and its value."""

    name: str  # the full sample name (a histogram's samples carry _bucket, _sum, _count)
    labels: Labels
    value: float


@dataclass(frozen=True, slots=True)
class MetricFamily:
    """A metric's HELP, TYPE and samples, written together under its name."""

    name: str  # the name HELP and TYPE carry (a counter's ends with _total)
    kind: str  # one of KINDS
    help: str
    samples: tuple[Sample, ...]

    def __post_init__(self) -> None:
        # names are the program's constants, so a bad one is a programming error: fail at once, not in a scraper
        if self.kind not in KINDS or _NAME.match(self.name) is None:
            raise ValueError(f"invalid metric family {self.name!r} of kind {self.kind!r}")
        if self.kind == "counter" and not self.name.endswith("_total"):
            raise ValueError(f"counter {self.name!r} must end with _total")
        for sample in self.samples:
            if not sample.name.startswith(self.name) or any(_LABEL_NAME.match(k) is None for k, _ in sample.labels):
                raise ValueError(f"invalid sample {sample.name!r} {sample.labels!r} in {self.name!r}")


def _labels(labels: Mapping[str, str] | None) -> Labels:
    return tuple(sorted(labels.items())) if labels else ()


def counter(name: str, help: str, values: float | Iterable[tuple[Mapping[str, str], float]]) -> MetricFamily:
    """A counter: one value, or (labels, value) pairs. `name` includes the `_total` suffix."""
    return _simple(name, "counter", help, values)


def gauge(name: str, help: str, values: float | Iterable[tuple[Mapping[str, str], float]]) -> MetricFamily:
    return _simple(name, "gauge", help, values)


def _simple(name: str, kind: str, help: str,
            values: float | Iterable[tuple[Mapping[str, str], float]]) -> MetricFamily:
    if isinstance(values, int | float):
        samples: tuple[Sample, ...] = (Sample(name, (), values),)
    else:
        samples = tuple(Sample(name, _labels(labels), value) for labels, value in values)
    return MetricFamily(name, kind, help, samples)


def histogram(name: str, help: str, bounds: Sequence[float], cumulative: Sequence[int], total: float) -> MetricFamily:
    """`cumulative`: the count of observations <= each bound, then the count of all (the +Inf bucket)."""
    if len(cumulative) != len(bounds) + 1 or list(cumulative) != sorted(cumulative):
        raise ValueError(f"histogram {name!r}: {len(bounds)} bounds need {len(bounds) + 1} cumulative counts")
    les = [*(format_value(float(b)) for b in bounds), "+Inf"]
    samples = [Sample(f"{name}_bucket", (("le", le),), count) for le, count in zip(les, cumulative, strict=True)]
    samples.append(Sample(f"{name}_sum", (), total))
    samples.append(Sample(f"{name}_count", (), cumulative[-1]))
    return MetricFamily(name, "histogram", help, tuple(samples))


def info(name: str, help: str, labels: Mapping[str, str]) -> MetricFamily:
    """An info metric, as 0.0.4 has it: a gauge `<name>_info{...} 1`."""
    full = f"{name}_info"
    return MetricFamily(full, "gauge", help, (Sample(full, _labels(labels), 1),))


def format_value(value: float) -> str:
    if isinstance(value, int):  # bool included: True is 1
        return str(int(value))
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


def _escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def render(families: Iterable[MetricFamily]) -> bytes:
    lines: list[str] = []
    for family in families:
        lines.append(f"# HELP {family.name} {_escape_help(family.help)}")
        lines.append(f"# TYPE {family.name} {family.kind}")
        for sample in family.samples:
            if sample.labels:
                inner = ",".join(f'{key}="{_escape_label(value)}"' for key, value in sample.labels)
                lines.append(f"{sample.name}{{{inner}}} {format_value(sample.value)}")
            else:
                lines.append(f"{sample.name} {format_value(sample.value)}")
    return ("\n".join(lines) + "\n").encode() if lines else b""
