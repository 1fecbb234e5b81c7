"""The admission decision: AdmissionReview request -> allowed or denied with the line, and warnings; the same as the
agent's loader and lint, for every way people write the ConfigMap, and one answer for every hostile ConfigMap."""

from __future__ import annotations

import json
import time
import tracemalloc
from pathlib import Path
from typing import Any

import pytest

from ipmasq.config.document import MAX_VALUES
from ipmasq.config.source import ConfigInput, config_from_bytes
from ipmasq.errors import ConfigError, ReviewError
from ipmasq.findings import Severity
from ipmasq.lint import lint_config
from ipmasq.lint.text import scan_lookalikes
from ipmasq.options import PolicyOptions
from ipmasq.policy.budget import WorkBudget
from ipmasq.webhook import review as review_module
from ipmasq.webhook.review import (
    MAX_CHECKED_RULES,
    MAX_LISTED,
    MAX_NAME_CHARS,
    REVIEW_WORK_STEPS,
    AdmissionVerdict,
    decide,
    respond,
)
from tests.hostile.admission import configmap, hostile_configmaps, plain_rules, real_rules

GOOD = "nonMasqueradeCIDRs:\n  - 10.0.0.0/8\n  - 172.16.0.0/12\nmasqLinkLocal: false\nresyncInterval: 60s\n"


def request(obj: dict[str, Any] | None = None, *, operation: str = "CREATE", config: str | None = None,
            name: str = "ip-masq-agent", namespace: str = "kube-system", kind: str = "ConfigMap") -> dict[str, Any]:
    if obj is None:
        obj = configmap({"config": config if config is not None else GOOD}, name=name, namespace=namespace)
    return {"uid": "0b2c", "kind": {"group": "", "version": "v1", "kind": kind},
            "resource": {"group": "", "version": "v1", "resource": kind.lower() + "s"},
            "name": obj["metadata"]["name"], "namespace": obj["metadata"]["namespace"], "operation": operation,
            "userInfo": {"username": "admin"}, "object": obj}


def review(req: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": req}


def verdict_of(config: str, options: PolicyOptions | None = None) -> Any:
    return decide(request(config=config), options or PolicyOptions())


def reviewed(config: str) -> AdmissionVerdict:
    """The verdict as the webhook gives it: within the review's work budget."""
    return respond(review(request(config=config)))[1]


def test_a_good_config_is_admitted_silently() -> None:
    answer, verdict = respond(review(request()))
    assert answer == {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                      "response": {"uid": "0b2c", "allowed": True}}
    assert verdict.reviewed


@pytest.mark.parametrize(("config", "line", "id_", "value"), [
    ("nonMasqueradeCIDRs:\n  - 10.0.0.0/8\n  - 10.0.0.0/33\n", 3, "invalid-cidr", "10.0.0.0/33"),
    ("nonMasqueradeCIDRs:\n  - 10.0.0.1/8\n", 2, "misaligned-cidr", "10.0.0.1/8"),
    ("resyncInterval: -5s\n", 1, "bad-duration", "-5s"),
    ("masqLinkLocal: maybe\n", 1, "wrong-type", "maybe"),
    ("nonMasqueradeCIDRs:\n\t- 10.0.0.0/8\n", 2, "indentation", "10.0.0.0/8"),
])
def test_what_the_agent_refuses_is_denied_with_the_key_the_line_and_the_value(
        config: str, line: int, id_: str, value: str) -> None:
    with pytest.raises(ConfigError):  # the agent's own loader refuses it
        config_from_bytes(ConfigInput((("f", config.encode()),)), PolicyOptions())
    answer, verdict = respond(review(request(config=config)))
    assert not verdict.allowed and answer["response"]["allowed"] is False
    status = answer["response"]["status"]
    assert status["code"] == 422 and status["message"] == verdict.message
    first = status["message"].splitlines()[1]
    assert first.startswith(f"data.config line {line} `") and f"[{id_}]" in first and value in first
    assert "(fix: " in first


@pytest.mark.parametrize(("config", "id_"), [
    ("nonMasqueradeCIDR:\n  - 10.0.0.0/8\n", "unknown-key"),  # a typo: the key is ignored, the defaults apply
    ("nonMasquerade\u200bCIDRs: [10.0.0.0/8]\n", "lookalike-character"),  # an invisible space, copy-pasted
    ("apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: ip-masq-agent\ndata:\n  config: |\n    x: 1\n",
     "config-is-manifest"),  # --from-file=config= of the manifest itself
    ('{"apiVersion": "v1", "kind": "ConfigMap", "data": {"config": "nonMasqueradeCIDRs: []"}}',
     "config-is-manifest"),  # ... or of `kubectl get -o json`
    ("server: https://10.0.0.1\ntoken: abc\n", "no-known-key"),  # some other file at hand
])
def test_what_the_agent_accepts_but_cannot_be_meant_is_denied_as_lint_finds_it(config: str, id_: str) -> None:
    config_from_bytes(ConfigInput((("f", config.encode()),)), PolicyOptions())  # the agent accepts it
    findings = scan_lookalikes(config, "f") + lint_config(config, source="f")  # what `ipmasq lint` runs
    assert any(f.id == id_ and f.severity is Severity.ERROR for f in findings)
    verdict = verdict_of(config)
    assert not verdict.allowed and f"[{id_}]" in (verdict.message or "")


@pytest.mark.parametrize(("config", "id_"), [
    ("nonMasqueradeCIDRs: []\n", "empty-non-masquerade"),
    ("nonMasqueradeCIDRs: [10.0.0.0/8]\nresyncInterval: 100ms\n", "short-resync-interval"),
    ("nonMasqueradeCIDRs: [10.0.0.0/8, 10.1.0.0/16]\n", "shadowed-cidr"),
    ("NonMasqueradeCIDRs: [10.0.0.0/8]\n", "key-case"),
    ("nonMasqueradeCIDRs: [10.0.0.0/8]\n---\nmasqLinkLocal: true\n", "ignored-document"),
    ("", "empty-config"),
])
def test_what_lint_warns_about_is_admitted_with_warnings(config: str, id_: str) -> None:
    answer, verdict = respond(review(request(config=config)))
    assert verdict.allowed and answer["response"]["allowed"] is True
    assert any(f"[{id_}]" in w for w in answer["response"]["warnings"]), answer
    assert all("\n" not in w and w.isprintable() for w in verdict.warnings)  # each one a header kubectl prints


def test_config_keys_of_the_directory_form_and_binary_data_are_checked() -> None:
    obj = configmap({"config": GOOD, "ip-masq-extra": "nonMasqueradeCIDRs: [10.0.0.0/33]\n"})
    verdict = decide(request(obj), PolicyOptions())
    assert not verdict.allowed and "data.ip-masq-extra line 1" in (verdict.message or "")
    binary = configmap(binary={"config": b"nonMasqueradeCIDRs: [10.0.0.0/8]\n\xff\xfe\n"})
    verdict = decide(request(binary), PolicyOptions())
    assert not verdict.allowed and "binaryData.config line 2: not UTF-8 text" in (verdict.message or "")
    good_binary = configmap(binary={"config": GOOD.encode()})
    assert decide(request(good_binary), PolicyOptions()).allowed


@pytest.mark.parametrize(("data", "expected", "allowed"), [
    ({"egress.yaml": GOOD}, "--from-file=config=FILE", False),  # --from-file=FILE: the key is the file's name
    ({"nonMasqueradeCIDRs": "[10.0.0.0/8]"}, "directly under data", False),  # the config's keys one level too high
    ({"ip-masq-agent": GOOD}, "mounts only that key", True),  # the directory form only
    ({}, "holds no data", True),
])
def test_a_configmap_without_data_config(data: dict[str, str], expected: str, allowed: bool) -> None:
    verdict = decide(request(configmap(data)), PolicyOptions())
    assert verdict.allowed is allowed
    assert expected in (verdict.message or "") + " ".join(verdict.warnings)


@pytest.mark.parametrize(("name", "namespace", "expected"), [
    ("ip-masq-agent", "default", "is never read"),
    ("ipmasq-agent", "kube-system", "looks meant for the ip-masq agent"),
    ("ip_masq_agent", "kube-system", "looks meant for the ip-masq agent"),
    ("ip-masq-agent-5f7g8h9k2m", "kube-system", "disableNameSuffixHash"),
    ("masquerade-settings", "kube-system", "looks meant for the ip-masq agent"),
])
def test_configmaps_the_agent_never_reads_are_admitted_with_a_warning(name: str, namespace: str,
                                                                      expected: str) -> None:
    verdict = decide(request(config=GOOD, name=name, namespace=namespace), PolicyOptions())
    assert verdict.allowed and expected in verdict.warnings[0]


def test_a_config_in_another_kube_system_configmap_is_warned_about() -> None:
    verdict = decide(request(configmap({"settings": GOOD}, name="network-settings")), PolicyOptions())
    assert verdict.allowed and "looks meant for the ip-masq agent" in verdict.warnings[0]


@pytest.mark.parametrize("req", [
    request(configmap({"Corefile": ".:53 {\n    forward . /etc/resolv.conf\n}\n"}, name="coredns")),
    request(config="nonMasqueradeCIDRs: [10.0.0.0/33]", operation="DELETE"),
    request(config="nonMasqueradeCIDRs: [10.0.0.0/33]", operation="CONNECT"),
    request(config="nonMasqueradeCIDRs: [10.0.0.0/33]", kind="Secret"),
    {**request(config="nonMasqueradeCIDRs: [10.0.0.0/33]"), "object": None},
    {**request(config="nonMasqueradeCIDRs: [10.0.0.0/33]"), "subResource": "status"},
    {"uid": "x"},
])
def test_everything_else_is_allowed_without_a_look(req: dict[str, Any]) -> None:
    verdict = decide(req, PolicyOptions())
    assert verdict.allowed and not verdict.warnings and not verdict.reviewed


def test_an_update_is_judged_on_the_new_object_only() -> None:
    req = request(config=GOOD, operation="UPDATE")
    req["oldObject"] = configmap({"config": "nonMasqueradeCIDRs: [10.0.0.0/33]"})
    assert decide(req, PolicyOptions()).allowed


def test_an_update_of_metadata_only_is_admitted_with_the_stored_configs_problems_as_warnings() -> None:
    bad = configmap({"config": "nonMasqueradeCIDRs: [10.0.0.0/33]"})
    req = request(bad, operation="UPDATE")
    req["oldObject"] = configmap({"config": "nonMasqueradeCIDRs: [10.0.0.0/33]"})
    req["object"]["metadata"]["labels"] = {"team": "network"}
    verdict = decide(req, PolicyOptions())
    assert verdict.allowed and verdict.warnings[0].startswith("the stored config is already refused: data.config")
    req["object"]["data"]["config"] = "nonMasqueradeCIDRs: [10.0.0.0/34]"  # a change of the config is judged
    assert not decide(req, PolicyOptions()).allowed


def test_the_agents_flags_decide_as_they_do_for_the_agent() -> None:
    ipv6 = "nonMasqueradeCIDRs: [10.0.0.0/8, 'fd00::/8']\n"
    assert not verdict_of(ipv6).allowed
    assert verdict_of(ipv6, PolicyOptions(enable_ipv6=True)).allowed


def test_a_rule_for_some_nodes_is_checked_not_refused_for_want_of_a_node_name() -> None:
    config = ("rules:\n  - name: partner\n    nodes: [gke-prod-egress-*]\n    destinations: [203.0.113.0/24]\n"
              "    action: snat\n    snatTo: 10.142.15.204\n")
    verdict = verdict_of(config)
    assert verdict.allowed, verdict.message


def test_a_long_list_of_errors_is_cut_with_a_count() -> None:
    config = "nonMasqueradeCIDRs:\n" + "".join(f"  - 10.{i}.0.0/33\n" for i in range(30))
    message = verdict_of(config).message or ""
    assert len(message.splitlines()) == 1 + MAX_LISTED + 1 and "and 22 more" in message


@pytest.mark.parametrize("body", [None, [], "x", {"apiVersion": "admission.k8s.io/v1beta1", "kind": "AdmissionReview"},
                                  {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview"},
                                  {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {}}])
def test_what_is_not_an_admission_review_is_a_review_error(body: object) -> None:
    with pytest.raises(ReviewError):
        respond(body)


class _Counted(WorkBudget):
    made: list[WorkBudget] = []  # noqa: RUF012 - every budget a review made, for the test to read

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _Counted.made.append(self)


@pytest.mark.parametrize(("name", "obj"), sorted(hostile_configmaps().items()), ids=lambda v: v if isinstance(v, str)
                         else "")
def test_every_hostile_configmap_gets_one_bounded_answer(name: str, obj: dict[str, Any],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """One answer, in bounded work: the rules' checks within the review's budget (counted in steps, the same on
    every machine), and the CPU time of the whole review far from what a quadratic check took (20 s and more);
    CPU time, not wall-clock time: a busy machine does not change it."""
    body = json.loads(json.dumps(review(request(obj))))  # as the server gets it
    _Counted.made = []
    monkeypatch.setattr(review_module, "WorkBudget", _Counted)
    started = time.thread_time()
    answer, verdict = respond(body)
    assert time.thread_time() - started < 10.0, name
    assert len(_Counted.made) == 1 and _Counted.made[0].spent <= REVIEW_WORK_STEPS + 50_000, name
    response = answer["response"]
    assert response["allowed"] is verdict.allowed and response["uid"] == "0b2c"
    for line in [*(verdict.message or "").splitlines(), *verdict.warnings]:
        assert line.isprintable() and len(line) <= 600, line[:200]
    json.dumps(answer)  # serialisable as it is


@pytest.mark.parametrize("length", [254, 1 << 20])
def test_a_name_longer_than_a_kubernetes_name_is_refused_unread(length: int) -> None:
    """Only a peer other than the API server sends one (it refuses them itself); the near-miss comparison of a
    1 MB name cost 2 s of CPU: refused before any comparison, in work that does not grow with the name."""
    obj = configmap({"config": GOOD}, name="ip-masq-agent" + "x" * (length - 13))
    started = time.thread_time()
    verdict = decide(request(obj), PolicyOptions())
    assert time.thread_time() - started < 0.5
    assert not verdict.allowed and "at most 253 characters" in (verdict.message or "")
    assert decide(request(configmap({"config": GOOD}, name="ip-masq-agent-" + "x" * 239)), PolicyOptions()).allowed


@pytest.mark.parametrize("config", ["x: [" + "1," * 520_000 + "1]\n", "x: [" + "{}," * 340_000 + "{}]\n",
                                    "{\"x\": [" + "1," * 520_000 + "1]}\n"])
def test_a_config_of_too_many_values_is_refused_while_parsing(config: str) -> None:
    """Refused by count while the parser reads (520,000 values peaked at 587 MiB when they were all built)."""
    tracemalloc.start()
    try:
        verdict = reviewed(config)
        _current, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert not verdict.allowed and f"more than {MAX_VALUES:,} values" in (verdict.message or "")
    assert peak < 64 << 20, peak


def test_rules_past_the_budget_are_named_not_passed_over_in_silence() -> None:
    verdict = reviewed(real_rules(1000))
    assert verdict.allowed  # a valid config is never denied for want of work
    left = [w for w in verdict.warnings if "[rules-not-checked]" in w]
    assert len(left) == 1 and "not checked for being shadowed" in left[0]


def test_more_rules_than_a_review_checks_are_all_named() -> None:
    verdict = reviewed(plain_rules(MAX_CHECKED_RULES + 1))
    (left,) = [w for w in verdict.warnings if "[rules-not-checked]" in w]
    assert f"{MAX_CHECKED_RULES + 1:,} in all" in left and f"at most {MAX_CHECKED_RULES:,} rules" in left


def test_a_config_of_as_many_rules_as_a_review_checks_is_checked_whole() -> None:
    verdict = reviewed(plain_rules(MAX_CHECKED_RULES))
    assert verdict.allowed and not any("[rules-not-checked]" in w for w in verdict.warnings)


def test_the_docs_state_the_rule_count_the_review_checks() -> None:
    page = (Path(__file__).parents[3] / "docs" / "webhook.md").read_text()
    assert f"{MAX_CHECKED_RULES:,} rules" in page and f"{REVIEW_WORK_STEPS:,} steps" in page
    assert f"more than {MAX_VALUES:,} values" in page and f"{MAX_NAME_CHARS} characters" in page


@pytest.mark.parametrize(("change", "field"), [
    ({"operation": ["CREATE"]}, r"request\.operation is not a string"),
    ({"kind": "ConfigMap"}, r"request\.kind is not an object"),
    ({"namespace": 7}, r"request\.namespace is not a string"),
    ({"object": {"metadata": {"name": "ip-masq-agent"}, "data": {"config": {"a": 1}}}},
     r"request\.object\.data\.config is not a string"),
    ({"object": "x"}, r"request\.object is not an object"),
])
def test_a_review_of_another_shape_is_a_review_error_naming_the_field(change: dict[str, Any], field: str) -> None:
    """The API server sends every member with its type: a review that does not is not answered as if it did."""
    with pytest.raises(ReviewError, match=field) as raised:
        respond(review({**request(), **change}))
    assert "\n" not in str(raised.value) and len(str(raised.value)) < 300


def test_another_kind_s_object_is_allowed_unread_whatever_its_shape() -> None:
    other = {**request(kind="Secret"), "object": {"data": {"k": {"not": "a string"}}}}
    answer, verdict = respond(review(other))
    assert answer["response"]["allowed"] and not verdict.reviewed
