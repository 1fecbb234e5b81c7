"""The admission decision: an AdmissionReview request (a plain JSON value, read through ipmasq.kube.admission's
AdmissionReview shape; one of another shape is a ReviewError) -> allowed or denied, and warnings.

Pure, no I/O: the agent's own loader says what the agent would refuse, `ipmasq lint` says what it would accept but
its author cannot have meant (a denial) and what works but surprises (a warning), so the webhook, the agent and
lint can never disagree. Every other ConfigMap is allowed at once, without reading its data: the configuration's
matchConditions (deploy/webhook) send only the ConfigMaps judged here, and any other that reaches the webhook all the
same (a configuration without them) must not be slowed down.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from difflib import SequenceMatcher
from typing import NotRequired, TypedDict, TypeVar

from ipmasq.config.source import CONFIG_PREFIX, ConfigInput, config_from_bytes
from ipmasq.config.validate import KNOWN_KEYS
from ipmasq.errors import ApiMalformed, ConfigError, ReviewError, clip, one_line
from ipmasq.findings import Finding, Severity
from ipmasq.kube import admission, objects
from ipmasq.lint.config import lint_config
from ipmasq.lint.manifest import AGENT_CONFIGMAP, AGENT_NAMESPACE, CONFIG_KEY
from ipmasq.lint.text import scan_lookalikes
from ipmasq.options import PolicyOptions
from ipmasq.policy.budget import AbandonSignal, WorkBudget

__all__ = ["ADMISSION_API", "MAX_CHECKED_RULES", "MAX_CONFIGMAP_DATA", "MAX_LISTED", "MAX_NAME_CHARS",
           "REVIEW_WORK_STEPS", "AdmissionResponse", "AdmissionResponseReview", "AdmissionVerdict", "data_size",
           "decide", "respond"]

ADMISSION_API = "admission.k8s.io/v1"
# A denial or the warnings list this many findings and count the rest: the first ones are what to fix first, and
# kubectl prints every warning on its own line.
MAX_LISTED = 8
# A warning travels in an HTTP header (Warning: 299 - "..."); the API server may cut longer ones.
MAX_WARNING_CHARS = 512
_WRITES = ("CREATE", "UPDATE")
# How close a ConfigMap's name must be to the agent's to be "meant for the agent" (difflib's ratio): catches
# ip-masq-agnet, ipmasq-agent and ip_masq_agent, not kube-proxy or coredns.
_NEAR_MISS = 0.8
MAX_CONFIGMAP_DATA = 1 << 20  # the API server's limit on a ConfigMap's data and binaryData together
# A ConfigMap's name and namespace are DNS subdomains: the API server refuses longer ones before any webhook sees
# them, so only another peer sends one, and nothing of it is compared (the near-miss check of a 1 MB name: 2 s).
MAX_NAME_CHARS = 253
# The work the rules' checks (shadowed, no effect) may do for one review, in steps of ipmasq.policy.budget: about
# 1.7 s of one core on the machine of docs/measurements.md, inside the API server's 5 s with the parse and the
# other checks. 1,000 plain rules need 13,000 steps, 1,000 of a real shape (sources, ports, node pools) 2.1
# million; a budget spent is said in a rules-not-checked warning naming the rules left, never a denial and never
# silence.
REVIEW_WORK_STEPS = 1_000_000
# The rules a review checks at all for being shadowed or changing nothing (docs/webhook.md states it): past this,
# every rule is named in rules-not-checked at once, without spending the budget on the first few.
MAX_CHECKED_RULES = 1_000


T = TypeVar("T")


class AdmissionResponse(TypedDict):
    uid: str
    allowed: bool
    status: NotRequired[objects.Status]
    warnings: NotRequired[list[str]]


class AdmissionResponseReview(TypedDict):
    apiVersion: str
    kind: str
    response: AdmissionResponse


@dataclass(frozen=True, slots=True)
class AdmissionVerdict:
    allowed: bool
    message: str | None = None  # the denial, lines the user reads after "denied the request: "
    warnings: tuple[str, ...] = field(default=())
    reviewed: bool = True  # False: not a ConfigMap of the agent's, allowed without a look at its data


ALLOWED = AdmissionVerdict(True, reviewed=False)


def respond(review: object, options: PolicyOptions | None = None, *, abandoned: AbandonSignal | None = None,
            handoff: int | None = None) -> tuple[AdmissionResponseReview, AdmissionVerdict]:
    """The AdmissionReview response to an AdmissionReview request, and the verdict in it; raises ReviewError when
    the body is not an AdmissionReview request, Abandoned (from the rules' checks) once `abandoned` is set,
    WorkOutgrown once the rules' checks pass `handoff` steps (the same review decided without it gives the verdict)."""
    if not isinstance(review, dict):
        raise ReviewError("the body is not a JSON object")
    if review.get("apiVersion") != ADMISSION_API or review.get("kind") != "AdmissionReview":
        raise ReviewError(f"not an {ADMISSION_API} AdmissionReview (apiVersion {clip(str(review.get('apiVersion')))}"
                          f", kind {clip(str(review.get('kind')))})")
    request = _read(admission.admission_review, review, "the AdmissionReview")["request"]
    verdict = decide(request, options or PolicyOptions(), WorkBudget(REVIEW_WORK_STEPS, abandoned,
                                                                         max_rules=MAX_CHECKED_RULES, handoff=handoff))
    response: AdmissionResponse = {"uid": request["uid"], "allowed": verdict.allowed}
    if verdict.message is not None:
        # 422 as the API server's own validation answers; kubectl prints the message after "denied the request: "
        response["status"] = {"code": 422, "reason": "Invalid", "message": verdict.message}
    if verdict.warnings:
        response["warnings"] = list(verdict.warnings)
    answer: AdmissionResponseReview = {"apiVersion": ADMISSION_API, "kind": "AdmissionReview", "response": response}
    return answer, verdict


def _read(check: Callable[[object, str], T], value: object, where: str) -> T:
    """`value` through its shape; one of another shape is the review's one line (ReviewError: a 400 to its sender,
    which is not the API server: the API server sends every member with its type)."""
    try:
        return check(value, where)
    except ApiMalformed as exc:
        raise ReviewError(str(exc)) from None


def decide(request: admission.AdmissionRequest, options: PolicyOptions,
           budget: WorkBudget | None = None) -> AdmissionVerdict:
    """The verdict on one AdmissionReview request (its `request` member, read by admission.admission_review); `budget`:
    the work its rules' checks may do, for all its config keys together (None: unbounded)."""
    if options.node_name is None:
        # every node's agent knows its own name: a rule with `nodes` is checked, not refused for want of one
        options = replace(options, node_name="")
    if request.get("operation") not in _WRITES or not _is_configmap(request) or request.get("object") is None:
        return ALLOWED
    obj = _read(admission.admitted_configmap, request.get("object"), "request.object")
    metadata = obj.get("metadata") or {}
    name = metadata.get("name") or request.get("name") or ""
    namespace = request.get("namespace") or metadata.get("namespace") or ""
    if len(name) > MAX_NAME_CHARS or len(namespace) > MAX_NAME_CHARS:
        return AdmissionVerdict(False, f"a ConfigMap's name and namespace have at most {MAX_NAME_CHARS} characters "
                                       f"(got {len(name):,} and {len(namespace):,}); not read")
    if namespace == AGENT_NAMESPACE and (name == AGENT_CONFIGMAP or name.startswith(CONFIG_PREFIX)) \
            and (size := data_size(obj)) > MAX_CONFIGMAP_DATA:
        # what the API server itself refuses (a ConfigMap's data and binaryData together); only a peer other than
        # the API server sends more, and nothing of it is parsed: a config of a million CIDRs costs the YAML
        # parser and the validator hundreds of MiB
        return AdmissionVerdict(False, f"ConfigMap {AGENT_NAMESPACE}/{name}: {size:,} bytes of data, more than a "
                                       f"ConfigMap may hold ({MAX_CONFIGMAP_DATA:,}); not read")
    if namespace != AGENT_NAMESPACE:
        if name == AGENT_CONFIGMAP:
            return AdmissionVerdict(True, warnings=(
                f"ConfigMap {namespace}/{name} is never read: the agent reads only {AGENT_NAMESPACE}/"
                f"{AGENT_CONFIGMAP}; create it there (kubectl -n {AGENT_NAMESPACE} ...) for its config to apply",))
        return ALLOWED
    if name == AGENT_CONFIGMAP:
        verdict = _review_configs(obj, name, options, budget, required=True)
        if not verdict.allowed and _data_unchanged(request, obj):
            # a label, an annotation or a finalizer on a ConfigMap whose config was already stored (before the
            # webhook, or while it was down): refusing it would fix nothing and block whoever manages metadata
            problems = (verdict.message or "").splitlines()[1:]
            return AdmissionVerdict(True, warnings=tuple(_listed([f"the stored config is already refused: {line}"
                                                         for line in problems])))
        return verdict
    if name.startswith(CONFIG_PREFIX):
        # a member of the family a DaemonSet mounting a whole directory reads (--config DIR): validated as the
        # agent would read it, and said to be outside what the shipped DaemonSet mounts
        verdict = _review_configs(obj, name, options, budget, required=False)
        return AdmissionVerdict(verdict.allowed, verdict.message, (_family_warning(name), *verdict.warnings))
    if _near_miss(name) or _holds_a_config(obj):
        return AdmissionVerdict(True, warnings=(
            f"ConfigMap {AGENT_NAMESPACE}/{name} looks meant for the ip-masq agent, but the agent reads only "
            f"{AGENT_NAMESPACE}/{AGENT_CONFIGMAP}: this one is never applied",))
    return ALLOWED


def data_size(obj: admission.AdmittedConfigMap) -> int:
    """A ConfigMap's size as the API server counts it for its 1 MiB limit: every key and value of data (UTF-8
    bytes) and of binaryData (decoded bytes), worked out without copying a value."""
    size = 0
    for key, value in (obj.get("data") or {}).items():
        size += _utf8_size(key) + _utf8_size(value)
    for key, value in (obj.get("binaryData") or {}).items():
        size += _utf8_size(key) + len(value) * 3 // 4 - value[-2:].count("=")
    return size


def _utf8_size(value: str) -> int:
    if value.isascii():  # known without a scan: the common case, and a 14 MB value costs nothing
        return len(value)
    return len(value.encode("utf-8", "surrogatepass"))


def _data_unchanged(request: admission.AdmissionRequest, obj: admission.AdmittedConfigMap) -> bool:
    if request.get("operation") != "UPDATE" or request.get("oldObject") is None:
        return False
    old = _read(admission.admitted_configmap, request.get("oldObject"), "request.oldObject")
    return all(old.get(member) == obj.get(member) for member in ("data", "binaryData"))


def _is_configmap(request: admission.AdmissionRequest) -> bool:
    if request.get("subResource"):
        return False
    kind = request.get("kind")
    if kind is not None and kind.get("group", "") == "" and kind.get("kind") == "ConfigMap":
        return True
    resource = request.get("resource")
    return resource is not None and resource.get("group", "") == "" and resource.get("resource") == "configmaps"


def _family_warning(name: str) -> str:
    if name.startswith(AGENT_CONFIGMAP + "-"):
        cause = (" (kustomize's configMapGenerator appends a hash to the name unless "
                 "generatorOptions.disableNameSuffixHash is true)")
    else:
        cause = ""
    return (f"ConfigMap {AGENT_NAMESPACE}/{name}: the shipped DaemonSet reads only {AGENT_CONFIGMAP}{cause}; this one "
            "is read only by a DaemonSet that mounts it in its config directory (--config DIR)")


def _near_miss(name: str) -> bool:
    lowered = name.lower()
    if "masq" in lowered:
        return True
    return SequenceMatcher(None, lowered.replace("_", "-"), AGENT_CONFIGMAP).ratio() >= _NEAR_MISS


def _holds_a_config(obj: admission.AdmittedConfigMap) -> bool:
    """Whether a ConfigMap's data has a key of the agent's config, or a value that starts like one."""
    for key, value in (obj.get("data") or {}).items():
        if key.lower() in KNOWN_KEYS:
            return True
        if value.lstrip()[:40].split(":", 1)[0].strip().lower() in KNOWN_KEYS:
            return True
    return False


# --- the agent's ConfigMap ---------------------------------------------------------------------------------------


@dataclass
class _Collected:
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def _config_keys(obj: admission.AdmittedConfigMap) -> list[tuple[str, bytes | str]]:
    """(where, content) of every key the agent reads: `config` (what the shipped DaemonSet mounts as its file) and
    the ip-masq* keys (the files a config directory holds), from data (text) and binaryData (bytes)."""
    found: list[tuple[str, bytes | str]] = []
    for key, value in (obj.get("data") or {}).items():
        if key == CONFIG_KEY or key.startswith(CONFIG_PREFIX):
            found.append((f"data.{key}", value))
    for key, value in (obj.get("binaryData") or {}).items():
        if key == CONFIG_KEY or key.startswith(CONFIG_PREFIX):
            try:
                found.append((f"binaryData.{key}", base64.b64decode(value, validate=True)))
            except (binascii.Error, ValueError):
                continue  # not base64: the API server refuses the object itself
    return found


def _review_configs(obj: admission.AdmittedConfigMap, name: str, options: PolicyOptions, budget: WorkBudget | None,
                    *, required: bool) -> AdmissionVerdict:
    configs = _config_keys(obj)
    collected = _Collected()
    if required and not any(where.endswith("." + CONFIG_KEY) for where, _ in configs):
        _missing_config(obj, configs, collected)
    for where, content in configs:
        _review_one(where, content, options, budget, collected)
    warnings = _listed(collected.warnings)
    if collected.errors:
        head = (f"ConfigMap {AGENT_NAMESPACE}/{name} would not do what it says (ipmasq lint finds the same; "
                "nothing was changed):")
        return AdmissionVerdict(False, "\n".join([head, *_listed(collected.errors)]), tuple(warnings))
    return AdmissionVerdict(True, warnings=tuple(warnings))


def _missing_config(obj: admission.AdmittedConfigMap, configs: list[tuple[str, bytes | str]],
                    collected: _Collected) -> None:
    keys = [*(obj.get("data") or {}), *(obj.get("binaryData") or {})]
    stray = [k for k in keys if k.lower() in KNOWN_KEYS]
    if stray:
        collected.errors.append(
            f"data.{stray[0]}: a key of the config written directly under data; the agent reads only "
            f"data.{CONFIG_KEY}: write `{CONFIG_KEY}: |` and indent the config below it [missing-config-key]")
    elif configs:
        shown = ", ".join(where for where, _ in configs)
        collected.warnings.append(
            f"no data.{CONFIG_KEY}: the shipped DaemonSet mounts only that key and runs with its defaults; "
            f"{shown} is read only by a DaemonSet that mounts the whole ConfigMap as its config directory")
    elif keys:
        listed = ", ".join(repr(clip(k)) for k in keys[:MAX_LISTED])
        hint = (" (`kubectl create configmap --from-file=FILE` names the key after the file: write "
                f"--from-file={CONFIG_KEY}=FILE)")
        collected.errors.append(
            f"no data.{CONFIG_KEY} (keys: {listed}): the agent finds no config and runs with its defaults{hint} "
            "[missing-config-key]")
    # no data at all: the agent's defaults, which is what an empty ConfigMap says; lint warns the same way
    else:
        collected.warnings.append(
            f"the ConfigMap holds no data: the agent runs with its built-in defaults (delete it, or write "
            f"data.{CONFIG_KEY})")


def _review_one(where: str, content: bytes | str, options: PolicyOptions, budget: WorkBudget | None,
                collected: _Collected) -> None:
    data = content.encode("utf-8", "surrogatepass") if isinstance(content, str) else content
    refused: ConfigError | None = None
    try:
        config_from_bytes(ConfigInput(((where, data),)), options)
    except ConfigError as exc:
        refused = exc
    except RecursionError:
        refused = ConfigError("nested too deeply to be an ip-masq-agent config", source=where)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        # the agent's own refusal names the byte and its line
        collected.errors.append(_agent_line(refused, where, data))
        return
    if text.startswith("\ufeff"):
        text = text[1:]  # a leading byte-order mark is harmless to the agent; elsewhere it is a lookalike
    findings = scan_lookalikes(text, where) + lint_config(text, source=where, options=options, whole_file=True,
                                                          budget=budget)
    findings.sort(key=Finding.sort_key)
    lines = text.splitlines()
    errors = [f for f in findings if f.severity is Severity.ERROR]
    if refused is not None and not errors:
        # lint reports every refusal of the agent's with its own words; this is the safety net if it ever does not
        collected.errors.append(_agent_line(refused, where, data))
    collected.errors += [_finding_line(f, lines) for f in errors]
    warnings = [f for f in findings if f.severity is Severity.WARNING]
    # what was not checked goes first: the list shows MAX_LISTED, and this one must never be cut from it
    unchecked = [f for f in warnings if f.id == "rules-not-checked"]
    collected.warnings[:0] = [_finding_line(f, lines) for f in unchecked]
    collected.warnings += [_finding_line(f, lines) for f in warnings if f.id != "rules-not-checked"]


def _agent_line(refused: ConfigError | None, where: str, data: bytes) -> str:
    if refused is None:  # not reached: bytes that are not UTF-8 are refused by the agent's loader
        return f"{where}: not UTF-8 text"
    try:
        quoted = _quote_line(data.decode("utf-8").splitlines(), refused.line)
    except UnicodeDecodeError:
        quoted = ""  # bytes are no line to quote: the message names the byte
    place = f"{where} line {refused.line}" if refused.line is not None else where
    return one_line(f"{place}{quoted}: {refused.message} (the agent refuses this config and keeps its last one)")


def _quote_line(lines: list[str], line: int | None) -> str:
    if line is None or not 0 < line <= len(lines) or not lines[line - 1].strip():
        return ""
    return f" `{clip(lines[line - 1].strip())}`"


def _finding_line(finding: Finding, lines: list[str]) -> str:
    """One line: where (the key and the config's own line, quoted), what, and the fix."""
    place = finding.file or ""
    if finding.line is not None:
        place += f" line {finding.line}"
    return one_line(f"{place}{_quote_line(lines, finding.line)}: {finding.message} [{finding.id}] "
                    f"(fix: {finding.hint})")


def _listed(lines: list[str]) -> list[str]:
    shown = [clip(line, MAX_WARNING_CHARS) for line in lines[:MAX_LISTED]]
    if len(lines) > MAX_LISTED:
        shown.append(f"... and {len(lines) - MAX_LISTED} more: run ipmasq lint on the config for all of them")
    return shown
