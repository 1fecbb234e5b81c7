"""Observe mode for a provider's agent whose inputs are not the ip-masq-agent ConfigMap: AKS's two ConfigMap fragments,
the aws-node DaemonSet's environment for EKS (ipmasq.writers: aks, eks).

WriterInputs follows those objects through the API (ipmasq.kube.configmaps: list+watch by name, the same machinery as
the agent's own ConfigMaps) and hands the loop their content as a config input, in place of the mounted file (the
loop's ConfigChooser): the ConfigMaps' keys as kubelet would project them (`configmap/NAME[KEY]`), the DaemonSet's
relevant environment as one JSON document (`daemonset/aws-node[env]`). The Observer loads that input with the
writer's own reading (`load_for`: ipmasq.writers.intended: AKS's merger, the VPC CNI's parsing) and compares the
node's rules with `check --writer`'s comparison (`compare_for`: for EKS, ipmasq.diagnose.eks.check_eks). A content
the writer itself would refuse is a config error, said in one line; a DaemonSet that is not there, or a setting its
manifest does not hold (valueFrom), is said in one line too, never guessed.

The input is the single value between the followers and the Observer: `sources_of` reads it back into the
ipmasq.writers.Sources it came from, so the loader and the comparison see exactly what the status's digest names.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from ipmasq.agent.api.config import ApiContent, Read, configmap_source
from ipmasq.agent.origin import FILE, ConfigOrigin
from ipmasq.agent.trouble import Trouble
from ipmasq.config.model import MasqConfig
from ipmasq.config.source import ConfigInput
from ipmasq.diagnose.check import NodeRules, check_node, ignored_findings
from ipmasq.diagnose.eks import check_eks, node_chain
from ipmasq.errors import ApiMalformed, ConfigError, InputsPending, NotFound, clip
from ipmasq.findings import Finding
from ipmasq.kube import objects, paths
from ipmasq.kube.client import ApiClient
from ipmasq.kube.configmaps import ConfigMapFollower, ConfigMapState, ObjectFollower, configmap_state
from ipmasq.options import PolicyOptions
from ipmasq.policy.policy import Policy
from ipmasq.writers import (
    EKS_DAEMONSET,
    ENV_EXCLUDE_SNAT_CIDRS,
    ENV_EXTERNAL_SNAT,
    REFERENCE_CONFIGMAP,
    Sources,
    Writer,
    config_files,
    eks_with_vpc,
    ignored,
    intended,
)

__all__ = ["ENV_SOURCE", "NAMESPACE", "EnvState", "WriterInputs", "compare_for", "current_input", "daemonset_env",
           "input_of", "load_for", "own_inputs", "sources_of"]

NAMESPACE = "kube-system"  # where the providers keep those objects
ENV_SOURCE = f"daemonset/{EKS_DAEMONSET}[env]"
_ENV = (ENV_EXCLUDE_SNAT_CIDRS, ENV_EXTERNAL_SNAT)  # what the VPC CNI's node SNAT follows; other changes are no news

Compare = Callable[[Policy, NodeRules, ConfigInput | None], Sequence[Finding]]
Load = Callable[[ConfigInput, PolicyOptions], MasqConfig]


@dataclass(frozen=True, slots=True)
class EnvState:
    """The aws-node container's settings of the VPC CNI's SNAT, as the API holds them."""

    namespace: str
    name: str
    exists: bool
    env: tuple[tuple[str, str], ...] = ()
    uid: str | None = None
    resource_version: str | None = None
    unreadable: str | None = None  # why the settings cannot be known from the DaemonSet (one line)


def daemonset_env(namespace: str, name: str, obj: object | None) -> EnvState:
    """The container named like the DaemonSet (aws-node's own), its literal values of the SNAT settings. `obj` as the
    API server sent it, read here through objects.daemonset: one of another shape is unreadable, in its one line."""
    if obj is None:
        return EnvState(namespace, name, exists=False)
    try:
        daemonset = objects.daemonset(obj, f"DaemonSet {namespace}/{name}")
    except ApiMalformed as exc:
        return EnvState(namespace, name, True, unreadable=f"{exc}: not observed")
    meta = daemonset["metadata"]
    uid, version = meta.get("uid"), meta.get("resourceVersion")
    containers = (((daemonset.get("spec") or {}).get("template") or {}).get("spec") or {}).get("containers") or []
    container = next((c for c in containers if c["name"] == name), None)
    if container is None:
        return EnvState(namespace, name, True, uid=uid, resource_version=version,
                        unreadable=f"the DaemonSet {namespace}/{name} has no container named {name}: the VPC CNI's "
                        "settings are not known: not observed")
    env: dict[str, str] = {}
    for item in container.get("env") or []:
        variable = item["name"]
        if variable not in _ENV:
            continue
        value = item.get("value")
        if value is None and item.get("valueFrom") is not None:
            return EnvState(namespace, name, True, uid=uid, resource_version=version,
                            unreadable=f"{name}'s {variable} is set by valueFrom (a ConfigMap, a Secret or a field): "
                            "its value is not in the DaemonSet: not observed")
        env[variable] = value or ""  # the last one wins, as in the container
    return EnvState(namespace, name, True, tuple(sorted(env.items())), uid, version)


State = ConfigMapState | EnvState


def input_of(states: Sequence[State]) -> Read:
    """The followed objects' content as one config input (or the one line saying why it cannot be read)."""
    files: list[tuple[str, bytes]] = []
    for state in states:
        if isinstance(state, EnvState):
            where = f"daemonset/{state.namespace}/{state.name}"
            if not state.exists:
                return ConfigError(f"no DaemonSet {state.namespace}/{state.name}: the VPC CNI, which writes "
                                   "AWS-SNAT-CHAIN-0, is not installed here: not observed", source=where)
            if state.unreadable is not None:
                return ConfigError(state.unreadable, source=where)
            files.append((ENV_SOURCE, json.dumps(dict(state.env), sort_keys=True).encode()))
        elif state.bad_value is not None:
            return ConfigError(f"{state.bad_value}: not read", source=f"configmap/{state.name}")
        else:
            files.extend((configmap_source(state.name, key), data) for key, data in state.keys)
    return ConfigInput(tuple(files))


def own_inputs(writer: Writer) -> bool:
    """Whether `writer` reads inputs of its own (AKS's ConfigMaps, aws-node's env), which WriterInputs follows, in
    place of the ip-masq-agent ConfigMap's `config` key."""
    return writer.daemonset is not None or tuple(writer.configmaps) != (REFERENCE_CONFIGMAP,)


def current_input(client: ApiClient, writer: Writer, namespace: str = NAMESPACE) -> Read:
    """The writer's inputs as the API holds them now, read once (`ipmasq status`), into the very input an observer
    following them compares with: its digest is the one a current observer's status names."""
    states: list[State] = []
    for name in sorted(writer.configmaps):
        states.append(configmap_state(namespace, name, None, _get(client, paths.configmaps(namespace, name))))
    if writer.daemonset is not None:
        states.append(daemonset_env(namespace, writer.daemonset,
                                    _get(client, paths.daemonsets(namespace, writer.daemonset))))
    return input_of(states)


def _get(client: ApiClient, path: str) -> object | None:
    """The object as the API server sent it (its reader checks its shape), None when there is none."""
    try:
        return client.get(path)
    except NotFound:
        return None


def sources_of(config_input: ConfigInput) -> Sources:
    """The Sources an input_of input holds (its inverse; any other file is not one of the writer's inputs)."""
    configmaps: dict[str, dict[str, bytes]] = {}
    env: dict[str, str] = {}
    for where, data in config_input.files:
        if where == ENV_SOURCE:
            try:
                decoded = json.loads(data)
            except ValueError:
                raise ConfigError("not the JSON of the DaemonSet's settings", source=where) from None
            env = {k: v for k, v in decoded.items() if isinstance(v, str)} if isinstance(decoded, dict) else {}
        elif where.startswith("configmap/") and where.endswith("]"):
            name, _, key = where.removeprefix("configmap/").removesuffix("]").partition("[")
            configmaps.setdefault(name, {})[key] = data
    return Sources(configmaps=configmaps, env=env)


def load_for(writer: Writer) -> Load:
    """The Observer's loader: the input read as `writer` reads its inputs (ConfigError where it would not apply
    them). For EKS without the VPC's CIDRs, which only the node's chain shows (compare_for adds them)."""
    def load(config_input: ConfigInput, options: PolicyOptions) -> MasqConfig:
        return intended(writer, sources_of(config_input))
    return load


def compare_for(writer: Writer) -> Compare:
    """`check --writer`'s comparison of the node's rules with what `writer` intends."""
    if writer.name == "eks":
        def compare_eks(policy: Policy, rules: NodeRules, config_input: ConfigInput | None) -> Sequence[Finding]:
            sources = sources_of(config_input or ConfigInput(()))
            # the VPC's CIDRs come from the instance metadata service, which no pod is asked here: the ones the
            # chain returns for (as `check --writer eks` takes them), added to the config loaded from the inputs
            # (derived once, by load_for); the exclusions and SNAT are what is compared
            chain = node_chain(rules)
            vpc = tuple(str(p) for p in chain.vpc_cidrs) if chain is not None else ()
            return check_eks(Policy(eks_with_vpc(policy.config, vpc), writer.options), rules, sources.env).findings
        return compare_eks

    def compare(policy: Policy, rules: NodeRules, config_input: ConfigInput | None) -> Sequence[Finding]:
        tables = {family: table for family, table in rules.tables.items() if family in policy.families}
        files = config_files(writer, sources_of(config_input)) if config_input is not None else ()
        # the keys its fragments set that it ignores (AKS's merger keeps three): said beside, never a mismatch
        said = ignored_findings(ignored(writer, files, policy.config))
        return [*said, *check_node(policy, replace(rules, tables=tables), writer=writer.called or writer.name).findings]
    return compare


class WriterInputs:
    """The writer's objects followed through the API, as the loop's config (a ConfigChooser: the mounted file is not
    the writer's input and is not used)."""

    def __init__(self, client: ApiClient, writer: Writer, *, log: logging.Logger, poke: Callable[[], None],
                 stop: threading.Event, namespace: str = NAMESPACE) -> None:
        self.writer, self.namespace, self.log, self.poke = writer, namespace, log, poke
        self.listeners: list[Callable[[ApiContent], None]] = []  # told each new content (the summary writer)
        self._lock = threading.Lock()
        self._states: dict[str, State] = {}
        self._content: ApiContent | None = None
        self._troubles: dict[str, Trouble] = {}
        self._followers: list[ObjectFollower[Any]] = [
            ConfigMapFollower(client, namespace, name, None, stop=stop, on_change=self._changed,
                              on_trouble=self._trouble_for(f"configmap/{name}"))
            for name in sorted(writer.configmaps)]  # in name order, as ApiConfig: the summary is on the first there
        if writer.daemonset is not None:
            daemonset = writer.daemonset
            self._followers.append(ObjectFollower(
                client, "DaemonSet", paths.daemonsets(namespace), namespace, daemonset,
                decode=lambda obj: daemonset_env(namespace, daemonset, obj), on_change=self._changed,
                on_trouble=self._trouble_for(f"daemonset/{daemonset}"), stop=stop))
        self.names = tuple(self._key(f) for f in self._followers)

    @staticmethod
    def _key(follower: ObjectFollower[Any]) -> str:
        return f"{follower.kind.lower()}/{follower.name}"

    def start(self) -> None:
        for follower in self._followers:
            follower.start()

    def pending(self) -> str | None:
        """Why the writer's intent is not known yet (None: every object was listed)."""
        with self._lock:
            if self._content is not None:
                return None
            missing = [name for name in self.names if name not in self._states]
        return (f"not ready: waiting for the API server's list of {', '.join(f'{self.namespace}/{m}' for m in missing)}"
                f" ({self.writer.name}'s inputs)")

    def choose(self, file_read: Read) -> tuple[Read, ConfigOrigin]:
        with self._lock:
            content = self._content
        if content is None:  # why there is no content yet, as the content: the Observer loads nothing meanwhile
            return InputsPending(self.pending() or "not ready: the writer's inputs not listed yet"), FILE
        return content.read, content.origin

    def content(self) -> ApiContent | None:
        with self._lock:
            return self._content

    def _changed(self, state: State) -> None:
        with self._lock:
            self._states[f"{'configmap' if isinstance(state, ConfigMapState) else 'daemonset'}/{state.name}"] = state
            if len(self._states) < len(self.names):
                return
            states = [self._states[name] for name in self.names]
            read = input_of(states)
            digest = read.digest() if isinstance(read, ConfigInput) else None
            configmaps = tuple(s for s in states if isinstance(s, ConfigMapState))
            origin = ConfigOrigin("api", digest=digest,
                                  configmaps=tuple((s.name, s.resource_version or "") for s in configmaps if s.exists),
                                  exists=any(s.exists for s in states))
            content = self._content = ApiContent(read, origin, configmaps)
        self.poke()
        for listener in self.listeners:
            listener(content)

    def _trouble_for(self, name: str) -> Callable[[str | None], None]:
        trouble = self._troubles[name] = Trouble(
            self.log, said="%s (observing against the last inputs read; retrying)",
            over=f"following {clip(name)} in {self.namespace} through the API again")
        return trouble.reporter(self._lock)
