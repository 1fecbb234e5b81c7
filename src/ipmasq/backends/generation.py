"""Cheap answers to "did anything in the node's NAT rules change since I last read them all?", read from the kernel.

An idle resync used to read every table it looks at (our rules, the other backend's and variant's, the foreign NAT
rules it counts), which costs seconds of CPU on a large node. These fingerprints let it skip those reads when nothing
at all changed, and they are built so that a change can never go unseen (the figures behind the choices below are in
docs/measurements.md):

- nf_tables (the nftables backend and every iptables-nft table, both families): the ruleset generation, read with
  one NFT_MSG_GETGEN request over a NETLINK_NETFILTER socket. The kernel bumps it on every committed nf_tables
  transaction in this network namespace, by any program; reads never bump it.
- iptables-legacy (x_tables, per family): the nat table's blob as IPT_SO_GET_ENTRIES / IP6T_SO_GET_ENTRIES returns
  it, hashed with each entry's packet and byte counters zeroed (they move with traffic, the rules do not). Every
  rule, chain and jump is in that blob, so equal hashes mean iptables-legacy-save would print the same rules.
  x_tables has no change counter, so the blob is copied every time (the kernel's copy is most of the cost); what
  this process does with it is kept small by remembering the last walk: the entries are grouped into chunks of
  LEGACY_CHUNK_BYTES cut at entry boundaries, and per chunk a sha256 of its bytes
  as read and a sha256 of its bytes with counters zeroed. The next read with the same GET_INFO (hooks, underflows,
  entry count, size) hashes each chunk as read (C speed); a chunk whose bytes are the same has the same rules and
  reuses its zeroed digest; only a chunk whose bytes differ (its counters moved, or a rule changed) is walked again,
  and it must still tile its place exactly (same boundaries) or the whole table is walked afresh. The digest is the
  sha256 of GET_INFO and every chunk's zeroed digest in order: equal digests mean equal zeroed bytes, chunk by chunk.
  A raw comparison by crc32 would be faster and could call a changed chunk unchanged (a collision): the
  "unchanged" decision is only ever taken on sha256.
  The copy itself is skipped when no program took the xtables lock since the last full read of that family
  (ipmasq.backends.xtables_lock: every iptables and iptables-restore that writes takes it) and GET_INFO is the
  same; a full read still happens at least every LEGACY_FULL_READ_EVERY reads, for a writer that skips the lock.

KernelFingerprint is the whole answer, built once by `ipmasq agent` (nothing is read or opened at import). Every
function answers None when it cannot tell (no permission, no such table, an unexpected reply): the caller
must then read everything, as it would without a fingerprint. This is the only module that opens such sockets.
"""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import os
import socket
import struct
import threading
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ipmasq.backends.xtables_lock import XtablesLockWatch
from ipmasq.prefix import Family
from ipmasq.sha256 import LARGE_INPUT_BYTES, Sha256, sha256

__all__ = ["LEGACY_CHUNK_BYTES", "LEGACY_DIGEST_MAX_BYTES", "LEGACY_FULL_READ_EVERY", "KernelFingerprint",
           "LegacyNatDigests", "LegacyTableDigest", "NodeFingerprint", "digest_legacy_entries", "nftables_generation"]

# The legacy nat table is copied whole into this process to be hashed (x_tables keeps no change counter), still far
# cheaper than the full read it saves (iptables-legacy-save and parsing every rule, with as much memory). Past this
# bound the fingerprint is "unknown" and every pass reads in full: no single allocation of this process grows without
# limit with a table someone else fills. The copy is freed after each read (kept, it would save page faults per read
# but hold its size resident between passes).
LEGACY_DIGEST_MAX_BYTES = 128 * 1024 * 1024
# The unit of "these bytes did not change": large enough that hashing chunk by chunk costs about what one hash of
# the whole table does, small enough that counters moving on a few hot rules send only a few hundred entries through
# the Python walk.
LEGACY_CHUNK_BYTES = 64 * 1024
# How often a family's table is copied and hashed even though no program took the xtables lock and GET_INFO did not
# change: a writer that bypasses the lock and keeps the table's size is seen within this many reads (with the
# default 60 s resync, 10 minutes; the drift is then repaired as any other). One full read in ten also keeps the
# mean cost of an idle read of a large table a small fraction of a copy's.
LEGACY_FULL_READ_EVERY = 10

# linux/netlink.h, linux/netfilter/nfnetlink.h, linux/netfilter/nf_tables.h
_NETLINK_NETFILTER = 12
_NLM_F_REQUEST = 0x1
_NLMSG_ERROR = 0x2
_NFNL_SUBSYS_NFTABLES = 10
_NFT_MSG_NEWGEN = 15
_NFT_MSG_GETGEN = 16
_NFTA_GEN_ID = 1
_NLMSG_HEADER = struct.Struct("=IHHII")  # len, type, flags, seq, pid (host order)
_NFGENMSG = struct.Struct("=BBH")  # family, version, res_id (big-endian, 0 here)
_NLATTR = struct.Struct("=HH")  # len, type

# linux/netfilter_ipv4/ip_tables.h, linux/netfilter_ipv6/ip6_tables.h: the same numbers for both families
_SO_GET_INFO = 64
_SO_GET_ENTRIES = 65
_TABLE_NAME_LEN = 32
# struct ipt_getinfo / ip6t_getinfo: name[32], valid_hooks, hook_entry[5], underflow[5], num_entries, size
_GETINFO = struct.Struct("=32sI5I5III")
_GET_ENTRIES_HEADER = struct.Struct("=32sI")  # struct ipt_get_entries: name[32], size; then the entries (8-aligned)
_NAT_NAME = b"nat".ljust(_TABLE_NAME_LEN, b"\0")
# Where each entry's next_offset (u16) and its struct xt_counters (two u64) sit inside struct ipt_entry (after
# struct ipt_ip, 84 bytes) and struct ip6t_entry (after struct ip6t_ip6, 136 bytes with padding).
_ENTRY_LAYOUT = {Family.V4: (90, 96), Family.V6: (142, 152)}
_COUNTERS_SIZE = 16
_NO_COUNTERS = bytes(_COUNTERS_SIZE)
_ENTRIES_AT = _GET_ENTRIES_HEADER.size + (-_GET_ENTRIES_HEADER.size) % 8  # the entries hold u64s: 8-aligned
_U16 = struct.Struct("=H")
_LEVEL = {Family.V4: socket.IPPROTO_IP, Family.V6: socket.IPPROTO_IPV6}
_ADDRESS_FAMILY = {Family.V4: socket.AF_INET, Family.V6: socket.AF_INET6}


def nftables_generation() -> int | None:
    """The nf_tables ruleset generation of this network namespace; None when it cannot be read."""
    try:
        sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, _NETLINK_NETFILTER)
    except OSError:
        return None
    try:
        sock.settimeout(1.0)
        sock.bind((0, 0))
        seq = 1
        message_type = (_NFNL_SUBSYS_NFTABLES << 8) | _NFT_MSG_GETGEN
        body = _NFGENMSG.pack(socket.AF_UNSPEC, 0, 0)
        sock.send(_NLMSG_HEADER.pack(_NLMSG_HEADER.size + len(body), message_type, _NLM_F_REQUEST, seq, 0) + body)
        reply = sock.recv(65536)
    except OSError:
        return None
    finally:
        sock.close()
    return _generation_from_reply(reply, seq)


def _generation_from_reply(reply: bytes, seq: int) -> int | None:
    """NFTA_GEN_ID (a big-endian u32) from a NFT_MSG_NEWGEN reply; None for an error or anything unexpected."""
    offset = 0
    while offset + _NLMSG_HEADER.size <= len(reply):
        length, message_type, _flags, message_seq, _pid = _NLMSG_HEADER.unpack_from(reply, offset)
        if length < _NLMSG_HEADER.size or offset + length > len(reply):
            return None
        if message_seq == seq and message_type == _NLMSG_ERROR:
            return None
        if message_seq == seq and message_type == (_NFNL_SUBSYS_NFTABLES << 8) | _NFT_MSG_NEWGEN:
            attr = offset + _NLMSG_HEADER.size + _NFGENMSG.size
            end = offset + length
            while attr + _NLATTR.size <= end:
                attr_length, attr_type = _NLATTR.unpack_from(reply, attr)
                if attr_length < _NLATTR.size:
                    return None
                if attr_type & 0x3FFF == _NFTA_GEN_ID and attr_length >= _NLATTR.size + 4:
                    return int(struct.unpack_from(">I", reply, attr + _NLATTR.size)[0])
                attr += (attr_length + 3) & ~3
            return None
        offset += (length + 3) & ~3
    return None


@dataclass(frozen=True, slots=True)
class _Chunk:
    """Entries [start, end) of a legacy table, as last read: the sha256 of their bytes as read (counters included)
    and of their bytes with every counter zeroed (their rules)."""

    start: int
    end: int
    raw: bytes
    rules: bytes


@dataclass(frozen=True, slots=True)
class LegacyTableDigest:
    """One read of a legacy table: its digest and what the next read needs to hash only what changed."""

    digest: bytes
    info: bytes  # GET_INFO's answer after the name: hooks, underflows, entry count, size
    chunks: tuple[_Chunk, ...]
    walked_bytes: int  # how much of the table went through the Python walk (all of it, or the changed chunks)
    copied: bool = True  # False: the last read's answer, kept because no writer took the xtables lock since


class LegacyNatDigests:
    """`digests(family)`: a digest of the iptables-legacy nat table's rules (counters left out); b"" when the kernel
    has no legacy nat table for the family (x_tables without it: nothing can be in it); None when it cannot be read.
    Remembers per family the chunks of the last read (a few hundred KiB for a 66 MiB table), so an unchanged table
    is not walked again, and watches the xtables lock file (`xtables_lock`, None: copy on every read). Thread-safe:
    the agent's loop is its only caller, a lock keeps a second one from mixing two reads."""

    def __init__(self, *, chunk_bytes: int = LEGACY_CHUNK_BYTES, xtables_lock: str | None = None,
                 full_read_every: int = LEGACY_FULL_READ_EVERY) -> None:
        self.chunk_bytes = chunk_bytes
        self.full_read_every = full_read_every
        self._last: dict[Family, LegacyTableDigest] = {}
        self.xtables_lock = xtables_lock
        self._lock_watch: XtablesLockWatch | None = None  # set up on the first read: importing opens nothing
        self._unsure: set[Family] = set(Family)  # a writer may have run since this family's last full read
        self._kept: dict[Family, int] = dict.fromkeys(Family, 0)  # reads answered from memory since the last copy
        self._lock = threading.Lock()

    def __call__(self, family: Family) -> bytes | None:
        with self._lock:
            table = self.read(family)
            return None if table is None else table.digest

    def read(self, family: Family) -> LegacyTableDigest | None:
        """The nat table's digest with what this read did; None when it cannot be read, and the empty digest b""
        (no chunks) when the family has no legacy nat table."""
        # the events are drained before the copy: a writer that opens the lock after this is seen by the next read
        if self._lock_watch is None and self.xtables_lock is not None:
            self._lock_watch = XtablesLockWatch(self.xtables_lock)
        if self._lock_watch is None or not self._lock_watch.quiet():
            self._unsure.update(Family)
        last = self._last.get(family)
        if family not in self._unsure and last is not None and last.info and \
                self._kept[family] + 1 < self.full_read_every and _read_info(family) == last.info:
            self._kept[family] += 1
            return dataclasses.replace(last, walked_bytes=0, copied=False)
        self._unsure.discard(family)
        self._kept[family] = 0
        copied = _copy_nat_table(family)
        if copied is None or isinstance(copied, bytes):
            self._last.pop(family, None)
            return None if copied is None else LegacyTableDigest(b"", b"", (), 0)
        info, entries = copied  # the only reference to the copy: freed (unmapped) when this returns
        table = digest_legacy_entries(info, entries, family, last, chunk_bytes=self.chunk_bytes)
        if table is None:
            self._last.pop(family, None)
        else:
            self._last[family] = table
        return table


def _raw_socket(family: Family) -> socket.socket | None:
    """The socket x_tables answers GET_INFO and GET_ENTRIES on; None when this process may not open one."""
    try:
        return socket.socket(_ADDRESS_FAMILY[family], socket.SOCK_RAW | socket.SOCK_CLOEXEC, socket.IPPROTO_RAW)
    except OSError:
        return None


def _read_info(family: Family) -> bytes | None:
    """GET_INFO's answer after the name (hooks, underflows, entry count, size): b"" when the kernel has no legacy
    nat table for the family, None when it cannot be read. Microseconds: nothing of the table is copied."""
    sock = _raw_socket(family)
    if sock is None:
        return None
    with sock:
        info = _get_info(sock, family)
    return info[_TABLE_NAME_LEN:] if info else info


def _get_info(sock: socket.socket, family: Family) -> bytes | None:
    try:
        return _getsockopt(sock, _LEVEL[family], _SO_GET_INFO, _NAT_NAME + bytes(_GETINFO.size - _TABLE_NAME_LEN))
    except OSError as exc:
        # ENOENT: no such table (the legacy nat module is not there); ENOPROTOOPT: no x_tables at all
        return b"" if exc.errno in (errno.ENOENT, errno.ENOPROTOOPT) else None


def _copy_nat_table(family: Family) -> tuple[bytes, memoryview] | bytes | None:
    """(GET_INFO's answer after the name, the entries as a writable view of this read's own copy); b"" when the
    kernel has no legacy nat table for the family; None when it cannot be read."""
    sock = _raw_socket(family)
    if sock is None:
        return None
    with sock:
        info = _get_info(sock, family)
        if not info:
            return info
        size = _GETINFO.unpack(info)[-1]
        if size > LEGACY_DIGEST_MAX_BYTES:
            return None  # the copy would cost more memory than the full read it saves (see LEGACY_DIGEST_MAX_BYTES)
        request = _GET_ENTRIES_HEADER.pack(_NAT_NAME, size) + bytes(_ENTRIES_AT - _GET_ENTRIES_HEADER.size)
        # the table may have been replaced between the two calls: EAGAIN, or a size that no longer fits
        try:
            blob, length = _getsockopt_buffer(sock, _LEVEL[family], _SO_GET_ENTRIES, request, _ENTRIES_AT + size)
        except OSError:
            return None
    if _GET_ENTRIES_HEADER.unpack_from(blob)[1] != size or length - _ENTRIES_AT != size:
        return None
    # in place: a table of 100,000 commented rules is tens of MiB, copied once by the kernel and never again
    return info[_TABLE_NAME_LEN:], memoryview(blob).cast("B")[_ENTRIES_AT:length]


def digest_legacy_entries(info: bytes, entries: memoryview, family: Family, last: LegacyTableDigest | None, *,
                          chunk_bytes: int = LEGACY_CHUNK_BYTES) -> LegacyTableDigest | None:
    """The digest of a legacy table's entries (GET_INFO's `info` after the name, then every entry with its counters
    zeroed, chunk by chunk), reusing `last` (the previous read of the same table) for every chunk whose bytes did not
    change; None when the entries are malformed. Zeroes the counters in `entries` where it walks.

    Why a chunk that hashes the same as read can keep its zeroed digest: with the same GET_INFO the first chunk
    starts at offset 0, an entry boundary. A chunk whose bytes are the ones last read holds the same entries, whose
    next_offset chain ends where it ended last time, the next chunk's start. A chunk whose bytes differ is walked
    and must end exactly there too, or the whole table is walked afresh. So every chunk starts on an entry, and its
    zeroed digest is that of its entries' rules."""
    new = _sha256_for(len(entries))
    if last is not None and last.info == info and last.chunks and last.chunks[-1].end == len(entries):
        table = _digest_changed_chunks(info, entries, family, last, new)
        if table is not None:
            return table
    return _digest_all(info, entries, family, chunk_bytes, new)


def _digest_changed_chunks(info: bytes, entries: memoryview, family: Family, last: LegacyTableDigest,
                           new: Callable[[Any], Sha256]) -> LegacyTableDigest | None:
    """The digest reusing `last`'s chunks; None when a changed chunk no longer tiles its place (walk everything)."""
    raws = [new(entries[chunk.start:chunk.end]).digest() for chunk in last.chunks]
    # every changed chunk is checked before any counter is zeroed: a failure leaves the bytes as read for the
    # full walk
    counters: list[array[int] | None] = []
    for chunk, raw in zip(last.chunks, raws, strict=True):
        if raw == chunk.raw:
            counters.append(None)
            continue
        walked = _walk(entries, family, chunk.start, chunk.end, chunk.end - chunk.start)
        if walked is None or len(walked) != 1:
            return None
        counters.append(walked[0][2])
    chunks = []
    walked_bytes = 0
    for chunk, raw, offsets in zip(last.chunks, raws, counters, strict=True):
        if offsets is None:
            chunks.append(chunk)
            continue
        _zero(entries, offsets)
        chunks.append(_Chunk(chunk.start, chunk.end, raw, new(entries[chunk.start:chunk.end]).digest()))
        walked_bytes += chunk.end - chunk.start
    return _table(info, tuple(chunks), walked_bytes, new)


def _digest_all(info: bytes, entries: memoryview, family: Family, chunk_bytes: int,
                new: Callable[[Any], Sha256]) -> LegacyTableDigest | None:
    """The digest from a walk of every entry, cut into chunks afresh; None when the entries are malformed."""
    walked = _walk(entries, family, 0, len(entries), chunk_bytes)
    if walked is None:
        return None
    chunks = []
    for start, end, offsets in walked:
        raw = new(entries[start:end]).digest()
        _zero(entries, offsets)
        chunks.append(_Chunk(start, end, raw, new(entries[start:end]).digest()))
    return _table(info, tuple(chunks), len(entries), new)


def _table(info: bytes, chunks: tuple[_Chunk, ...], walked_bytes: int,
           new: Callable[[Any], Sha256]) -> LegacyTableDigest:
    digest = new(info)  # hooks, underflows, entry count, size
    for chunk in chunks:
        digest.update(chunk.rules)
    return LegacyTableDigest(digest.digest(), info, chunks, walked_bytes)


def _sha256_for(total_bytes: int) -> Callable[[Any], Sha256]:
    """sha256 for the chunks of a table of `total_bytes`: OpenSSL's (much faster, SHA extensions) once the table is
    large enough to be worth loading it, CPython's own below that (see ipmasq.sha256)."""
    if total_bytes >= LARGE_INPUT_BYTES:
        import hashlib

        return hashlib.sha256
    return sha256


def _walk(entries: memoryview, family: Family, start: int, stop: int,
          chunk_bytes: int) -> list[tuple[int, int, array[int]]] | None:
    """Follow the entries' next_offset chain from `start` to exactly `stop`, cut into chunks of at least
    `chunk_bytes` at entry boundaries (the last one may be shorter): per chunk (start, end, where each entry's
    counters are: 4 bytes each in an array, not a Python int each). None when an entry
    is malformed or the chain does not end exactly at `stop`."""
    next_at, counters_at = _ENTRY_LAYOUT[family]
    least = counters_at + _COUNTERS_SIZE
    read_u16 = _U16.unpack_from
    chunks: list[tuple[int, int, array[int]]] = []
    chunk_start = offset = start
    offsets = array("I")
    while offset < stop:
        if offset - chunk_start >= chunk_bytes:
            chunks.append((chunk_start, offset, offsets))
            chunk_start, offsets = offset, array("I")
        if offset + least > stop:
            return None
        (next_offset,) = read_u16(entries, offset + next_at)
        if next_offset < least or offset + next_offset > stop:
            return None
        offsets.append(offset + counters_at)
        offset += next_offset
    if offset != stop:
        return None
    if offset > chunk_start:
        chunks.append((chunk_start, offset, offsets))
    return chunks


def _zero(entries: memoryview, counter_offsets: array[int]) -> None:
    for at in counter_offsets:
        entries[at:at + _COUNTERS_SIZE] = _NO_COUNTERS


def _getsockopt(sock: socket.socket, level: int, option: int, request: bytes) -> bytes:
    """getsockopt(2) with an input buffer (the table's name goes in): Python's socket.getsockopt cannot pass one."""
    buffer, length = _getsockopt_buffer(sock, level, option, request, len(request))
    return buffer.raw[:length]


def _getsockopt_buffer(sock: socket.socket, level: int, option: int, request: bytes,
                       size: int) -> tuple[ctypes.Array[ctypes.c_char], int]:
    """getsockopt(2) into a buffer of `size` bytes starting with `request`; (the buffer, the length answered)."""
    buffer = ctypes.create_string_buffer(size)
    ctypes.memmove(buffer, request, len(request))
    length = ctypes.c_uint32(size)
    libc = ctypes.CDLL(None, use_errno=True)  # this process's own C library, already loaded: no state kept here
    if libc.getsockopt(sock.fileno(), level, option, buffer, ctypes.byref(length)) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))
    return buffer, length.value


@dataclass(frozen=True, slots=True)
class NodeFingerprint:
    """Everything an idle pass reads, as cheap kernel facts; equal fingerprints mean no rule changed in between."""

    nftables_generation: int
    legacy_nat: tuple[bytes, ...]  # per family, IPv4 then IPv6


class KernelFingerprint:
    """The Fingerprint (backends.base) of this network namespace's NAT rules: nf_tables and iptables-legacy, both
    families; None when any part cannot be read (the caller then reads everything). Keeps the legacy reader's memory
    of its last walks, so `ipmasq agent` builds one and hands it to the Reconciler; `xtables_lock` as in
    LegacyNatDigests (xtables_lock.xtables_lock_path(): the one iptables here would take)."""

    def __init__(self, *, xtables_lock: str | None = None) -> None:
        self.legacy = LegacyNatDigests(xtables_lock=xtables_lock)

    def __call__(self) -> NodeFingerprint | None:
        if os.geteuid() != 0 and not _has_net_admin():
            return None
        generation = nftables_generation()
        if generation is None:
            return None
        digests = []
        for family in Family:
            digest = self.legacy(family)
            if digest is None:
                return None
            digests.append(digest)
        return NodeFingerprint(generation, tuple(digests))


def _has_net_admin() -> bool:
    """CAP_NET_ADMIN (bit 12) in this process's effective set: a DaemonSet agent runs as non-root with it."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> 12 & 1)
    except (OSError, ValueError):
        pass
    return False
