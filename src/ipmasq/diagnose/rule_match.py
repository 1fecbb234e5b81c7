"""Whether an iptables rule's tests hold for a packet, as the kernel's would: its conditions (-s, -d, -i, -o, -p, each
possibly negated), its matches (comment, addrtype LOCAL, mark, the port matches and multiport) and MARK's arithmetic.
A test the packet description leaves open (its source, interface, protocol or port unknown), or one not understood,
raises Undecidable naming the missing field; all_hold lets a test that surely fails decide before that. The nat walk
(ipmasq.diagnose.trace) and the mangle walk (ipmasq.diagnose.mangle) both test rules here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from functools import lru_cache, partial

from ipmasq.errors import PrefixError, Undecidable
from ipmasq.netfilter.iptables import Condition, IptablesRule, Match
from ipmasq.policy.packet import Packet
from ipmasq.prefix import Family, Prefix, parse_cidr

__all__ = ["PORT_MATCHES", "PROTOCOL_NUMBERS", "all_hold", "apply_mark", "cidr_or_none", "condition_holds",
           "is_local", "match_holds", "port_test_ranges", "rule_holds", "tests_ports"]

PROTOCOL_NUMBERS = {"tcp": 6, "udp": 17, "icmp": 1, "sctp": 132, "icmpv6": 58, "ipv6-icmp": 58, "udplite": 136}
_LOOPBACK = {Family.V4: parse_cidr("127.0.0.0/8"), Family.V6: parse_cidr("::1/128")}
PORT_MATCHES = frozenset({"tcp", "udp", "sctp", "udplite", "dccp"})
_PORT_OPTIONS = {"--dport": "dport", "--destination-port": "dport", "--sport": "sport", "--source-port": "sport"}
_MULTIPORT_OPTIONS = {"--dports": "dport", "--destination-ports": "dport", "--sports": "sport",
                      "--source-ports": "sport", "--ports": "either"}


@lru_cache(maxsize=4096)  # check traces the same few foreign rules once per destination interval
def cidr_or_none(text: str) -> Prefix | None:
    try:
        return parse_cidr(text)
    except PrefixError:
        return None


def _prefix(text: str, family: Family) -> Prefix:
    prefix = cidr_or_none(text)
    if prefix is None:
        raise Undecidable(f"cannot read address {text!r}")
    if prefix.family is not family:
        raise Undecidable(f"{text} is not an IPv{family.value} prefix")
    return prefix


def _source_in(packet: Packet, prefix: Prefix) -> bool:
    if not packet.source:
        raise Undecidable(f"the packet's source is unknown and this rule tests -s {prefix}")
    inside = [prefix.covers(s) for s in packet.source]
    if all(inside):
        return True
    if not any(prefix.covers(s) or s.covers(prefix) for s in packet.source):
        return False
    raise Undecidable(f"-s {prefix} covers only part of the source range {', '.join(map(str, packet.source))}")


def _interface_is(name: str | None, pattern: str, option: str) -> bool:
    if name is None:
        flag = "--out-interface" if option == "-o" else "--in-interface"
        raise Undecidable(f"the rule tests {option} {pattern} and the packet's interface is unknown (give {flag})")
    return name.startswith(pattern[:-1]) if pattern.endswith("+") else name == pattern


def _protocol_is(protocol: str | None, value: str) -> bool:
    value = value.lower()
    if value in ("all", "0"):
        return True
    wanted = PROTOCOL_NUMBERS.get(value, int(value) if value.isdigit() else None)
    if wanted is None:
        raise Undecidable(f"protocol {value!r} is not known")
    if protocol is None:
        raise Undecidable(f"the rule tests -p {value} and the packet's protocol is not given (give --protocol)")
    return PROTOCOL_NUMBERS.get(protocol, int(protocol) if protocol.isdigit() else -1) == wanted


def condition_holds(c: Condition, packet: Packet) -> bool:
    if c.option == "-d":
        hit = _prefix(c.value, packet.family).contains(packet.destination)
    elif c.option == "-s":
        hit = _source_in(packet, _prefix(c.value, packet.family))
    elif c.option in ("-o", "-i"):
        hit = _interface_is(packet.out_interface if c.option == "-o" else packet.in_interface, c.value, c.option)
    elif c.option == "-p":
        hit = _protocol_is(packet.protocol, c.value)
    else:
        raise Undecidable(f"condition {c.option} is not understood by trace")
    return hit != c.negated


def rule_holds(rule: IptablesRule, packet: Packet, mark: int) -> bool:
    """All tests of the rule (all_hold)."""
    tests: list[Callable[[], bool]] = [partial(condition_holds, c, packet) for c in rule.conditions]
    tests += [partial(match_holds, m, packet, mark) for m in rule.matches]
    return all_hold(tests)


def all_hold(tests: Iterable[Callable[[], bool]]) -> bool:
    """Whether every test holds; a test that surely fails decides even when another one cannot be evaluated (its
    Undecidable is raised only when no test fails)."""
    undecidable: Undecidable | None = None
    for test in tests:
        try:
            hit = test()
        except Undecidable as exc:
            undecidable = undecidable or exc
            continue
        if not hit:
            return False
    if undecidable is not None:
        raise undecidable
    return True


def _negatable(args: tuple[str, ...], what: str) -> list[tuple[str, str, bool]]:
    """A match's options as (option, value, negated), e.g. ("--dst-type", "LOCAL", True)."""
    out = []
    i = 0
    while i < len(args):
        negated = args[i] == "!"
        at = i + 1 if negated else i
        if at + 1 >= len(args) or not args[at].startswith("--"):
            raise Undecidable(f"cannot read -m {what} {' '.join(args)}")
        out.append((args[at], args[at + 1], negated))
        i = at + 2
    return out


def match_holds(match: Match, packet: Packet, mark: int) -> bool:
    if match.name == "comment":
        return True
    if match.name == "addrtype":
        for option, value, negated in _negatable(match.args, "addrtype"):
            if option not in ("--dst-type", "--src-type") or value != "LOCAL":
                raise Undecidable(f"-m addrtype {option} {value}: only --dst-type/--src-type LOCAL is understood")
            if option == "--dst-type":
                local = is_local(packet, packet.destination)
            else:
                if not packet.source:
                    raise Undecidable("the packet's source is unknown and this rule tests --src-type LOCAL")
                local = all(s.length == packet.family.bits and is_local(packet, s.network) for s in packet.source)
            if local == negated:
                return False
        return True
    if match.name == "mark":
        for option, value, negated in _negatable(match.args, "mark"):
            if option != "--mark":
                raise Undecidable(f"-m mark {option} is not understood")
            wanted, mask = _value_mask(value, default_mask=0xFFFFFFFF)
            if ((mark & mask) == wanted) == negated:
                return False
        return True
    if match.name in PORT_MATCHES:
        for option, value, negated in _negatable(match.args, match.name):
            which = _PORT_OPTIONS.get(option)
            if which is None:
                raise Undecidable(f"-m {match.name} {option} is not understood by trace")
            if _port_in(packet, which, _port_ranges(value, option)) == negated:
                return False
        return True
    if match.name == "multiport":
        for option, value, negated in _negatable(match.args, "multiport"):
            which = _MULTIPORT_OPTIONS.get(option)
            if which is None:
                raise Undecidable(f"-m multiport {option} is not understood by trace")
            ranges = [r for item in value.split(",") for r in _port_ranges(item, option)]
            if _port_in(packet, which, ranges) == negated:
                return False
        return True
    raise Undecidable(f"-m {match.name} is not understood by trace")


def tests_ports(rule: IptablesRule) -> bool:
    """The rule has a port match (check splits the traffic its destinations get by port)."""
    return any(m.name in PORT_MATCHES or m.name == "multiport" for m in rule.matches)


def port_test_ranges(rule: IptablesRule) -> list[tuple[int, int]]:
    """The destination port ranges the rule's port matches test (what check splits ports at); unreadable ones are
    left out here, the walk reports them."""
    out = []
    for match in rule.matches:
        options = _PORT_OPTIONS if match.name in PORT_MATCHES else _MULTIPORT_OPTIONS if match.name == "multiport" \
            else None
        if options is None:
            continue
        try:
            for option, value, _ in _negatable(match.args, match.name):
                if options.get(option) in ("dport", "either"):
                    out += [r for item in value.split(",") for r in _port_ranges(item, option)]
        except Undecidable:
            continue
    return out


def _port_ranges(text: str, option: str) -> list[tuple[int, int]]:
    """`80`, `8000:8080`, `:1024` or `1024:` as an inclusive range (iptables' forms for a port or a range)."""
    low, colon, high = text.partition(":")
    try:
        first = int(low) if low else 0
        last = (int(high) if high else 65535) if colon else first
    except ValueError:
        raise Undecidable(f"cannot read port {text!r} of {option}") from None
    if not 0 <= first <= 65535 or not 0 <= last <= 65535:
        raise Undecidable(f"port {text!r} of {option} is out of range")
    return [(min(first, last), max(first, last))]  # iptables swaps an inverted range


def _port_in(packet: Packet, which: str, ranges: list[tuple[int, int]]) -> bool:
    shown = ",".join(str(a) if a == b else f"{a}:{b}" for a, b in ranges)
    ports = []
    if which in ("dport", "either"):
        if packet.port is None:
            raise Undecidable(f"the rule tests destination port {shown} and the packet's port is not given "
                               "(give --port)")
        ports.append(packet.port)
    if which in ("sport", "either"):
        if packet.source_port is None:
            raise Undecidable(f"the rule tests source port {shown} and the packet's source port is not given "
                               "(give --source-port)")
        ports.append(packet.source_port)
    return any(low <= port <= high for port in ports for low, high in ranges)


def is_local(packet: Packet, address: int) -> bool:
    # the node's own addresses (--local-address) and loopback are what routing types LOCAL
    return address in packet.local_addresses or _LOOPBACK[packet.family].contains(address)


def _value_mask(text: str, *, default_mask: int) -> tuple[int, int]:
    value, _, mask = text.partition("/")
    try:
        return int(value, 0), (int(mask, 0) if mask else default_mask)
    except ValueError:
        raise Undecidable(f"cannot read mark {text!r}") from None


def apply_mark(rule: IptablesRule, mark: int) -> int:
    args = rule.target_args
    if len(args) != 2:
        raise Undecidable(f"cannot read MARK {' '.join(args)}")
    option, value = args
    if option == "--set-xmark":
        v, m = _value_mask(value, default_mask=0xFFFFFFFF)
        return (mark & ~m & 0xFFFFFFFF) ^ v
    if option == "--set-mark":
        v, m = _value_mask(value, default_mask=0xFFFFFFFF)
        return (mark & ~m & 0xFFFFFFFF) | v
    number, _ = _value_mask(value, default_mask=0)
    if option == "--or-mark":
        return mark | number
    if option == "--and-mark":
        return mark & number
    if option == "--xor-mark":
        return mark ^ number
    raise Undecidable(f"MARK {option} is not understood")
