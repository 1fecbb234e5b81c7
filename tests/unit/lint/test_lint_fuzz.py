"""lint never crashes: random text, random bytes, and corpus manifests with random edits give findings, not errors."""

from __future__ import annotations

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from ipmasq.findings import Finding
from ipmasq.lint import HINTS, lint_source
from tests.conftest import ROOT

CORPUS = sorted((ROOT / "tests" / "lint_corpus").glob("*.yaml"))
_YAMLISH = st.sampled_from(["\n", "  ", "- ", ": ", "|", ">", "{", "}", "[", "]", ",", "#", "'", '"', "\t", "---\n",
                            "config", "data", "kind: ConfigMap", "apiVersion: v1", "nonMasqueradeCIDRs", "10.0.0.0/8",
                            "fe80::/10", "\u2013", "\u00a0", "\u201c", "&a", "*a", "!!str", "%YAML 1.1\n", "? "])


def _check(findings: list[Finding]) -> None:
    for f in findings:
        assert f.id in HINTS
        assert f.line is None or f.line >= 1
        assert "\n" not in f.as_text()


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(st.text())
def test_random_text(text: str) -> None:
    _check(lint_source("t", text.encode("utf-8", "surrogatepass")))


@settings(max_examples=300, deadline=None)
@given(st.binary())
def test_random_bytes(data: bytes) -> None:
    _check(lint_source("b", data))


@settings(max_examples=400, deadline=None)
@given(st.lists(_YAMLISH, max_size=40).map("".join))
def test_yaml_shaped_text(text: str) -> None:
    _check(lint_source("y", text.encode()))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(CORPUS), st.lists(st.tuples(st.integers(0, 400), st.integers(0, 3), _YAMLISH), max_size=4))
# a blank line inside a rule's CIDR: the scalar holds a newline, which the finding's one line must not
@example(ROOT / "tests" / "lint_corpus" / "rule-nodes-match-none.yaml", [(148, 0, "\n"), (148, 0, "\n")])
def test_corpus_with_random_edits(path: object, edits: list[tuple[int, int, str]]) -> None:
    text = path.read_text(encoding="utf-8")  # type: ignore[attr-defined]
    for position, delete, insert in edits:
        position %= len(text) + 1
        text = text[:position] + insert + text[position + delete:]
    _check(lint_source("e", text.encode("utf-8")))
