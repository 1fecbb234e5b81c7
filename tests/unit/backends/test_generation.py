"""The iptables-legacy fingerprint's memory of its last walk, over synthetic x_tables blobs: counters moving alone
never change the digest and send only their chunks through the walk; any other byte changed (with or without
counters moving in the same chunk, same size or not, entries re-cut across chunks) changes it; the digest from a
remembered walk always equals the one from a fresh walk of the same bytes."""

from __future__ import annotations

import random
import struct

from ipmasq.backends.generation import LegacyTableDigest, digest_legacy_entries
from ipmasq.prefix import Family

NEXT_AT, COUNTERS_AT = 90, 96  # struct ipt_entry: next_offset (u16), then struct xt_counters (two u64)
CHUNK = 1024  # small chunks, so a table of a few KiB has many
INFO = bytes(range(52))  # GET_INFO after the name: any fixed bytes stand for hooks, entry count, size


def entry(size: int, body: int) -> bytearray:
    """One entry of `size` bytes whose rule bytes all derive from `body`, counters zero."""
    data = bytearray((body * 7 + i) & 0xFF for i in range(size))
    struct.pack_into("=H", data, NEXT_AT, size)
    data[COUNTERS_AT:COUNTERS_AT + 16] = bytes(16)
    return data


def table(sizes: list[int]) -> bytearray:
    return bytearray(b"".join(entry(size, i) for i, size in enumerate(sizes)))


def offsets(blob: bytearray) -> list[int]:
    found, at = [], 0
    while at < len(blob):
        found.append(at)
        at += struct.unpack_from("=H", blob, at + NEXT_AT)[0]
    return found


def count(blob: bytearray, at: int, packets: int) -> None:
    """Traffic on the entry at `at`: its counters move."""
    struct.pack_into("=QQ", blob, at + COUNTERS_AT, packets, packets * 60)


def read(blob: bytearray, last: LegacyTableDigest | None, info: bytes = INFO) -> LegacyTableDigest:
    """What the reader does with one copy: the kernel's bytes are its own (zeroed in place), the caller's stay."""
    result = digest_legacy_entries(info, memoryview(bytearray(blob)), Family.V4, last, chunk_bytes=CHUNK)
    assert result is not None
    return result


def fresh(blob: bytearray, info: bytes = INFO) -> bytes:
    return read(blob, None, info).digest


SIZES = [112 + 8 * (i % 9) for i in range(120)]  # ~16 KiB: 15 chunks


def test_counters_moving_alone_are_no_change_and_walk_only_their_chunks() -> None:
    blob = table(SIZES)
    first = read(blob, None)
    assert first.walked_bytes == len(blob) and len(first.chunks) > 10
    again = read(blob, first)
    assert again.digest == first.digest and again.walked_bytes == 0
    hot = offsets(blob)[5], offsets(blob)[70]  # two chunks far apart
    for at in hot:
        count(blob, at, 1234)
    moved = read(blob, again)
    assert moved.digest == first.digest
    assert 0 < moved.walked_bytes <= 2 * (CHUNK + max(SIZES))
    count(blob, hot[0], 99999)  # moving again, elsewhere nothing
    assert read(blob, moved).digest == first.digest


def test_a_rule_changed_in_a_chunk_whose_counters_also_moved_is_a_change() -> None:
    blob = table(SIZES)
    first = read(blob, None)
    at = offsets(blob)[40]
    count(blob, at, 7)
    blob[at + 10] ^= 0x01  # the destination address of the same entry: one bit
    changed = read(blob, first)
    assert changed.digest != first.digest
    assert changed.digest == fresh(blob)
    assert changed.walked_bytes < len(blob)


def test_a_same_size_edit_anywhere_is_a_change() -> None:
    blob = table(SIZES)
    last = read(blob, None)
    for index in (0, 1, 59, 119):
        at = offsets(blob)[index]
        blob[at + 200 % SIZES[index]] ^= 0x80  # inside a match or the target: the chain name, the jump's offset
        now = read(blob, last)
        assert now.digest != last.digest, index
        assert now.digest == fresh(blob)
        last = now


def test_entries_re_cut_across_chunks_with_the_same_total_size_are_walked_afresh() -> None:
    sizes = list(SIZES)
    before = table(sizes)
    first = read(before, None)
    sizes[3] += 8
    sizes[100] -= 8  # one entry grows, one far away shrinks: GET_INFO and the size are the same
    after = table(sizes)
    assert len(after) == len(before)
    changed = read(after, first)
    assert changed.digest != first.digest
    assert changed.digest == fresh(after) and changed.walked_bytes == len(after)


def test_a_different_get_info_walks_everything() -> None:
    blob = table(SIZES)
    first = read(blob, None)
    other_info = bytes(51) + b"\x01"  # a hook moved: nothing of the last walk is trusted
    moved = read(blob, first, other_info)
    assert moved.digest != first.digest and moved.walked_bytes == len(blob)


def test_malformed_entries_are_unknown_not_a_digest() -> None:
    blob = table(SIZES)
    first = read(blob, None)
    struct.pack_into("=H", blob, offsets(blob)[50] + NEXT_AT, 0)  # an entry that does not advance
    assert digest_legacy_entries(INFO, memoryview(bytearray(blob)), Family.V4, first, chunk_bytes=CHUNK) is None
    assert digest_legacy_entries(INFO, memoryview(bytearray(blob)), Family.V4, None, chunk_bytes=CHUNK) is None
    truncated = table(SIZES)[:-8]
    assert digest_legacy_entries(INFO, memoryview(truncated), Family.V4, None, chunk_bytes=CHUNK) is None


def test_random_edits_are_changes_and_random_counters_are_not() -> None:
    """400 random single edits (a byte of a rule, or of the counters), each read after the last read, remembered:
    the digest moves exactly when a rule byte moved, and always equals a fresh walk's."""
    rng = random.Random(20240611)
    sizes = [112 + 8 * rng.randrange(0, 40) for _ in range(90)]
    blob = table(sizes)
    last = read(blob, None)
    for _ in range(400):
        at = rng.choice(offsets(blob))
        if rng.random() < 0.5:
            count(blob, at, rng.randrange(1, 1 << 40))
            now = read(blob, last)
            assert now.digest == last.digest
        else:
            size = struct.unpack_from("=H", blob, at + NEXT_AT)[0]
            where = rng.choice([i for i in range(size) if not (NEXT_AT <= i < NEXT_AT + 2)
                                and not (COUNTERS_AT <= i < COUNTERS_AT + 16)])
            blob[at + where] ^= 1 << rng.randrange(8)
            now = read(blob, last)
            assert now.digest != last.digest
        assert now.digest == fresh(blob)
        last = now


def test_ipv6_entries_zero_their_own_counters() -> None:
    next_at, counters_at = 142, 152  # struct ip6t_entry
    data = bytearray()
    for i in range(30):
        one = bytearray((i * 3 + j) & 0xFF for j in range(200))
        struct.pack_into("=H", one, next_at, 200)
        one[counters_at:counters_at + 16] = bytes(16)
        data += one
    first = digest_legacy_entries(INFO, memoryview(bytearray(data)), Family.V6, None, chunk_bytes=CHUNK)
    assert first is not None
    struct.pack_into("=QQ", data, 200 * 7 + counters_at, 5, 500)
    moved = digest_legacy_entries(INFO, memoryview(bytearray(data)), Family.V6, first, chunk_bytes=CHUNK)
    assert moved is not None and moved.digest == first.digest and moved.walked_bytes > 0
