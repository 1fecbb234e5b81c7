import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VECTORS = ROOT / "tests" / "vectors"  # the reference agent's measured behaviour, see its README
PYTHON = sys.executable


def _lab_kubectl_first() -> None:
    """The Kubernetes lab's own kubectl (the release its cluster runs, built by `ipmasq lab --kubernetes --prepare`)
    first on PATH when it is built: the tests' kubectl then matches the API server it talks to, and kustomize is the
    one that release ships, whatever kubectl the machine has."""
    import os

    from ipmasq.lab.kubernetes.artifacts import cache_dir

    kubectl = cache_dir() / "kubernetes" / "bin" / "kubectl"
    if os.access(kubectl, os.X_OK) and (cache_dir() / "kubernetes" / "key.json").exists():
        os.environ["PATH"] = f"{kubectl.parent}{os.pathsep}{os.environ.get('PATH', '')}"


_lab_kubectl_first()
