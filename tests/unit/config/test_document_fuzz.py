"""Random bytes, random YAML and hostile shapes (deep nesting, aliases) never crash the loader: they load, or raise
our ConfigError in one line."""

from __future__ import annotations

import json

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ipmasq.config import ConfigInput, config_from_bytes
from ipmasq.config.document import MAX_DEPTH, YAML_LOADER, _depth_bound
from ipmasq.config.model import MasqConfig
from ipmasq.errors import ConfigError
from ipmasq.lint import lint_source
from ipmasq.netfilter.iptables import render_restore
from ipmasq.options import PolicyOptions
from ipmasq.policy.policy import Policy
from ipmasq.prefix import Family

OPTIONS = (PolicyOptions(), PolicyOptions(enable_ipv6=True, nomasq_all_reserved_ranges=True))


def load_or_config_error(data: bytes, options: PolicyOptions) -> MasqConfig | None:
    try:
        config = config_from_bytes(ConfigInput((("/fuzz", data),)), options)
    except ConfigError as exc:
        assert "\n" not in str(exc)
        assert str(exc).startswith("/fuzz")
        return None
    # whatever loads must also render
    for family in Policy(config, options).families:
        assert render_restore(Policy(config, options), family).endswith("COMMIT\n")
    if Family.V6 not in Policy(config, options).families:
        assert all(e.prefix.family is Family.V4 for e in config.non_masquerade)
    return config


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=300), st.sampled_from(OPTIONS))
def test_random_bytes(data: bytes, options: PolicyOptions) -> None:
    load_or_config_error(data, options)


keys = st.sampled_from(["nonMasqueradeCIDRs", "masqueradeCIDRs", "cidrLimit", "masqLinkLocal", "masqLinkLocalIPv6",
                        "resyncInterval", "NONMASQUERADECIDRS", "other"])
scalars = st.one_of(st.none(), st.booleans(), st.integers(-5, 100), st.floats(allow_nan=True), st.text(max_size=20),
                    st.sampled_from(["10.0.0.0/8", "10.0.0.1/8", "fc00::/7", "1m", "0s", "yes", "169.254.0.0/16"]))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner,
                                                                                         max_size=3), max_leaves=8)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(keys, values, max_size=5), st.sampled_from(OPTIONS), st.booleans())
def test_random_yaml_documents(document: dict[str, object], options: PolicyOptions, as_json: bool) -> None:
    if as_json:
        try:
            text = json.dumps(document)
        except ValueError:
            return
    else:
        text = yaml.safe_dump(document, default_flow_style=False)
    load_or_config_error(text.encode(), options)


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("- :\n\t[]{}\"'#|>&*!%@`,?10./abcnM–\u00a0")), max_size=120))
def test_random_yaml_like_text(text: str) -> None:
    load_or_config_error(text.encode(), OPTIONS[0])


# --- hostile shapes: deep nesting, aliases ---------------------------------------------------------------------


def nested(depth: int, opener: str, closer: str, inner: str) -> str:
    return opener * depth + inner + closer * depth


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 3 * MAX_DEPTH), st.sampled_from(["flow", "block-map", "block-seq", "json"]),
       st.sampled_from(["10.0.0.0/8", "", "x", "*a", "&a y"]), st.booleans())
def test_random_depths_load_or_fail_in_one_line(depth: int, shape: str, leaf: str, as_value: bool) -> None:
    if shape == "flow":
        text = nested(depth, "[", "]", leaf)
    elif shape == "json":
        text = '{"nonMasqueradeCIDRs": ' + nested(depth, "[", "]", json.dumps(leaf)) + "}"
    elif shape == "block-map":
        text = "".join("  " * i + f"k{i}:\n" for i in range(depth)) + "  " * depth + leaf + "\n"
    else:
        text = "- " * depth + leaf + "\n"
    if as_value and shape != "json":
        text = "nonMasqueradeCIDRs:\n  " + text.replace("\n", "\n  ")
    config = load_or_config_error(text.encode(), OPTIONS[0])
    findings = lint_source("/fuzz", text.encode())  # lint never raises either
    if depth > MAX_DEPTH:
        assert config is None
        assert [f.message for f in findings if f.id == "yaml-syntax"] == [
            f"nested deeper than {MAX_DEPTH} levels; a config is a mapping of lists"]


# single characters and the tokens that open block collections, so that parsable nesting comes up often
yaml_ish = st.lists(st.sampled_from([*"-?: \n\t[]{},&*!ab#'\"|>.%", "---", "- ", "? ", ": ", "\n  ", "\n    - "]),
                    max_size=120).map("".join)


@settings(max_examples=500, deadline=None)
@given(yaml_ish)
def test_the_cheap_depth_bound_is_never_below_the_real_depth(text: str) -> None:
    try:
        events = list(yaml.parse(text, Loader=yaml.CSafeLoader))
    except yaml.YAMLError:
        return
    depth = deepest = 0
    for event in events:
        if isinstance(event, yaml.CollectionStartEvent):
            depth += 1
            deepest = max(deepest, depth)
        elif isinstance(event, yaml.CollectionEndEvent):
            depth -= 1
    assert _depth_bound(text) >= deepest


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("abc"), st.lists(st.sampled_from(["*a", "*b", "*c", "x", "[*a, *b]"]),
                                                         max_size=12)), min_size=1, max_size=8))
def test_random_anchors_and_aliases(definitions: list[tuple[str, list[str]]]) -> None:
    lines = [f"k{i}: &{anchor} [{', '.join(items)}]" for i, (anchor, items) in enumerate(definitions)]
    lines.append(f"nonMasqueradeCIDRs: *{definitions[-1][0]}")
    load_or_config_error("\n".join(lines).encode(), OPTIONS[0])
    lint_source("/fuzz", "\n".join(lines).encode())


@settings(max_examples=500, deadline=None)
@given(st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=30).map(lambda t: t + "/")
       | st.from_regex(r"\A[-+0-9.:eExXoObB_TtZz /]{1,30}\Z"), st.booleans())
def test_the_loaders_shortcut_resolves_as_the_safe_loader(value: str, plain: bool) -> None:
    # YAML_LOADER answers "a string" at once for any scalar holding "/": what the resolver would have said anyway
    loader = YAML_LOADER("")
    try:
        want = yaml.SafeLoader.resolve(loader, yaml.ScalarNode, value, (plain, not plain))
        assert loader.resolve(yaml.ScalarNode, value, (plain, not plain)) == want
    finally:
        loader.dispose()
