"""A real Prometheus server inside a lab namespace, scraping the lab's agents, and a client for its HTTP API.

The server runs as `prometheus --config.file=... --storage.tsdb.path=...` in the monitoring namespace; its address
exists only there, so the lab talks to it through a relay: this module run inside the same namespace
(`python -m ipmasq.lab.prometheus relay BASE_URL`), reading one API path per line on stdin and answering each with
one line of JSON. Nothing listens on the machine's own network.

The alert rules are the product's (ipmasq.monitoring), with every `for:` shortened so a lab run sees alerts go
pending and firing within seconds.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ipmasq.errors import PrometheusError
from ipmasq.lab.netns import Namespace, stop_process
from ipmasq.lab.wait import until
from ipmasq.monitoring import JOB, rule_group

__all__ = ["PORT", "FiredAlert", "PrometheusServer", "ScrapeTarget", "alert_rule_groups",
           "prometheus_config", "relay"]

PORT = 9090
START_TIMEOUT = 20.0
QUERY_TIMEOUT = 5.0


@dataclass(frozen=True)
class ScrapeTarget:
    """One agent's /metrics endpoint and the labels Prometheus attaches to its series."""

    address: str  # HOST:PORT
    labels: tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class FiredAlert:
    """One entry of /api/v1/alerts: an alert instance and its state (pending or firing)."""

    name: str
    state: str
    labels: tuple[tuple[str, str], ...]

    def label(self, key: str) -> str | None:
        return dict(self.labels).get(key)


def alert_rule_groups(for_seconds: float) -> list[dict[str, Any]]:
    """The fleet's alert rules (ipmasq.monitoring, as deploy/monitoring/ ships them), every `for:` shortened."""
    return [rule_group(for_override=f"{for_seconds:g}s")]


def prometheus_config(targets: Sequence[ScrapeTarget], rules_file: str) -> dict[str, Any]:
    """prometheus.yml (JSON is YAML): scrape and evaluate every second, one static target per agent."""
    return {
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
        "rule_files": [rules_file],
        "scrape_configs": [{
            "job_name": JOB,
            "static_configs": [{"targets": [t.address], "labels": dict(t.labels)} for t in targets],
        }],
    }


class PrometheusServer:
    """`prometheus` in `namespace`, listening on `address`:9090; `query()` and `alerts()` through the relay."""

    def __init__(self, namespace: Namespace, address: str, workdir: str) -> None:
        self.namespace = namespace
        self.address = address
        self.workdir = workdir
        self.log_path = os.path.join(workdir, "prometheus.log")
        self._server: subprocess.Popen[str] | None = None
        self._relay: subprocess.Popen[str] | None = None
        self._lock = threading.Lock()

    @property
    def base_url(self) -> str:
        return f"http://{self.address}:{PORT}"

    def start(self, targets: Sequence[ScrapeTarget], *, for_seconds: float,
              scrape_configs: list[dict[str, Any]] | None = None, binary: str | None = None,
              rule_groups: list[dict[str, Any]] | None = None) -> None:
        """Scrape `targets` (static), or the jobs `scrape_configs` instead (the Kubernetes lab's service
        discovery, with `binary`: a Prometheus built with it, which Debian's is not); evaluate the fleet's alert rules
        with every `for:` shortened to `for_seconds`, or `rule_groups` instead."""
        binary = binary or shutil.which("prometheus")
        if binary is None:
            raise PrometheusError("prometheus is not installed (Debian: apt-get install prometheus)")
        os.makedirs(self.workdir, exist_ok=True)
        rules_file = os.path.join(self.workdir, "rules.yml")
        config_file = os.path.join(self.workdir, "prometheus.yml")
        with open(rules_file, "w") as fh:
            json.dump({"groups": alert_rule_groups(for_seconds) if rule_groups is None else rule_groups}, fh,
                      indent=1)
        with open(config_file, "w") as fh:
            config = prometheus_config(targets, rules_file)
            if scrape_configs is not None:
                config["scrape_configs"] = scrape_configs
            json.dump(config, fh, indent=1)
        log = open(self.log_path, "a")  # noqa: SIM115 - the server process owns it until it exits
        self._server = self.namespace.popen(
            [binary, f"--config.file={config_file}", f"--storage.tsdb.path={os.path.join(self.workdir, 'data')}",
             f"--web.listen-address={self.address}:{PORT}", "--storage.tsdb.retention.time=1h"],
            stdout=log, stderr=subprocess.STDOUT)
        log.close()
        self._relay = self.namespace.popen([sys.executable, "-m", "ipmasq.lab.prometheus", "relay", self.base_url],
                                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        server = self._server
        until(lambda: "Ready" in self._get_raw("/-/ready"), f"prometheus ready (log: {self.log_path})",
              timeout=START_TIMEOUT, error=PrometheusError,
              gone=lambda: None if server.poll() is None else f"prometheus exited with {server.returncode}")

    @property
    def processes(self) -> list[subprocess.Popen[str]]:
        return [p for p in (self._relay, self._server) if p is not None]

    def _get_raw(self, path: str) -> str:
        """One relay round trip: the path goes in, one line comes out (`error ...` when the server did not answer)."""
        relay = self._relay
        if relay is None or relay.stdin is None or relay.stdout is None:
            raise PrometheusError("the Prometheus relay is not running")
        with self._lock:
            try:
                relay.stdin.write(path + "\n")
                relay.stdin.flush()
                line = relay.stdout.readline()
            except OSError as exc:
                raise PrometheusError(f"the Prometheus relay died: {exc}") from None
        if not line:
            raise PrometheusError(f"the Prometheus relay exited with {relay.poll()}")
        kind, _, body = line.rstrip("\n").partition(" ")
        return body if kind == "ok" else ""

    def _api(self, path: str) -> Any:
        body = self._get_raw(path)
        if not body:
            raise PrometheusError(f"prometheus did not answer {path} (log: {self.log_path})")
        try:
            answer = json.loads(body)
        except json.JSONDecodeError:
            raise PrometheusError(f"prometheus answered {path} with non-JSON") from None
        if not isinstance(answer, dict) or answer.get("status") != "success":
            raise PrometheusError(f"prometheus refused {path}: {str(answer)[:200]}")
        return answer.get("data")

    def query(self, expr: str) -> list[tuple[dict[str, str], float]]:
        """An instant vector query: (labels, value) per series."""
        data = self._api("/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
        if not isinstance(data, dict) or data.get("resultType") != "vector":
            raise PrometheusError(f"query {expr!r} did not return a vector")
        return [(dict(item["metric"]), float(item["value"][1])) for item in data["result"]]

    def alerts(self) -> list[FiredAlert]:
        data = self._api("/api/v1/alerts")
        return [FiredAlert(str(a["labels"].get("alertname", "")), str(a["state"]), tuple(sorted(a["labels"].items())))
                for a in data["alerts"]]

    def stop(self) -> None:
        for proc in self.processes:
            stop_process(proc)
        self._server = self._relay = None


def relay(base_url: str) -> int:
    """Inside the monitoring namespace: GET base_url+PATH for each PATH line; print `ok BODY` or `error WHY`."""
    for line in sys.stdin:
        path = line.strip()
        try:
            with urllib.request.urlopen(base_url + path, timeout=QUERY_TIMEOUT) as response:
                body = response.read().decode()
            # Prometheus' JSON is one line already, its /-/ready text is not: flatten either to one line
            print("ok " + " ".join(body.split()) if not body.lstrip().startswith("{")
                  else "ok " + json.dumps(json.loads(body), separators=(",", ":")), flush=True)
        except (OSError, ValueError) as exc:
            print(f"error {' '.join(str(exc).split())}", flush=True)
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "relay":
        raise SystemExit(relay(sys.argv[2]))
    print("usage: python -m ipmasq.lab.prometheus relay BASE_URL", file=sys.stderr)
    raise SystemExit(2)
