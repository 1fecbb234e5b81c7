"""Every measured vector of the reference agent: the same rules, or a clear one-line error."""

from __future__ import annotations

from pathlib import Path

import pytest

from ipmasq.config import load_config
from ipmasq.errors import ConfigError
from ipmasq.netfilter.iptables import canonical, render_restore
from ipmasq.options import PolicyOptions
from ipmasq.policy.policy import Policy
from ipmasq.prefix import Family
from tests.conftest import VECTORS

CASES = sorted((VECTORS / "cases").iterdir())
# Runs without a config file, with the flags vectors/README.md names.
FLAG_ONLY = {
    "01-no-file.out": PolicyOptions(),
    "16-no-file-all-reserved.out": PolicyOptions(nomasq_all_reserved_ranges=True),
    "17-gke-chain.out": PolicyOptions(masq_chain="IP-MASQ", nomasq_all_reserved_ranges=True),
}


def save_lines(restore_text: str) -> list[str]:
    """What iptables-save would print for the payload: `:CHAIN` and canonical `-A` lines."""
    out = []
    for line in restore_text.splitlines():
        if line.startswith(":"):
            out.append(line)
        elif line.startswith("-A"):
            out.append(canonical(line).replace(" --random-fully", ""))  # v2.9.1 predates --random-fully
    return out


def expected_for(name: str) -> str:
    return (VECTORS / "expected" / name).read_text()


@pytest.mark.parametrize("case", CASES, ids=lambda p: p.name)
def test_case_matches_reference(case: Path) -> None:
    expected = expected_for(case.name + ".out")
    options = PolicyOptions()
    if expected.startswith("LOG:"):
        reference_message = expected.split("error syncing configuration: ", 1)[1].strip()
        with pytest.raises(ConfigError) as raised:
            load_config(str(case), options)
        message = str(raised.value)
        assert "\n" not in message
        assert message.startswith(f"{case}:")
        assert reference_message in message
    else:
        payload = render_restore(Policy(load_config(str(case), options), options), Family.V4)
        assert save_lines(payload) == expected.splitlines()


@pytest.mark.parametrize("name", sorted(FLAG_ONLY))
def test_flag_only_runs_match_reference(name: str) -> None:
    options = FLAG_ONLY[name]
    payload = render_restore(Policy(load_config(None, options), options), Family.V4)
    assert save_lines(payload) == expected_for(name).splitlines()


def test_payload_is_exactly_the_reference_restore_text() -> None:
    options = PolicyOptions()
    payload = render_restore(Policy(load_config(None, options), options), Family.V4)
    assert payload == (
        "*nat\n"
        ":IP-MASQ-AGENT - [0:0]\n"
        '-A POSTROUTING -m comment --comment "ip-masq-agent: ensure nat POSTROUTING directs all non-LOCAL '
        'destination traffic to our custom IP-MASQ-AGENT chain" -m addrtype ! --dst-type LOCAL -j IP-MASQ-AGENT\n'
        '-A IP-MASQ-AGENT -m comment --comment "ip-masq-agent: local traffic is not subject to MASQUERADE" '
        "-d 169.254.0.0/16 -j RETURN\n"
        '-A IP-MASQ-AGENT -m comment --comment "ip-masq-agent: local traffic is not subject to MASQUERADE" '
        "-d 10.0.0.0/8 -j RETURN\n"
        '-A IP-MASQ-AGENT -m comment --comment "ip-masq-agent: local traffic is not subject to MASQUERADE" '
        "-d 172.16.0.0/12 -j RETURN\n"
        '-A IP-MASQ-AGENT -m comment --comment "ip-masq-agent: local traffic is not subject to MASQUERADE" '
        "-d 192.168.0.0/16 -j RETURN\n"
        '-A IP-MASQ-AGENT -m comment --comment "ip-masq-agent: outbound traffic is subject to MASQUERADE '
        '(must be last in chain)" -j MASQUERADE --random-fully\n'
        "COMMIT\n"
    )
