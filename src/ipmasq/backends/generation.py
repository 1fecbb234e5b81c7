"""Cheap answers to "did anything in the node's NAT rules change since I last read them all?", read from the kernel.

An idle resync used to read every table it looks at (our rules, the other backend's and variant's, the foreign NAT
rules it counts): seconds of CPU with 100,000 CIDRs or 40,000 kube-proxy rules. These fingerprints let it skip
those reads when nothing at all changed, and they are built so that a change can never go unseen:

- nf_tables (the nftables backend and every iptables-nft table, both families): the ruleset generation, read with
  one NFT_MSG_GETGEN request over a NETLINK_NETFILTER socket. The kernel bumps it on every committed nf_tables
  transaction in this network namespace, by any program; reads never bump it.
- iptables-legacy (x_tables, per family): the nat table's blob as IPT_SO_GET_ENTRIES / IP6T_SO_GET_ENTRIES returns
  it, hashed with each entry's packet and byte counters zeroed (they move with traffic, the rules do not). Every
  rule, chain and jump is in that blob, so equal hashes mean iptables-legacy-save would print the same rules.

Every function answers None when it cannot tell (no permission, no such table, an unexpected reply): the caller
must then read everything, as it would without a fingerprint. This is the only module that opens such sockets.
"""

from __future__ import annotations

import ctypes
import errno
import os
import socket
import struct
from dataclasses import dataclass

from ipmasq.prefix import Family
from ipmasq.sha256 import sha256

__all__ = ["LEGACY_DIGEST_MAX_BYTES", "NodeFingerprint", "legacy_nat_digest", "nftables_generation", "node_fingerprint"]

# The legacy nat table is copied whole into this process to be hashed (x_tables keeps no change counter): 100,000
# commented rules are ~55 MiB and ~0.4 s to walk, still a tenth of the full read it saves (iptables-legacy-save and
# parsing 140,000 rules: ~3.6 s, and as much memory). Past this bound the fingerprint is "unknown" and every pass
# reads in full: no single allocation of this process grows without limit with a table someone else fills.
LEGACY_DIGEST_MAX_BYTES = 128 * 1024 * 1024

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
# Where each entry's next_offset (u16) and its struct xt_counters (two u64) sit inside struct ipt_entry (after
# struct ipt_ip, 84 bytes) and struct ip6t_entry (after struct ip6t_ip6, 136 bytes with padding).
_ENTRY_LAYOUT = {Family.V4: (90, 96), Family.V6: (142, 152)}
_COUNTERS_SIZE = 16
_NO_COUNTERS = bytes(_COUNTERS_SIZE)
_ENTRIES_AT = _GET_ENTRIES_HEADER.size + (-_GET_ENTRIES_HEADER.size) % 8  # the entries hold u64s: 8-aligned
_U16 = struct.Struct("=H")
_LEVEL = {Family.V4: socket.IPPROTO_IP, Family.V6: socket.IPPROTO_IPV6}
_LIBC = ctypes.CDLL(None, use_errno=True)
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


def legacy_nat_digest(family: Family) -> bytes | None:
    """A digest of the iptables-legacy nat table's rules (counters left out); b"" when the kernel has no legacy nat
    table for the family (x_tables without it: nothing can be in it); None when it cannot be read."""
    try:
        sock = socket.socket(_ADDRESS_FAMILY[family], socket.SOCK_RAW | socket.SOCK_CLOEXEC, socket.IPPROTO_RAW)
    except OSError:
        return None
    try:
        name = b"nat".ljust(_TABLE_NAME_LEN, b"\0")
        try:
            info = _getsockopt(sock, _LEVEL[family], _SO_GET_INFO, name + bytes(_GETINFO.size - _TABLE_NAME_LEN))
        except OSError as exc:
            # ENOENT: no such table (the legacy nat module is not there); ENOPROTOOPT: no x_tables at all
            return b"" if exc.errno in (errno.ENOENT, errno.ENOPROTOOPT) else None
        fields = _GETINFO.unpack(info)
        size = fields[-1]
        if size > LEGACY_DIGEST_MAX_BYTES:
            return None  # the copy would cost more memory than the full read it saves (see LEGACY_DIGEST_MAX_BYTES)
        request = _GET_ENTRIES_HEADER.pack(name, size) + bytes(_ENTRIES_AT - _GET_ENTRIES_HEADER.size)
        # the table may have been replaced between the two calls: EAGAIN, or a size that no longer fits
        try:
            blob, length = _getsockopt_buffer(sock, _LEVEL[family], _SO_GET_ENTRIES, request, _ENTRIES_AT + size)
        except OSError:
            return None
    finally:
        sock.close()
    # in place: a table of 100,000 commented rules is tens of MiB, copied once by the kernel and never again
    entries = memoryview(blob).cast("B")[_ENTRIES_AT:length]
    if _GET_ENTRIES_HEADER.unpack_from(blob)[1] != size or len(entries) != size \
            or not _zero_counters(entries, family):
        return None
    digest = sha256(info[_TABLE_NAME_LEN:], expected_bytes=len(entries))  # hooks, underflows, entry count, size
    digest.update(entries)
    return digest.digest()


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
    if _LIBC.getsockopt(sock.fileno(), level, option, buffer, ctypes.byref(length)) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))
    return buffer, length.value


def _zero_counters(entries: memoryview, family: Family) -> bool:
    """Zero every entry's packet and byte counters in place; False when the entries are malformed."""
    next_at, counters_at = _ENTRY_LAYOUT[family]
    end = counters_at + _COUNTERS_SIZE
    size = len(entries)
    read_u16 = _U16.unpack_from
    offset = 0
    while offset < size:
        if offset + end > size:
            return False
        (next_offset,) = read_u16(entries, offset + next_at)
        if next_offset < end or offset + next_offset > size:
            return False
        entries[offset + counters_at:offset + end] = _NO_COUNTERS
        offset += next_offset
    return True


@dataclass(frozen=True, slots=True)
class NodeFingerprint:
    """Everything an idle pass reads, as cheap kernel facts; equal fingerprints mean no rule changed in between."""

    nftables_generation: int
    legacy_nat: tuple[bytes, ...]  # per family, IPv4 then IPv6


def node_fingerprint() -> NodeFingerprint | None:
    """The fingerprint of this network namespace's NAT rules (nf_tables and iptables-legacy, both families), or
    None when any part cannot be read (the caller then reads everything)."""
    if os.geteuid() != 0 and not _has_net_admin():
        return None
    generation = nftables_generation()
    if generation is None:
        return None
    digests = []
    for family in Family:
        digest = legacy_nat_digest(family)
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
