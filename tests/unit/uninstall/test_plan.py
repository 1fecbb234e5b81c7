"""The uninstall's decision from what was read (pure): where rules are removed and with what, what is never asked
for."""

from __future__ import annotations

from ipmasq.ownership import ObjectFacts, facts_of
from ipmasq.uninstall.plan import ClusterSeen, PodSeen, StatusSeen, describe, plan_of
from ipmasq.version import IMAGE

OURS = {"app.kubernetes.io/part-of": "ipmasq"}


def _agent(name: str, args: list[str], image: str = "reg/ipmasq:1") -> ObjectFacts:
    return facts_of("DaemonSet", {"metadata": {"name": name, "namespace": "kube-system", "uid": name, "labels": OURS},
                                  "spec": {"template": {"spec": {"containers": [
                                      {"name": "ip-masq-agent", "image": image, "args": ["agent", *args]}]}}}})


def test_rules_are_removed_where_the_enforcing_agent_ran_never_for_an_observer() -> None:
    enforcing = _agent("ip-masq-agent", ["--masq-chain", "IP-MASQ"])
    observer = _agent("ipmasq-observer", ["--observe=gke"])
    seen = ClusterSeen(
        objects=(enforcing, observer),
        pods=(PodSeen("kube-system", "a-1", "n1", enforcing.key), PodSeen("kube-system", "o-2", "n2", observer.key),
              PodSeen("kube-system", "a-9", "gone", enforcing.key)),
        nodes=("n1", "n2", "n3", "n4"),
        statuses=(StatusSeen("n3", "enforce", "X; rm -rf /"), StatusSeen("n4", "observe", "IP-MASQ"),
                  StatusSeen("n2", "observe", "")),
        configmap=False)
    plan = plan_of(seen)
    visits = {v.node: v for v in plan.visits}
    assert sorted(visits) == ["n1", "n3"]
    assert visits["n1"].chain_flags == ("--masq-chain=IP-MASQ",) and visits["n1"].image == "reg/ipmasq:1"
    assert visits["n3"].chain_flags == () and visits["n3"].image == "reg/ipmasq:1"  # a chain no agent accepts
    assert [r.facts.name for r in plan.enforcing] == ["ip-masq-agent"]
    assert [r.facts.name for r in plan.removals] == ["ipmasq-observer"]
    assert plan_of(seen, image="mine:2").visits[0].image == "mine:2"
    assert [v.image for v in plan_of(ClusterSeen((), (), ("n1",), (), False), all_nodes=True).visits] == [IMAGE]


def test_remove_unmarked_is_passed_to_every_nodes_uninstall_and_said() -> None:
    enforcing = _agent("ip-masq-agent", ["--masq-chain", "IP-MASQ"])
    seen = ClusterSeen((enforcing,), (PodSeen("kube-system", "a-1", "n1", enforcing.key),), ("n1", "n2"),
                       (StatusSeen("n2", "enforce", ""),), False)
    assert all("--remove-unmarked" not in v.chain_flags for v in plan_of(seen).visits)
    plan = plan_of(seen, remove_unmarked=True)
    assert [v.chain_flags for v in plan.visits] == [("--masq-chain=IP-MASQ", "--remove-unmarked"),
                                                    ("--remove-unmarked",)]
    assert any("ipmasq uninstall --masq-chain=IP-MASQ --remove-unmarked" in line for line in describe(plan))


def test_a_name_that_cannot_be_asked_for_is_kept_and_said() -> None:
    odd = facts_of("ClusterRole", {"metadata": {"name": "system:ipmasq", "labels": OURS}})
    plan = plan_of(ClusterSeen((odd,), (), (), (), False))
    assert plan.removals == ()
    assert describe(plan)[-1] == ("kept clusterrole/system:ipmasq: its name is not one ipmasq asks the API server "
                                  "for")


def test_no_node_is_visited_by_its_status_alone_once_another_agent_runs_in_ipmasqs_place() -> None:
    """ipmasq's DaemonSet deleted without an uninstall, the reference agent installed in its place: it writes the chain
    ipmasq wrote, with the same rules, so ipmasq's marker still matches them; the status objects left behind must not
    send a removal pod that would take its working rules. --all-nodes is the operator's word and stays."""
    reference = facts_of("DaemonSet", {"metadata": {"name": "ip-masq-agent", "namespace": "kube-system", "uid": "r"},
                                       "spec": {"template": {"spec": {"containers": [
                                           {"name": "ip-masq-agent", "image": "reg.example/ip-masq-agent:2.9"}]}}}})
    seen = ClusterSeen((reference,), (), ("n1", "n2"), (StatusSeen("n1", "enforce", "IP-MASQ-AGENT"),), False)
    plan = plan_of(seen)
    assert plan.visits == ()
    assert any("no node visited" in note and "daemonset/kube-system/ip-masq-agent" in note for note in plan.notes)
    assert [v.node for v in plan_of(seen, all_nodes=True).visits] == ["n1", "n2"]
    # without another agent, the status objects still name where to clean
    assert [v.node for v in plan_of(ClusterSeen((), (), ("n1", "n2"), seen.statuses, False)).visits] == ["n1"]
