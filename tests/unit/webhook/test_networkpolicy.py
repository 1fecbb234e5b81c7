"""deploy/webhook's NetworkPolicy: the webhook's port admits the control plane's address range only (a parameter the
docs name), valid on every supported minor; the second line of the webhook's defence, the server's own the first."""

from __future__ import annotations

import ipaddress
from typing import Any

from tests.conftest import ROOT
from tests.unit.test_deploy import DEPLOY, kustomize, validate_on_every_supported_minor


def rendered() -> dict[str, list[dict[str, Any]]]:
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for doc in kustomize(DEPLOY / "webhook"):
        by_kind.setdefault(doc["kind"], []).append(doc)
    return by_kind


def test_the_webhook_port_admits_one_address_range_and_nothing_else() -> None:
    by_kind = rendered()
    (policy,) = by_kind["NetworkPolicy"]
    validate_on_every_supported_minor(policy)
    (deployment,) = by_kind["Deployment"]
    pod = deployment["spec"]["template"]
    # it selects the webhook's pods, and only ingress is restricted (its calls to the API server are not)
    assert policy["metadata"]["namespace"] == deployment["metadata"]["namespace"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    (rule,) = policy["spec"]["ingress"]
    (peer,) = rule["from"]
    assert set(peer) == {"ipBlock"}  # no pod or namespace selector: no pod of the cluster is let in by its labels
    network = ipaddress.ip_network(peer["ipBlock"]["cidr"])
    assert network.prefixlen > 0 and "except" not in peer["ipBlock"]
    (container,) = pod["spec"]["containers"]
    (port,) = rule["ports"]
    assert port["protocol"] == "TCP" and port["port"] in {p["name"] for p in container["ports"]}


def test_the_address_range_is_a_documented_parameter() -> None:
    """Named as GKE's private clusters name it, where an operator sets it (an overlay) and how to see it is right."""
    for doc in ("docs/how-to/reject-a-bad-configmap.md", "docs/concepts/webhook.md"):
        text = (ROOT / doc).read_text()
        assert "networkpolicy.yaml" in text and "--master-ipv4-cidr" in text, doc
    howto = (ROOT / "docs/how-to/reject-a-bad-configmap.md").read_text()
    assert "/spec/ingress/0/from/0/ipBlock/cidr" in howto  # the overlay's patch
