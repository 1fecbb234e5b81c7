"""The agent's HTTP endpoints (/metrics, /healthz, /readyz) and the client `ipmasq health` uses to query them.

The DaemonSet runs with hostNetwork, so the port is the node's: it listens on loopback by default and the
kubelet's probes are exec probes (`ipmasq health`) run inside the pod, which shares that loopback.

    /healthz   200 while the loop is alive: its heartbeat is recent (a wedged loop fails though this thread answers)
    /readyz    200 while the kernel matches the current config; 503 while the config is bad (the last good config
               is still enforced) or the backend fails
    /metrics   Prometheus text format 0.0.4 (ipmasq.agent.exposition: no library needed)
    /settings  what the agent enforces from: its config path, policy flags, node name and backend, as one line of
               JSON (`ipmasq check` run in the agent's container, by kubectl exec, compares with these)

Bodies are one line, the reason, so `ipmasq health` can print it as is.

A second listener (--prometheus-address, the DaemonSet gives it the node's own address) serves /metrics alone, for
Prometheus to scrape from outside the node, as Cilium's agent serves its own: what a scraper may reach is the
metrics, never /settings or the probes' endpoints, which stay on loopback. Nor, unless the operator opts in
(`rule_series`, the agent's --prometheus-rule-metrics), the per-rule series: their labels are the config rules'
names and their values each rule's traffic, which the whole pod network could otherwise read off the node's port.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import select
import socket
import threading

from ipmasq.agent.exposition import CONTENT_TYPE
from ipmasq.agent.health_probe import DEFAULT_METRICS_ADDRESS, parse_listen_address, query
from ipmasq.agent.metrics import AgentVitals, render_metrics
from ipmasq.agent.reports import ProbeVerdict
from ipmasq.agent.responder import Responder, Response, listen
from ipmasq.errors import IpmasqError

# the client side lives in ipmasq.agent.health_probe, so `ipmasq health` (an exec probe, every few seconds, in the
# agent's container) does not import the agent; it is re-exported here
__all__ = ["DEFAULT_METRICS_ADDRESS", "EndpointServer", "parse_listen_address", "query", "respond",
           "respond_metrics_only"]

# A port in use (the agent being replaced still serves it during a rolling update) is tried again this often.
BIND_RETRY_SECONDS = 1.0


def respond(status: AgentVitals, path: str) -> Response:
    """What each endpoint answers; the responder (ipmasq.agent.responder) has already taken the query string off."""
    if path == "/healthz":
        return _check(status.liveness())
    if path == "/readyz":
        return _check(status.readiness())
    if path == "/metrics":
        return Response(200, render_metrics(status), CONTENT_TYPE)
    if path == "/settings":
        return Response(200, json.dumps(status.settings, sort_keys=True).encode() + b"\n", "application/json")
    return Response(404, b"not found: try /metrics, /healthz, /readyz or /settings\n")


def respond_metrics_only(status: AgentVitals, path: str, *, rule_series: bool = False) -> Response:
    """The scrape listener's answers: /metrics (the per-rule series only with `rule_series`), and nothing else (not
    even whether another path exists)."""
    if path == "/metrics":
        return Response(200, render_metrics(status, rule_series=rule_series), CONTENT_TYPE)
    return Response(404, b"not found: only /metrics is served here\n")


def _check(check: ProbeVerdict) -> Response:
    return Response(200 if check.ok else 503, check.why.encode() + b"\n")


class EndpointServer:
    """The endpoints on a daemon thread; `start()` binds (raising IpmasqError when it cannot) and serves.

    With `wait_if_in_use`, a port another process holds (the old agent, during a rolling update on a hostNetwork
    node) is not fatal: the thread tries again every BIND_RETRY_SECONDS until it binds or the server is stopped.
    """

    def __init__(self, status: AgentVitals, address: str, *, metrics_only: bool = False,
                 flag: str = "--metrics-address", rule_series: bool = False) -> None:
        self.status = status
        self.address = address
        self.metrics_only = metrics_only
        self.rule_series = rule_series  # metrics_only: the per-rule series served too
        self.flag = flag  # named in what the agent logs about this listener
        self.what = "/metrics" if metrics_only else "/metrics, /healthz and /readyz"
        self._listener: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC)

    def _bind(self) -> socket.socket:
        return listen(*parse_listen_address(self.address))

    def start(self, *, wait_if_in_use: bool = False, log: logging.Logger | None = None) -> None:
        try:
            server = self._bind()
        except OSError as exc:
            if not (wait_if_in_use and exc.errno == errno.EADDRINUSE):
                raise IpmasqError(f"cannot listen on {self.address} ({self.flag}): "
                                  f"{exc.strerror or exc}") from None
            if log is not None:
                log.warning("cannot listen on %s (%s): %s (another agent during an update?); trying again every %gs",
                            self.address, self.flag, exc.strerror or exc, BIND_RETRY_SECONDS)
            self._thread = threading.Thread(target=self._bind_later, args=(log,), name="ipmasq-status", daemon=True)
            self._thread.start()
            return
        self._listener = server
        self._thread = threading.Thread(target=self._serve, args=(server,), name="ipmasq-status", daemon=True)
        self._thread.start()

    def _bind_later(self, log: logging.Logger | None) -> None:
        while not select.select([self._wake_r], [], [], BIND_RETRY_SECONDS)[0]:
            try:
                server = self._bind()
            except OSError:
                continue
            self._listener = server
            if log is not None:
                log.info("serving %s on %s", self.what, self.address)
            self._serve(server)
            return

    def _serve(self, listener: socket.socket) -> None:
        # poll() sleeps until a client or the wake pipe: an idle agent does not wake for its endpoints at all, and
        # stop() (SIGTERM) ends the thread at once
        def answer(path: str) -> Response:
            if self.metrics_only:
                return respond_metrics_only(self.status, path, rule_series=self.rule_series)
            return respond(self.status, path)

        Responder(listener, answer, self._wake_r).run()

    @property
    def port(self) -> int:
        assert self._listener is not None
        return int(self._listener.getsockname()[1])

    @property
    def serving(self) -> bool:
        return self._listener is not None

    def stop(self) -> None:
        if self._thread is not None:
            os.write(self._wake_w, b"x")
            self._thread.join(5)
            self._thread = None
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        os.close(self._wake_r)
        os.close(self._wake_w)
