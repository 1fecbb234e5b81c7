"""What each provider's agent does with the keys it does not read (ipmasq.writers.ignored): the node is compared with
what that agent really writes, and each ignored key is said with what happens to the traffic it names."""

from __future__ import annotations

import pytest

from ipmasq.config.model import MasqConfig
from ipmasq.errors import ConfigError
from ipmasq.writers import WRITERS, Ignored, Sources, config_files, ignored, intended

RULES = """\
nonMasqueradeCIDRs: [10.0.0.0/8]
rules:
  - name: db
    destinations: [35.1.0.0/16]
    protocol: tcp
    ports: [5432]
    action: preserve
  - name: vpn
    destinations: [10.12.0.0/16]
    action: masquerade
  - name: partner
    destinations: [10.13.0.0/16, 8.8.8.0/24]
    action: snat
    snatTo: 192.168.1.5
  - name: already
    destinations: [10.14.0.0/16]
    action: preserve
"""


def said(writer: str, text: str) -> dict[str, Ignored]:
    sources = Sources({"ip-masq-agent": {"config": text.encode()},
                       "azure-ip-masq-agent-config": {"ip-masq-agent": text.encode()}})
    profile = WRITERS[writer]
    writes: MasqConfig | ConfigError
    try:
        writes = intended(profile, sources)
    except ConfigError as exc:
        writes = exc
    return {item.key: item for item in ignored(profile, config_files(profile, sources), writes)}


@pytest.mark.parametrize("writer", ["reference", "gke", "aks", "cilium"])
def test_masquerade_cidrs_inside_a_non_masquerade_range_stay_unmasqueraded(writer: str) -> None:
    item = said(writer, "nonMasqueradeCIDRs: [10.0.0.0/8]\nmasqueradeCIDRs: [10.11.0.0/24, 34.0.0.0/8]\n")[
        "masqueradeCIDRs"]
    assert item.changed == ("10.11.0.0/24",) and item.line == 2
    assert item.effect == "10.11.0.0/24 stays un-masqueraded, 34.0.0.0/8 is masqueraded anyway (nothing lost)"
    assert item.message().endswith("enforce with ipmasq to use it") and "docs/how-to" in item.hint()


def test_the_writer_reads_only_its_keys_so_the_comparison_is_with_what_it_writes() -> None:
    config = intended(WRITERS["gke"], Sources({"ip-masq-agent": {"config": RULES.encode()
                                                                 + b"masqueradeCIDRs: [10.11.0.0/24]\n"}}))
    assert config.masquerade == () and config.rules == ()
    assert [str(e.prefix) for e in config.non_masquerade] == ["10.0.0.0/8"]


def test_each_rule_says_what_happens_to_its_traffic() -> None:
    item = said("gke", RULES)["rules"]
    assert item.effect == (
        "rule db (preserve, tcp port 5432): 35.1.0.0/16 is masqueraded; "
        "rule vpn (masquerade, any traffic): 10.12.0.0/16 stays un-masqueraded; "
        "rule partner (snat to 192.168.1.5, any traffic): 10.13.0.0/16 stays un-masqueraded, 8.8.8.0/24 is "
        "masqueraded to the node's address, not 192.168.1.5; "
        "rule already (preserve, any traffic): 10.14.0.0/16 keeps the pod's address anyway (nothing lost)")
    assert item.changed == ("35.1.0.0/16", "10.12.0.0/16", "10.13.0.0/16", "8.8.8.0/24")


def test_keys_the_reference_reads_are_not_said_and_aks_drops_more() -> None:
    text = "nonMasqueradeCIDRs: [10.0.0.0/8]\ncidrLimit: 100\nresyncInterval: 30s\nmasqLinkLocal: true\n"
    assert said("gke", text) == {} == said("reference", text)
    aks = said("aks", text)
    assert set(aks) == {"cidrLimit", "resyncInterval"} and not any(i.changes_traffic for i in aks.values())
    assert "every 60 s" in aks["resyncInterval"].effect and "64 CIDRs" in aks["cidrLimit"].effect
    assert aks["cidrLimit"].hint().startswith("delete the key")
    assert "no resync" in said("cilium", text)["resyncInterval"].effect


def test_enable_ipv6_is_the_flag_only_for_the_reference() -> None:
    on = said("gke", "nonMasqueradeCIDRs: [10.0.0.0/8]\nenableIPv6: true\n")["enableIPv6"]
    assert on.changed == ("::/0",) and "IPv6 pod traffic stays un-masqueraded everywhere" in on.effect
    # with an IPv6 CIDR the agent refuses the whole config: said, with the reference's words
    refused = said("gke", "nonMasqueradeCIDRs: [10.0.0.0/8, fd00::/8]\nenableIPv6: true\n")["enableIPv6"]
    assert "refuses the whole config (ipv6 is not enabled, but ipv6 cidr fd00::/8 provided" in refused.effect
    off = said("gke", "nonMasqueradeCIDRs: [10.0.0.0/8]\nenableIPv6: false\n")["enableIPv6"]
    assert not off.changes_traffic and "no traffic changes" in off.effect


def test_the_vpc_cni_reads_no_configmap_at_all() -> None:
    eks = said("eks", "nonMasqueradeCIDRs: [10.0.0.0/8]\nmasqLinkLocal: true\n")
    assert eks["nonMasqueradeCIDRs"].effect == "10.0.0.0/8 is masqueraded"
    assert not eks["masqLinkLocal"].changes_traffic  # the CNI SNATs link-local anyway
    assert "AWS_VPC_K8S_CNI_EXCLUDE_SNAT_CIDRS" in eks["nonMasqueradeCIDRs"].hint()
    assert eks["nonMasqueradeCIDRs"].message().startswith("The VPC CNI (aws-node) ignores nonMasqueradeCIDRs")


def test_a_long_list_is_named_in_part_and_given_whole() -> None:
    cidrs = ", ".join(f"10.{2 * i}.0.0/16" for i in range(20))  # not adjacent: not merged
    item = said("gke", f"nonMasqueradeCIDRs: [10.0.0.0/8]\nmasqueradeCIDRs: [{cidrs}]\n")["masqueradeCIDRs"]
    assert "and 14 more stay un-masqueraded" in item.effect and len(item.changed) == 20


def test_what_ipmasq_refuses_too_is_said_without_a_guess() -> None:
    item = said("gke", "nonMasqueradeCIDRs: [10.0.0.0/8]\nmasqueradeCIDRs: [10.11.0.0/33]\n")["masqueradeCIDRs"]
    assert not item.changes_traffic and "ipmasq refuses the file as well" in item.effect
