"""`lint --writer NAME`: before a ConfigMap is applied, the keys a provider's agent would ignore (ipmasq.writers),
each at its line with what happens to that traffic, so that "GKE's managed agent ignores masqueradeCIDRs" is said
before apply rather than found on a node.

Pure: a file's bytes in (a raw config, or a manifest holding the ip-masq-agent ConfigMap), findings out.
"""

from __future__ import annotations

from ipmasq.config.model import MasqConfig
from ipmasq.errors import ConfigError
from ipmasq.findings import Finding, Severity
from ipmasq.lint.manifest import configmap_config
from ipmasq.writers import AKS_CONFIGMAPS, REFERENCE_CONFIGMAP, REFERENCE_KEY, Sources, Writer, ignored, intended

__all__ = ["IGNORED_BY_WRITER", "writer_findings"]

IGNORED_BY_WRITER = "ignored-by-writer"  # the same id as check's: one fact, said before apply and on the node
_AKS_USER_KEY = "ip-masq-agent"  # the key of the user's fragment, azure-ip-masq-agent-config


def writer_findings(source: str, data: bytes, writer: Writer) -> list[Finding]:
    """ignored-by-writer findings for one linted file, read as `writer` reads it: for AKS as the user's fragment
    (azure-ip-masq-agent-config), for the others as the ip-masq-agent ConfigMap's `config`. Nothing when the file
    is not a config lint can read (lint's own findings say why)."""
    try:
        text = data.decode("utf-8")
        embedded = configmap_config(text)
    except (UnicodeDecodeError, ValueError):
        return []
    config = data if embedded is None else embedded.encode("utf-8", "surrogatepass")
    if writer.name == "aks":
        sources = Sources({AKS_CONFIGMAPS[1]: {_AKS_USER_KEY: config}})
    else:
        sources = Sources({REFERENCE_CONFIGMAP: {REFERENCE_KEY: config}})
    writes: MasqConfig | ConfigError
    try:
        writes = intended(writer, sources)
    except ConfigError as exc:
        writes = exc  # refused: the keys it ignores may be why (enableIPv6), and are said either way
    found = ignored(writer, ((source, config),), writes)
    # configmap_config keeps a literal block's lines those of the manifest (blank lines in front); a quoted string's
    # (kubectl's JSON) cannot be mapped back: no line rather than a wrong one
    mapped = embedded is None or embedded.startswith("\n")
    return [Finding(IGNORED_BY_WRITER, Severity.ERROR if item.changes_traffic else Severity.WARNING,
                    item.message(located=False), item.hint(), file=source, line=item.line if mapped else None,
                    destinations=item.changed) for item in found]
