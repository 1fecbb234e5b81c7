"""ipmasq: pod SNAT for Kubernetes nodes that operators can see, trust and prove."""

__all__ = ["__version__"]

__version__ = "0.1.0"
