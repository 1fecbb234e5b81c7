"""Observe mode on real netfilter: another program writes the node's rules (a stand-in for GKE's agent, applying a
fixed rule set with iptables-restore), `ipmasq agent --observe gke` beside it says whether they enforce the config,
and writes nothing: the node's nat table stays byte for byte what the writer wrote, and a pod's connection leaves
with the source address the writer's rules give it, whatever the observer reports.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from ipmasq.lab.kubelet import publish
from ipmasq.lab.netns import Network
from ipmasq.testing.writers import aws_snat_rules, ip_masq_agent_rules
from tests.conftest import ROOT
from tests.eventually import eventually
from tests.kernel.agent.test_metrics import get, scrape
from tests.kernel.agent_harness import AWS_DB, NODE, ONPREM, POD, World, agent, world

GKE_FLAGS = ("--masq-chain", "IP-MASQ", "--nomasq-all-reserved-ranges", "--random-fully=false")
GKE_DEFAULT = (ROOT / "tests" / "dumps" / "gke-1.14-aws-vpn.save").read_text()  # what GKE's agent writes
TEN = "nonMasqueradeCIDRs: [10.0.0.0/8]\n"


def _rendered(config: Path) -> str:
    """The rules the writer writes once it has caught up with `config` (its chain, no --random-fully)."""
    return subprocess.run([sys.executable, "-m", "ipmasq", "render", "--config", str(config), *GKE_FLAGS],
                          check=True, capture_output=True, text=True).stdout


def _table(text: str) -> list[str]:
    """The rules, without the comments (a timestamp) and the chains' packet counters (traffic moves them)."""
    return [line.split(" [")[0] if line.startswith(":") else line for line in text.splitlines()
            if not line.startswith("#")]


def _passes(node: object, result: str) -> float:
    return scrape(node).get(f"ipmasq_syncs_total{{result={result}}}", 0.0)  # type: ignore[arg-type]


def test_the_observer_reports_a_config_the_writers_rules_miss_and_writes_nothing(net: Network, tmp_path: Path) -> None:
    with world(net) as w:
        w.node.run(["iptables-restore", "--noflush"], stdin=GKE_DEFAULT)
        written = _table(w.nat())
        assert w.seen(AWS_DB) == POD  # GKE's defaults: the AWS VPC (172.16/12) sees the pod
        directory = str(tmp_path / "config")
        publish(directory, "")
        with agent(w.node, tmp_path / "agent.log", "--observe", "gke", *GKE_FLAGS, "--config",
                   f"{directory}/ip-masq-agent", "--api", "off") as observer:
            eventually(lambda: _passes(w.node, "in-sync") >= 1,
                       lambda: f"an in-sync pass of the observer\n{observer.log}")
            assert get(w.node, "/readyz")[0] == 200
            # the ConfigMap changes, the writer's rules do not: out of sync, still ready, nothing written
            publish(directory, TEN)
            eventually(lambda: _passes(w.node, "out-of-sync") >= 1, lambda: f"an out-of-sync pass\n{observer.log}")
            code, body = get(w.node, "/readyz")
            assert code == 200 and "observing" in body, body
            assert observer.lines("do not enforce the config") and "172.16.0.0/12" in observer.log
            assert _table(w.nat()) == written and w.seen(AWS_DB) == POD
            # the writer catches up: in sync again, seen from the rules alone (no config change in between)
            w.node.run(["iptables", "-t", "nat", "-F", "IP-MASQ"])
            w.node.run(["iptables-restore", "--noflush"], stdin=_rendered(Path(directory) / "ip-masq-agent"))
            in_sync = _passes(w.node, "in-sync")
            eventually(lambda: _passes(w.node, "in-sync") > in_sync + 1, lambda: f"in sync again\n{observer.log}")
            assert observer.lines("enforce the config (policy")
            assert w.seen(AWS_DB) == NODE  # the writer's new rules masquerade it, as the config says
            assert "observe mode" in observer.log and not observer.lines("took the node lock")


# The observer of a provider's agent, on the node's real rules: its inputs as the API server's followers hand them
# over (ipmasq.observe.provider_inputs.input_of; the followers themselves are proven on the fake API server in the unit
# tests), the live read of the node's nat table, the writer's own comparison. Prints one verdict per input.
_OBSERVE_PROVIDER = """
import json, logging, sys
from ipmasq.observe.observer import Observer
from ipmasq.observe.provider_inputs import EnvState, compare_for, input_of, load_for
from ipmasq.backends.runner import SubprocessRunner
from ipmasq.kube.configmaps import ConfigMapState
from ipmasq.writers import WRITERS

writer, inputs = sys.argv[1], json.loads(sys.argv[2])
profile = WRITERS[writer]
observer = Observer(profile.options, SubprocessRunner(), log=logging.getLogger("observe"), writer=writer,
                    backend="iptables", load=load_for(profile), compare=compare_for(profile))
for given in inputs:
    if writer == "eks":
        states = [EnvState("kube-system", "aws-node", True, tuple(sorted(given.items())))]
    else:
        states = [ConfigMapState("kube-system", name, True, keys=tuple((k, v.encode()) for k, v in keys.items()))
                  for name, keys in sorted(given.items())]
    observer.take_config(input_of(states))
    report = observer.reconcile()
    print(json.dumps([report.result.value, report.mismatch]))
"""


def _observe_provider(w: World, writer: str, inputs: list[dict[str, Any]]) -> list[tuple[str, str | None]]:
    out = w.node.run([sys.executable, "-c", _OBSERVE_PROVIDER, writer, json.dumps(inputs)])
    return [(result, mismatch) for result, mismatch in map(json.loads, out.stdout.splitlines())]


def test_the_observer_compares_aws_snat_chain_with_the_aws_node_env_and_writes_nothing(net: Network) -> None:
    with world(net) as w:
        w.node.run(["iptables-restore", "--noflush"], stdin=aws_snat_rules("10.142.0.0/16", ("10.2.0.0/16",), NODE))
        written = _table(w.nat())
        exclude = "AWS_VPC_K8S_CNI_EXCLUDE_SNAT_CIDRS"
        verdicts = _observe_provider(w, "eks", [{exclude: "10.2.0.0/16"}, {exclude: "10.2.0.0/16,172.30.0.0/16"},
                                                {exclude: "10.2.0.0/16", "AWS_VPC_K8S_CNI_EXTERNALSNAT": "true"}])
        assert verdicts[0] == ("in-sync", None), verdicts
        assert verdicts[1][0] == "out-of-sync" and "172.30.0.0/16" in str(verdicts[1][1]), verdicts
        assert verdicts[2][0] == "out-of-sync" and "EXTERNALSNAT=true" in str(verdicts[2][1]), verdicts
        # what the observer said of 172.30.0.0/16, the peer sees: SNATed to the node; and nothing was written
        assert w.seen(AWS_DB) == NODE and _table(w.nat()) == written


def test_the_observer_merges_aks_s_fragments_against_the_node_s_chain_and_writes_nothing(net: Network) -> None:
    reconciled = {"azure-ip-masq-agent-config-reconciled": {
        "ip-masq-agent-reconciled": "nonMasqueradeCIDRs: [10.224.0.0/12]\nmasqLinkLocal: false\n"}}
    both = {**reconciled, "azure-ip-masq-agent-config": {"ip-masq-agent": "nonMasqueradeCIDRs: [10.0.0.0/8]\n"}}
    with world(net) as w:
        w.node.run(["iptables-restore", "--noflush"],
                   stdin=ip_masq_agent_rules("IP-MASQ-AGENT", ("10.224.0.0/12",), random_fully=False))
        written = _table(w.nat())
        verdicts = _observe_provider(w, "aks", [reconciled, both])
        assert verdicts[0] == ("in-sync", None), verdicts
        # the user's fragment is merged in by AKS, not yet applied on the node: 10.0.0.0/8 is still masqueraded
        assert verdicts[1][0] == "out-of-sync" and "10.0.0.0/8" in str(verdicts[1][1]), verdicts
        assert w.seen(ONPREM) == NODE and _table(w.nat()) == written
