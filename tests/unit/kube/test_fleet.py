"""`ipmasq status`'s verdict per node, from the API's objects (the lab's tests hold it to real kernels)."""

from __future__ import annotations

from typing import Any

from ipmasq.commands.status import render_table
from ipmasq.config.source import config_digest
from ipmasq.kube.configmaps import ConfigMapState
from ipmasq.kube.fleet import fleet_view

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
    from ipmasq.kube.agentstatus import status_path
    from ipmasq.testing.kube import FakeKubeClient

    client = FakeKubeClient()
    client.put("/api/v1/namespaces/kube-system/configmaps/ip-masq-agent",
               {"metadata": {"name": "ip-masq-agent"}, "data": {"config": CURRENT.decode()}})
    for i in range(1234):
        name = f"node-{i:04d}"
        client.put(f"/api/v1/nodes/{name}", {"metadata": {"name": name}})
        client.put(status_path(name), status(name, CURRENT))
        client.put(f"/api/v1/namespaces/kube-system/pods/agent-{i:04d}", {**pod(name), "metadata": {"name": name}})
    args = argparse.Namespace(namespace="kube-system", configmaps="ip-masq-agent", configmap_key="config")
    view = command._gather(client, args)
    assert len(view.rows) == 1234 and view.all_current
    pages = [path for verb, path in client.calls if verb == "GET" and path == "/api/v1/nodes"]
    assert len(pages) == 7  # 200 a page
