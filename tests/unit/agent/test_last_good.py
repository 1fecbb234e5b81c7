"""The config half both passes hold: a config taken once per change, the last good one kept while a bad one is said
once, the content's digest computed once per input."""

from __future__ import annotations

import logging

import pytest

from ipmasq.agent.last_good import LastGoodConfig
from ipmasq.config.source import ConfigInput, config_digest
from ipmasq.errors import ConfigError
from ipmasq.options import PolicyOptions

SOURCE = "/etc/config/ip-masq-agent"


def config(text: str) -> ConfigInput:
    return ConfigInput(((SOURCE, text.encode()),))


def test_a_good_config_is_taken_once_and_an_equal_one_keeps_its_policy(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    half = LastGoodConfig(PolicyOptions(), log=logging.getLogger("test.last_good"))
    assert half.policy is None and half.resync_interval > 0
    assert half.take(config("nonMasqueradeCIDRs: [10.0.0.0/8]\n"))
    first = half.policy
    assert first is not None and half.policy_hash is not None and half.error is None
    assert not half.take(config("nonMasqueradeCIDRs: [10.0.0.0/8]\n"))  # the same input: nothing to do
    assert half.take(config("nonMasqueradeCIDRs:   [10.0.0.0/8]\n"))  # other bytes, the same config
    assert half.policy is first  # verified once, it stays verified
    assert half.config_digest == config_digest((b"nonMasqueradeCIDRs:   [10.0.0.0/8]\n",))
    assert sum("config loaded" in r.getMessage() for r in caplog.records) == 1


def test_a_bad_config_keeps_the_last_good_policy_and_is_said_once(caplog: pytest.LogCaptureFixture) -> None:
    half = LastGoodConfig(PolicyOptions(), log=logging.getLogger("test.last_good"))
    half.take(config("nonMasqueradeCIDRs: [10.0.0.0/8]\n"))
    good, digest = half.policy, half.config_digest
    bad = config("nonMasqueradeCIDRs: [10.0.0.0/33]\n")
    assert half.take(bad) and not half.take(bad)
    assert half.policy is good and half.config_digest == digest
    assert half.error is not None and half.error.startswith(f"{SOURCE}:1:")
    assert sum("config error" in r.getMessage() for r in caplog.records) == 1
    assert half.take(ConfigError("unreadable", source=SOURCE)) and half.policy is good
    half.take(config("nonMasqueradeCIDRs: [10.0.0.0/8]\n"))
    assert half.error is None


def test_a_loader_that_cannot_run_is_asked_again_at_the_next_take() -> None:
    calls = []

    def load(config_input: ConfigInput, options: PolicyOptions) -> object:
        calls.append(config_input)
        raise OSError("the loader could not run")

    half = LastGoodConfig(PolicyOptions(), log=logging.getLogger("test.last_good"), load=load)  # type: ignore[arg-type]
    for _ in range(2):
        with pytest.raises(OSError):
            half.take(config("nonMasqueradeCIDRs: [10.0.0.0/8]\n"))
    assert len(calls) == 2 and half.policy is None and half.error is None


def test_a_config_input_s_digest_is_computed_once(monkeypatch: pytest.MonkeyPatch) -> None:
    from ipmasq.config import source

    computed = []
    real = source.config_digest
    monkeypatch.setattr(source, "config_digest", lambda contents: computed.append(contents) or real(contents))
    content = config("nonMasqueradeCIDRs: [10.0.0.0/8]\n")
    assert content.digest() == content.digest() == real((b"nonMasqueradeCIDRs: [10.0.0.0/8]\n",))
    assert len(computed) == 1
    assert content == config("nonMasqueradeCIDRs: [10.0.0.0/8]\n")  # the digest is no part of its equality
