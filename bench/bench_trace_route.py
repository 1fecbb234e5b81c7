"""Benchmark the path model: `trace`'s question on nodes of 100 to 1,000 ip rules and 10,000 to 100,000 routes,
side by side with reading the node's rules and routes.

    .venv/bin/python bench/bench_trace_route.py [--sizes 100:10000,300:30000,1000:100000] [--rounds 3]

As root, each node is a network namespace holding the rules and routes (added with `ip -batch`), read as trace
reads it (`ip -j -4 rule; ip -j -6 rule; ip -j route show table all; ip -j addr`, parsed: "read"; the programs
alone: "ip -j"); without root, the same node as iproute2's JSON, generated, and "read" is parsing it. "answer" is
one question after the read: the Fib
built (indexes of every table) and the whole path of a pod's packet that meets every rule before the main table's
routes decide (the lookup's worst case), mangle and nat included. Targets: the answer within 5x the read (the
read is what a person waits for anyway), and both growing linearly at most (the per-route cost flat across sizes).
Figures: docs/measurements.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

from ipmasq.diagnose.path import PathFacts, path
from ipmasq.diagnose.path_sources import ROUTING_COMMANDS, read_live_routing
from ipmasq.lab.netns import NamespaceRunner, network
from ipmasq.netfilter.iptables import parse_save
from ipmasq.policy.packet import Packet
from ipmasq.prefix import Family
from ipmasq.route.facts import Routing
from ipmasq.route.iproute2 import parse_routing

NAT = "*nat\n:POSTROUTING ACCEPT [0:0]\n-A POSTROUTING ! -d 10.0.0.0/8 -j MASQUERADE\nCOMMIT\n"
PACKET = Packet.of("198.51.100.10", source="10.44.0.5", protocol="tcp", port=443)
TARGET_RATIO = 5.0


def _route_prefix(j: int) -> str:
    # distinct prefixes of several lengths inside 100.64.0.0/10: every length is a probe of the lookup
    length = (24, 28, 32)[j % 3]
    base = 0x64400000 + (j << 8)
    base &= ~((1 << (32 - length)) - 1)
    return f"{base >> 24}.{(base >> 16) & 255}.{(base >> 8) & 255}.{base & 255}/{length}"


def _rule_words(i: int) -> list[str]:
    # rules the packet passes without matching: other destinations, other marks, other sources
    kind = i % 3
    if kind == 0:
        return ["to", f"198.18.{i % 256}.0/24", "lookup", str(100 + i % 200)]
    if kind == 1:
        return ["fwmark", f"{0x1000 + i:#x}/0xffff", "lookup", str(100 + i % 200)]
    return ["from", f"10.{100 + i % 100}.{i % 256}.0/24", "lookup", str(100 + i % 200)]


def _synthetic(rules: int, routes: int) -> str:
    """The node as iproute2 would print it."""
    rule_items: list[dict[str, Any]] = [{"priority": 0, "src": "all", "table": "local"}]
    for i in range(rules):
        words = _rule_words(i)
        item: dict[str, Any] = {"priority": 1000 + i, "src": "all", "table": words[-1]}
        if words[0] == "to":
            item.update(dst=words[1].split("/")[0], dstlen=24)
        elif words[0] == "from":
            item.update(src=words[1].split("/")[0], srclen=24)
        else:
            item.update(fwmark=words[1].split("/")[0], fwmask="0xffff")
        rule_items.append(item)
    rule_items += [{"priority": 32766, "src": "all", "table": "main"},
                   {"priority": 32767, "src": "all", "table": "default"}]
    route_items = [{"dst": "default", "gateway": "192.168.10.1", "dev": "eth0", "flags": []},
                   {"dst": "192.168.10.0/24", "dev": "eth0", "scope": "link", "flags": []},
                   {"dst": "10.44.0.0/24", "dev": "cni0", "scope": "link", "flags": []}]
    route_items += [{"dst": _route_prefix(j), "gateway": "192.168.10.1", "dev": "eth0",
                     **({"table": str(100 + j % 200)} if j % 2 else {}), "flags": []} for j in range(routes)]
    links = [{"ifindex": 1, "ifname": "lo", "flags": ["UP"], "addr_info": [
                 {"family": "inet", "local": "127.0.0.1", "prefixlen": 8, "scope": "host"}]},
             {"ifindex": 2, "ifname": "eth0", "flags": ["UP"], "addr_info": [
                 {"family": "inet", "local": "192.168.10.2", "prefixlen": 24, "scope": "global"}]},
             {"ifindex": 3, "ifname": "cni0", "flags": ["UP"], "addr_info": [
                 {"family": "inet", "local": "10.44.0.1", "prefixlen": 24, "scope": "global"}]}]
    return "\n".join(json.dumps(a) for a in (rule_items, [], route_items, links))


@contextmanager
def _namespace(rules: int, routes: int) -> Any:
    with network() as net:
        node = net.add("node")
        pod = net.add("pod")
        net.link(node, ["192.168.10.2/24"], pod, ["192.168.10.1/24"])  # eth0's stand-in
        net.link(node, ["10.44.0.1/24"], pod, ["10.44.0.9/24"])  # cni0's stand-in
        lines = ["route add default via 192.168.10.1"]
        lines += [f"route add {_route_prefix(j)} via 192.168.10.1" + (f" table {100 + j % 200}" if j % 2 else "")
                  for j in range(routes)]
        lines += [f"rule add priority {1000 + i} {' '.join(_rule_words(i))}" for i in range(rules)]
        node.run(["ip", "-batch", "-"], stdin="\n".join(lines) + "\n", timeout=600)
        yield node


def _best(rounds: int, work: Callable[[], object]) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="100:10000,300:30000,1000:100000")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    sizes = [tuple(int(n) for n in size.split(":")) for size in args.sizes.split(",")]
    live = os.geteuid() == 0
    nat = {Family.V4: parse_save(NAT)}
    print(f"mode: {'live namespaces (ip -j)' if live else 'generated JSON (not root)'}; best of {args.rounds}")
    print(f"{'rules':>6} {'routes':>8} {'ip -j s':>8} {'read s':>8} {'answer s':>9} {'answer/read':>12} "
          f"{'read us/route':>14} {'answer us/route':>16}  answer")
    failed = False
    for rules, routes in sizes:
        holder: dict[str, Routing] = {}
        if live:
            with _namespace(rules, routes) as node:
                runner = NamespaceRunner(node, timeout=300)

                def read(runner: NamespaceRunner = runner, holder: dict[str, Routing] = holder) -> None:
                    holder["routing"] = read_live_routing(runner)

                read_s = _best(args.rounds, read)
                programs_s = _best(args.rounds, lambda runner=runner: [runner(argv) for argv in ROUTING_COMMANDS])
        else:
            programs_s = 0.0
            text = _synthetic(rules, routes)

            def read(text: str = text, holder: dict[str, Routing] = holder) -> None:
                holder["routing"] = parse_routing(text, "generated")

            read_s = _best(args.rounds, read)
        routing = holder["routing"]
        assert len(routing.rules) >= rules and len(routing.routes) >= routes, (len(routing.rules), len(routing.routes))
        answers: list[str | None] = []

        def answer(routing: Routing = routing, answers: list[str | None] = answers) -> None:
            result = path(PathFacts(routing, nat), PACKET)
            answers.append(result.source_seen)

        answer_s = _best(args.rounds, answer)
        ratio = answer_s / read_s
        failed |= ratio > TARGET_RATIO or answers[-1] is None
        print(f"{rules:>6} {routes:>8} {programs_s:>8.3f} {read_s:>8.3f} {answer_s:>9.3f} {ratio:>12.2f} "
              f"{read_s / routes * 1e6:>14.2f} {answer_s / routes * 1e6:>16.2f}  {answers[-1]}")
    print(f"target: answer/read <= {TARGET_RATIO}: {'missed' if failed else 'met'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(__file__))
    raise SystemExit(main())
