"""The rendered payload, applied by the real iptables-restore in a namespace, reads back exactly as rendered.

This is what makes `canonical` trustworthy: the agent and `check` compare the kernel's iptables-save output with
canonical(rendered rules), so the two must agree for every rule shape we write (exceptions, --to-ports, IPv6),
with both iptables variants a node may use.
"""

from __future__ import annotations

import pytest

from ipmasq.config import ConfigInput, config_from_bytes
from ipmasq.lab.netns import Network
from ipmasq.netfilter.iptables import canonical, parse_save, render_restore
from ipmasq.options import PolicyOptions, parse_to_ports
from ipmasq.policy.policy import Policy
from ipmasq.prefix import Family

CASES = {
    "reference-defaults": ("", PolicyOptions()),
    "gke": ("", PolicyOptions(masq_chain="IP-MASQ", nomasq_all_reserved_ranges=True, random_fully=False)),
    "exceptions": ("nonMasqueradeCIDRs: [10.0.0.0/8, 10.11.5.0/24]\nmasqueradeCIDRs: [10.11.0.0/16, 1.2.3.4/32]\n",
                   PolicyOptions()),
    "to-ports": ("nonMasqueradeCIDRs: [10.0.0.0/8]\nmasqueradeCIDRs: [10.11.0.0/16]\n",
                 PolicyOptions(to_ports=parse_to_ports("32768-40000,40001-50000,50001-65535"))),
    "ipv6": ("nonMasqueradeCIDRs: [10.0.0.0/8, 'fd00::/8', '2001:db8::/32']\nmasqueradeCIDRs: ['2001:db8:1::/48']\n",
             PolicyOptions(enable_ipv6=True)),
}
TOOLS = {"nft": ("iptables-restore", "iptables-save", "ip6tables-restore", "ip6tables-save"),
         "legacy": ("iptables-legacy-restore", "iptables-legacy-save", "ip6tables-legacy-restore",
                    "ip6tables-legacy-save")}


@pytest.mark.parametrize("variant", sorted(TOOLS))
@pytest.mark.parametrize("case", sorted(CASES))
def test_payload_round_trips_through_the_kernel(net: Network, case: str, variant: str) -> None:
    text, options = CASES[case]
    policy = Policy(config_from_bytes(ConfigInput((("/c", text.encode()),)), options), options)
    node = net.add("node")
    restore4, save4, restore6, save6 = TOOLS[variant]
    for family in policy.families:
        restore, save = (restore4, save4) if family is Family.V4 else (restore6, save6)
        payload = render_restore(policy, family)
        node.run([restore, "--noflush", "-w"], stdin=payload)
        table = parse_save(node.run([save, "-t", "nat"]).stdout)
        expected = [canonical(line) for line in payload.splitlines() if line.startswith("-A")]
        assert table.rules == expected
        assert table.chains[options.masq_chain] == "-"
