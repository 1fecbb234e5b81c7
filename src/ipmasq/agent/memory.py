"""Giving the heap the agent freed back to the kernel, after the passes that allocate the most.

A pass after a config change (the config parsed, a policy built, the rules rendered and written) and the start-up
(argparse's parser, the imports' temporaries) free megabytes in the middle of glibc's heap, which glibc keeps
resident: it returns only a free top of the heap by itself. malloc_trim(0) also hands back the free pages inside
(madvise). Idle resyncs allocate little, so they skip it. Where malloc_trim does not exist (musl), nothing happens.

Before it, a full garbage collection: besides any cycles, it empties the interpreter's free lists (tuples, floats,
lists, dicts) that a pass fills when it drops thousands of small objects at once (a parsed config, a parsed nft
set's ranges), so their pools are free again instead of held for objects of that one size.
What each step hands back is measured in docs/measurements.md.
"""

from __future__ import annotations

import ctypes
import gc
from collections.abc import Callable

__all__ = ["release_free_memory"]

_trim: Callable[[int], int] | None = None
_looked_up = False


def release_free_memory() -> bool:
    """A full collection, then malloc_trim(0); False when the C library has no malloc_trim."""
    global _trim, _looked_up
    gc.collect()
    if not _looked_up:
        _looked_up = True
        try:
            _trim = ctypes.CDLL(None).malloc_trim  # the process's own symbols: libc is loaded already
        except (OSError, AttributeError):
            _trim = None
    if _trim is None:
        return False
    _trim(0)
    return True
