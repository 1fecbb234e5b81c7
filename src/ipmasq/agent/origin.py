"""Where a config came from, carried as a value beside the config itself from the follower to the status.

The loop reads the mounted file and takes the API's content (ipmasq.agent.api.config) as one pair, config and origin;
the origin of the content a pass enforced travels in its report to whoever writes about it. Nobody calls back to ask
where a config came from: a status object names the ConfigMap's resourceVersion of the very content the kernel was
verified to hold (never a newer one that arrived meanwhile), and a rejected config's origin is a field, not a guess
from its error's text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["FILE", "ConfigOrigin"]


@dataclass(frozen=True, slots=True)
class ConfigOrigin:
    source: Literal["api", "file"]
    # config_digest of the content as the API shows it (None: the file's, or not known)
    digest: str | None = None
    # (name, resourceVersion) of each followed ConfigMap that holds this content (source "api")
    configmaps: tuple[tuple[str, str], ...] = ()
    # whether any followed ConfigMap exists, as the API last listed them (None: not listed yet, or no API)
    exists: bool | None = None


FILE = ConfigOrigin("file")
