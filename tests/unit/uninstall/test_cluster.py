"""`kubectl ipmasq uninstall` over the fake API, with deploy/'s own manifests: only what is ipmasq's goes (GKE's
addon DaemonSet and ServiceAccount of the same name, a Helm chart's ClusterRole and the user's ConfigMap stay, each
said with why), rules are removed only where ipmasq's enforcing agent ran and with its own image, an install of
0.2.0 without the label is recognised whole, and the dry run says what the run does and writes nothing. The real
cluster's proof is tests/kernel/lab/kubernetes/test_day_two.py and test_journeys.py."""

from __future__ import annotations

from typing import Any

import pytest

from ipmasq.errors import NotFound
from ipmasq.kube import paths
from ipmasq.uninstall.cluster import UninstallReport, read, run
from ipmasq.uninstall.plan import describe, plan_of
from ipmasq.version import IMAGE
from tests.clock import Clock
from tests.unit.uninstall.fakes import CONFIGMAP, PODS, FakeCluster

USERS_IMAGE = "registry.example.com/team/ipmasq:0.3.0@sha256:" + "b" * 64
AGENT = paths.daemonsets("kube-system", "ip-masq-agent")
OBSERVER = paths.daemonsets("kube-system", "ipmasq-observer")
WEBHOOK = paths.resource("apps/v1", "deployments", namespace="kube-system", name="ipmasq-webhook")


def uninstall(cluster: FakeCluster, **kwargs: Any) -> tuple[UninstallReport, list[str]]:
    clock = Clock()
    lines: list[str] = []

    def sleep(seconds: float) -> None:
        clock.now += seconds

    image, all_nodes = kwargs.pop("image", None), kwargs.pop("all_nodes", False)
    plan = plan_of(read(cluster), image=image, all_nodes=all_nodes)
    return run(cluster, plan, clock=clock, sleep=sleep, say=lines.append, **kwargs), lines


def dry_run(cluster: FakeCluster, **kwargs: Any) -> list[str]:
    before = len(cluster.calls)
    lines = describe(plan_of(read(cluster), **kwargs))
    assert {verb for verb, _ in cluster.calls[before:]} == {"GET"}  # it only reads
    return lines


def _uid(cluster: FakeCluster, path: str) -> str:
    return str(cluster.objects[path]["metadata"]["uid"])


def gke_with_ipmasqs_observer() -> tuple[FakeCluster, list[str], dict[str, str]]:
    cluster = FakeCluster(["n1", "n2"])
    google = cluster.gke_agent()
    google_pods = cluster.run_pods(google, ["n1", "n2"])
    helm = cluster.helm_cluster_role()
    observer = cluster.install("overlays/observe")
    cluster.run_pods(OBSERVER, ["n1", "n2"])
    for node in ("n1", "n2"):
        cluster.status(node, mode="observe", chain="IP-MASQ")
    cluster.configmap()
    google_account = paths.resource("v1", "serviceaccounts", namespace="kube-system", name="ip-masq-agent")
    # what the observers said (on their Nodes, on the ConfigMap), and what kubelet said of Google's pod
    observer += [cluster.event("default", "n1.17f3"), cluster.event("default", "n2.17f4"),
                 cluster.event("kube-system", "ip-masq-agent.17f5")]
    kubelets = cluster.event("kube-system", "ip-masq-agent-n1.17f6", ours=False)
    theirs = {path: _uid(cluster, path) for path in (google, google_account, helm, CONFIGMAP, kubelets, *google_pods)}
    return cluster, observer, theirs


KEPT_BESIDE_GKE = [
    "kept daemonset/kube-system/ip-masq-agent: not ipmasq's (addonmanager.kubernetes.io/mode=Reconcile)",
    "kept clusterrole/ip-masq-agent: not ipmasq's (app.kubernetes.io/managed-by=Helm)",
    "kept serviceaccount/kube-system/ip-masq-agent: not ipmasq's (addonmanager.kubernetes.io/mode=Reconcile)",
    "kept configmap/kube-system/ip-masq-agent: yours: the agents' config (the reference agent reads it too)",
]


def test_beside_gke_the_observer_goes_and_googles_agent_its_account_and_a_helm_role_stay() -> None:
    cluster, observer, theirs = gke_with_ipmasqs_observer()
    report, lines = uninstall(cluster)
    assert report.ok and report.nodes == ()  # an observer writes no rules: no node is visited
    assert not cluster.created
    assert {path: _uid(cluster, path) for path in theirs} == theirs  # the very same objects, never re-created
    assert not [path for path in observer if path in cluster.objects]
    assert not [p for p in cluster.objects if "/pods/ipmasq-observer" in p or p.startswith(paths.statuses() + "/")]
    assert lines[-4:] == KEPT_BESIDE_GKE
    assert "removed daemonset/kube-system/ipmasq-observer: app.kubernetes.io/part-of=ipmasq" in lines
    assert ("removed customresourcedefinition/ipmasqagentstatuses.ipmasq.dev: app.kubernetes.io/part-of=ipmasq "
            "(and its 2 IPMasqAgentStatus objects)") in lines
    assert any(line.startswith("no node to clean: ") for line in lines)
    assert ("removed 3 Events of ipmasq (default: 2, kube-system: 1): app.kubernetes.io/part-of=ipmasq (what its "
            "agents saw, of an install that is gone)") in lines


def test_the_dry_run_says_what_the_run_does_and_writes_nothing() -> None:
    cluster, _, _ = gke_with_ipmasqs_observer()
    planned = dry_run(cluster)
    report, done = uninstall(cluster)
    assert planned[-4:] == done[-4:] == KEPT_BESIDE_GKE  # what is kept is said the same way
    would = sorted(line.removeprefix("would remove ") for line in planned if line.startswith("would remove "))
    removed = sorted(line.removeprefix("removed ") for line in done if line.startswith("removed "))
    assert would == removed and len(removed) == 13 and len(report.removed) == 12 + 3  # the Events in one line


def enforcing_install(**reports: tuple[int, str] | None) -> FakeCluster:
    """ipmasq enforcing (deploy/, the user's own image), its webhook and monitoring, on four nodes: its agent's
    pods on n1 and n2; n3's pod is gone but its status says it enforced there; n4 was only observed; a status of a
    Node deleted since."""
    cluster = FakeCluster(["n1", "n2", "n3", "n4"])
    cluster.install("", image=USERS_IMAGE)
    cluster.enforcing_pods = set(cluster.run_pods(AGENT, ["n1", "n2"]))
    cluster.install("webhook", image=USERS_IMAGE)
    cluster.run_pods(WEBHOOK, ["n3", "n4"])
    cluster.install("monitoring")
    for node in ("n1", "n2"):
        cluster.status(node)
    cluster.status("n3", chain="IP-MASQ")
    cluster.status("n4", mode="observe")
    cluster.status("deleted-node")
    cluster.configmap()
    cluster.reports.update(reports)
    return cluster


def test_an_enforcing_install_is_removed_from_the_nodes_it_ran_on_with_its_own_image() -> None:
    cluster = enforcing_install(n1=(0, "removed: iptables (nft)\nkept IP-MASQ (iptables-nft, ipv4): not ours\n"),
                                n2=(0, "nothing to remove\n"), n3=(0, "removed: nftables\n"))
    report, lines = uninstall(cluster)
    assert report.ok
    pods = {pod["spec"]["nodeName"]: pod for pod in cluster.created}
    assert sorted(pods) == ["n1", "n2", "n3"]  # n4 was only observed; deleted-node is no Node
    assert {pod["spec"]["containers"][0]["image"] for pod in pods.values()} == {USERS_IMAGE}
    assert "ipmasq uninstall --masq-chain=IP-MASQ " in pods["n3"]["spec"]["containers"][0]["command"][-1]
    assert pods["n1"]["metadata"]["labels"]["app.kubernetes.io/part-of"] == "ipmasq"
    # every line the node printed is relayed
    assert "node n1: removed: iptables (nft)" in lines
    assert any(line.startswith("node n1: kept IP-MASQ (iptables-nft, ipv4): not ours (") for line in lines)
    # the agent gone before any removal pod (FakeCluster.create checks), the removal pods before any other object
    order = cluster.order
    first_create = next(i for i, step in enumerate(order) if step.startswith("create "))
    assert order[:first_create] == [f"delete {AGENT}"]
    last_pod = max(i for i, step in enumerate(order) if step.startswith(f"delete {PODS}/ipmasq-uninstall-"))
    objects = [step.removeprefix("delete ") for step in order[last_pod + 1:]]
    assert objects[0].endswith("validatingwebhookconfigurations/ipmasq-webhook")
    assert objects.index(WEBHOOK) < objects.index(next(p for p in objects if p.endswith("/services/ipmasq-webhook")))
    assert [p.rpartition("/serviceaccounts/")[2] for p in objects[-2:]] == ["ip-masq-agent", "ipmasq-webhook"]
    # nothing of ipmasq is left; the user's ConfigMap and the Nodes are
    assert sorted(cluster.objects) == sorted([CONFIGMAP, *(paths.nodes(f"n{i}") for i in range(1, 5))])
    assert lines[-1] == ("kept configmap/kube-system/ip-masq-agent: yours: the agents' config (the reference agent "
                         "reads it too)")


def test_an_install_of_0_2_0_without_the_label_is_recognised_whole_each_object_with_why() -> None:
    cluster = FakeCluster(["n1"])
    installed = [*cluster.install("", as_0_2_0=True), *cluster.install("webhook", as_0_2_0=True),
                 *cluster.install("monitoring", as_0_2_0=True)]
    assert not any("app.kubernetes.io/part-of" in str(cluster.objects[p]) for p in installed)
    cluster.enforcing_pods = set(cluster.run_pods(AGENT, ["n1"]))
    cluster.status("n1")
    cluster.reports["n1"] = (0, "removed: iptables (nft)\n")
    report, lines = uninstall(cluster)
    assert report.ok and [n.node for n in report.nodes] == ["n1"]
    assert sorted(cluster.objects) == [paths.nodes("n1")]
    for said in (
        "removed daemonset/kube-system/ip-masq-agent: app.kubernetes.io/name=ipmasq (ipmasq's own label before "
        "app.kubernetes.io/part-of)",
        "removed serviceaccount/kube-system/ip-masq-agent: the service account of ipmasq's "
        "daemonset/kube-system/ip-masq-agent",
        "removed lease/kube-system/ip-masq-agent: the summary Lease of ipmasq's daemonset/kube-system/ip-masq-agent",
        "removed rolebinding/default/ip-masq-agent-node-events: binds only ipmasq's "
        "serviceaccount/kube-system/ip-masq-agent",
        "removed role/default/ip-masq-agent-node-events: bound only by ipmasq's "
        "rolebinding/default/ip-masq-agent-node-events",
        "removed clusterrole/ip-masq-agent: its rules are about the ipmasq.dev API",
        "removed validatingadmissionpolicy/ip-masq-agent-own-node: its rules are about the ipmasq.dev API",
        "removed validatingadmissionpolicybinding/ip-masq-agent-own-node: binds ipmasq's "
        "validatingadmissionpolicy/ip-masq-agent-own-node",
        "removed deployment/kube-system/ipmasq-webhook: app.kubernetes.io/name=ipmasq-webhook (ipmasq's own label "
        "before app.kubernetes.io/part-of)",
    ):
        assert any(line.startswith(said) for line in lines), said


def test_an_observer_of_0_2_0_beside_gke_goes_and_googles_agent_stays() -> None:
    cluster = FakeCluster(["n1"])
    google = cluster.gke_agent()
    uid = _uid(cluster, google)
    cluster.install("overlays/observe", as_0_2_0=True)
    report, lines = uninstall(cluster)
    assert report.nodes == () and _uid(cluster, google) == uid
    assert sorted(p for p in cluster.objects if "ipmasq" in p or "ip-masq-agent" in p) == sorted([
        google, paths.resource("v1", "serviceaccounts", namespace="kube-system", name="ip-masq-agent")])
    assert "removed lease/kube-system/ip-masq-agent: the summary Lease of ipmasq's " \
           "daemonset/kube-system/ipmasq-observer" in lines


def test_what_merely_shares_a_name_is_kept_and_nothing_is_visited() -> None:
    """The reference agent installed by hand (GKE's documented way): its DaemonSet and a ClusterRole of the name,
    no label of anyone's: not ipmasq's alone, kept."""
    cluster = FakeCluster(["n1"])
    cluster.put(AGENT, {"metadata": {"namespace": "kube-system", "labels": {"k8s-app": "ip-masq-agent"}}, "spec": {
        "template": {"spec": {"containers": [{"image": "registry.k8s.io/networking/ip-masq-agent:v2.9.3"}]}}}})
    cluster.put(paths.resource("rbac.authorization.k8s.io/v1", "clusterroles", name="ip-masq-agent"), {})
    report, lines = uninstall(cluster)
    assert report.removed == () and not cluster.created and AGENT in cluster.objects
    assert lines[-2:] == [
        "kept daemonset/kube-system/ip-masq-agent: not ipmasq's alone (no app.kubernetes.io/part-of=ipmasq label; "
        "other programs use the name ip-masq-agent too)",
        "kept clusterrole/ip-masq-agent: not ipmasq's alone (no app.kubernetes.io/part-of=ipmasq label; other "
        "programs use the name ip-masq-agent too)"]


def test_a_node_that_fails_or_never_runs_is_named_and_the_rest_goes_on() -> None:
    cluster = enforcing_install(n1=(0, "removed: nftables\n"), n2=(1, "iptables-restore: \x1b[31mlocked\n"), n3=None)
    report, lines = uninstall(cluster, timeout=30)
    assert not report.ok
    outcomes = {n.node: n for n in report.nodes}
    assert outcomes["n1"].ok and not outcomes["n2"].ok and not outcomes["n3"].ok
    assert "within 30 s" in outcomes["n3"].why
    broken = [line for line in lines if line.startswith("node n2")]
    assert broken[0] == "node n2: iptables-restore: \\x1b[31mlocked"  # escaped, relayed
    assert broken[1].startswith("node n2: FAILED: ipmasq uninstall exited 1; on that node run `ipmasq uninstall`")
    assert not [p for p in cluster.objects if "/pods/ipmasq-uninstall" in p]  # every removal pod deleted
    assert sorted(cluster.objects) == sorted([CONFIGMAP, *(paths.nodes(f"n{i}") for i in range(1, 5))])


def test_a_second_run_finds_nothing_and_all_nodes_cleans_every_node_with_ipmasqs_image() -> None:
    cluster = enforcing_install(n1=(0, "removed: nftables\n"), n2=(0, ""), n3=(0, ""))
    uninstall(cluster)
    report, lines = uninstall(cluster)
    assert report.removed == () and report.nodes == ()
    assert lines == ["no node to clean: ipmasq's enforcing agent runs on none, and no IPMasqAgentStatus says it "
                     "enforced anywhere (an observer writes no rules); --all-nodes cleans every node",
                     "kept configmap/kube-system/ip-masq-agent: yours: the agents' config (the reference agent reads "
                     "it too)"]
    cluster.created.clear()
    cluster.reports.update(n4=(0, "nothing to remove\n"))
    report, _ = uninstall(cluster, all_nodes=True)  # after `kubectl delete -k deploy/`, nothing says where it ran
    assert report.ok and [n.node for n in report.nodes] == ["n1", "n2", "n3", "n4"]
    assert {p["spec"]["containers"][0]["image"] for p in cluster.created} == {IMAGE}


def test_the_agents_pods_that_never_go_stop_the_run_before_any_rule_or_object_is_touched() -> None:
    cluster = enforcing_install()
    original = cluster.delete

    def delete(path: str) -> dict[str, Any]:  # a DaemonSet whose pods the kubelets never end
        if path == AGENT:
            del cluster.objects[AGENT]
            return {}
        return original(path)

    cluster.delete = delete  # type: ignore[method-assign]
    from ipmasq.errors import ApiError

    with pytest.raises(ApiError, match=r"the pods of daemonset/kube-system/ip-masq-agent are still running 180 s "
                                       r"after it was deleted: ip-masq-agent-n1, ip-masq-agent-n2; nothing else"):
        uninstall(cluster)
    assert not cluster.created


def test_a_kind_this_cluster_does_not_serve_is_no_error() -> None:
    cluster = enforcing_install(n1=(0, ""), n2=(0, ""), n3=(0, ""))
    for path in list(cluster.objects):
        if "monitoring.coreos.com" in path:
            del cluster.objects[path]
    cluster.refuse(paths.resource("monitoring.coreos.com/v1", "podmonitors"),
                   NotFound(404, "the server could not find the requested resource"))
    report, _ = uninstall(cluster)
    assert report.ok


def test_status_objects_of_any_shape_are_read_and_only_an_enforcing_ones_node_is_visited() -> None:
    """Any node's agent writes the status objects: a wrong type reads as absent, a hostile chain is no flag."""
    cluster = FakeCluster(["n1", "n2", "n3"])
    cluster.install("")
    cluster.put(paths.statuses("n1"), {"metadata": {"name": "n1"}, "mode": 5, "chain": ["x"], "ready": "yes"})
    cluster.put(paths.statuses("n2"), {"metadata": {"name": "n2"}, "mode": "enforce", "chain": "$(reboot)"})
    cluster.put(paths.statuses("n3"), {"metadata": {"name": "n3"}, "mode": "observe\x1b[2J"})
    cluster.reports.update(n1=(0, ""), n2=(0, ""))
    report, _ = uninstall(cluster)
    assert [n.node for n in report.nodes] == ["n1", "n2"]  # a mode that is no string: an enforcing agent's (0.2.0)
    assert all("reboot" not in str(pod) for pod in cluster.created)


def test_a_node_that_is_not_ready_is_named_not_cleaned_and_the_rest_of_the_cluster_goes_on() -> None:
    """Its agent's pod stays Terminating and no pod starts there until its kubelet is back: the run neither waits for
    it nor sends a removal pod, says what stays there and what to do, and removes everything else."""
    cluster = enforcing_install(n1=(0, "removed: nftables\n"), n3=(0, ""))
    cluster.not_ready("n2")
    planned = dry_run(cluster)
    report, lines = uninstall(cluster)
    assert not report.ok
    outcomes = {n.node: n for n in report.nodes}
    assert outcomes["n1"].ok and outcomes["n3"].ok and not outcomes["n2"].ok
    assert outcomes["n2"].why == "the node is not Ready: no pod is sent there"
    assert sorted(p["spec"]["nodeName"] for p in cluster.created) == ["n1", "n3"]
    said = ("node n2: NOT CLEANED: the node is not Ready: no pod is sent there (ipmasq's agent ran there (pod "
            "ip-masq-agent-n2 of daemonset/kube-system/ip-masq-agent)); its rules stay until `ipmasq uninstall` runs "
            "there, or `kubectl ipmasq uninstall --all-nodes` once it is Ready")
    assert said in lines and said in planned
    assert "would remove daemonset/kube-system/ip-masq-agent: app.kubernetes.io/part-of=ipmasq; then wait for its " \
           "1 pod(s) to go" in planned
    # every object of ipmasq is gone; the agent's pod on n2 waits for its kubelet
    left = sorted(p for p in cluster.objects if not p.startswith("/api/v1/nodes/"))
    assert left == sorted([CONFIGMAP, f"{PODS}/ip-masq-agent-n2"])
    assert report.seconds < 60  # no wait for what cannot end


def test_the_pods_an_interrupted_run_left_are_removed_by_the_next_and_never_waited_for() -> None:
    """A removal pod of an uninstall that was killed, a debug pod of `kubectl ipmasq check` that was killed: bare
    pods of ipmasq's, removed and said; a pod of ipmasq's workloads, or one with an owner, is not one of them."""
    cluster = enforcing_install(n1=(0, ""), n2=(0, ""), n3=(0, ""))
    bare = {"app.kubernetes.io/part-of": "ipmasq", "app.kubernetes.io/component": "uninstall"}
    stray = f"{PODS}/ipmasq-uninstall-0a1b2c3d-zzzzz"
    cluster.put(stray, {"metadata": {"namespace": "kube-system", "labels": bare}, "spec": {"nodeName": "n1"},
                        "status": {"phase": "Succeeded"}})
    debug = paths.pods("default", "ipmasq-debug-1-00aa11bb")
    cluster.put(debug, {"metadata": {"namespace": "default", "labels": {**bare, "app.kubernetes.io/component":
                                                                       "debug"}}, "spec": {"nodeName": "n4"}})
    owned = paths.pods("team", "batch-1")
    cluster.put(owned, {"metadata": {"namespace": "team", "labels": bare, "ownerReferences": [
        {"kind": "Job", "name": "batch", "uid": "j1"}]}, "spec": {"nodeName": "n4"}})
    planned = dry_run(cluster)
    assert "would remove pod/kube-system/ipmasq-uninstall-0a1b2c3d-zzzzz (left by an interrupted uninstall run)" \
        in planned
    report, lines = uninstall(cluster)
    assert report.ok and report.seconds < 60  # this run's own pods are waited for, never another's
    assert stray not in cluster.objects and debug not in cluster.objects and owned in cluster.objects
    assert "removed pod/default/ipmasq-debug-1-00aa11bb (left by an interrupted debug run)" in lines


def test_the_timeout_of_the_nodes_pods_counts_from_the_last_ones_creation() -> None:
    """On a large cluster creating the pods takes a while: none is given less than --timeout to finish."""
    cluster = enforcing_install(n1=(0, ""), n2=(0, ""), n3=(0, ""))
    clock = Clock()
    create = cluster.create

    def slow_create(path: str, body: Any) -> dict[str, Any]:
        clock.now += 20  # an API server answering slowly, or thousands of nodes before this one
        return create(path, body)

    cluster.create = slow_create  # type: ignore[method-assign]

    def sleep(seconds: float) -> None:
        clock.now += seconds

    report = run(cluster, plan_of(read(cluster)), timeout=30, clock=clock, sleep=sleep)
    assert report.ok, [n.why for n in report.nodes]


def test_on_a_large_cluster_the_looks_at_the_pods_are_spaced_by_how_many_there_are() -> None:
    """1,200 agent pods that do not go within the timeout: each look lists them all (three pages), so looks come a
    page's half second apart per page, not every half second."""
    nodes = [f"n{i}" for i in range(1200)]
    cluster = FakeCluster(nodes)
    cluster.install("")
    cluster.run_pods(AGENT, nodes)
    original = cluster.delete

    def delete(path: str) -> dict[str, Any]:  # kubelets slower than the timeout
        if path == AGENT:
            return cluster.objects.pop(AGENT)
        return original(path)

    cluster.delete = delete  # type: ignore[method-assign]
    plan = plan_of(read(cluster))
    before = len(cluster.calls)
    clock = Clock()

    def sleep(seconds: float) -> None:
        clock.now += seconds

    from ipmasq.errors import ApiError

    with pytest.raises(ApiError, match="still running 30 s after"):
        run(cluster, plan, timeout=30, clock=clock, sleep=sleep)
    pages = [path for verb, path in cluster.calls[before:] if verb == "GET" and path == PODS]
    assert len(pages) <= 3 * (30 / 1.5 + 1), len(pages)  # 1.5 s between looks of three pages; 0.5 s: 183 pages


def test_remove_unmarked_is_refused_while_another_agent_writing_ip_masq_agents_text_is_installed() -> None:
    """GKE's IP-MASQ carries the reference agent's comments and no ipmasq marker: `--all-nodes --remove-unmarked`
    beside it would have taken it off every node. AKS's azure-ip-masq-agent likewise (read by its name)."""
    from ipmasq.errors import UsageError

    cluster, _, _ = gke_with_ipmasqs_observer()
    with pytest.raises(UsageError, match=r"--remove-unmarked would also remove the rules daemonset/kube-system/"
                                         r"ip-masq-agent writes"):
        plan_of(read(cluster), all_nodes=True, remove_unmarked=True)
    assert plan_of(read(cluster), all_nodes=True).visits  # without it, every node is visited: only marked chains go
    aks = FakeCluster(["n1"])
    aks.install("")
    aks.put(paths.daemonsets("kube-system", "azure-ip-masq-agent"), {"metadata": {
        "namespace": "kube-system", "labels": {"kubernetes.azure.com/managedby": "aks"}}})
    aks.run_pods(AGENT, ["n1"])
    with pytest.raises(UsageError, match="azure-ip-masq-agent"):
        plan_of(read(aks), remove_unmarked=True)
    assert "kept daemonset/kube-system/azure-ip-masq-agent: not ipmasq's (kubernetes.azure.com/managedby=aks)" in \
        describe(plan_of(read(aks)))
    alone = FakeCluster(["n1"])
    alone.install("")
    alone.run_pods(AGENT, ["n1"])
    assert [v.chain_flags for v in plan_of(read(alone), remove_unmarked=True).visits] == [("--remove-unmarked",)]
