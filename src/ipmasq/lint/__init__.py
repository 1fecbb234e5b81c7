"""`ipmasq lint`'s pure core: findings (ipmasq.findings) for config files and ip-masq-agent ConfigMap manifests."""

from ipmasq.lint.config import Expectations, Placement, lint_config
from ipmasq.lint.hints import HINTS
from ipmasq.lint.manifest import AGENT_CONFIGMAP, AGENT_NAMESPACE, lint_source, nothing_to_lint

__all__ = [
    "AGENT_CONFIGMAP",
    "AGENT_NAMESPACE",
    "HINTS",
    "Expectations",
    "Placement",
    "lint_config",
    "lint_source",
    "nothing_to_lint",
]
