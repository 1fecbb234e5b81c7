"""What every Kubernetes lab test needs: root, the Debian packages, and no cluster already up (a kept one)."""

from __future__ import annotations

import os

import pytest

from ipmasq.lab.kubernetes.artifacts import missing_packages
from ipmasq.lab.kubernetes.cluster import cluster_is_up


def require_kubernetes_lab() -> None:
    """Skip without root or a package (fail when CI is set: there the lab must run); fail if a cluster is up."""
    missing = missing_packages()
    if missing or os.geteuid() != 0:
        reason = f"the Kubernetes lab needs root and {' '.join(missing)}"
        if os.environ.get("CI"):
            pytest.fail(f"{reason} (CI is set: the Kubernetes lab must run)")
        pytest.skip(reason)
    if cluster_is_up():
        pytest.fail("a Kubernetes lab cluster is already up (ipmasq lab --kubernetes --down removes it)")
