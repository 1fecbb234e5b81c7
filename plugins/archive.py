"""Build the krew archive of `kubectl ipmasq` (plugins/ipmasq.yaml names it) and print its sha256.

    python3 plugins/archive.py OUT.tar.gz

The archive is byte-for-byte reproducible (sorted members, fixed owners, modes and times, gzip without a time), so
the digest in the manifest can be checked against a fresh build: tests/unit/test_kubectl_plugin.py does.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import sys
import tarfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
# name in the archive -> the file, and its mode: the launcher krew links onto PATH, the completion launcher kubectl
# runs when it is on PATH too, and the licence the code is under (an archive without it cannot be redistributed)
MEMBERS = {
    "LICENSE": (HERE.parent / "LICENSE", 0o644),
    "kubectl-ipmasq": (HERE / "kubectl-ipmasq", 0o755),
    "kubectl_complete-ipmasq": (HERE / "kubectl_complete-ipmasq", 0o755),
}


def archive() -> bytes:
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for name in sorted(MEMBERS):
            path, mode = MEMBERS[name]
            data = path.read_bytes()
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime, info.uid, info.gid = len(data), mode, 0, 0, 0
            info.uname = info.gname = "root"
            tar.addfile(info, io.BytesIO(data))
    out = io.BytesIO()
    with gzip.GzipFile(fileobj=out, mode="wb", mtime=0, filename="") as compressed:
        compressed.write(raw.getvalue())
    return out.getvalue()


def main(argv: list[str]) -> int:
    data = archive()
    if argv:
        Path(argv[0]).write_bytes(data)
    print(hashlib.sha256(data).hexdigest())
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
