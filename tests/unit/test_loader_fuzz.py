"""Random bytes and random YAML never crash the loader: they load, or raise our ConfigError."""

from __future__ import annotations

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ipmasq.config import ConfigInput, config_from_bytes
from ipmasq.config.model import MasqConfig
from ipmasq.errors import ConfigError
from ipmasq.options import PolicyOptions
from ipmasq.policy import Policy
from ipmasq.prefix import Family
from ipmasq.rules.iptables import render_restore

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
    import json

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
