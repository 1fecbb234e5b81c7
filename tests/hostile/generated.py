"""The hostile inputs too big or too special to keep as files: made on demand under a temporary directory.

The small ones live beside this module (config/, dumps/, flowlogs/); these are a 50 MB file, 10 MB lines and
values, 100,000-deep nesting, a 5,000-deep jump chain, and paths that are no regular file (a FIFO, a socket,
/dev/zero behind a symlink, a directory, a symlink loop).
"""

from __future__ import annotations

import gzip
import itertools
import json
import os
import socket
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
TEN_MB = 10_000_000
SAVE_HEAD = "*nat\n:PREROUTING ACCEPT [0:0]\n:INPUT ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\n:POSTROUTING ACCEPT [0:0]\n"
GCP_RECORD = '{"connection": {"src_ip": "10.44.14.15", "dest_ip": "172.30.12.110"}, "disposition": "DENIED"}\n'


def corpus_file(kind: str, name: str) -> Path:
    """A committed case: tests/hostile/KIND/NAME."""
    path = HERE / kind / name
    assert path.is_file(), path
    return path


def sparse(path: Path, size: int) -> Path:
    """A file of `size` zero bytes that costs no disk: only reading it would cost memory."""
    with path.open("wb") as fh:
        fh.truncate(size)
    return path


def fifo(path: Path) -> Path:
    os.mkfifo(path)  # opening it for reading blocks until a writer comes; none ever does
    return path


def unix_socket(path: Path) -> Path:
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(path))  # the bound name stays after the socket object is collected
    server.close()
    return path


def symlink(path: Path, target: str) -> Path:
    path.symlink_to(target)
    return path


def directory(path: Path) -> Path:
    path.mkdir()
    return path


def symlink_loop(path: Path) -> Path:
    """A config directory whose only ip-masq* entry is a symlink pointing at itself (ELOOP when opened)."""
    path.mkdir()
    (path / "ip-masq-agent").symlink_to("ip-masq-agent")
    return path


def deep_yaml(depth: int) -> bytes:
    return b"nonMasqueradeCIDRs: " + b"[" * depth + b"]" * depth + b"\n"


def deep_json(depth: int) -> bytes:
    return b'{"nonMasqueradeCIDRs":\n' + b"[" * depth + b"]" * depth + b"}\n"


def huge_value_config() -> bytes:
    return b"nonMasqueradeCIDRs: [" + b"9" * TEN_MB + b"]\n"


def jump_chain(depth: int) -> bytes:
    """POSTROUTING -> C1 -> C2 -> ... -> C<depth> -> MASQUERADE: deeper than any real ruleset (xtables stops at 32k)."""
    chains = [f"C{i}" for i in range(1, depth + 1)]
    lines = [SAVE_HEAD, *(f":{c} - [0:0]\n" for c in chains), f"-A POSTROUTING -j {chains[0]}\n"]
    lines += [f"-A {a} -j {b}\n" for a, b in itertools.pairwise(chains)]
    lines += [f"-A {chains[-1]} -j MASQUERADE\n", "COMMIT\n"]
    return "".join(lines).encode()


def ten_mb_save_line() -> bytes:
    return (SAVE_HEAD + '-A POSTROUTING -m comment --comment "' + "x" * TEN_MB + '" -j MASQUERADE\nCOMMIT\n').encode()


def deep_nft(depth: int) -> bytes:
    return b'{"nftables": ' + b"[" * depth + b"]" * depth + b"}\n"


def nft_huge_string() -> bytes:
    table = {"table": {"family": "inet", "name": "ip-masq-agent", "handle": 1}}
    chain = {"chain": {"family": "inet", "table": "ip-masq-agent", "name": "x" * TEN_MB}}
    return json.dumps({"nftables": [table, chain]}).encode()


def ten_mb_flow_line() -> bytes:
    return (GCP_RECORD + '{"connection": {"src_ip": "' + "9" * TEN_MB + '", "dest_ip": "1.1.1.1"}}\n').encode()


def gzip_bomb() -> bytes:
    """200 MB of one line without a newline, gzipped to ~200 KB: reading it as lines would hold it all."""
    out = gzip.compress(b"", compresslevel=9)
    chunk = gzip.compress(b"x" * 20_000_000, compresslevel=9)
    return out + chunk * 10  # concatenated gzip members read as one stream


# name -> how to make it under a directory; the name says what it is
Maker = Callable[[Path], Path]
GENERATED: dict[str, Maker] = {
    "config-50mb": lambda d: sparse(d / "ip-masq-agent", 50_000_000),
    "config-fifo": lambda d: fifo(d / "ip-masq-agent"),
    "config-socket": lambda d: unix_socket(d / "ip-masq-agent"),
    "config-dev-zero-symlink": lambda d: symlink(d / "ip-masq-agent", "/dev/zero"),
    "config-directory-in-place": lambda d: directory(d / "ip-masq-agent"),
    "config-dir-symlink-loop": lambda d: symlink_loop(d / "config"),
    "config-symlink-loop": lambda d: symlink(d / "ip-masq-agent", "ip-masq-agent"),
    "config-yaml-100000": lambda d: write(d / "ip-masq-agent", deep_yaml(100_000)),
    "config-json-100000": lambda d: write(d / "ip-masq-agent.json", deep_json(100_000)),
    "config-10mb-value": lambda d: write(d / "ip-masq-agent", huge_value_config()),
    "dump-50mb": lambda d: sparse(d / "nat.save", 50_000_000),
    "dump-fifo": lambda d: fifo(d / "nat.save"),
    "dump-socket": lambda d: unix_socket(d / "nat.save"),
    "dump-dev-zero-symlink": lambda d: symlink(d / "nat.save", "/dev/zero"),
    "dump-directory": lambda d: directory(d / "nat.save"),
    "dump-jump-chain-5000": lambda d: write(d / "nat.save", jump_chain(5000)),
    "dump-10mb-line": lambda d: write(d / "nat.save", ten_mb_save_line()),
    "dump-nft-100000": lambda d: write(d / "ruleset.json", deep_nft(100_000)),
    "dump-nft-10mb-string": lambda d: write(d / "ruleset.json", nft_huge_string()),
    "flowlog-10mb-line": lambda d: write(d / "flows.jsonl", ten_mb_flow_line()),
    "flowlog-50mb": lambda d: sparse(d / "flows.log", 50_000_000),
    "flowlog-fifo": lambda d: fifo(d / "flows.log"),
    "flowlog-socket": lambda d: unix_socket(d / "flows.log"),
    "flowlog-dev-zero-symlink": lambda d: symlink(d / "flows.log", "/dev/zero"),
    "flowlog-directory": lambda d: directory(d / "flows.log"),
    "flowlog-gzip-one-line-200mb": lambda d: write(d / "flows.log.gz", gzip_bomb()),
}


def write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def make(name: str, root: Path) -> Path:
    """Make case `name` in its own directory under root; returns the path to give the command."""
    where = root / name
    where.mkdir()
    return GENERATED[name](where)


def aws_node_with_junk_env(size: int = 2**20) -> bytes:
    """The aws-node DaemonSet (as `kubectl get -o yaml` prints it) whose AWS_VPC_K8S_CNI_EXCLUDE_SNAT_CIDRS is `size`
    bytes of comma-separated junk: ~190,000 entries of 1 to 8 characters that are not CIDRs."""
    import random

    alphabet = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789./:"
    draw = random.Random(1)  # the same corpus every run
    entries, total = [], 0
    while total < size:
        entry = "".join(draw.choice(alphabet) for _ in range(draw.randint(1, 8)))
        entries.append(entry)
        total += len(entry) + 1
    return ("apiVersion: apps/v1\nkind: DaemonSet\nmetadata:\n  name: aws-node\n  namespace: kube-system\nspec:\n"
            "  template:\n    spec:\n      containers:\n      - name: aws-node\n        env:\n"
            "        - name: AWS_VPC_K8S_CNI_EXCLUDE_SNAT_CIDRS\n"
            f"          value: {json.dumps(','.join(entries))}\n").encode()
