"""Run the lab's scenarios: the real `ipmasq agent` on the node, configs published like kubelet does.

The lab waits for the node's kernel to hold what the agent should have written (read through the same backend
code the agent uses, from outside the agent), then probes; it never waits by sleeping and hoping.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field

from ipmasq.backends.base import Backend
from ipmasq.backends.iptables import IptablesBackend, Variant
from ipmasq.backends.nftables import NftablesBackend
from ipmasq.errors import IpmasqError, LabError
from ipmasq.lab.kubelet import publish
from ipmasq.lab.netns import NamespaceRunner, stop_process
from ipmasq.lab.scenarios import NO_RULES, Phase, PhaseResult, Scenario, policy_for, run_phase
from ipmasq.lab.topology import Lab
from ipmasq.lab.wait import until
from ipmasq.options import PolicyOptions
from ipmasq.policy.policy import Policy
from ipmasq.prefix import Family

__all__ = ["NodeAgent", "ScenarioResult", "run_scenario"]

SYNC_TIMEOUT = 15.0


@dataclass
class NodeAgent:
    """`ipmasq agent` running in the lab's node namespace, with its ConfigMap directory."""

    lab: Lab
    backend: str
    flags: tuple[str, ...]
    config_dir: str
    proc: subprocess.Popen[str] | None = None
    log_path: str = ""
    node_name: str | None = None  # --node-name of the next start (selects the config rules with nodes)

    def start(self) -> None:
        self.log_path = os.path.join(self.lab.workdir, "agent.log")
        log = open(self.log_path, "a")  # noqa: SIM115 - the agent process owns it until it exits
        argv = [sys.executable, "-m", "ipmasq", "agent", "--config", os.path.join(self.config_dir, "ip-masq-agent"),
                "--backend", self.backend, *self.flags]
        if self.node_name is not None:
            argv.append(f"--node-name={self.node_name}")
        self.proc = self.lab.node.popen(argv, stdout=log, stderr=subprocess.STDOUT)
        log.close()

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        if self.proc is None:
            return
        stop_process(self.proc)
        self.proc = None

    def uninstall(self, options: PolicyOptions) -> None:
        self.lab.node.run([sys.executable, "-m", "ipmasq", "uninstall", f"--masq-chain={options.masq_chain}"])

    def kernel(self, families: tuple[Family, ...] | None = None) -> Backend:
        """The node's rules as the agent's backend reads them; `families`: those to read (default: the flags')."""
        runner = NamespaceRunner(self.lab.node)
        if self.backend == "iptables":
            # the lab's node is created with the default iptables (nft variant); the agent detects the same
            return IptablesBackend(runner, chain=self._chain(), variant=Variant.NFT,
                                   families=families or self._families())
        return NftablesBackend(runner)

    def _chain(self) -> str:
        for flag in self.flags:
            if flag.startswith("--masq-chain="):
                return flag.split("=", 1)[1]
        return PolicyOptions().masq_chain

    def _families(self) -> tuple[Family, ...]:
        return (Family.V4, Family.V6) if "--enable-ipv6" in self.flags else (Family.V4,)

    def wait_synced(self, policy: Policy, *, timeout: float = SYNC_TIMEOUT) -> None:
        kernel = self.kernel(policy.families)  # a config's enableIPv6 counts as the flag does
        proc = self.proc
        until(lambda: all(kernel.read(f) == kernel.desired(policy, f) for f in policy.families),
              f"the node's rules reaching the config (agent log: {self.log_path})", timeout=timeout, interval=0.05,
              gone=lambda: None if proc is None or proc.poll() is None else f"the agent exited with {proc.returncode}")

    def wait_empty(self, policy: Policy) -> None:
        kernel = self.kernel()
        if not all(kernel.read(f).empty for f in policy.families):
            raise LabError("rules of ours are still on the node after uninstall")


@dataclass
class ScenarioResult:
    name: str
    summary: str
    phases: list[PhaseResult] = field(default_factory=list)
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and all(p.ok for p in self.phases)


def run_scenario(lab: Lab, scenario: Scenario, *, backend: str) -> ScenarioResult:
    result = ScenarioResult(scenario.name, scenario.summary)
    config_dir = os.path.join(lab.workdir, f"config-{scenario.name}")
    publish(config_dir, None)  # the ConfigMap volume exists, the key does not (yet)
    agent = NodeAgent(lab, backend, scenario.flags, config_dir)
    started = False

    def prepare(phase: Phase) -> None:
        nonlocal started
        if phase.agent == "uninstalled":
            agent.stop()
            agent.uninstall(phase.options)
            agent.wait_empty(policy_for(NO_RULES, phase.options))
            return
        if started and (phase.recreate_node or phase.options.node_name != agent.node_name):
            # a new node comes up (a new name is a new node): nothing of the old one's netfilter survives, and
            # its agent starts from scratch
            agent.stop()
            lab.reset_node()
        agent.node_name = phase.options.node_name
        publish(config_dir, phase.config)
        if not agent.running and phase.agent == "running":
            agent.start()
            started = True
        if agent.running:
            agent.wait_synced(policy_for(phase.config, phase.options))
        for rule in phase.hand_written:
            lab.node.run(rule.command)  # what an operator typed on the node, after the agent wrote its rules
        if phase.agent == "stopped":
            agent.stop()
            agent.wait_synced(policy_for(phase.config, phase.options), timeout=0)  # SIGTERM left the rules

    touches_node = any(p.recreate_node or p.hand_written for p in scenario.phases)
    try:
        for phase in scenario.phases:
            result.phases.append(run_phase(lab, phase, prepare))
    except IpmasqError as exc:
        result.error = str(exc)
    finally:
        agent.stop()
        options = scenario.phases[0].options
        subprocess.run(lab.node.argv([sys.executable, "-m", "ipmasq", "uninstall",
                                      f"--masq-chain={options.masq_chain}"]), capture_output=True)
        if touches_node:
            # rules written by hand are no agent's to uninstall: the next scenario starts on a clean node
            subprocess.run(lab.node.argv(["nft", "flush", "ruleset"]), capture_output=True)
    return result
