"""The one way a test finds a program it runs: on PATH (or where its own install puts it), a failure under CI and a
skip elsewhere when it is missing, naming where it comes from.

kubectl is the Kubernetes lab's own when the lab is built (tests/conftest.py puts it first on PATH; scripts/test.sh
builds the lab before the tests when it runs as root), so its kustomize is the one the lab's release ships."""

from __future__ import annotations

import os
import shutil

import pytest

__all__ = ["KUBECTL", "PROMTOOL", "need"]

KUBECTL = "the Kubernetes lab's kubectl (ipmasq lab --kubernetes --prepare, which scripts/test.sh runs as root), or " \
          "any kubectl on PATH"
PROMTOOL = "Debian's prometheus package, which scripts/bootstrap.sh installs"


def need(tool: str, where: str, *, also: tuple[str, ...] = ()) -> str:
    """The path of `tool`: on PATH, else the first of `also` that is executable."""
    found = shutil.which(tool) or next((path for path in also if os.access(path, os.X_OK)), None)
    if found is None:
        if os.environ.get("CI"):
            pytest.fail(f"{tool} is missing: it comes from {where}")
        pytest.skip(f"{tool} is missing: it comes from {where}")
    return found
