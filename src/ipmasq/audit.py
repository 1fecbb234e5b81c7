"""`audit`: which flows in VPC flow logs left a node with a pod source address, and what a config does to them now.

Formats (detected per file, gzip or plain):
- AWS VPC flow logs, default format (version 2: `version account-id interface-id srcaddr dstaddr srcport dstport
  protocol packets bytes start end action log-status`), with or without the header line; a header naming other
  fields (a custom format) is followed; a leading timestamp column (CloudWatch's console/export) is dropped.
  NODATA/SKIPDATA records carry no addresses and are counted as skipped.
- GCP VPC flow logs as JSON lines: Cloud Logging entries (`jsonPayload.connection.src_ip/dest_ip`) or bare
  payloads; `disposition` (firewall rule logging: ALLOWED/DENIED) gives the action when present.

Reading counts (source, destination, action) triples first and parses each distinct address once, because
flow logs repeat the same few conversations millions of times.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from enum import Enum
from typing import IO, Any

from ipmasq.errors import FlowLogError, NotAFile, NoWriter, clip
from ipmasq.input_files import open_input
from ipmasq.policy.policy import Policy, PolicyVerdict, Reason
from ipmasq.prefix import Family, Prefix, format_address, parse_address

__all__ = ["AuditReport", "FlowAction", "Group", "RawCounts", "audit", "count_flows"]

AWS_DEFAULT_FIELDS = ("version", "account-id", "interface-id", "srcaddr", "dstaddr", "srcport", "dstport",
                      "protocol", "packets", "bytes", "start", "end", "action", "log-status")
_GZIP_MAGIC = b"\x1f\x8b"


class FlowAction(Enum):
    ACCEPT = "ACCEPT"
    REJECT = "REJECT"
    UNKNOWN = "-"  # GCP's VPC flow logs record no verdict


_ACTIONS = {"ACCEPT": FlowAction.ACCEPT, "REJECT": FlowAction.REJECT, "ALLOWED": FlowAction.ACCEPT,
            "DENIED": FlowAction.REJECT, "-": FlowAction.UNKNOWN}


@dataclass
class RawCounts:
    """Pod-source flows: (source text, destination text, action text) -> [flows, file, line of the first one]."""

    counts: dict[tuple[str, str, str], list[Any]]
    records: int = 0
    skipped: int = 0


# A flow log record is a few hundred bytes; a longer line (a file without newlines, a gzip of one endless line)
# would be held in memory whole before any check could refuse it.
MAX_FLOW_LINE = 1 << 20


def _open(path: str) -> IO[str]:
    """A flow log as text, gunzipped when it is gzip (by its magic bytes, not its name); `-` is stdin.

    Opened once and peeked at, so that a pipe (`audit <(zcat ...)`) loses nothing to the sniffing; a FIFO is
    opened without waiting for a writer; a device, socket or directory is refused before it is read.
    """
    raw: io.RawIOBase
    if path == "-":
        # its own buffered reader over fd 0, to peek at the magic bytes (closing it leaves stdin open)
        raw = io.FileIO(sys.stdin.fileno(), closefd=False)
    else:
        try:
            fd, _, first = open_input(path)
        except OSError as exc:
            raise FlowLogError(f"{path}: {exc.strerror}") from None
        except NotAFile as exc:
            raise FlowLogError(f"{path}: {exc}, not a flow log file: not read") from None
        except NoWriter:
            raise FlowLogError(f"{path}: a FIFO that no process writes to: nothing to read") from None
        raw = _AfterFirst(first, fd)
    stream = io.BufferedReader(raw)
    try:
        magic = stream.peek(2)[:2]
    except OSError as exc:
        stream.close()
        raise FlowLogError(f"{path}: {exc.strerror}") from None
    if magic == _GZIP_MAGIC:
        return io.TextIOWrapper(gzip.GzipFile(fileobj=stream), encoding="utf-8", errors="replace")
    return io.TextIOWrapper(stream, encoding="utf-8", errors="replace")


class _AfterFirst(io.RawIOBase):
    """An open file read from its start: the bytes already taken from it (a FIFO's probe), then the rest."""

    def __init__(self, first: bytes, fd: int) -> None:
        super().__init__()
        self._first = memoryview(first)
        self._fd = fd

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any, /) -> int:
        if self._first:
            taken = min(len(buffer), len(self._first))
            buffer[:taken] = self._first[:taken]
            self._first = self._first[taken:]
            return taken
        return os.readv(self._fd, [buffer])

    def close(self) -> None:
        if not self.closed:
            os.close(self._fd)
        super().close()


def _lines(fh: IO[str], path: str) -> Iterator[str]:
    """The lines of `fh`, each read with a bound: a line past MAX_FLOW_LINE is an error, not a memory cost."""
    readline = fh.readline
    number = 0
    while line := readline(MAX_FLOW_LINE + 1):
        number += 1
        if len(line) > MAX_FLOW_LINE:
            raise FlowLogError(f"{path}:{number}: a line longer than {MAX_FLOW_LINE:,} characters: no flow log record "
                               f"is; it starts {clip(repr(line[:200]))}")
        yield line


class _PodSources:
    """Is this source text a pod address? Each distinct text is parsed once."""

    def __init__(self, ranges: tuple[Prefix, ...]) -> None:
        self.ranges = ranges
        self.known: dict[str, bool] = {}

    def check(self, text: str, path: str, number: int) -> bool:
        try:
            family, address = parse_address(text)
        except ValueError:
            raise FlowLogError(f"{path}:{number}: source {clip(repr(text))} is not an IP address") from None
        pod = self.known[text] = _in_ranges(family, address, self.ranges)
        return pod


def count_flows(paths: Iterable[str], pod_ranges: tuple[Prefix, ...]) -> RawCounts:
    """Read the files, keep the records whose source is in `pod_ranges`, count them by (src, dst, action)."""
    raw = RawCounts({})
    pods = _PodSources(pod_ranges)
    for given in paths:
        fh = _open(given)
        path = "<stdin>" if given == "-" else given  # as messages name it
        try:
            with fh:
                lines = _lines(fh, path)
                first = _first_line(lines)
                if first is None:
                    continue
                if first[1].lstrip().startswith("{"):
                    _count_gcp(path, first, lines, raw, pods)
                else:
                    _count_aws(path, first, lines, raw, pods)
        except (OSError, EOFError, gzip.BadGzipFile) as exc:
            raise FlowLogError(f"{path}: cannot read: {exc}") from None
    return raw


def _first_line(fh: Iterator[str]) -> tuple[int, str] | None:
    for number, line in enumerate(fh, start=1):
        if line.strip():
            return number, line
    return None


class _AwsFormat:
    """Where the fields are: the default format, or the one a header line names."""

    def __init__(self, fields: tuple[str, ...] = AWS_DEFAULT_FIELDS) -> None:
        self.fields = fields
        self.src = fields.index("srcaddr")
        self.dst = fields.index("dstaddr")
        self.action = fields.index("action") if "action" in fields else -1
        self.width = len(fields)


def _count_aws(path: str, first: tuple[int, str], fh: Iterator[str], raw: RawCounts, pods: _PodSources) -> None:
    fmt = _AwsFormat()
    counts = raw.counts
    known = pods.known
    records = skipped = 0
    number = first[0] - 1

    def unusual(parts: list[str]) -> list[str] | None:
        """A header (switches the format), or a timestamp-prefixed record; None: skip the line."""
        nonlocal fmt
        if not parts:
            return None
        if "srcaddr" in parts and "dstaddr" in parts:
            fmt = _AwsFormat(tuple(parts))
            return None
        if len(parts) == fmt.width + 1 and "T" in parts[0] and ":" in parts[0]:
            return parts[1:]  # CloudWatch prints the event's timestamp first
        raise FlowLogError(f"{path}:{number}: not an AWS flow log record ({fmt.width} fields: "
                           f"{' '.join(fmt.fields[:5])} ...): {clip(repr(' '.join(parts)))}")

    for line in _prepend(first[1], fh):
        number += 1
        parts = line.split()
        if len(parts) != fmt.width or parts[fmt.src] == "srcaddr":
            found = unusual(parts)
            if found is None:
                continue
            parts = found
        records += 1
        src = parts[fmt.src]
        pod = known.get(src)
        if pod is None:
            if src == "-":  # NODATA / SKIPDATA
                skipped += 1
                continue
            pod = pods.check(src, path, number)
        if not pod:
            continue
        key = (src, parts[fmt.dst], parts[fmt.action] if fmt.action >= 0 else "-")
        entry = counts.get(key)
        if entry is None:
            counts[key] = [1, path, number]
        else:
            entry[0] += 1
    raw.records += records - skipped
    raw.skipped += skipped


def _prepend(first: str, fh: Iterator[str]) -> Iterator[str]:
    yield first
    yield from fh


def _json_loads() -> Callable[[str], Any]:
    """orjson when installed (the `audit` extra): GCP records are JSON, and json.loads alone caps the rate."""
    try:
        import orjson
    except ImportError:
        return json.loads
    loads: Callable[[str], Any] = orjson.loads
    return loads


def _count_gcp(path: str, first: tuple[int, str], fh: Iterator[str], raw: RawCounts, pods: _PodSources) -> None:
    counts = raw.counts
    known = pods.known
    loads = _json_loads()
    number = first[0] - 1
    for line in _prepend(first[1], fh):
        number += 1
        if not line.strip():
            continue
        try:
            entry = loads(line)
            payload = entry.get("jsonPayload", entry)
            connection = payload["connection"]
            src = connection["src_ip"]
            dst = connection["dest_ip"]
            if type(src) is not str or type(dst) is not str:
                raise TypeError("addresses must be strings")
            key = (src, dst, str(payload.get("disposition", "-")))
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError):  # orjson's errors are ValueErrors
            raise FlowLogError(f"{path}:{number}: not a GCP VPC flow log JSON record with "
                               f"connection.src_ip/dest_ip strings: {clip(repr(line.strip()))}") from None
        raw.records += 1
        pod = known.get(src)
        if pod is None:
            pod = pods.check(src, path, number)
        if not pod:
            continue
        found = counts.get(key)
        if found is None:
            counts[key] = [1, path, number]
        else:
            found[0] += 1


@dataclass(frozen=True, slots=True)
class Group:
    """Pod-source flows to one destination prefix, and what the config does to that prefix now."""

    destination: Prefix
    flows: int
    accepted: int
    rejected: int
    unknown: int
    sources: tuple[str, ...]  # distinct pod sources, sorted (at most 5 kept)
    source_count: int
    masquerade: bool | None  # None: the config treats addresses of this group differently
    matched: tuple[str, ...]  # the prefixes of the config that decided ("catch-all" for the final rule)
    reasons: tuple[str, ...]

    @property
    def shown(self) -> str:
        """The prefix, or the bare address when it is a single host (as flow logs show it)."""
        prefix = self.destination
        if prefix.length == prefix.family.bits:
            return format_address(prefix.family, prefix.network)
        return str(prefix)

    @property
    def status(self) -> str:
        if self.rejected and not self.accepted and not self.unknown:
            return "rejected"
        if self.accepted and not self.rejected and not self.unknown:
            return "accepted"
        if not self.accepted and not self.rejected:
            return "no verdict in the log"
        return f"{self.accepted} accepted, {self.rejected} rejected"

    @property
    def with_config(self) -> str:
        if self.masquerade is None:
            return "some masqueraded, some not"
        return "masqueraded" if self.masquerade else "not masqueraded (still the pod IP)"

    @property
    def still_failing(self) -> bool:
        """Rejected flows that this config would still send with the pod IP: the problem stays."""
        return self.rejected > 0 and self.masquerade is not True


@dataclass(frozen=True, slots=True)
class AuditReport:
    records: int
    skipped: int
    pod_flows: int
    groups: tuple[Group, ...]


@dataclass
class _Tally:
    flows: int = 0
    by_action: dict[FlowAction, int] = field(default_factory=lambda: dict.fromkeys(FlowAction, 0))
    sources: set[str] = field(default_factory=set)
    addresses: set[int] = field(default_factory=set)
    # (source, destination) of each distinct flow, kept only when the policy has config rules (which may match on
    # the source): without rules the destination alone decides
    pairs: set[tuple[int, int]] = field(default_factory=set)


def _in_ranges(family: Family, address: int, ranges: tuple[Prefix, ...]) -> bool:
    return any(r.family is family and r.network <= address <= r.last for r in ranges)


def audit(raw: RawCounts, policy: Policy, *, group_bits: dict[Family, int] | None = None) -> AuditReport:
    """Group the pod-source flows by destination prefix (/32 and /128 unless `group_bits` says otherwise)."""
    bits = group_bits or {Family.V4: 32, Family.V6: 128}
    ruled = any(policy.rules(family) for family in policy.families)
    destinations: dict[str, tuple[Family, int]] = {}
    groups: dict[Prefix, _Tally] = {}
    pod_flows = 0
    for (src, dst, action_text), (count, path, number) in raw.counts.items():
        parsed = destinations.get(dst)
        if parsed is None:
            try:
                parsed = destinations[dst] = parse_address(dst)
            except ValueError:
                raise FlowLogError(f"{path}:{number}: destination {clip(repr(dst))} is not an IP address") from None
        action = _ACTIONS.get(action_text.upper())
        if action is None:
            raise FlowLogError(f"{path}:{number}: action {clip(repr(action_text))} is not ACCEPT or REJECT")
        family, address = parsed
        length = bits[family]
        network = address & ~((1 << (family.bits - length)) - 1)
        key = Prefix(family, network, length)
        group = groups.get(key)
        if group is None:
            group = groups[key] = _Tally()
        group.flows += count
        group.by_action[action] += count
        group.sources.add(src)
        group.addresses.add(address)
        if ruled:
            source_family, source = parse_address(src)  # a pod address: count_flows parsed it already
            if source_family is family:
                group.pairs.add((source, address))
        pod_flows += count
    out = []
    for prefix, g in groups.items():
        verdicts = _flow_verdicts(policy, prefix.family, g, ruled=ruled)
        # a verdict that still depends on fields the log does not give (protocol, port) is neither way for sure
        kinds = {v.masquerade if v.decided else None for v in verdicts}
        matched = sorted({_decided_by(v) for v in verdicts
                          if v.matched is not None or v.rule is not None or v.reason is Reason.CATCH_ALL})
        reasons = sorted({v.reason.value for v in verdicts} |
                         {f"depends on {', '.join(v.depends_on)}" for v in verdicts if not v.decided})
        sources = sorted(g.sources)
        out.append(Group(prefix, g.flows, g.by_action[FlowAction.ACCEPT], g.by_action[FlowAction.REJECT],
                         g.by_action[FlowAction.UNKNOWN],
                         tuple(sources[:5]), len(sources), kinds.pop() if len(kinds) == 1 else None,
                         tuple(matched), tuple(reasons)))
    out.sort(key=lambda g: (-g.rejected, -g.flows, g.destination))
    return AuditReport(raw.records, raw.skipped, pod_flows, tuple(out))


def _flow_verdicts(policy: Policy, family: Family, tally: _Tally, *, ruled: bool) -> list[PolicyVerdict]:
    """What the policy does to the group's flows: per destination address when only the CIDR lists decide, per
    (source, destination) of each flow when config rules may match on the source. The logs read here give no
    protocol and port to the policy, so a rule on them leaves the verdict undecided (PolicyVerdict.depends_on)."""
    if not ruled:
        return [policy.verdict_for(family, address) for address in sorted(tally.addresses)]
    return [policy.verdict_for(family, address, source=source) for source, address in sorted(tally.pairs)]


def _decided_by(verdict: PolicyVerdict) -> str:
    if verdict.rule is not None:
        return f"rule {verdict.rule.name}"
    return "catch-all" if verdict.reason is Reason.CATCH_ALL else str(verdict.matched)
