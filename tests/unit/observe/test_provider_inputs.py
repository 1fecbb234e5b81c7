"""Observe mode for AKS and EKS: their inputs followed through the API (the fake API server), read as that provider
reads them, and the node's rules compared with check --writer's comparison; nothing written."""

from __future__ import annotations

import logging
import threading
from typing import Any

import pytest

from ipmasq.agent.reports import SyncResult
from ipmasq.config.source import ConfigInput
from ipmasq.diagnose.check import NodeRules
from ipmasq.errors import ConfigError
from ipmasq.kube import paths
from ipmasq.kube.configmaps import ConfigMapState
from ipmasq.netfilter.iptables import parse_save
from ipmasq.observe.observer import Observer
from ipmasq.observe.provider_inputs import (
    ENV_SOURCE,
    EnvState,
    WriterInputs,
    compare_for,
    daemonset_env,
    input_of,
    load_for,
    sources_of,
)
from ipmasq.policy.policy import Policy
from ipmasq.prefix import Family
from ipmasq.testing.kube import FakeKubeClient
from ipmasq.testing.writers import aws_snat_rules, ip_masq_agent_rules
from ipmasq.writers import WRITERS
from tests.eventually import eventually

LOG = logging.getLogger("test")
USER, RECONCILED = "azure-ip-masq-agent-config", "azure-ip-masq-agent-config-reconciled"


def configmap(key: str, text: str) -> dict[str, Any]:
    return {"metadata": {"namespace": "kube-system"}, "data": {key: text}}


def aws_node(*env: dict[str, Any]) -> dict[str, Any]:
    return {"metadata": {"namespace": "kube-system", "uid": "ds-uid"},
            "spec": {"template": {"spec": {"containers": [
                {"name": "aws-vpc-cni-init"}, {"name": "aws-node", "image": "x", "env": list(env)}]}}}}


class Node:
    """The node's rules as the observer reads them, with a fingerprint that moves with every write."""

    def __init__(self, text: str) -> None:
        self.text, self.generation = text, 1

    def write(self, text: str) -> None:
        self.text, self.generation = text, self.generation + 1

    def read(self, _policy: Policy) -> NodeRules:
        return NodeRules("iptables", {Family.V4: parse_save(self.text)})


def observer(writer: str, node: Node, inputs: WriterInputs | None = None) -> Observer:
    profile = WRITERS[writer]
    return Observer(profile.options, runner=None, log=LOG, writer=writer,  # type: ignore[arg-type]
                    fingerprint=lambda: node.generation, read_rules=node.read, load=load_for(profile),
                    compare=compare_for(profile))


# --- the aws-node DaemonSet's settings ------------------------------------------------------------------------


def test_the_aws_node_container_s_literal_snat_settings_are_read_and_nothing_else() -> None:
    obj = aws_node({"name": "AWS_VPC_K8S_CNI_EXCLUDE_SNAT_CIDRS", "value": "10.2.0.0/16"},
                   {"name": "AWS_VPC_K8S_CNI_EXTERNALSNAT", "value": "false"},
                   {"name": "ENABLE_PREFIX_DELEGATION", "value": "true"})
    state = daemonset_env("kube-system", "aws-node", obj)
    assert state.env == (("AWS_VPC_K8S_CNI_EXCLUDE_SNAT_CIDRS", "10.2.0.0/16"),
                         ("AWS_VPC_K8S_CNI_EXTERNALSNAT", "false"))
    assert state.uid == "ds-uid" and state.unreadable is None
    assert daemonset_env("kube-system", "aws-node", None) == EnvState("kube-system", "aws-node", exists=False)


@pytest.mark.parametrize("obj", [
    aws_node({"name": "AWS_VPC_K8S_CNI_EXCLUDE_SNAT_CIDRS", "valueFrom": {"configMapKeyRef": {"name": "x"}}}),
    {"metadata": {}, "spec": {"template": {"spec": {"containers": [{"name": "other"}]}}}},
    {"metadata": "garbage", "spec": ["x"]},
])
def test_what_the_daemonset_does_not_hold_is_one_line_never_a_guess(obj: dict[str, Any]) -> None:
    state = daemonset_env("kube-system", "aws-node", obj)
    assert state.unreadable is not None and "not observed" in state.unreadable and "\n" not in state.unreadable
    read = input_of([state])
    assert isinstance(read, ConfigError) and read.source == "daemonset/kube-system/aws-node"


def test_no_aws_node_daemonset_is_said_in_one_line() -> None:
    read = input_of([EnvState("kube-system", "aws-node", exists=False)])
    assert isinstance(read, ConfigError) and "not installed" in read.message


def test_the_input_reads_back_into_the_sources_it_came_from() -> None:
    states = [ConfigMapState("kube-system", USER, True, keys=(("ip-masq-agent", b"a"), ("other", b"b"))),
              ConfigMapState("kube-system", RECONCILED, False),
              EnvState("kube-system", "aws-node", True, (("AWS_VPC_K8S_CNI_EXTERNALSNAT", "true"),))]
    read = input_of(states)
    assert isinstance(read, ConfigInput)
    assert [name for name, _ in read.files] == [f"configmap/{USER}[ip-masq-agent]", f"configmap/{USER}[other]",
                                                ENV_SOURCE]
    sources = sources_of(read)
    assert sources.configmaps == {USER: {"ip-masq-agent": b"a", "other": b"b"}}
    assert sources.env == {"AWS_VPC_K8S_CNI_EXTERNALSNAT": "true"}
    bad = input_of([ConfigMapState("kube-system", USER, True, bad_value="binaryData 'x' that is not base64")])
    assert isinstance(bad, ConfigError)


# --- AKS ------------------------------------------------------------------------------------------------------


def _aks_api() -> tuple[FakeKubeClient, WriterInputs, threading.Event, list[int]]:
    client = FakeKubeClient()
    stop = threading.Event()
    pokes: list[int] = []
    inputs = WriterInputs(client, WRITERS["aks"], log=LOG, poke=lambda: pokes.append(1), stop=stop)
    return client, inputs, stop, pokes


def test_aks_s_two_configmaps_are_followed_whole_and_merged_as_aks_merges_them() -> None:
    client, inputs, stop, pokes = _aks_api()
    client.put(paths.configmaps("kube-system", RECONCILED),
               configmap("ip-masq-agent-reconciled", "nonMasqueradeCIDRs: [10.224.0.0/12]\nmasqLinkLocal: false\n"))
    client.put(paths.configmaps("kube-system", USER), configmap("ip-masq-agent", "nonMasqueradeCIDRs: [10.0.0.0/8]\n"))
    node = Node(ip_masq_agent_rules("IP-MASQ-AGENT", ("10.0.0.0/8", "10.224.0.0/12"), random_fully=False))
    watcher = observer("aks", node, inputs)
    assert inputs.pending() is not None
    seen = watcher.take_config(inputs.choose(ConfigInput(()))[0])  # nothing listed yet: nothing loaded, not ready
    assert not seen.readiness.ok and "waiting for the API server's list" in seen.readiness.why
    assert watcher.reconcile().result is SyncResult.NO_POLICY
    inputs.start()
    try:
        eventually(lambda: inputs.pending() is None and pokes, "every input listed, the loop poked")
        read, origin = inputs.choose(ConfigInput(()))
        assert origin.source == "api" and origin.exists and dict(origin.configmaps).keys() == {USER, RECONCILED}
        assert {q["fieldSelector"] for q in client.watch_queries} == {f"metadata.name={USER}",
                                                                      f"metadata.name={RECONCILED}"}
        watcher.take_config(read)
        report = watcher.reconcile()
        assert report.result is SyncResult.IN_SYNC and report.readiness.ok, report
        content = inputs.content()
        assert content is not None and content.target is not None and content.target.name == USER
    finally:
        stop.set()
        for _ in range(2):
            client.watch_events.put(None)
    # the user's fragment adds a CIDR the node's chain lacks: out of sync, named; still ready
    inputs._changed(ConfigMapState("kube-system", USER, True, keys=(
        ("ip-masq-agent", b"nonMasqueradeCIDRs: [10.0.0.0/8, 192.168.0.0/16]\n"),), uid="u", resource_version="9"))
    watcher.take_config(inputs.choose(ConfigInput(()))[0])
    report = watcher.reconcile()
    assert report.result is SyncResult.OUT_OF_SYNC and report.readiness.ok
    assert report.mismatch is not None and "192.168.0.0/16" in report.mismatch
    # a fragment the merger would refuse: a config error in one line, the last good inputs still observed
    inputs._changed(ConfigMapState("kube-system", USER, True, keys=(("ip-masq-agent", b"nonMasqueradeCIDRs: [x]\n"),)))
    seen = watcher.take_config(inputs.choose(ConfigInput(()))[0])
    assert seen.config_error is not None and "azure-ip-masq-merger stops" in seen.config_error
    assert watcher.reconcile().result is SyncResult.OUT_OF_SYNC


# --- EKS ------------------------------------------------------------------------------------------------------


def _eks(env: dict[str, str]) -> ConfigInput:
    read = input_of([EnvState("kube-system", "aws-node", True, tuple(sorted(env.items())))])
    assert isinstance(read, ConfigInput)
    return read


def test_eks_s_chain_is_compared_with_the_aws_node_env() -> None:
    node = Node(aws_snat_rules("10.142.0.0/16", ("10.2.0.0/16",), "192.0.2.10"))
    watcher = observer("eks", node)
    watcher.take_config(_eks({"AWS_VPC_K8S_CNI_EXCLUDE_SNAT_CIDRS": "10.2.0.0/16"}))
    report = watcher.reconcile()
    assert report.result is SyncResult.IN_SYNC, report.mismatch
    # the env excludes one more CIDR, which ipamd has not applied (it reads its env at start)
    watcher.take_config(_eks({"AWS_VPC_K8S_CNI_EXCLUDE_SNAT_CIDRS": "10.2.0.0/16,172.30.0.0/16"}))
    report = watcher.reconcile()
    assert report.result is SyncResult.OUT_OF_SYNC and report.mismatch is not None
    assert "config-not-applied" in report.mismatch and "172.30.0.0/16" in report.mismatch
    # external SNAT: no node SNAT intended, the chain still SNATs
    watcher.take_config(_eks({"AWS_VPC_K8S_CNI_EXCLUDE_SNAT_CIDRS": "10.2.0.0/16",
                              "AWS_VPC_K8S_CNI_EXTERNALSNAT": "true"}))
    report = watcher.reconcile()
    assert report.result is SyncResult.OUT_OF_SYNC and "EXTERNALSNAT=true" in (report.mismatch or "")
    # the CNI catches up (no chain at all): in sync, from the rules alone
    node.write("*nat\nCOMMIT\n")
    assert watcher.reconcile().result is SyncResult.IN_SYNC


def test_without_the_aws_node_daemonset_the_observer_says_why_in_one_line_and_compares_nothing() -> None:
    watcher = observer("eks", Node("*nat\nCOMMIT\n"))
    seen = watcher.take_config(input_of([EnvState("kube-system", "aws-node", exists=False)]))
    assert seen.config_error is not None and not seen.readiness.ok
    assert "not installed" in seen.readiness.why and "\n" not in seen.readiness.why
    assert watcher.reconcile().result is SyncResult.NO_POLICY


def test_eks_without_the_chain_says_so() -> None:
    watcher = observer("eks", Node("*nat\nCOMMIT\n"))
    watcher.take_config(_eks({}))
    report = watcher.reconcile()
    assert report.result is SyncResult.OUT_OF_SYNC and "chain-missing" in (report.mismatch or "")


def test_the_aws_node_daemonset_is_followed_by_name() -> None:
    client = FakeKubeClient()
    stop = threading.Event()
    client.put(paths.daemonsets("kube-system", "aws-node"),
               aws_node({"name": "AWS_VPC_K8S_CNI_EXCLUDE_SNAT_CIDRS", "value": "10.2.0.0/16"}))
    inputs = WriterInputs(client, WRITERS["eks"], log=LOG, poke=lambda: None, stop=stop)
    inputs.start()
    try:
        eventually(lambda: inputs.pending() is None, "every input listed")
    finally:
        stop.set()
        client.watch_events.put(None)
    read, origin = inputs.choose(ConfigInput(()))
    assert isinstance(read, ConfigInput) and sources_of(read).env == {"AWS_VPC_K8S_CNI_EXCLUDE_SNAT_CIDRS":
                                                                     "10.2.0.0/16"}
    assert origin.configmaps == () and origin.exists
    assert ("GET", "/apis/apps/v1/namespaces/kube-system/daemonsets") in client.calls
    content = inputs.content()
    assert content is not None and content.target is None  # no ConfigMap to summarise the fleet on


def test_a_daemonset_of_another_shape_is_one_line_naming_the_field() -> None:
    obj = aws_node({"name": "AWS_VPC_K8S_CNI_EXTERNALSNAT", "value": False})  # a YAML boolean, never quoted
    state = daemonset_env("kube-system", "aws-node", obj)
    assert state.unreadable is not None and "\n" not in state.unreadable
    assert "env[0].value is not a string" in state.unreadable and state.unreadable.endswith("not observed")
    read = input_of([state])
    assert isinstance(read, ConfigError) and read.source == "daemonset/kube-system/aws-node"
