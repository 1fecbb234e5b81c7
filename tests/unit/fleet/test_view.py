"""`ipmasq status`'s verdict per node, from the API's objects (the lab's tests hold it to real kernels)."""

from __future__ import annotations

from typing import Any

from ipmasq.commands.status import render_table
from ipmasq.config.source import config_digest
from ipmasq.fleet.view import fleet_view
from ipmasq.kube.configmaps import ConfigMapState

CURRENT = b"nonMasqueradeCIDRs: [10.0.0.0/8]\n"
CONFIGMAP = ConfigMapState("kube-system", "ip-masq-agent", True, CURRENT, "u1", "77")


def status(node: str, content: bytes, *, ready: bool = True, rejection: str | None = None) -> dict[str, Any]:
    return {"metadata": {"name": node}, "nodeName": node, "ready": ready, "policyHash": "f" * 64,
            "configDigest": config_digest((content,)), "configSource": "api", "driftRepairs": 2,
            "lastRejection": rejection, "reason": "ready" if ready else f"not ready: config error: {rejection}"}


def pod(node: str, ready: bool = True) -> dict[str, Any]:
    return {"metadata": {"name": f"ip-masq-agent-{node[-1]}"}, "spec": {"nodeName": node},
            "status": {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


def test_every_node_current() -> None:
    view = fleet_view([CONFIGMAP], [status("n1", CURRENT), status("n2", CURRENT)], [pod("n1"), pod("n2")],
                      ["n1", "n2"])
    assert view.all_current
    assert render_table(view).splitlines()[-1] == "2 of 2 nodes enforce the current config"


def test_a_rejecting_node_an_old_node_and_a_node_without_agent_are_each_named() -> None:
    bad = "configmap/ip-masq-agent[config]:3: bad"
    view = fleet_view([CONFIGMAP], [status("n1", b"old", ready=False, rejection=bad), status("n2", b"older")],
                      [pod("n1"), pod("n2")], ["n1", "n2", "n3"])
    assert not view.all_current
    why = {row.node: row.why for row in view.rows}
    assert why == {"n1": f"rejects the current config: {bad}",
                   "n2": "enforces another config than the ConfigMap's current one",
                   "n3": "no agent pod on this node"}


def test_no_configmap_means_the_defaults_empty_content() -> None:
    absent = ConfigMapState("kube-system", "ip-masq-agent", exists=False)
    view = fleet_view([absent], [status("n1", b"")], [pod("n1")], ["n1"])
    assert view.rows[0].why == "enforces another config than the ConfigMap's current one"
    defaults = {**status("n1", b""), "configDigest": config_digest(())}
    assert fleet_view([absent], [defaults], [pod("n1")], ["n1"]).all_current


def test_garbage_status_objects_are_read_as_empty_values() -> None:
    view = fleet_view([CONFIGMAP], [{"metadata": {"name": "n1"}, "ready": "yes", "driftRepairs": "many",
                                     "configMaps": "x"}], [pod("n1")], ["n1"])
    assert not view.rows[0].current


def test_status_lists_in_pages_so_five_thousand_nodes_stay_within_the_clients_bound() -> None:
    import argparse

    from ipmasq.commands import status as command
    from ipmasq.kube import paths
    from ipmasq.testing.kube import FakeKubeClient

    client = FakeKubeClient()
    client.put("/api/v1/namespaces/kube-system/configmaps/ip-masq-agent",
               {"metadata": {"name": "ip-masq-agent"}, "data": {"config": CURRENT.decode()}})
    for i in range(1234):
        name = f"node-{i:04d}"
        client.put(f"/api/v1/nodes/{name}", {"metadata": {"name": name}})
        client.put(paths.statuses(name), status(name, CURRENT))
        client.put(f"/api/v1/namespaces/kube-system/pods/agent-{i:04d}",
                   {**pod(name), "metadata": {"name": name, "labels": {"k8s-app": "ip-masq-agent"}}})
    args = argparse.Namespace(namespace="kube-system", configmaps="ip-masq-agent", configmap_key="config")
    view = command._gather(client, args)
    assert len(view.rows) == 1234 and view.all_current
    pages = [path for verb, path in client.calls if verb == "GET" and path == "/api/v1/nodes"]
    assert len(pages) == 7  # 200 a page


def test_rows_are_keyed_by_object_name_and_objects_for_no_node_are_ignored() -> None:
    """A forged object claiming another node (its body's nodeName) neither replaces that node's row nor adds one."""
    bad = "configmap/ip-masq-agent[config]:3: bad"
    forged = {**status("zzz-forged", CURRENT), "nodeName": "n1"}
    view = fleet_view([CONFIGMAP], [status("n1", b"old", ready=False, rejection=bad), forged, status("n2", CURRENT)],
                      [pod("n1"), pod("n2")], ["n1", "n2"])
    assert [row.node for row in view.rows] == ["n1", "n2"] and view.ignored == 1
    assert not view.all_current and view.rows[0].why == f"rejects the current config: {bad}"
    assert render_table(view).splitlines()[-2:] == ["1 of 2 nodes enforce the current config",
                                                    "(1 status object named after no node of the cluster ignored)"]


def test_named_nodes_only_and_a_named_node_that_does_not_exist_is_not_current() -> None:
    statuses = [status("n1", CURRENT), status("n2", b"old")]
    pods = [pod("n1"), pod("n2")]
    assert fleet_view([CONFIGMAP], statuses, pods, ["n1", "n2"], only=["n1"]).all_current
    assert not fleet_view([CONFIGMAP], statuses, pods, ["n1", "n2"], only=["n1", "n2"]).all_current
    missing = fleet_view([CONFIGMAP], statuses, pods, ["n1", "n2"], only=["n1", "n9"])
    assert not missing.all_current and {row.node: row.why for row in missing.rows}["n9"] == "no such node"


def test_an_observed_node_is_current_only_when_its_rules_enforce_the_config_and_says_why_not() -> None:
    observed = {**status("n1", CURRENT), "mode": "observe", "writer": "gke", "chain": "IP-MASQ",
                "mismatch": "IP-MASQ: config-not-applied: only the MASQUERADE rule"}
    in_sync = {**status("n2", CURRENT), "mode": "observe", "writer": "gke", "chain": "IP-MASQ"}
    view = fleet_view([CONFIGMAP], [observed, in_sync], [pod("n1"), pod("n2")], ["n1", "n2"])
    rows = {row.node: row for row in view.rows}
    assert not rows["n1"].current and rows["n2"].current
    assert rows["n1"].why == ("observed: gke's rules in IP-MASQ do not enforce the current config: IP-MASQ: "
                              "config-not-applied: only the MASQUERADE rule")
    assert "observe (gke, IP-MASQ)" in render_table(view)


def test_observers_of_a_provider_with_inputs_of_its_own_are_compared_with_those_inputs_not_the_configmap() -> None:
    """EKS's observers name the digest of aws-node's env: status reads that DaemonSet, as they do."""
    import argparse

    from ipmasq.commands import status as command
    from ipmasq.kube import paths
    from ipmasq.testing.kube import FakeKubeClient

    client = FakeKubeClient()

    def aws_node(exclusions: str) -> None:
        client.put(paths.daemonsets("kube-system", "aws-node"), {
            "metadata": {"name": "aws-node"}, "spec": {"template": {"spec": {"containers": [
                {"name": "aws-node", "env": [{"name": "AWS_VPC_K8S_CNI_EXCLUDE_SNAT_CIDRS", "value": exclusions}]}]}}}})

    env = b'{"AWS_VPC_K8S_CNI_EXCLUDE_SNAT_CIDRS": "192.168.0.0/16"}'
    for name in ("n1", "n2"):
        client.put(paths.nodes(name), {"metadata": {"name": name}})
        client.put(f"/api/v1/namespaces/kube-system/pods/observer-{name}",
                   {**pod(name), "metadata": {"name": name, "labels": {"k8s-app": "ipmasq-observer"}}})
        client.put(paths.statuses(name), {**status(name, env), "mode": "observe", "writer": "eks",
                                          "chain": "AWS-SNAT-CHAIN-0"})
    args = argparse.Namespace(namespace="kube-system", configmaps="ip-masq-agent", configmap_key="config")
    aws_node("192.168.0.0/16")
    view = command._gather(client, args)
    assert view.all_current, [row.why for row in view.rows]  # no ip-masq-agent ConfigMap: not what EKS reads
    assert "eks's inputs (daemonset/aws-node) in kube-system: content " in render_table(view)
    aws_node("192.168.0.0/16,172.30.0.0/16")  # the observers have not read it yet
    view = command._gather(client, args)
    assert [row.why for row in view.rows] == ["observed against other inputs than eks's current ones "
                                              "(daemonset/aws-node)"] * 2
    del client.objects[paths.daemonsets("kube-system", "aws-node")]
    view = command._gather(client, args)
    assert not view.all_current and view.rows[0].why.startswith("eks's inputs cannot be read: no DaemonSet")


def test_nothing_an_api_object_says_reaches_the_terminal_raw() -> None:
    """ESC, BEL, C1 controls and bidi overrides in a status object are printed escaped, never as they are."""
    hostile = "\x1b]0;owned\x07\x1b[2K\u202eevil\x9b31m\nforged-row"
    rejected = {**status("n1", b"old", ready=False, rejection=hostile), "agentPod": hostile}
    pods = [{**pod("n1"), "metadata": {"name": "pod\x1b[1A"}}]
    table = render_table(fleet_view([CONFIGMAP], [rejected], pods, ["n1"]))
    assert all(char.isprintable() for line in table.splitlines() for char in line)
    assert "\\x1b]0;owned\\x07" in table and "\\u202e" in table and len(table.splitlines()) == 4


def test_the_agent_pod_a_status_names_is_its_row_when_an_observer_runs_beside_another_pod() -> None:
    observer = {**pod("n1"), "metadata": {"name": "ipmasq-observer-1"}}
    other = {**pod("n1", ready=False), "metadata": {"name": "ip-masq-agent-1"}}
    named = {**status("n1", CURRENT), "agentPod": "ipmasq-observer-1", "mode": "observe"}
    (row,) = fleet_view([CONFIGMAP], [named], [other, observer], ["n1"]).rows
    assert row.pod == "ipmasq-observer-1" and row.current


def test_without_the_node_trust_policy_every_row_is_unverified_and_one_line_says_why() -> None:
    from ipmasq.fleet.nodetrust import NodeTrust

    why = "the admission policy ip-masq-agent-own-node is not installed: any agent's token can write any node's status"
    view = fleet_view([CONFIGMAP], [status("n1", CURRENT), status("n2", b"old")], [pod("n1"), pod("n2")],
                      ["n1", "n2"], trust=NodeTrust(False, why))
    assert [row.verified for row in view.rows] == [False, False] and not view.ok
    lines = render_table(view).splitlines()
    assert [line.split()[4:6] for line in lines[2:4]] == [["yes", "(unverified)"], ["NO", "(unverified)"]]
    assert lines[-1] == f"1 of 2 nodes enforce the current config, UNVERIFIED: {why}"
    document = view.as_json()
    assert document["node_trust"] == {"verified": False, "why": why}
    assert [row["verified"] for row in document["nodes"]] == [False, False]


def test_a_node_forging_anothers_status_without_the_policy_no_longer_turns_status_green() -> None:
    """The attack, against the fake API server: node n2's agent is behind, n1's token rewrites n2's status object
    to say it is current. Without the policy `status` says the rows are unverified and exits 1; with the shipped policy
    and binding installed the same rows are verified (the policy is what refuses the forgery: the lab's test)."""
    import argparse

    import yaml

    from ipmasq.commands import status as command
    from ipmasq.fleet.nodetrust import POLICY
    from ipmasq.kube import paths
    from ipmasq.testing.kube import FakeKubeClient
    from tests.conftest import ROOT

    client = FakeKubeClient()
    client.put(paths.configmaps("kube-system", "ip-masq-agent"),
               {"metadata": {"name": "ip-masq-agent"}, "data": {"config": CURRENT.decode()}})
    for name, content in (("n1", CURRENT), ("n2", b"old")):
        client.put(paths.nodes(name), {"metadata": {"name": name}})
        client.put(paths.statuses(name), status(name, content))
        client.put(f"/api/v1/namespaces/kube-system/pods/agent-{name}",
                   {**pod(name), "metadata": {"name": f"agent-{name}", "labels": {"k8s-app": "ip-masq-agent"}}})
    args = argparse.Namespace(namespace="kube-system", configmaps="ip-masq-agent", configmap_key="config")
    before = command._gather(client, args)
    assert not before.ok and [row.current for row in before.rows] == [True, False]
    client.patch(paths.statuses("n2"), {"configDigest": config_digest((CURRENT,))})  # n1's forgery
    forged = command._gather(client, args)
    assert forged.all_current and not forged.ok  # every row says current, and is marked unverified
    assert render_table(forged).splitlines()[-1].startswith("2 of 2 nodes enforce the current config, UNVERIFIED: "
                                                            "the admission policy ip-masq-agent-own-node is not "
                                                            "installed")
    for doc in yaml.safe_load_all((ROOT / "deploy" / "base" / "admission-policy.yaml").read_text()):
        path = (paths.admission_policies(POLICY) if doc["kind"] == "ValidatingAdmissionPolicy"
                else paths.admission_policy_bindings(POLICY))
        client.put(path, doc)
    assert command._gather(client, args).ok


def test_a_key_the_observed_writer_ignores_is_shown_on_a_current_row_never_as_not_current() -> None:
    ignored = "GKE's managed agent ignores masqueradeCIDRs: 10.11.0.0/24 stays un-masqueraded"
    observed = {**status("n1", CURRENT), "mode": "observe", "writer": "gke", "chain": "IP-MASQ",
                "ignoredByWriter": ignored}
    view = fleet_view([CONFIGMAP], [observed], [pod("n1")], ["n1"])
    (row,) = view.rows
    assert row.current and row.why == "" and row.as_json()["ignored_by_writer"] == ignored
    assert f"(ignored by gke: {ignored})" in render_table(view)
    assert view.all_current


def test_a_providers_pod_of_the_same_label_is_never_a_nodes_ipmasq_agent() -> None:
    """GKE's managed ip-masq-agent's pods carry k8s-app=ip-masq-agent too: status tells them apart by their
    DaemonSet (addon-managed: not ipmasq's) and shows the node without an agent pod, not with Google's."""
    import argparse

    from ipmasq.commands import status as command
    from ipmasq.testing.kube import FakeKubeClient

    client = FakeKubeClient()
    client.put("/api/v1/namespaces/kube-system/configmaps/ip-masq-agent",
               {"metadata": {"name": "ip-masq-agent"}, "data": {"config": CURRENT.decode()}})
    client.put("/apis/apps/v1/namespaces/kube-system/daemonsets/ip-masq-agent",
               {"metadata": {"name": "ip-masq-agent", "namespace": "kube-system", "uid": "google-ds",
                             "labels": {"k8s-app": "ip-masq-agent", "addonmanager.kubernetes.io/mode": "Reconcile"}}})
    client.put("/apis/apps/v1/namespaces/kube-system/daemonsets/ipmasq-observer",
               {"metadata": {"name": "ipmasq-observer", "namespace": "kube-system", "uid": "ours-ds",
                             "labels": {"app.kubernetes.io/part-of": "ipmasq"}}})
    for node, owner, name in (("n1", "google-ds", "ip-masq-agent-g1"), ("n2", "google-ds", "ip-masq-agent-g2"),
                              ("n2", "ours-ds", "ipmasq-observer-o2")):
        client.put(f"/api/v1/nodes/{node}", {"metadata": {"name": node}})
        client.put(f"/api/v1/namespaces/kube-system/pods/{name}",
                   {**pod(node), "metadata": {"name": name, "labels": {"k8s-app": name.rsplit("-", 1)[0]},
                                              "ownerReferences": [{"kind": "DaemonSet", "uid": owner}]}})
    args = argparse.Namespace(namespace="kube-system", configmaps="ip-masq-agent", configmap_key="config")
    rows = {row.node: row for row in command._gather(client, args).rows}
    assert rows["n1"].pod is None
    assert rows["n2"].pod == "ipmasq-observer-o2"


def test_without_others_pods_keeps_what_says_nothing() -> None:
    from ipmasq.ownership import without_others_pods

    def owned(uid: str) -> dict[str, Any]:
        return {"metadata": {"name": uid, "ownerReferences": [{"uid": uid}]}}

    daemonsets = [{"metadata": {"name": "a", "uid": "aks", "labels": {"kubernetes.azure.com/managedby": "aks"}}},
                  {"metadata": {"name": "ip-masq-agent", "uid": "old"}},  # 0.2.0's from a user's registry
                  "garbage", {"metadata": "garbage"}]
    pods = [owned("aks"), owned("old"), {"metadata": {"name": "orphan"}}, "garbage"]
    assert without_others_pods(daemonsets, pods) == [owned("old"), {"metadata": {"name": "orphan"}}, "garbage"]
