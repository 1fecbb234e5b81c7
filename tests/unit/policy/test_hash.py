"""policy_hash: one identity per effective policy (config + flags), the same in every process."""

from __future__ import annotations

import subprocess

import pytest

from ipmasq.config import ConfigInput, config_from_bytes
from ipmasq.options import PolicyOptions, PortRange
from ipmasq.policy.hash import canonical_policy, policy_hash
from ipmasq.policy.policy import Policy
from tests.conftest import PYTHON

BASE = "nonMasqueradeCIDRs: [10.0.0.0/8, 172.30.0.0/16]\nmasqueradeCIDRs: [10.11.0.0/24]\nresyncInterval: 60s\n"


def hash_of(text: str, options: PolicyOptions | None = None, source: str = "/etc/config/ip-masq-agent") -> str:
    options = options or PolicyOptions()
    return policy_hash(Policy(config_from_bytes(ConfigInput(((source, text.encode()),)), options), options))


def test_the_reference_defaults_hash_to_a_pinned_value() -> None:
    # pinned: a change here changes every agent's reported identity; bump POLICY_HASH_VERSION on purpose instead
    options = PolicyOptions()
    policy = Policy(config_from_bytes(ConfigInput(()), options), options)
    assert canonical_policy(policy) == (
        "ipmasq-policy-v1\nchain IP-MASQ-AGENT\nrandom-fully true\nto-ports \nresync-interval 60.0\nfamily 4\n"
        "169.254.0.0/16 preserve\n10.0.0.0/8 preserve\n172.16.0.0/12 preserve\n192.168.0.0/16 preserve\n")
    assert policy_hash(policy) == "e7d860049f2d8f36e772e5c7917a340be9e9866140de5692f311e39e01b2def3"


def test_what_does_not_change_the_rules_does_not_change_the_hash() -> None:
    same = [
        "# the VPN peers\nnonMasqueradeCIDRs:\n  - 10.0.0.0/8   # pods\n  - 172.30.0.0/16\n"
        "masqueradeCIDRs: [10.11.0.0/24]\nresyncInterval: 1m\n",
        BASE.replace("nonMasqueradeCIDRs", "NonMasqueradeCIDRs"),  # keys match case-insensitively
        '{"nonMasqueradeCIDRs": ["10.0.0.0/8", "172.30.0.0/16"], "masqueradeCIDRs": ["10.11.0.0/24"]}',
    ]
    assert {hash_of(text) for text in same} == {hash_of(BASE)}
    assert hash_of(BASE, source="/elsewhere/ip-masq-agent.yaml") == hash_of(BASE)
    # the flag only changes the built-in defaults, which an explicit nonMasqueradeCIDRs replaces
    assert hash_of(BASE, PolicyOptions(nomasq_all_reserved_ranges=True)) == hash_of(BASE)


@pytest.mark.parametrize(("text", "options"), [
    (BASE.replace("172.30.0.0/16", "172.31.0.0/16"), None),
    (BASE.replace("10.11.0.0/24", "10.12.0.0/24"), None),
    (BASE.replace("60s", "30s"), None),
    (BASE + "masqLinkLocal: true\n", None),
    (BASE, PolicyOptions(masq_chain="IP-MASQ")),
    (BASE, PolicyOptions(random_fully=False)),
    (BASE, PolicyOptions(to_ports=(PortRange(32768, 65535),))),
    (BASE, PolicyOptions(enable_ipv6=True)),
])
def test_what_changes_the_rules_changes_the_hash(text: str, options: PolicyOptions | None) -> None:
    assert hash_of(text, options) != hash_of(BASE)


def test_without_exceptions_the_list_order_is_the_rule_order() -> None:
    assert hash_of("nonMasqueradeCIDRs: [172.30.0.0/16, 10.0.0.0/8]\n") != \
        hash_of("nonMasqueradeCIDRs: [10.0.0.0/8, 172.30.0.0/16]\n")


def test_the_same_in_another_process() -> None:
    script = ("import sys\n"
              "from ipmasq.config import ConfigInput, config_from_bytes\n"
              "from ipmasq.options import PolicyOptions\n"
              "from ipmasq.policy.policy import Policy\n"
              "from ipmasq.policy.hash import policy_hash\n"
              "o = PolicyOptions(enable_ipv6=True)\n"
              "c = config_from_bytes(ConfigInput((('x', sys.stdin.read().encode()),)), o)\n"
              "print(policy_hash(Policy(c, o)))\n")
    text = BASE.replace("[10.0.0.0/8", "[10.0.0.0/8, 'fd00::/8'")
    seen = {subprocess.run([PYTHON, "-c", script], input=text, capture_output=True, text=True, check=True,
                           env={"PYTHONHASHSEED": salt}).stdout.strip() for salt in ("1", "2", "random")}
    assert seen == {hash_of(text, PolicyOptions(enable_ipv6=True))}
