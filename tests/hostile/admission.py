"""The hostile corpus as ConfigMaps: what the webhook may be sent, each as the API server would store it.

Every committed hostile config (tests/hostile/config/) as the agent's ConfigMap (text in data, bytes that are not
UTF-8 in binaryData, as `kubectl create configmap --from-file` puts them), and the ConfigMap-sized cases: 1 MiB of
CIDRs (refused by the limit, and linted whole with the limit raised), nesting and aliases at 1 MiB, 1 MiB of random
bytes, a thousand config files in the directory form, ten thousand keys, and 1 MiB in a ConfigMap of another
namespace. Each stays within the API server's 1 MiB limit for a ConfigMap's data.
"""

from __future__ import annotations

import base64
import random
from typing import Any

from tests.hostile.generated import HERE, deep_json, deep_yaml

__all__ = ["CONFIGMAP_LIMIT", "configmap", "hostile_configmaps"]

CONFIGMAP_LIMIT = 1 << 20  # bytes of data and binaryData together


def configmap(data: dict[str, str] | None = None, binary: dict[str, bytes] | None = None, *,
              name: str = "ip-masq-agent", namespace: str = "kube-system") -> dict[str, Any]:
    obj: dict[str, Any] = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name, "namespace": namespace}}
    if data is not None:
        obj["data"] = data
    if binary is not None:
        obj["binaryData"] = {k: base64.b64encode(v).decode() for k, v in binary.items()}
    return obj


def _as_configmap(content: bytes) -> dict[str, Any]:
    try:
        return configmap({"config": content.decode("utf-8")})
    except UnicodeDecodeError:
        return configmap(binary={"config": content})


def _cidr_lines(budget: int) -> str:
    lines: list[str] = []
    size = 0
    i = 0
    while True:
        line = f"  - 10.{(i >> 16) & 255}.{(i >> 8) & 255}.{i & 255}/32\n"
        if size + len(line) > budget:
            return "".join(lines)
        lines.append(line)
        size += len(line)
        i += 1


def _alias_bomb_at_size() -> str:
    levels = ["a0: &a0 [10.0.0.0/8, 10.0.0.0/8, 10.0.0.0/8, 10.0.0.0/8, 10.0.0.0/8, 10.0.0.0/8, 10.0.0.0/8]"]
    for level in range(1, 60):
        levels.append(f"a{level}: &a{level} [" + ", ".join([f"*a{level - 1}"] * 9) + "]")
    return "\n".join(levels) + "\nnonMasqueradeCIDRs: *a59\n"


def hostile_configmaps() -> dict[str, dict[str, Any]]:
    """name -> a ConfigMap object (as `kubectl apply -f` takes it)."""
    cases = {f"file-{path.name}": _as_configmap(path.read_bytes())
             for path in sorted((HERE / "config").iterdir()) if path.is_file()}
    budget = CONFIGMAP_LIMIT - 64
    cidrs = _cidr_lines(budget - 40)
    rng = random.Random(20)
    cases.update({
        "cidrs-1mib-over-the-limit": configmap({"config": "nonMasqueradeCIDRs:\n" + cidrs}),
        "cidrs-1mib-limit-raised": configmap({"config": "cidrLimit: 100000\nnonMasqueradeCIDRs:\n" + cidrs}),
        "yaml-nested-1mib": configmap({"config": deep_yaml((budget - 30) // 2).decode()}),
        "json-nested-1mib": configmap({"config": deep_json((budget - 30) // 2).decode()}),
        "alias-bomb-deep": configmap({"config": _alias_bomb_at_size()}),
        "random-bytes-1mib": configmap(binary={"config": rng.randbytes(budget * 3 // 4)}),
        "directory-form-1000-files": configmap(
            {f"ip-masq-{i:04d}": f"nonMasqueradeCIDRs: [10.{i // 256}.{i % 256}.0/24]\n" for i in range(1000)}),
        "keys-10000": configmap({f"k{i:05d}": "x" * 80 for i in range(10000)}),
        "other-namespace-1mib": configmap({"config": "nonMasqueradeCIDRs:\n" + cidrs}, namespace="default"),
        "near-miss-name-1mib": configmap({"config": "nonMasqueradeCIDRs:\n" + cidrs}, name="ip-masq-agnet"),
        "one-long-line-1mib": configmap({"config": "nonMasqueradeCIDRs: [" + "9" * (budget - 40) + "]\n"}),
        "control-characters": configmap({"config": "nonMasqueradeCIDRs:\n  - \"10.0.0.0/8\x1b[2J\x07\"\n"}),
    })
    return cases
