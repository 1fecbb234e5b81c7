"""Reading the dump files `check --from-dump` and `trace --dump` take: one clear error line, never a traceback."""

from __future__ import annotations

from ipmasq.errors import IpmasqError

__all__ = ["read_dump_file"]


def read_dump_file(path: str) -> tuple[str, str]:
    """(path shown in messages, text); `-` is stdin."""
    import sys

    if path == "-":
        return "<stdin>", sys.stdin.read()
    try:
        with open(path, encoding="utf-8") as fh:
            return path, fh.read()
    except OSError as exc:
        raise IpmasqError(f"{path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise IpmasqError(f"{path}: not a text file (expected iptables-save or nft -j output)") from None
