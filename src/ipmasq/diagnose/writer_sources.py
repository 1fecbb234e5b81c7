"""What a provider's agent reads, from the objects an operator saved (`kubectl get cm,ds -n kube-system -o yaml`).

`check --writer` compares a node's rules with what that writer intends (ipmasq.writers), and the writer's inputs
are Kubernetes objects: ConfigMaps (the ip-masq-agent one, AKS's fragments) and, for EKS, the aws-node DaemonSet's
container environment. This reads them from manifests (one object, several documents, or a `kind: List`) into an
ipmasq.writers.Sources. Pure; only fixed paths of the composed YAML are visited, so aliases cost nothing extra.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import yaml

from ipmasq.config.document import compose_yaml, yaml_error
from ipmasq.errors import ConfigError, clip
from ipmasq.writers import EKS_DAEMONSET, Sources

__all__ = ["sources_from_manifests"]

_NAMESPACE = "kube-system"


def _get(node: yaml.Node | None, key: str) -> yaml.Node | None:
    if not isinstance(node, yaml.MappingNode):
        return None
    found = None
    for k, v in node.value:
        if isinstance(k, yaml.ScalarNode) and k.value == key:
            found = v  # the last one wins, as in the API server's decoder
    return found


def _text(node: yaml.Node | None) -> str | None:
    return node.value if isinstance(node, yaml.ScalarNode) else None


def _objects(document: yaml.Node) -> Iterator[yaml.Node]:
    kind = _text(_get(document, "kind")) or ""
    items = _get(document, "items")
    if isinstance(items, yaml.SequenceNode) and (kind == "" or kind.endswith("List")):
        yield from items.value
    else:
        yield document


def sources_from_manifests(manifests: Sequence[tuple[str, str]], *, vpc_cidrs: tuple[str, ...] = ()) -> Sources:
    """ConfigMaps of kube-system (or without a namespace) by name; the aws-node container's env. A later object of
    the same name replaces an earlier one, as `kubectl apply` in turn would."""
    configmaps: dict[str, dict[str, bytes]] = {}
    env: dict[str, str] = {}
    for source, text in manifests:
        try:
            documents = compose_yaml(text, source)
        except yaml.YAMLError as exc:
            raise yaml_error(exc, text, source) from None
        for obj in (o for d in documents for o in _objects(d)):
            kind = _text(_get(obj, "kind"))
            metadata = _get(obj, "metadata")
            name = _text(_get(metadata, "name"))
            namespace = _text(_get(metadata, "namespace"))
            if name is None or namespace not in (None, _NAMESPACE):
                continue
            if kind == "ConfigMap":
                data = _get(obj, "data")
                entries = data.value if isinstance(data, yaml.MappingNode) else []
                configmaps[name] = {k.value: v.value.encode("utf-8", "surrogatepass") for k, v in entries
                                    if isinstance(k, yaml.ScalarNode) and isinstance(v, yaml.ScalarNode)}
            elif kind == "DaemonSet" and name == EKS_DAEMONSET:
                env = _container_env(obj, source)
    return Sources(configmaps=configmaps, env=env, vpc_cidrs=vpc_cidrs)


def _container_env(daemonset: yaml.Node, source: str) -> dict[str, str]:
    """The aws-node container's literal env values (a valueFrom is not known from the manifest: refused)."""
    containers = _get(_get(_get(_get(daemonset, "spec"), "template"), "spec"), "containers")
    for container in containers.value if isinstance(containers, yaml.SequenceNode) else ():
        if _text(_get(container, "name")) != EKS_DAEMONSET:
            continue
        env: dict[str, str] = {}
        variables = _get(container, "env")
        for item in variables.value if isinstance(variables, yaml.SequenceNode) else ():
            name = _text(_get(item, "name"))
            if name is None:
                continue
            value = _get(item, "value")
            if value is None and _get(item, "valueFrom") is not None and name.startswith("AWS_VPC_K8S_CNI_"):
                raise ConfigError(f"aws-node's {clip(name)} comes from valueFrom: its value is not in the manifest "
                                  "(give it as the pod's env: kubectl -n kube-system exec ds/aws-node -- env)",
                                  source=source)
            env[name] = _text(value) or ""
        return env
    raise ConfigError(f"the {EKS_DAEMONSET} DaemonSet has no container named {EKS_DAEMONSET}", source=source)
