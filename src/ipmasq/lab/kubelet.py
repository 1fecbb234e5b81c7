"""Update a config directory the way kubelet updates a ConfigMap volume (atomic, through `..data`).

Layout kubelet maintains (AtomicWriter):

    DIR/..2024_01_01_00_00_00.123456789/ip-masq-agent   one directory per version
    DIR/..data -> ..2024_01_01_00_00_00.123456789        swapped by rename(2): readers see old or new, never half
    DIR/ip-masq-agent -> ..data/ip-masq-agent            created once

`publish(dir, text)` makes a new version and swaps; `publish(dir, None)` removes the key (the ConfigMap
disappeared or lost its key), which is what an agent sees when the ConfigMap is deleted.
"""

from __future__ import annotations

import os
import shutil
import time

__all__ = ["KEY", "publish"]

KEY = "ip-masq-agent"


def publish(directory: str, text: str | None, *, key: str = KEY) -> str:
    """Write a new version of `key` and atomically point `..data` at it; returns the version directory."""
    os.makedirs(directory, exist_ok=True)
    stamp = time.strftime("..%Y_%m_%d_%H_%M_%S", time.gmtime()) + f".{time.time_ns() % 10**9:09d}"
    version = os.path.join(directory, stamp)
    os.mkdir(version)
    if text is not None:
        with open(os.path.join(version, key), "w") as fh:
            fh.write(text)
    data = os.path.join(directory, "..data")
    old = os.readlink(data) if os.path.islink(data) else None
    tmp = os.path.join(directory, "..data_tmp")
    if os.path.lexists(tmp):
        os.unlink(tmp)
    os.symlink(stamp, tmp)
    os.rename(tmp, data)  # the atomic swap
    link = os.path.join(directory, key)
    if text is not None and not os.path.lexists(link):
        os.symlink(os.path.join("..data", key), link)
    elif text is None and os.path.lexists(link):
        os.unlink(link)
    if old is not None:
        shutil.rmtree(os.path.join(directory, old), ignore_errors=True)
    return version
