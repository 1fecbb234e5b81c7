"""sha256 that does not load OpenSSL for small inputs: `import hashlib` maps libcrypto, about 3.4 MiB of the node
agent's resident memory, for digests of a few KiB (a policy, an nf_tables table's header) that CPython's own
built-in sha256 takes in microseconds. Large inputs (a legacy iptables table of tens of MiB) still go to OpenSSL,
about 8 times faster there; the digest is the same either way.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from importlib import import_module
from typing import Any, Protocol

__all__ = ["LARGE_INPUT_BYTES", "Sha256", "sha256", "sha256_of_lines"]

LARGE_INPUT_BYTES = 1 << 20


class Sha256(Protocol):
    def update(self, data: Any, /) -> None: ...
    def digest(self) -> bytes: ...
    def hexdigest(self) -> str: ...


def sha256(data: Any = b"", *, expected_bytes: int = 0) -> Sha256:
    """A sha256 object over `data`; `expected_bytes`: how much more will be fed with update() (picks OpenSSL)."""
    if len(data) + expected_bytes >= LARGE_INPUT_BYTES:
        import hashlib

        return hashlib.sha256(data)
    return _builtin()(data)


# Lines hashed per update: one update per line costs more in calls than the hash itself (100,000 rules)
_LINES_PER_UPDATE = 256


def sha256_of_lines(lines: Iterable[str], *, expected_bytes: int = 0) -> str:
    """The hex sha256 of `lines`, each ended by a newline (UTF-8), fed a few hundred at a time; `expected_bytes`: as
    for sha256 (a rough size of the whole, to pick OpenSSL for large inputs)."""
    digest = sha256(expected_bytes=expected_bytes)
    pending = iter(lines)
    while chunk := list(itertools.islice(pending, _LINES_PER_UPDATE)):
        digest.update(("\n".join(chunk) + "\n").encode())
    return digest.hexdigest()


def _builtin() -> Callable[[Any], Sha256]:
    for name in ("_sha2", "_sha256"):  # CPython 3.12 and later; 3.11
        try:
            constructor: Callable[[Any], Sha256] = import_module(name).sha256
        except (ImportError, AttributeError):
            continue
        return constructor
    import hashlib  # a Python built without them

    return hashlib.sha256
