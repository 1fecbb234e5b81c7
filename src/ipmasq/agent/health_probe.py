"""The client side of the agent's endpoints: the listen address format and the GET `ipmasq health` sends.

Kept apart from ipmasq.agent.health (the server) so that `ipmasq health`, which the DaemonSet's exec probes run
every few seconds inside the agent's container, imports nothing of the agent: only ipmasq.http11 (h11), the HTTP
the API client and the status responder use too.
"""

from __future__ import annotations

from typing import NamedTuple

from ipmasq import http11
from ipmasq.errors import UsageError

__all__ = ["DEFAULT_METRICS_ADDRESS", "AgentAnswer", "parse_listen_address", "query"]

# Not 9253 (NodeLocal DNSCache's metrics port on every GKE node, also php-fpm_exporter's), nor 9100 (node-exporter),
# 9099 (calico), 9153 (CoreDNS), 9808 (CSI livenessprobe), 9962-9965 (cilium), 10248-10259 (kubelet, kube-proxy).
DEFAULT_METRICS_ADDRESS = "127.0.0.1:9847"


class AgentAnswer(NamedTuple):
    """What an endpoint said: ok when it answered 200; `why` is its one-line body, or why it could not be asked."""

    ok: bool
    why: str


def parse_listen_address(text: str) -> tuple[str, int]:
    """HOST:PORT, [V6]:PORT or :PORT (all addresses) -> (host, port); a UsageError names what is wrong."""
    host, sep, port_text = text.rpartition(":")
    if not sep or not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise UsageError(f"invalid address {text!r}: expected HOST:PORT, e.g. {DEFAULT_METRICS_ADDRESS}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port_text)


QUERY_MAX_BYTES = 1 << 20  # an endpoint's answer is a line; /metrics a few KiB


def query(address: str, path: str, *, timeout: float = 3.0) -> AgentAnswer:
    """GET one endpoint of a running agent: ok when it answered 200; `why` is its one-line answer or the failure.
    `timeout` bounds the whole exchange, and the answer is bounded by QUERY_MAX_BYTES as it arrives."""
    host, port = parse_listen_address(address)
    host = host or "127.0.0.1"
    authority = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    deadline = http11.Deadline(timeout)
    try:
        connection = http11.connect(host, port, deadline)
    except http11.HttpError as exc:
        return AgentAnswer(False, f"cannot reach the agent at {address}: {exc}")
    try:
        connection.send_request("GET", path, {"Host": authority, "Connection": "close"}, None, deadline)
        head = connection.receive_head(deadline)
        body = connection.read_body(deadline, QUERY_MAX_BYTES)
    except http11.HttpError as exc:
        return AgentAnswer(False, f"cannot reach the agent at {address}: {exc}")
    finally:
        connection.close()
    text = body.decode(errors="replace").strip()
    line = text.splitlines()[0] if text else f"HTTP {head.status}"
    return AgentAnswer(head.status == 200, line)
