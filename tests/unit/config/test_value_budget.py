"""The config's value budget: counted while the parser reads (before any node is built), with a cheap bound from
single characters deciding whether the count is needed at all; that bound must never be below the real count."""

from __future__ import annotations

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from ipmasq.config.document import MAX_VALUES, YAML_LOADER, _values_bound, parse_document
from ipmasq.errors import ConfigError

_scalars = st.one_of(st.integers(), st.booleans(), st.none(), st.text(max_size=12), st.floats(allow_nan=False))
_values = st.recursive(_scalars, lambda inner: st.one_of(st.lists(inner, max_size=5),
                                                         st.dictionaries(st.text(max_size=6), inner, max_size=5)),
                       max_leaves=40)


def _events(text: str) -> int:
    return sum(isinstance(e, yaml.NodeEvent) for e in yaml.parse(text, Loader=YAML_LOADER))


@settings(max_examples=300, deadline=None)
@given(_values, st.sampled_from([None, True, False]), st.booleans())
def test_the_bound_from_characters_is_never_below_the_parsers_count(value: object, flow: bool | None,
                                                                    unicode: bool) -> None:
    text = yaml.safe_dump(value, default_flow_style=flow, allow_unicode=unicode, width=20)
    assert _values_bound(text) >= _events(text)


def test_a_list_of_100000_cidrs_is_within_the_budget() -> None:
    text = "cidrLimit: 200000\nnonMasqueradeCIDRs:\n" + "".join(
        f"  - 10.{i >> 16 & 255}.{i >> 8 & 255}.{i & 255}/32\n" for i in range(100_000))
    document = parse_document(text.encode(), "c")
    assert document is not None and len(document.fields[1].value.value) == 100_000


@pytest.mark.parametrize("text", [f"x: [{'1,' * MAX_VALUES}1]\n", "x:\n" + "- a\n" * MAX_VALUES,
                                  '{"x": [' + "1," * MAX_VALUES + "1]}"])
def test_one_value_past_the_budget_is_refused_where_it_is(text: str) -> None:
    with pytest.raises(ConfigError, match=f"more than {MAX_VALUES:,} values"):
        parse_document(text.encode(), "c")
