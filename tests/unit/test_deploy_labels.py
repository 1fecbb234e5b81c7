"""deploy/'s labels: everything every kustomization renders, its pods too, is app.kubernetes.io/part-of ipmasq (what
`kubectl ipmasq uninstall` removes), the observer's pods told apart from the enforcing agent's, and no selector
changed (immutable: the upgrade's `kubectl apply` would fail); what 0.2.0 shipped without the label is still
recognised whole, and every kind shipped is one the uninstall removes."""

from __future__ import annotations

from typing import Any

import pytest

from ipmasq.ownership import COMPONENT, PART_OF, decide, facts_of
from ipmasq.uninstall.plan import KINDS, LEGACY
from tests.unit.test_deploy import DEPLOY, kustomize
from tests.unit.uninstall.fakes import render_without_labels

# every kustomization that renders on its own (a kustomize Component, such as GKE's flags or what the observe
# overlays share, is rendered as part of those that use it)
KUSTOMIZATIONS = sorted(p.parent.relative_to(DEPLOY).as_posix().removeprefix(".")
                        for p in DEPLOY.rglob("kustomization.yaml") if "\nkind: Component" not in p.read_text())
# what a user applies (the other is a part of these: deploy/base)
APPLIED = ["", "overlays/gke", "overlays/gke/webhook", "overlays/observe", "overlays/observe/aks",
           "overlays/observe/eks", "webhook", "monitoring"]
COMPONENTS = {"": "agent", "overlays/gke": "agent", "overlays/observe": "observer", "overlays/observe/aks": "observer",
              "overlays/observe/eks": "observer", "webhook": "webhook", "overlays/gke/webhook": "webhook"}


def _template_labels(doc: dict[str, Any]) -> dict[str, str] | None:
    template = doc.get("spec", {}).get("template") if isinstance(doc.get("spec"), dict) else None
    return template.get("metadata", {}).get("labels", {}) if isinstance(template, dict) else None


def test_every_kustomization_is_covered_here() -> None:
    assert set(APPLIED) <= set(KUSTOMIZATIONS)
    assert set(KUSTOMIZATIONS) - set(APPLIED) == {"base"}


@pytest.mark.parametrize("path", KUSTOMIZATIONS)
def test_everything_rendered_and_its_pods_are_part_of_ipmasq(path: str) -> None:
    docs = kustomize(DEPLOY / path)
    assert docs
    for doc in docs:
        where = f"{doc['kind']} {doc['metadata']['name']}"
        assert doc["metadata"]["labels"][PART_OF] == "ipmasq", where
        template = _template_labels(doc)
        if template is not None:
            assert template[PART_OF] == "ipmasq", where


@pytest.mark.parametrize("path", list(COMPONENTS))
def test_the_pods_say_their_component_the_observers_apart_from_the_enforcing_agents(path: str) -> None:
    (workload,) = [d for d in kustomize(DEPLOY / path) if d["kind"] in ("DaemonSet", "Deployment")]
    assert workload["metadata"]["labels"][COMPONENT] == COMPONENTS[path]
    labels = _template_labels(workload)
    assert labels is not None and labels[COMPONENT] == COMPONENTS[path]


@pytest.mark.parametrize("path", APPLIED)
def test_no_selector_changed_so_the_upgrades_apply_succeeds(path: str) -> None:
    """A DaemonSet's and a Deployment's spec.selector is immutable; a PodDisruptionBudget's and a Service's select the
    pods: every one is what it was without the labels (0.2.0's)."""
    def selectors(docs: list[dict[str, Any]]) -> dict[tuple[str, str], Any]:
        return {(d["kind"], d["metadata"]["name"]): d["spec"]["selector"] for d in docs
                if isinstance(d.get("spec"), dict) and "selector" in d["spec"]}

    now, before = selectors(kustomize(DEPLOY / path)), selectors(render_without_labels(path))
    assert now == before and (path == "monitoring" or now)


@pytest.mark.parametrize("path", APPLIED)
def test_what_0_2_0_shipped_is_found_by_name_and_recognised_whole(path: str) -> None:
    """Without the label (an install not yet upgraded), every object is among the names the uninstall reads and is
    judged ipmasq's; with it, each is ipmasq's by the label."""
    legacy = {(kind, namespace, name) for kind, namespace, name in LEGACY}
    old = [facts_of(d["kind"], d) for d in render_without_labels(path)]
    assert {f.key for f in old} <= legacy
    assert {f.label: v.why for f, v in zip(old, decide(old).values(), strict=True) if not v.ours} == {}
    new = [facts_of(d["kind"], d) for d in kustomize(DEPLOY / path)]
    assert {v.why for v in decide(new).values()} == {"app.kubernetes.io/part-of=ipmasq"}


def test_every_kind_shipped_is_one_the_uninstall_removes() -> None:
    shipped = {d["kind"] for path in APPLIED for d in kustomize(DEPLOY / path)}
    removed = {k.kind for k in KINDS}
    assert shipped <= removed
    # the webhook makes its certificate's Secret; a NetworkPolicy beside ipmasq's pods goes too
    assert removed - shipped <= {"Secret", "NetworkPolicy"}
