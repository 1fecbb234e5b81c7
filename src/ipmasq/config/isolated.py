"""The node agent's config loading, in a short-lived child process: the agent never imports the YAML parser.

PyYAML (its loader, constructors, emitter and libyaml binding), the document reader and the validator are about
2 MiB of resident memory that a Python process never gives back once imported, against a node agent that reads its
config only when the file changes. So the agent hands the bytes it read to `python -m ipmasq.config.isolated`,
which runs the very same `config_from_bytes` and prints the validated config (or the ConfigError) as JSON; the agent
rebuilds the equal MasqConfig from it. The child lives for one load (~0.1 s of CPU) and its memory goes with it.

    stdin   one JSON line {"options": PolicyOptions fields, "files": [[source, length], ...]}, then the files' bytes
    stdout  one JSON object: {"config": ...} or {"error": {"message", "source", "line", "column", "code"}}

A ConfigError comes back as the same ConfigError (same one-line message, file, line, column and code). A child that
cannot run or dies (no memory, killed) is an IpmasqError naming what happened, one line: the agent logs it, stays
not ready and loads again at the next wakeup, keeping the last good rules meanwhile. SIGTERM while the child runs
stops the agent at once: the child is killed with it (subprocess.run kills it on any exception).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

from ipmasq.config.model import Entry, MasqConfig, Origin, Rule, RuleAction
from ipmasq.config.source import ConfigInput
from ipmasq.errors import ConfigError, IpmasqError, clip
from ipmasq.options import PolicyOptions, PortRange
from ipmasq.policy.prefix import Family, Prefix

__all__ = ["decode_config", "encode_config", "encode_options", "load_config_isolated", "main"]

_FAMILIES = {int(f): f for f in Family}
_ORIGINS = {o.value: o for o in Origin}
_ACTIONS = {a.value: a for a in RuleAction}


def load_config_isolated(config_input: ConfigInput, options: PolicyOptions) -> MasqConfig:
    """config_from_bytes(config_input, options), computed in a child process (see the module docstring)."""
    header = {"options": encode_options(options), "files": [[source, len(data)] for source, data in config_input.files]}
    request = json.dumps(header).encode() + b"\n" + b"".join(data for _, data in config_input.files)
    # the child imports this very package, wherever the agent found it (a venv, a source tree on PYTHONPATH)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
    try:
        done = subprocess.run([sys.executable, "-m", __name__], input=request, capture_output=True, env=env,
                              check=False)
    except OSError as exc:
        raise IpmasqError(f"config loader process could not start: {exc.strerror or exc}") from None
    try:
        answer = json.loads(done.stdout) if done.returncode == 0 else None
    except ValueError:
        answer = None
    if not isinstance(answer, dict):
        lines = done.stderr.decode(errors="replace").strip().splitlines()
        detail = f": {clip(lines[-1], 200)}" if lines else ""
        how = f"exit {done.returncode}" if done.returncode >= 0 else f"signal {-done.returncode}"
        raise IpmasqError(f"config loader process failed ({how}){detail}")
    if "error" in answer:
        e = answer["error"]
        raise ConfigError(e["message"], source=e["source"], line=e["line"], column=e["column"], code=e["code"])
    return decode_config(answer["config"])


def main() -> int:
    """The child: read the request on stdin, answer on stdout (exit 0 whenever there is an answer)."""
    from ipmasq.config.source import config_from_bytes

    data = sys.stdin.buffer.read()
    end = data.index(b"\n")
    header = json.loads(data[:end])
    files, at = [], end + 1
    for source, length in header["files"]:
        files.append((source, data[at:at + length]))
        at += length
    try:
        answer: dict[str, Any] = {"config": encode_config(config_from_bytes(ConfigInput(tuple(files)),
                                                                             decode_options(header["options"])))}
    except ConfigError as exc:
        answer = {"error": {"message": exc.message, "source": exc.source, "line": exc.line, "column": exc.column,
                            "code": exc.code}}
    sys.stdout.write(json.dumps(answer))
    return 0


def encode_options(options: PolicyOptions) -> dict[str, Any]:
    return {"masq_chain": options.masq_chain, "nomasq_all_reserved_ranges": options.nomasq_all_reserved_ranges,
            "enable_ipv6": options.enable_ipv6, "random_fully": options.random_fully,
            "to_ports": [[r.low, r.high] for r in options.to_ports], "node_name": options.node_name}


def decode_options(obj: dict[str, Any]) -> PolicyOptions:
    return PolicyOptions(**{**obj, "to_ports": tuple(PortRange(low, high) for low, high in obj["to_ports"])})


def encode_config(config: MasqConfig) -> dict[str, Any]:
    """JSON-ready; file names are indexes into "strings" (100,000 entries of one file name its path once)."""
    strings: dict[str | None, int | None] = {None: None}

    def ref(text: str | None) -> int | None:
        if text not in strings:
            strings[text] = len(strings) - 1
        return strings[text]

    def entries(items: tuple[Entry, ...]) -> list[list[Any]]:
        return [[int(e.prefix.family), e.prefix.network, e.prefix.length, e.masquerade, e.origin.value, ref(e.source),
                 e.line] for e in items]

    def prefixes(items: tuple[Prefix, ...]) -> list[list[int]]:
        return [[int(p.family), p.network, p.length] for p in items]

    rules = [{"name": r.name, "family": int(r.family), "destinations": prefixes(r.destinations),
              "action": r.action.value, "sources": prefixes(r.sources), "protocol": r.protocol,
              "ports": [list(p) for p in r.ports], "nodes": list(r.nodes), "snat_to": r.snat_to,
              "source": r.source, "line": r.line} for r in config.rules]
    encoded = {"non_masquerade": entries(config.non_masquerade), "masquerade": entries(config.masquerade),
               "cidr_limit": config.cidr_limit, "masq_link_local": config.masq_link_local,
               "masq_link_local_ipv6": config.masq_link_local_ipv6, "resync_interval": config.resync_interval,
               "sources": list(config.sources), "rules": rules, "enable_ipv6": config.enable_ipv6,
               "warnings": list(config.warnings)}
    encoded["strings"] = [text for text in strings if text is not None]
    return encoded


def decode_config(obj: dict[str, Any]) -> MasqConfig:
    """The MasqConfig encode_config was given, equal to it (tuples, enums and NamedTuples as the loader makes)."""
    strings: list[str] = obj["strings"]

    def entries(items: list[list[Any]]) -> tuple[Entry, ...]:
        return tuple(Entry(Prefix(_FAMILIES[f], network, length), masquerade, _ORIGINS[origin],
                           None if source is None else strings[source], line)
                     for f, network, length, masquerade, origin, source, line in items)

    def prefixes(items: list[list[int]]) -> tuple[Prefix, ...]:
        return tuple(Prefix(_FAMILIES[f], network, length) for f, network, length in items)

    rules = tuple(Rule(name=r["name"], family=_FAMILIES[r["family"]], destinations=prefixes(r["destinations"]),
                       action=_ACTIONS[r["action"]], sources=prefixes(r["sources"]), protocol=r["protocol"],
                       ports=tuple((low, high) for low, high in r["ports"]), nodes=tuple(r["nodes"]),
                       snat_to=r["snat_to"], source=r["source"], line=r["line"]) for r in obj["rules"])
    return MasqConfig(non_masquerade=entries(obj["non_masquerade"]), masquerade=entries(obj["masquerade"]),
                      cidr_limit=obj["cidr_limit"], masq_link_local=obj["masq_link_local"],
                      masq_link_local_ipv6=obj["masq_link_local_ipv6"], resync_interval=obj["resync_interval"],
                      sources=tuple(obj["sources"]), rules=rules, enable_ipv6=obj["enable_ipv6"],
                      warnings=tuple(obj["warnings"]))


if __name__ == "__main__":
    raise SystemExit(main())
