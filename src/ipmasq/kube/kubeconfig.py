"""A kubeconfig read as kubectl reads it: the files of $KUBECONFIG merged, a context, its cluster and user.

kubectl's rules (client-go's clientcmd loading rules): every file of KUBECONFIG (':'-separated; missing ones are
skipped) is read in order; for clusters, users and contexts the first file to name one wins, and so does the first
current-context; relative paths are relative to the file that named them. Without KUBECONFIG, ~/.kube/config.

What a user can say: a token, a tokenFile, a client certificate and key as files or as data (kept in memory: the
client loads them through an anonymous in-memory file, never a file on disk), or an exec credential plugin
(client.authentication.k8s.io/v1 and v1beta1; run by ipmasq.kube.auth when a token is needed and again when the
one it printed expires). A cluster: server, certificate-authority (file or data), insecure-skip-tls-verify,
tls-server-name, proxy-url (an http:// proxy). A user's auth-provider (the removed in-tree gcp/azure/oidc
helpers) is refused with one line naming the exec plugin that replaced it.

The file is read through the one bounded reader of credential files (a regular file, at most 4 MiB, with a
deadline: a FIFO or /dev/zero is one line, never a wait or a flood), and YAML aliases may repeat at most
MAX_ALIAS_NODES nodes, as kubectl's YAML decoder refuses "excessive aliasing": a few hundred bytes of nested
aliases would otherwise stand for billions of values.

Values only: the result is a Credentials; nothing here opens a connection or runs a plugin.
"""

from __future__ import annotations

import base64
import binascii
import os
from typing import Any
from urllib.parse import urlsplit

import yaml

from ipmasq.errors import ApiError, clip, one_line
from ipmasq.kube.credentials import MAX_CERTIFICATE_BYTES, Credentials, ExecPlugin, in_cluster, read_credential

__all__ = ["EXEC_API_VERSIONS", "MAX_ALIAS_NODES", "MAX_KUBECONFIG_BYTES", "load", "merged"]

EXEC_API_VERSIONS = ("client.authentication.k8s.io/v1", "client.authentication.k8s.io/v1beta1")
MAX_KUBECONFIG_BYTES = MAX_CERTIFICATE_BYTES  # kubeconfigs with dozens of clusters and embedded CAs are ~100 KiB
# The nodes YAML aliases may repeat in one kubeconfig: an anchored user or cluster repeated a few times is a few
# hundred; an alias bomb of 687 bytes stands for ~10^9.
MAX_ALIAS_NODES = 10_000
_SECTIONS = (("clusters", "cluster"), ("users", "user"), ("contexts", "context"))


def load(path: str | None = None, *, context: str | None = None) -> Credentials:
    """The credentials of `context` (default: the current one) in `path`, else in $KUBECONFIG's files merged, else
    ~/.kube/config; with no kubeconfig at all, the pod's own service account (as kubectl does in a pod)."""
    if path is not None:
        paths = [path]
    elif os.environ.get("KUBECONFIG"):
        paths = [p for p in os.environ["KUBECONFIG"].split(os.pathsep) if p]
    else:
        paths = [os.path.expanduser("~/.kube/config")]
        if not os.path.exists(paths[0]) and context is None and (pod := in_cluster()) is not None:
            return pod
    config, origins = merged(paths, explicit=path is not None)
    where = paths[0] if len(paths) == 1 else "$KUBECONFIG"
    name = context or config.get("current-context")
    if not name:
        raise ApiError(f"{where}: no current-context (name one with --context)")
    ctx = _entry(config, "contexts", "context", name, where)
    cluster_name, user_name = ctx.get("cluster"), ctx.get("user")
    cluster = _entry(config, "clusters", "cluster", cluster_name, where)
    user = _entry(config, "users", "user", user_name, where) if user_name else {}
    cluster_base = origins.get(("clusters", str(cluster_name)), ".")
    user_base = origins.get(("users", str(user_name)), ".")
    return _credentials(cluster, user, cluster_base, user_base, where)


def merged(paths: list[str], *, explicit: bool = False) -> tuple[dict[str, Any], dict[tuple[str, str], str]]:
    """The files' merge as kubectl makes it, and for each named cluster and user the directory of the file that
    defined it (its relative paths are relative to that)."""
    result: dict[str, Any] = {"clusters": [], "users": [], "contexts": []}
    seen: dict[tuple[str, str], str] = {}
    read_any = False
    for path in paths:
        config = _read(path, must_exist=explicit)
        if config is None:
            continue
        read_any = True
        base = os.path.dirname(os.path.abspath(path))
        if "current-context" not in result and config.get("current-context"):
            result["current-context"] = config["current-context"]
        for section, _key in _SECTIONS:
            items = config.get(section) or []
            if not isinstance(items, list):
                raise ApiError(f"{path}: {section} is not a list")
            for item in items:
                if not isinstance(item, dict) or not isinstance(item.get("name"), str):
                    continue
                if (section, item["name"]) in seen:
                    continue  # the first file to name it wins
                seen[(section, item["name"])] = base
                result[section].append(item)
    if not read_any:
        shown = paths[0] if len(paths) == 1 else f"$KUBECONFIG ({clip(os.pathsep.join(paths), 120)})"
        raise ApiError(f"{shown}: no kubeconfig there")
    return result, seen


def _read(path: str, *, must_exist: bool) -> dict[str, Any] | None:
    full = os.path.expanduser(path)
    if not must_exist and not os.path.exists(full):
        return None  # a $KUBECONFIG entry that is not there is skipped, as kubectl skips it
    data = read_credential(full, "the kubeconfig", limit=MAX_KUBECONFIG_BYTES)
    try:
        config = yaml.load(data, Loader=_BoundedLoader)  # a SafeLoader whose aliases are bounded
    except yaml.YAMLError as exc:
        raise ApiError(f"{path}: not a kubeconfig: {clip(one_line(str(exc).splitlines()[0]))}") from None
    except RecursionError:
        raise ApiError(f"{path}: not a kubeconfig (nested too deeply)") from None
    if config is None:
        return {}
    if not isinstance(config, dict):
        raise ApiError(f"{path}: not a kubeconfig (no mapping at the top)")
    return config


class _BoundedLoader(yaml.SafeLoader):
    """PyYAML's safe loader, counting the nodes each alias repeats: past MAX_ALIAS_NODES in all, the document is
    refused; so is an alias inside the value it names (a cycle nothing reading a kubeconfig should walk)."""

    def __init__(self, stream: bytes) -> None:
        super().__init__(stream)
        self._repeated = 0
        self._sizes: dict[int, int] = {}  # id of each finished collection -> its nodes, itself included

    def compose_node(self, parent: yaml.Node | None, index: int) -> yaml.Node | None:
        if self.check_event(yaml.AliasEvent):
            event: yaml.AliasEvent = self.peek_event()  # type: ignore[no-untyped-call]
            anchored = self.anchors.get(event.anchor)
            if anchored is not None:
                self._repeated += self._size(anchored)
                if self._repeated > MAX_ALIAS_NODES:
                    raise yaml.YAMLError(f"YAML aliases repeat more than {MAX_ALIAS_NODES:,} values")
        node = super().compose_node(parent, index)
        if isinstance(node, yaml.CollectionNode) and id(node) not in self._sizes:
            children = node.value if isinstance(node, yaml.SequenceNode) else [p for pair in node.value for p in pair]
            self._sizes[id(node)] = 1 + sum(self._size(child) for child in children)
        return node

    def _size(self, node: yaml.Node) -> int:
        if isinstance(node, yaml.ScalarNode):
            return 1
        size = self._sizes.get(id(node))
        if size is None:  # still being composed: the alias is inside the value it names
            raise yaml.YAMLError("a YAML alias refers to the value that contains it")
        return size


def _entry(config: dict[str, Any], section: str, key: str, name: object, where: str) -> dict[str, Any]:
    for item in config.get(section) or []:
        if item.get("name") == name:
            value = item.get(key)
            if not isinstance(value, dict):
                raise ApiError(f"{where}: the {key} {clip(str(name))!r} is not a mapping")
            return value
    raise ApiError(one_line(f"{where}: no {key} named {clip(str(name))!r} in {section}"))


def _credentials(cluster: dict[str, Any], user: dict[str, Any], cluster_base: str, user_base: str,
                 where: str) -> Credentials:
    server_text = str(cluster.get("server", ""))
    server = urlsplit(server_text)
    try:
        port = server.port or 443
    except ValueError:
        port = -1
    if server.scheme != "https" or not server.hostname or port < 0:
        raise ApiError(one_line(f"{where}: the cluster's server is not an https address: {clip(server_text)!r}"))
    if user.get("auth-provider"):
        provider = (user["auth-provider"] or {}).get("name") if isinstance(user["auth-provider"], dict) else None
        raise ApiError(one_line(f"{where}: the user's auth-provider {clip(str(provider))!r} is no longer supported "
                                "by kubectl either: use its exec plugin (gke-gcloud-auth-plugin, kubelogin)"))
    host = f"[{server.hostname}]" if ":" in server.hostname else server.hostname
    proxy = _text(cluster, "proxy-url", where)
    if proxy is not None and urlsplit(proxy).scheme != "http":
        raise ApiError(one_line(f"{where}: proxy-url {clip(proxy)!r}: only http:// proxies are supported"))
    cert_data = _pem(user, "client-certificate-data", where)
    key_data = _pem(user, "client-key-data", where)
    return Credentials(
        host=host, port=port,
        ca_file=_path(cluster_base, cluster.get("certificate-authority")),
        ca_data=_pem(cluster, "certificate-authority-data", where),
        insecure=cluster.get("insecure-skip-tls-verify") is True,
        tls_server_name=_text(cluster, "tls-server-name", where),
        proxy_url=proxy,
        token=_text(user, "token", where),
        token_file=_path(user_base, user.get("tokenFile")),
        client_cert_file=None if cert_data else _path(user_base, user.get("client-certificate")),
        client_key_file=None if key_data else _path(user_base, user.get("client-key")),
        client_cert_data=cert_data,
        client_key_data=key_data,
        exec_plugin=_exec(user.get("exec"), user_base, where),
        cluster_info={"server": server_text, **({"certificate-authority-data": cluster["certificate-authority-data"]}
                                               if cluster.get("certificate-authority-data") else {}),
                      **({"tls-server-name": cluster["tls-server-name"]} if cluster.get("tls-server-name") else {}),
                      "insecure-skip-tls-verify": cluster.get("insecure-skip-tls-verify") is True},
    )


def _exec(value: object, base: str, where: str) -> ExecPlugin | None:
    if value is None:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("command"), str) or not value["command"]:
        raise ApiError(f"{where}: the user's exec has no command")
    api_version = value.get("apiVersion")
    if api_version not in EXEC_API_VERSIONS:
        raise ApiError(one_line(f"{where}: exec plugin {clip(value['command'])!r}: apiVersion "
                                f"{clip(str(api_version))!r} is not one of {', '.join(EXEC_API_VERSIONS)}"))
    args = value.get("args") or []
    env = value.get("env") or []
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        raise ApiError(f"{where}: exec plugin {clip(value['command'])!r}: args is not a list of strings")
    if not isinstance(env, list) or not all(isinstance(e, dict) and isinstance(e.get("name"), str)
                                            and isinstance(e.get("value"), str) for e in env):
        raise ApiError(f"{where}: exec plugin {clip(value['command'])!r}: env is not a list of name/value pairs")
    mode = value.get("interactiveMode") or ("IfAvailable" if api_version.endswith("v1beta1") else None)
    if mode not in ("Never", "IfAvailable", "Always"):
        raise ApiError(f"{where}: exec plugin {clip(value['command'])!r}: interactiveMode must be Never, "
                       "IfAvailable or Always")
    hint = value.get("installHint")
    return ExecPlugin(command=value["command"], api_version=api_version, args=tuple(args),
                      env=tuple((e["name"], e["value"]) for e in env),
                      install_hint=hint if isinstance(hint, str) else None, interactive_mode=mode,
                      provide_cluster_info=value.get("provideClusterInfo") is True, base_dir=base)


def _text(section: dict[str, Any], key: str, where: str) -> str | None:
    value = section.get(key)
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise ApiError(f"{where}: {key} is not a string")
    return value


def _path(base: str, value: object) -> str | None:
    if not isinstance(value, str) or not value:
        return None
    return os.path.join(base, os.path.expanduser(value))


def _pem(section: dict[str, Any], key: str, where: str) -> str | None:
    value = section.get(key)
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise ApiError(f"{where}: {key} is not base64 text")
    try:
        return base64.b64decode(value, validate=True).decode()
    except (binascii.Error, UnicodeDecodeError):
        raise ApiError(f"{where}: {key} is not base64 PEM") from None
