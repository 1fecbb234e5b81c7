"""Where `check` and `trace` get the node's nat rules: a dump file (or stdin), or the live node, read-only.

The live reads use the same tools and variant detection as the backends, so the tools see what the agent sees;
they go through the injected Runner and never write. Every failure is one line naming the file.
"""

from __future__ import annotations

import functools
import json
import os
import re
import stat
import sys
from dataclasses import replace

from ipmasq.backends.base import Runner
from ipmasq.backends.choose import detect
from ipmasq.backends.iptables import Variant, detect_variant, tools
from ipmasq.diagnose.check import NodeRules
from ipmasq.errors import BackendError, IpmasqError, NftParseError, NotAFile, NoWriter, RuleParseError, clip, one_line
from ipmasq.input_files import open_input
from ipmasq.netfilter.iptables import NatTable, our_chains, parse_save, save_lines
from ipmasq.netfilter.nft import NftTable
from ipmasq.netfilter.nft_json import parse_list_json
from ipmasq.prefix import Family

__all__ = ["MAX_DUMP_BYTES", "MAX_DUMP_LINE", "family_of_dump", "holds_no_nat_rules", "iptables_nft_families",
           "parse_save_dump", "read_dump_file", "read_iptables_nft_beside", "read_live_rules", "read_nat_save",
           "rules_from_dump"]


# The nat table of a node with kube-proxy in iptables mode and ten thousand services is ~20 MB of iptables-save:
# three times that still reads in well under a second; more (a 50 GB file, /dev/zero) would only cost memory.
MAX_DUMP_BYTES = 64 << 20
# iptables caps a comment at 256 characters; the longest real rule (multiport, many matches) is well under 4 KiB.
# A longer line is no iptables-save output, and the rule tokenizer would need memory in proportion to it.
MAX_DUMP_LINE = 64 << 10
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")  # what neither iptables-save nor nft -j prints
_CONTROL_BYTES = re.compile(_CONTROL.pattern.encode())
_BUILTIN_NAT_CHAINS = frozenset({"PREROUTING", "INPUT", "OUTPUT", "POSTROUTING"})


def read_dump_file(path: str, expected: str = "iptables-save or nft -j output") -> tuple[str, str]:
    """(path shown in messages, text); `-` is stdin. At most MAX_DUMP_BYTES, never blocking on a FIFO nobody
    writes to; a pipe (`--from-dump <(iptables-save -t nat)`) reads as a file does. `expected`: what the file
    should hold, as refusals say it."""
    if path == "-":
        stdin = sys.stdin.buffer.fileno()
        _refuse_too_large(os.fstat(stdin), "<stdin>")  # `< big-file` is refused unread, as the file itself is
        return "<stdin>", _decoded(read_bounded(stdin, "<stdin>"), "<stdin>", expected)
    try:
        fd, status, first = open_input(path)
    except OSError as exc:
        raise IpmasqError(f"{path}: {exc.strerror}") from None
    except NotAFile as exc:
        raise IpmasqError(f"{path}: {exc}, not a dump file: not read (expected {expected})") from None
    except NoWriter:
        raise IpmasqError(f"{path}: a FIFO that no process writes to: nothing to read (expected {expected})") \
            from None
    try:
        _refuse_too_large(status, path)
        return path, _decoded(read_bounded(fd, path, first), path, expected)
    except OSError as exc:
        raise IpmasqError(f"{path}: {exc.strerror}") from None
    finally:
        os.close(fd)


def read_bounded(fd: int, shown: str, first: bytes = b"") -> bytearray:
    """All of `fd` (after `first`, already read from it), refused past MAX_DUMP_BYTES (a stream's size is known only
    by reading one byte too many). One growing buffer, not a list of chunks joined: the bytes are held once."""
    data = bytearray(first)
    while chunk := os.read(fd, 1 << 20):
        data += chunk
        if len(data) > MAX_DUMP_BYTES:
            raise _too_large(shown, None)
    return data


def _refuse_too_large(status: os.stat_result, shown: str) -> None:
    if stat.S_ISREG(status.st_mode) and status.st_size > MAX_DUMP_BYTES:
        raise _too_large(shown, status.st_size)


def _too_large(shown: str, size: int | None) -> IpmasqError:
    told = f"{size:,} bytes" if size is not None else f"more than {MAX_DUMP_BYTES:,} bytes"
    return IpmasqError(f"{shown}: {told}, too large: a dump of the nat table is at most {MAX_DUMP_BYTES >> 20} MiB")


def _decoded(data: bytearray, shown: str, expected: str = "iptables-save or nft -j output") -> str:
    # before decoding, which would hold the text a second time: a 50 MB file of zeros costs its bytes only
    control = _CONTROL_BYTES.search(data)
    if control is not None:
        raise _control_error(shown, data.count(b"\n", 0, control.start()) + 1, chr(control.group()[0]), expected)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise IpmasqError(f"{shown}:{line}: not a text file (byte {exc.start} is no UTF-8; expected {expected})") \
            from None


def family_of_dump(table: NatTable) -> Family:
    """iptables-save and ip6tables-save print the same syntax: the addresses tell them apart."""
    for rule in table.rules:
        for token in rule.split(" "):
            if "/" in token and ":" in token and token[0] in "0123456789abcdefABCDEF:":
                return Family.V6
    return Family.V4


def rules_from_dump(text: str, path: str) -> NodeRules:
    """A dump holding `nft -j list ruleset` output or an iptables-save (ip6tables-save) nat table."""
    if text.lstrip().startswith("{"):
        try:
            return NodeRules("nftables", {}, parse_list_json(text), nft_ruleset=text)
        except NftParseError as exc:
            raise IpmasqError(one_line(f"{path}: {exc}")) from None  # it may quote the listing's names
    return NodeRules("iptables", {family_of_dump(table := parse_save_dump(text, path)): table})


def read_live_rules(run: Runner, families: tuple[Family, ...], *, chain: str, backend: str,
                    variant: Variant | None = None) -> NodeRules:
    """The live node's rules for `backend` (iptables, nftables, or auto: whichever of ours the node holds, and only
    on a node with neither, the agent's own choice); `variant`: the iptables variant to read (None: detected)."""
    tables: dict[Family, NatTable] = {}
    if backend in ("iptables", "auto"):
        if variant is None:
            variant = detect_variant(run)  # once for every family: it runs each variant's save of each family
        tables = {family: _parsed_save(_SAVE_NOISE.sub("", read_nat_save(run, family, variant=variant)))
                  for family in families}
    nft: NftTable | None = None
    if backend in ("nftables", "auto"):
        try:
            nft = parse_list_json(read_nft_ruleset(run))
        except NftParseError as exc:
            raise IpmasqError(one_line(f"nft -j list ruleset: {exc}")) from None
    if backend == "auto":
        if any(our_chains(t, chain) for t in tables.values()):
            backend = "iptables"
        elif nft is not None:
            backend = "nftables"
        else:
            backend = detect(run).backend
            if backend == "nftables":
                tables = {}
    return NodeRules(backend, tables, nft)


# what changes in iptables-save's output when no rule does: its comments (a timestamp) and the chains' counters
_SAVE_NOISE = re.compile(r"^#[^\n]*\n|(?<= )\[\d+:\d+\]$", re.MULTILINE)


@functools.lru_cache(maxsize=2)
def _parsed_save(text: str) -> NatTable:
    """parse_save, remembered for the last two texts (a family each): observe mode reads a node every few seconds,
    and a nat table re-applied unchanged (a writer's loop, kube-proxy's resync) is not parsed again (nothing
    changes a NatTable once parsed, so the readers may share it)."""
    return parse_save(text)


def read_node_rules(run: Runner, families: tuple[Family, ...], *, chain: str, backend: str,
                    variant: Variant | None = None) -> NodeRules:
    """Everything `check` compares on a live node, read-only: ours (read_live_rules), the whole nftables ruleset
    (other tables' nat chains decide pod traffic too; a node without nft has none beside iptables), and on nftables
    iptables-nft's nat tables in that ruleset (kube-proxy's iptables mode) as iptables-nft-save reads them. `ipmasq
    check` and the agent's observe mode both read the node through this."""
    rules = read_live_rules(run, families, chain=chain, backend=backend, variant=variant)
    ruleset: str | None
    if rules.backend == "nftables":
        ruleset = read_nft_ruleset(run)
    else:
        try:
            ruleset = read_nft_ruleset(run)
        except (IpmasqError, OSError):
            ruleset = None
    rules = replace(rules, nft_ruleset=ruleset)
    if rules.backend == "nftables" and ruleset is not None:
        rules = replace(rules, tables=read_iptables_nft_beside(run, ruleset, families))
    return rules


def holds_no_nat_rules(rules: NodeRules) -> bool:
    """Whether a live read found no nat rule at all: no iptables nat rule (of the variant read, every family), not
    our nftables table, and no rule in any nftables table with a nat chain. Every Kubernetes node whose pod SNAT is
    done by nat rules holds some (the agent's, kube-proxy's KUBE-POSTROUTING, the CNI's): without any, `check` is
    not on such a node (a workstation, a container's own namespace) or the node's SNAT is in BPF (Cilium)."""
    if rules.nft is not None or any(table.rules for table in rules.tables.values()):
        return False
    if rules.nft_ruleset is None:
        return True
    try:
        listing = json.loads(rules.nft_ruleset)
    except ValueError:
        return False  # unreadable here: not evidence of an empty node
    items = listing.get("nftables") if isinstance(listing, dict) else None
    objects = [item for item in items if isinstance(item, dict)] if isinstance(items, list) else []
    nat_tables = {(c.get("family"), c.get("table")) for item in objects
                  if isinstance(c := item.get("chain"), dict) and c.get("type") == "nat"}
    return not any(isinstance(r := item.get("rule"), dict) and (r.get("family"), r.get("table")) in nat_tables
                   for item in objects)


def parse_save_dump(text: str, path: str, *, nat_required: bool = True) -> NatTable:
    """The nat table of an iptables-save dump; errors name the file (and the line). `nat_required` False: a dump
    without a nat table (a node whose nat rules are all nftables') is an empty table, not an error.

    A dump is read from a file someone may have edited, cut short or confused with another: what iptables-save
    cannot print (an nft listing, control characters, an endless line, a *nat table without COMMIT, rules of an
    undeclared chain) is an error here, not a verdict.
    """
    if text.lstrip().startswith("{"):
        raise IpmasqError(f"{path}: an nft -j listing: this reads iptables-save output (check reads both)")
    nft_text = _NFT_TEXT_TABLE.search(text[:_NFT_TEXT_LOOK])
    if nft_text is not None:
        raise IpmasqError(f"{path}:{_line_of(text, nft_text.start())}: an `nft list ruleset` text listing "
                          f"({clip(nft_text.group().strip())}): give its JSON form, `nft -j list ruleset > "
                          "ruleset.json`, or iptables-save output")
    _check_dump_text(text, path)
    try:
        table = parse_save(text)
    except RuleParseError as exc:
        raise RuleParseError(one_line(f"{path}: {exc}")) from None
    if not table.chains and not table.rules:
        if not nat_required:
            return table
        raise IpmasqError(f"{path}: no *nat table found (expected iptables-save or nft -j list ruleset output)")
    _check_chains(text, table, path)
    return table


def _control_error(shown: str, line: int, char: str, expected: str = "iptables-save or nft -j output") -> IpmasqError:
    return IpmasqError(f"{shown}:{line}: control character {char!r} (U+{ord(char):04X}): not {expected}")


def _line_of(text: str, position: int) -> int:
    return text.count("\n", 0, position) + 1


# `nft list ruleset` prints `table FAMILY NAME {` at a line's start; iptables-save never does. Looked for in the first
# 64 KiB: a text listing starts with a table (its comments and blank lines aside)
_NFT_TEXT_TABLE = re.compile(r"^[ \t]*table[ \t]+(?:ip|ip6|inet|arp|bridge|netdev)[ \t]+\S+[ \t]*\{", re.MULTILINE)
_NFT_TEXT_LOOK = 1 << 16


def _check_dump_text(text: str, path: str) -> None:
    """What iptables-save never prints, found without copying the text (it may be 64 MiB)."""
    control = _CONTROL.search(text)
    if control is not None:
        raise _control_error(path, _line_of(text, control.start()), control.group())
    start, number = 0, 1
    while start < len(text):
        end = text.find("\n", start)
        end = len(text) if end < 0 else end
        if end - start > MAX_DUMP_LINE:
            raise IpmasqError(f"{path}:{number}: a line of {end - start:,} characters (iptables-save prints "
                              f"rules under {MAX_DUMP_LINE:,}): {clip(text[start:start + 200])}")
        start, number = end + 1, number + 1
    nat = re.search(r"^\*nat[ \t\r]*$", text, re.MULTILINE)
    if nat is not None:
        closing = re.compile(r"^(?:COMMIT|\*\S*)[ \t\r]*$", re.MULTILINE).search(text, nat.end())
        if closing is None or not closing.group().startswith("COMMIT"):
            raise IpmasqError(f"{path}:{_line_of(text, nat.start())}: the *nat table has no COMMIT: the dump is cut "
                              "short (iptables-save ends every table with COMMIT)")


def _check_chains(text: str, table: NatTable, path: str) -> None:
    """Rules only in declared chains (iptables-restore refuses any other). Chains that jump in a loop are left to
    the walk, which answers "cannot decide: loop" with the chains of the loop."""
    declared = set(table.chains) | _BUILTIN_NAT_CHAINS
    for number, name, line in save_lines(text):
        if name != "nat" or not line.startswith(("-A ", "-I ")):
            continue
        chain = line[3:].split(" ", 1)[0]
        if chain not in declared:
            raise IpmasqError(one_line(f"{path}:{number}: a rule of chain {clip(chain, 60)}, which the dump never "
                                       f"declares (:{clip(chain, 60)} - [0:0]): not iptables-save output"))


def read_nat_save(run: Runner, family: Family, *, variant: Variant | None = None) -> str:
    """`iptables-save -t nat` (or ip6tables-save) of the variant the node uses."""
    chosen = detect_variant(run) if variant is None else variant
    argv = [tools(chosen, family).save, "-t", "nat"]
    result = run(argv, None)
    if result.returncode != 0:
        raise BackendError(f"{argv[0]} -t nat failed", argv=tuple(argv), stderr=result.stderr,
                           returncode=result.returncode)
    return result.stdout


def read_nft_ruleset(run: Runner) -> str:
    """`nft -j list ruleset`, set elements included (check compares them)."""
    argv = ["nft", "-j", "list", "ruleset"]
    result = run(argv, None)
    if result.returncode != 0:
        raise BackendError("nft -j list ruleset failed", argv=tuple(argv), stderr=result.stderr,
                           returncode=result.returncode)
    return result.stdout


def iptables_nft_families(ruleset: str) -> tuple[Family, ...]:
    """The families whose iptables nat table iptables-nft keeps in this `nft -j list ruleset` (its `ip nat` and
    `ip6 nat` tables: kube-proxy's iptables mode, the agent's own iptables backend, anything written with iptables).
    nft's JSON shows iptables' matches and targets there as bare `xt` stubs without their arguments, so those tables
    are read with iptables-nft-save and walked in iptables' terms instead."""
    try:
        listing = json.loads(ruleset).get("nftables", [])
    except (ValueError, AttributeError):
        return ()
    named = {(item["table"].get("family"), item["table"].get("name")) for item in listing
             if isinstance(item, dict) and isinstance(item.get("table"), dict)}
    return tuple(family for family, key in ((Family.V4, ("ip", "nat")), (Family.V6, ("ip6", "nat")))
                 if key in named)


def read_iptables_nft_beside(run: Runner, ruleset: str, families: tuple[Family, ...]) -> dict[Family, NatTable]:
    """iptables-nft's nat tables on an nftables node, one per family the listing holds (see iptables_nft_families),
    as iptables-nft-save prints them."""
    return {family: parse_save(read_nat_save(run, family, variant=Variant.NFT))
            for family in iptables_nft_families(ruleset) if family in families}
