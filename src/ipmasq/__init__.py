"""ipmasq: pod SNAT for Kubernetes nodes that operators can see, trust and prove."""

__all__ = ["__version__"]

__version__ = "0.3.0"  # the one place the release is written: pyproject.toml, the image and deploy/ follow it
