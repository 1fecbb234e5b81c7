"""The writer profiles: each provider's reading of its config, as the provider's own source reads it."""

from __future__ import annotations

import pytest

from ipmasq.config.model import Origin
from ipmasq.errors import ConfigError
from ipmasq.policy.policy import Policy
from ipmasq.prefix import parse_cidr
from ipmasq.writers import (
    WRITERS,
    NodeFacts,
    Sources,
    cilium_map_intent,
    eks_exclusions,
    eks_external_snat,
    intended,
    unobservable,
)


def _cidrs(config: object) -> list[str]:
    return [str(e.prefix) for e in config.non_masquerade]  # type: ignore[attr-defined]


def _configmap(text: str) -> Sources:
    return Sources(configmaps={"ip-masq-agent": {"config": text.encode()}})


def test_every_profile_cites_its_facts() -> None:
    assert set(WRITERS) == {"reference", "gke", "aks", "eks", "cilium"}
    for writer in WRITERS.values():
        assert writer.cited, writer.name
        assert all(c.fact and c.source for c in writer.cited)
        if writer.chain is not None:
            assert writer.options.masq_chain == writer.chain


def test_gke_without_configmap_keeps_every_reserved_range() -> None:
    config = intended(WRITERS["gke"], Sources())
    assert "100.64.0.0/10" in _cidrs(config) and "240.0.0.0/4" in _cidrs(config)
    assert len(config.non_masquerade) == 11
    assert WRITERS["gke"].options.masq_chain == "IP-MASQ"
    reference = intended(WRITERS["reference"], Sources())
    assert _cidrs(reference) == ["10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16"]


def test_gke_reads_only_the_config_key() -> None:
    sources = Sources(configmaps={"ip-masq-agent": {"other": b"nonMasqueradeCIDRs: [1.0.0.0/8]"}})
    assert len(intended(WRITERS["gke"], sources).non_masquerade) == 11
    config = intended(WRITERS["gke"], _configmap("nonMasqueradeCIDRs: [10.4.0.0/14]\n"))
    assert _cidrs(config) == ["10.4.0.0/14"]
    assert config.non_masquerade[0].source == "configmap/ip-masq-agent[config]"


def test_gke_bad_configmap_is_a_located_error() -> None:
    with pytest.raises(ConfigError) as caught:
        intended(WRITERS["gke"], _configmap("nonMasqueradeCIDRs:\n  - 10.0.0.1/8\n"))
    assert "configmap/ip-masq-agent[config]:2" in str(caught.value)


def _aks(reconciled: str | None, user: str | None, **extra: dict[str, bytes]) -> Sources:
    configmaps: dict[str, dict[str, bytes]] = {}
    if reconciled is not None:
        configmaps["azure-ip-masq-agent-config-reconciled"] = {"ip-masq-agent-reconciled": reconciled.encode()}
    if user is not None:
        configmaps["azure-ip-masq-agent-config"] = {"ip-masq-agent": user.encode()}
    for name, data in extra.items():
        configmaps.setdefault(name.replace("_", "-"), {}).update(data)
    return Sources(configmaps=configmaps)


def test_aks_unions_cidrs_and_ors_booleans() -> None:
    config = intended(WRITERS["aks"], _aks(
        "nonMasqueradeCIDRs: [192.168.0.0/16, 10.244.0.0/16]\nmasqLinkLocal: true\n",
        "nonMasqueradeCIDRs: [10.244.0.0/16, 100.64.0.0/10]\nmasqLinkLocal: false\nmasqLinkLocalIPv6: true\n"))
    assert sorted(_cidrs(config)) == ["10.244.0.0/16", "100.64.0.0/10", "192.168.0.0/16"]
    assert config.masq_link_local and config.masq_link_local_ipv6
    assert not WRITERS["aks"].options.random_fully


def test_aks_user_cannot_remove_the_providers_cidrs() -> None:
    # an empty list in the user's fragment adds nothing and removes nothing (the merger skips empty lists)
    config = intended(WRITERS["aks"], _aks("nonMasqueradeCIDRs: [10.0.0.0/8]\n", "nonMasqueradeCIDRs: []\n"))
    assert _cidrs(config) == ["10.0.0.0/8"]


def test_aks_keys_match_case_insensitively_and_unknown_keys_drop() -> None:
    config = intended(WRITERS["aks"], _aks(None, "NonMasqueradeCidrs: [10.1.0.0/16]\nresyncInterval: 5s\n"
                                                 "masqueradeCIDRs: [8.8.8.8/32]\n"))
    assert _cidrs(config) == ["10.1.0.0/16"]
    assert config.masquerade == () and config.resync_interval == 60.0


def test_aks_every_ip_masq_fragment_counts() -> None:
    sources = _aks("nonMasqueradeCIDRs: [10.0.0.0/8]\n", None,
                   azure_ip_masq_agent_config={"ip-masq-extra": b"nonMasqueradeCIDRs: [172.16.0.0/12]\n",
                                               "notes": b"nonMasqueradeCIDRs: [1.0.0.0/8]\n"})
    assert sorted(_cidrs(intended(WRITERS["aks"], sources))) == ["10.0.0.0/8", "172.16.0.0/12"]


def test_aks_invalid_fragment_stops_the_merge() -> None:
    for bad in ("nonMasqueradeCIDRs: [10.0.0.1/8]\n", "nonMasqueradeCIDRs: 10.0.0.0/8\n",
                "masqLinkLocal: \"yes\"\n", "nonMasqueradeCIDRs: [\n"):
        with pytest.raises(ConfigError) as caught:
            intended(WRITERS["aks"], _aks("nonMasqueradeCIDRs: [10.0.0.0/8]\n", bad))
        assert "last merged file" in str(caught.value)
        assert "configmap/azure-ip-masq-agent-config[ip-masq-agent]" in str(caught.value)


def test_aks_without_fragments_uses_the_agents_defaults() -> None:
    assert _cidrs(intended(WRITERS["aks"], Sources())) == ["10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16"]


def test_eks_exclusions_skip_what_the_cni_skips() -> None:
    env = {"AWS_VPC_K8S_CNI_EXCLUDE_SNAT_CIDRS": "10.8.0.0/16,bogus, 172.20.0.0/16,192.168.1.7/24,0.0.0.0/0"}
    kept, skipped = eks_exclusions(env)
    assert [str(p) for p in kept] == ["10.8.0.0/16", "192.168.1.0/24", "0.0.0.0/0"]
    assert skipped == ("bogus", " 172.20.0.0/16")
    config = intended(WRITERS["eks"], Sources(env=env, vpc_cidrs=("172.31.0.0/16",)))
    assert _cidrs(config) == ["172.31.0.0/16", "10.8.0.0/16", "192.168.1.0/24", "0.0.0.0/0"]
    assert config.masq_link_local  # no link-local exemption in AWS-SNAT-CHAIN-0
    assert any("bogus" in w for w in config.warnings)


def test_eks_external_snat_means_no_node_snat() -> None:
    for value, external in (("true", True), ("1", True), ("TRUE", True), ("yes", False), ("", False)):
        assert eks_external_snat({"AWS_VPC_K8S_CNI_EXTERNALSNAT": value}) is external
    env = {"AWS_VPC_K8S_CNI_EXTERNALSNAT": "true", "AWS_VPC_K8S_CNI_EXCLUDE_SNAT_CIDRS": "10.0.0.0/8"}
    assert eks_exclusions(env) == ((), ())
    policy = Policy(intended(WRITERS["eks"], Sources(env=env)), WRITERS["eks"].options)
    assert not policy.verdict("8.8.8.8").masquerade


def test_eks_policy_snats_everything_outside_the_vpc_and_exclusions() -> None:
    env = {"AWS_VPC_K8S_CNI_EXCLUDE_SNAT_CIDRS": "10.8.0.0/16"}
    policy = Policy(intended(WRITERS["eks"], Sources(env=env, vpc_cidrs=("172.31.0.0/16",))), WRITERS["eks"].options)
    assert policy.verdict("8.8.8.8").masquerade and policy.verdict("169.254.169.254").masquerade
    assert not policy.verdict("10.8.1.1").masquerade and not policy.verdict("172.31.9.9").masquerade


def test_cilium_empty_or_missing_means_the_reserved_ranges() -> None:
    for sources in (Sources(), _configmap("")):
        config = intended(WRITERS["cilium"], sources)
        assert len(config.non_masquerade) == 11 and all(e.origin is Origin.DEFAULT for e in config.non_masquerade)
        assert parse_cidr("169.254.0.0/16") in cilium_map_intent(config)


def test_cilium_masks_host_bits_and_adds_link_local() -> None:
    config = intended(WRITERS["cilium"], _configmap("nonMasqueradeCIDRs: [10.0.0.1/8]\nmasqLinkLocalIPv6: true\n"))
    assert {str(p) for p in cilium_map_intent(config)} == {"10.0.0.0/8", "169.254.0.0/16"}
    # a file that is not empty but lists nothing: nothing but link-local (the defaults are only for an empty file)
    config = intended(WRITERS["cilium"], _configmap("masqLinkLocal: false\n"))
    assert {str(p) for p in cilium_map_intent(config)} == {"169.254.0.0/16", "fe80::/10"}


def test_cilium_unparsable_config_keeps_the_map() -> None:
    with pytest.raises(ConfigError, match="keeps the map"):
        intended(WRITERS["cilium"], _configmap("nonMasqueradeCIDRs: [not-a-cidr]\n"))


def test_unobservable_is_one_line_or_none() -> None:
    assert unobservable(WRITERS["gke"], NodeFacts()) is None
    line = unobservable(WRITERS["gke"], NodeFacts(gke_autopilot=True, privileged_allowed=False))
    assert line is not None and "Autopilot" in line and "\n" not in line
    assert unobservable(WRITERS["gke"], NodeFacts(gke_autopilot=True, privileged_allowed=True)) is None
    assert "cilium" in (unobservable(WRITERS["gke"], NodeFacts(dataplane_v2=True)) or "")
    assert "Auto Mode" in (unobservable(WRITERS["eks"], NodeFacts(eks_auto_mode=True)) or "")
    assert unobservable(WRITERS["cilium"], NodeFacts(cilium_exec=False)) is not None
