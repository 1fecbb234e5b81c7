"""A lab node's facts, written to a directory, so that trace can be run on them offline and compared with what the
peers saw.

    routing.json          { ip -j -4 rule; ip -j -6 rule; ip -j route show table all; ip -j addr; }
                          (the routing dump docs/concepts/path.md gives as the one line that captures a node)
    iptables.save         iptables-save (every table: nat and mangle among them)
    ip6tables.save        ip6tables-save
    ruleset.json          nft -j list ruleset
    probes.json           each probe: the pod's address, the node interface its packets arrive by, destination,
                          protocol and port, the source the scenario expects the packet to leave the node with
                          (node_source) and the peer to see (expected_source), the one the peer saw, and what
                          trace on the node predicted (traced_source)

The commands are those a user runs on a node (read-only), run in the node's namespace; the routing commands are the
ones `ipmasq trace` runs on a live node (ipmasq.diagnose.path_sources). `ipmasq trace DEST --source POD --protocol
tcp --port P --routes routing.json --dump iptables.save --dump ruleset.json` reads a phase's files as they are
(ip6tables.save for an IPv6 destination).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from ipmasq.diagnose.path_sources import ROUTING_COMMANDS
from ipmasq.lab.netns import Namespace

__all__ = ["FACT_FILES", "dump_node_facts", "write_probes"]

FACT_FILES: dict[str, tuple[str, ...]] = {
    "iptables.save": ("iptables-save",),
    "ip6tables.save": ("ip6tables-save",),
    "ruleset.json": ("nft", "-j", "list", "ruleset"),
}


def dump_node_facts(node: Namespace, directory: Path) -> None:
    """The node's routing and netfilter as its tools print them, one file each (see the module's docstring)."""
    directory.mkdir(parents=True, exist_ok=True)
    routing = [node.run(list(argv)).stdout.strip() or "[]" for argv in ROUTING_COMMANDS]
    (directory / "routing.json").write_text("\n".join(routing) + "\n")
    for name, argv in FACT_FILES.items():
        (directory / name).write_text(node.run(list(argv)).stdout)


def write_probes(directory: Path, probes: Sequence[dict[str, object]]) -> None:
    """probes.json: the packets the pods sent, what trace predicted and what their peers saw."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "probes.json").write_text(json.dumps(list(probes), indent=1) + "\n")
