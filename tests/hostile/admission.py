"""The hostile corpus as ConfigMaps: what the webhook may be sent, each as the API server would store it.

Every committed hostile config (tests/hostile/config/) as the agent's ConfigMap (text in data, bytes that are not
UTF-8 in binaryData, as `kubectl create configmap --from-file` puts them), and the ConfigMap-sized cases: 1 MiB of
CIDRs (refused by the limit, and linted whole with the limit raised), nesting and aliases at 1 MiB, 1 MiB of random
bytes, a thousand config files in the directory form, ten thousand keys, and 1 MiB in a ConfigMap of another
namespace; half a million tiny values, rules by the thousand (plain, overlapping, of a real shape). Each stays
within the API server's 1 MiB limit for a ConfigMap's data.
"""

from __future__ import annotations

import base64
import random
from typing import Any

from tests.hostile.generated import HERE, deep_json, deep_yaml

__all__ = ["CONFIGMAP_LIMIT", "configmap", "hostile_configmaps", "overlapping_rules", "plain_rules", "real_rules"]

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


def plain_rules(n: int) -> str:
    """n rules, each to a /24 of its own: nothing overlaps."""
    return "rules:\n" + "".join(f"  - name: r{i}\n    destinations: [10.{i >> 8 & 255}.{i & 255}.0/24]\n"
                                 "    action: masquerade\n" for i in range(n))


def overlapping_rules(n: int) -> str:
    """n rules whose destinations nest in each other (10/8 down to /31), each on a port of its own."""
    return "rules:\n" + "".join(f"  - name: r{i}\n    destinations: [10.0.0.0/{8 + i % 24}]\n    protocol: tcp\n"
                                 f"    ports: [\"{1 + i}\"]\n    action: masquerade\n" for i in range(n))


def real_rules(n: int, seed: int = 1) -> str:
    """n rules of the shape real ones have: endpoints and subnets of private and partner ranges, most with pod
    sources, half with a protocol and ports, a tenth on a node pool, actions of every kind."""
    rng = random.Random(seed)
    lines = ["nonMasqueradeCIDRs: [10.0.0.0/8, 172.16.0.0/12, 192.168.0.0/16]", "rules:"]
    for i in range(n):
        base, bits = rng.choice([(10 << 24, 24), (172 << 24 | 16 << 16, 20), (192 << 24 | 168 << 16, 16),
                                 (203 << 24, 24)])
        length = rng.choice([32, 32, 28, 24, 20, 16])
        address = (base | rng.getrandbits(bits)) & ~((1 << (32 - length)) - 1) & 0xFFFFFFFF
        lines += [f"  - name: rule-{i:04d}", f"    destinations: [{_dotted(address)}/{length}]"]
        if rng.random() < 0.7:
            lines.append(f"    sources: [10.44.{rng.randrange(256)}.0/24]" if rng.random() < 0.5 else
                         "    sources: [10.44.0.0/14]")
        if rng.random() < 0.5:
            lines.append(f"    protocol: {rng.choice(['tcp', 'udp'])}")
            lines.append(f"    ports: [\"{rng.choice(['443', '5432', '8000-8100', '53'])}\"]")
        if rng.random() < 0.1:
            lines.append('    nodes: ["gke-prod-egress-*"]')
        action = rng.choice(["masquerade", "preserve", "snat"])
        lines.append(f"    action: {action}")
        if action == "snat":
            lines.append("    snatTo: 10.142.15.204")
    return "\n".join(lines) + "\n"


def _dotted(address: int) -> str:
    return ".".join(str(address >> shift & 255) for shift in (24, 16, 8, 0))


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
        "values-1mib": configmap({"config": "x: [" + "1," * ((budget - 10) // 2) + "1]\n"}),
        "empty-maps-1mib": configmap({"config": "x: [" + "{}," * ((budget - 10) // 3) + "{}]\n"}),
        "rules-1600-plain": configmap({"config": plain_rules(1600)}),
        "rules-200-overlapping": configmap({"config": overlapping_rules(200)}),
        "rules-1000-real": configmap({"config": real_rules(1000)}),
    })
    return cases
