"""The agent's /metrics, /healthz and /readyz, scraped from a real agent inside a namespace (client there too).

Readiness goes false on a bad ConfigMap update and true again after a good one, while the last good rules stay;
drift repairs and reloads are counted; `ipmasq health` gives the exec probes' exit codes; JSON logs are one
object per line; /metrics is served without prometheus-client installed (the library only parses it here).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from ipmasq.lab.kubelet import publish
from ipmasq.lab.netns import Namespace, Network
from tests.conftest import ROOT
from tests.eventually import eventually
from tests.kernel.agent_harness import agent

ADDRESS = "127.0.0.1:9847"  # the default, on the namespace's own loopback
GOOD = "nonMasqueradeCIDRs: [10.0.0.0/8, 172.30.0.0/16]\nresyncInterval: 60s\n"
BAD = "nonMasqueradeCIDRs:\n  - 10.0.0.0/8\n  - 10.0.0.1/8\nresyncInterval: 60s\n"
GOOD_AGAIN = "nonMasqueradeCIDRs: [10.0.0.0/8]\nresyncInterval: 60s\n"


def health(node: Namespace, *args: str) -> subprocess.CompletedProcess[str]:
    return node.run([sys.executable, "-m", "ipmasq", "health", *args], check=False)


def get(node: Namespace, path: str, address: str = ADDRESS) -> tuple[int, str]:
    script = ("import sys, urllib.request, urllib.error\n"
              "try:\n    r = urllib.request.urlopen(sys.argv[1], timeout=5)\n"
              "    print(r.status); print(r.read().decode())\n"
              "except urllib.error.HTTPError as e:\n    print(e.code); print(e.read().decode())\n")
    out = node.run([sys.executable, "-c", script, f"http://{address}{path}"]).stdout
    code, _, body = out.partition("\n")
    return int(code), body


def scrape(node: Namespace) -> dict[str, float]:
    code, text = get(node, "/metrics")
    assert code == 200, text
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "version")
            samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return samples


def nat_rules(node: Namespace, backend: str) -> tuple[int, int]:
    """(rules, set elements) of ours as the kernel lists them."""
    if backend == "iptables":
        save = node.run(["iptables-save", "-t", "nat"]).stdout.splitlines()
        # the ownership marker's rule is a record, not a rule of the chain (ipmasq_rules leaves it out)
        return sum(1 for line in save if line.startswith("-A") and "IP-MASQ-AGENT" in line
                   and not line.startswith("-A IPMASQ-OWNS-")), 0
    listing = node.run(["nft", "list", "table", "inet", "ip-masq-agent"]).stdout
    rules = listing.count('comment "ip-masq-agent: ')  # every rule of ours carries one
    elements = sum(len(e.split(",")) for e in listing.split("elements = {")[1:] for e in [e.split("}")[0]])
    return rules, elements


@pytest.mark.parametrize("backend", ["iptables", "nftables"])
def test_readiness_follows_the_config_and_metrics_count_what_happened(net: Network, tmp_path: Path,
                                                                      backend: str) -> None:
    node = net.add("node")
    config_dir = tmp_path / "config"
    publish(str(config_dir), GOOD)
    with agent(node, tmp_path / "agent.log", f"--config={config_dir}/ip-masq-agent", f"--backend={backend}",
               f"--metrics-address={ADDRESS}") as running:
        eventually(lambda: health(node).returncode == 0, lambda: f"ready\n{running.log}")
        ready = health(node)
        assert ready.stdout.strip() == "ready: the kernel matches the current config"
        live = health(node, "--live")
        assert live.returncode == 0 and live.stdout.startswith("alive: the loop's last heartbeat was")
        m = scrape(node)
        assert m["ipmasq_syncs_total{result=applied}"] == 1 and m["ipmasq_config_reloads_total"] == 1
        assert m["ipmasq_ready"] == 1 and m["ipmasq_config_valid"] == 1
        assert m[f"ipmasq_build_info{{backend={running_backend(running.log)}}}"] == 1
        rules, elements = nat_rules(node, backend)
        assert (m["ipmasq_rules{family=ipv4}"], m["ipmasq_set_elements{family=ipv4}"]) == (rules, elements)
        assert rules > 0 and (elements > 0) == (backend == "nftables")
        # a pass since the agent started (the age is no wall-clock bound: a loaded machine only makes both larger)
        assert 0 <= m["ipmasq_seconds_since_last_successful_sync"] <= time.time() - m["process_start_time_seconds"]
        assert m["process_resident_memory_bytes"] > 0

        publish(str(config_dir), BAD)
        eventually(lambda: health(node).returncode == 1, lambda: f"not ready with the bad config\n{running.log}")
        not_ready = health(node)
        assert not_ready.stderr.strip().startswith("not ready: config error: ")
        assert "ip-masq-agent:3" in not_ready.stderr and "10.0.0.1/8" in not_ready.stderr
        code, body = get(node, "/readyz")
        assert code == 503 and body.strip() == not_ready.stderr.strip()
        assert health(node, "--live").returncode == 0  # a bad config is not a reason to restart the agent
        m = scrape(node)
        assert m["ipmasq_ready"] == 0 and m["ipmasq_config_valid"] == 0 and m["ipmasq_config_load_errors_total"] == 1
        assert nat_rules(node, backend) == (rules, elements)  # the last good config stays enforced

        publish(str(config_dir), GOOD_AGAIN)
        eventually(lambda: health(node).returncode == 0, lambda: f"ready again\n{running.log}")
        m = scrape(node)
        assert m["ipmasq_config_reloads_total"] == 2 and m["ipmasq_config_load_errors_total"] == 1
        assert m["ipmasq_syncs_total{result=applied}"] == 2 and m["ipmasq_drift_repairs_total"] == 0
        assert m["ipmasq_rules{family=ipv4}"] == nat_rules(node, backend)[0]

        # drift: someone empties our objects; SIGHUP resyncs at once instead of waiting 60 s
        if backend == "iptables":
            node.run(["iptables", "-t", "nat", "-F", "IP-MASQ-AGENT"])
        else:
            node.run(["nft", "flush", "set", "inet", "ip-masq-agent", "nomasq_v4"])
        running.proc.send_signal(1)
        eventually(lambda: scrape(node)["ipmasq_drift_repairs_total"] == 1,
                   lambda: f"one drift repair counted\n{running.log}")
        assert health(node).returncode == 0
    # one line per event, nothing per scrape or probe
    assert len(running.lines("config error")) == 1 and len(running.lines("repaired drift")) == 1
    assert not running.lines("GET /")


def running_backend(log: str) -> str:
    line = next(line for line in log.splitlines() if "agent started: backend " in line)
    return line.split("agent started: backend ", 1)[1].split(", config ")[0]


def test_health_command_exit_codes(net: Network, tmp_path: Path) -> None:
    node = net.add("node")
    unreachable = health(node)  # no agent: nothing listens on the namespace's loopback
    assert unreachable.returncode == 1
    assert unreachable.stderr.strip().startswith(f"cannot reach the agent at {ADDRESS}: ")
    assert health(node, "--address=nonsense").returncode == 2
    with agent(node, tmp_path / "agent.log", f"--config={tmp_path}/absent", "--backend=iptables",
               "--metrics-address=127.0.0.1:9999") as running:
        # no config file: the reference defaults, applied: ready
        eventually(lambda: health(node, "--address=127.0.0.1:9999").returncode == 0,
                   lambda: f"ready on 127.0.0.1:9999\n{running.log}")
        assert health(node).returncode == 1  # the default port: not where this agent listens
        code, body = get(node, "/nowhere", "127.0.0.1:9999")
        assert code == 404 and body.startswith("not found")


def test_json_logs_are_one_object_per_line(net: Network, tmp_path: Path) -> None:
    node = net.add("node")
    config_dir = tmp_path / "config"
    publish(str(config_dir), GOOD)
    with agent(node, tmp_path / "agent.log", f"--config={config_dir}/ip-masq-agent", "--backend=iptables",
               "--log-format=json") as running:
        eventually(lambda: health(node).returncode == 0, lambda: f"ready\n{running.log}")
        publish(str(config_dir), BAD)
        eventually(lambda: health(node).returncode == 1, lambda: f"not ready\n{running.log}")
    entries = [json.loads(line) for line in running.log.splitlines()]
    messages = [(e["level"], e["msg"]) for e in entries]
    assert ("info", "serving /metrics, /healthz and /readyz on 127.0.0.1:9847") in messages
    assert any(level == "info" and msg.startswith("applied IPv4 rules") for level, msg in messages)
    assert any(level == "error" and msg.startswith("config error:") and "10.0.0.1/8" in msg for level, msg in messages)
    assert all(set(e) == {"time", "level", "logger", "msg"} for e in entries)


def test_metrics_are_served_without_prometheus_client(net: Network, tmp_path: Path) -> None:
    node = net.add("node")
    shadow = tmp_path / "shadow" / "prometheus_client"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('simulated: not installed')\n")
    with agent(node, tmp_path / "agent.log", f"--config={tmp_path}/absent", "--backend=iptables",
               env={"PYTHONPATH": f"{tmp_path / 'shadow'}:{ROOT / 'src'}"}) as running:
        eventually(lambda: health(node).returncode == 0, lambda: f"ready\n{running.log}")
        m = scrape(node)  # parsed by prometheus-client in this process; the agent cannot import it
        assert m["ipmasq_syncs_total{result=applied}"] == 1 and m["ipmasq_ready"] == 1
        assert m["ipmasq_rules{family=ipv4}"] == nat_rules(node, "iptables")[0]
        assert m["process_resident_memory_bytes"] > 0 and m["process_open_fds"] > 0
        agent_rss = int(next(line for line in Path(f"/proc/{running.proc.pid}/status").read_text().splitlines()
                             if line.startswith("VmRSS:")).split()[1]) * 1024
        assert abs(m["process_resident_memory_bytes"] - agent_rss) < 4 * 1024 * 1024  # the agent's own, not ours
    assert not running.lines("WARNING")
    assert running.lines("serving /metrics, /healthz and /readyz on 127.0.0.1:9847")
