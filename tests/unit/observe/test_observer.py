"""Observe mode: another program's rules compared with the config by check's comparison; nothing ever written."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from ipmasq.agent.reports import SyncResult
from ipmasq.config.source import ConfigInput
from ipmasq.diagnose.check import NodeRules
from ipmasq.errors import BackendError, ConfigError
from ipmasq.netfilter.iptables import parse_save
from ipmasq.observe.observer import Observer, mismatch_line
from ipmasq.options import PolicyOptions
from ipmasq.policy.policy import Policy
from ipmasq.prefix import Family
from tests.conftest import ROOT

GKE = PolicyOptions(masq_chain="IP-MASQ", nomasq_all_reserved_ranges=True, random_fully=False)
GKE_DEFAULT = (ROOT / "tests" / "dumps" / "gke-1.14-aws-vpn.save").read_text()  # what GKE's agent writes
LOG = logging.getLogger("test")


def config(text: str) -> ConfigInput:
    return ConfigInput((("configmap/ip-masq-agent[config]", text.encode()),))


class Node:
    """The node as the observer reads it: the writer's rules (iptables-save text), and a fingerprint that moves
    with every write, as the kernel's nf_tables generation does."""

    def __init__(self, text: str) -> None:
        self.text, self.generation, self.reads = text, 1, 0

    def write(self, text: str) -> None:
        self.text, self.generation = text, self.generation + 1

    def read(self, _policy: Policy) -> NodeRules:
        self.reads += 1
        return NodeRules("iptables", {Family.V4: parse_save(self.text)})


def observer(node: Node) -> Observer:
    return Observer(GKE, runner=None, log=LOG, writer="gke", fingerprint=lambda: node.generation,  # type: ignore[arg-type]
                    read_rules=node.read)


def test_the_writers_rules_for_the_config_are_in_sync_and_a_config_they_miss_is_out_of_sync() -> None:
    node = Node(GKE_DEFAULT)
    watcher = observer(node)
    assert not watcher.take_config(config("")).readiness.ok  # nothing looked at yet
    report = watcher.reconcile()
    assert report.result is SyncResult.IN_SYNC and report.mismatch is None and report.readiness.ok
    assert report.policy_hash is not None and report.config_digest is not None and report.writes == ()
    # the ConfigMap changes, the writer's rules do not: reported, and still ready (drift is never NotReady)
    seen = watcher.take_config(config("nonMasqueradeCIDRs: [10.0.0.0/8]\n"))
    assert seen.changed and seen.readiness.ok
    report = watcher.reconcile()
    assert report.result is SyncResult.OUT_OF_SYNC and report.readiness.ok
    assert report.mismatch is not None and report.mismatch.startswith("rules-differ")
    assert "172.16.0.0/12" in report.mismatch  # what the node lets go unmasqueraded that the config does not


def test_an_idle_pass_reads_nothing_until_the_rules_change_and_equal_rules_are_not_compared_again() -> None:
    node = Node(GKE_DEFAULT)
    watcher = observer(node)
    watcher.take_config(config(""))
    for _ in range(5):
        assert watcher.reconcile().result is SyncResult.IN_SYNC
    assert node.reads == 1 and watcher.comparisons == 1
    node.write(GKE_DEFAULT)  # a writer re-applying the same rules: the generation moves, the rules do not
    assert watcher.reconcile().result is SyncResult.IN_SYNC
    assert node.reads == 2 and watcher.comparisons == 1
    only_masquerade = "\n".join(line for line in GKE_DEFAULT.splitlines() if "RETURN" not in line) + "\n"
    node.write(only_masquerade)  # the writer lost its config: only the MASQUERADE rule left
    report = watcher.reconcile()
    assert report.result is SyncResult.OUT_OF_SYNC and watcher.comparisons == 2
    assert report.mismatch is not None and "config-not-applied" in report.mismatch


def test_rules_that_cannot_be_read_make_it_not_ready_and_a_bad_config_keeps_the_last_good_one() -> None:
    node = Node(GKE_DEFAULT)
    failing = {"now": True}

    def read(policy: Policy) -> NodeRules:
        if failing["now"]:
            raise BackendError("iptables-save -t nat failed", stderr="Permission denied (you must be root)")
        return node.read(policy)

    watcher = Observer(GKE, runner=None, log=LOG, writer="gke", read_rules=read)  # type: ignore[arg-type]
    watcher.take_config(config(""))
    report = watcher.reconcile()
    assert report.result is SyncResult.FAILED and not report.readiness.ok
    assert "iptables-save -t nat failed" in (report.backend_error or "")
    failing["now"] = False
    assert watcher.reconcile().result is SyncResult.IN_SYNC
    bad = watcher.take_config(ConfigError("invalid CIDR '10.0.0.0/33'", source="configmap/ip-masq-agent[config]",
                                          line=1))
    assert bad.config_error is not None and bad.readiness.ok  # observing goes on against the last good config
    report = watcher.reconcile()
    assert report.result is SyncResult.IN_SYNC and report.config_error is not None


def test_observe_mode_holds_nothing_that_could_write() -> None:
    """The Observer holds no backend: only the config half (the enforcing agent's own) and a name for the loop."""
    watcher = observer(Node(GKE_DEFAULT))
    assert watcher.backend.name == "observe (gke)"
    held = [watcher.backend, watcher._config, *vars(watcher._config).values()]
    assert not [value for value in held if any(hasattr(value, name) for name in ("apply", "remove_all", "run"))]


def test_the_mismatch_line_is_one_line_bounded_and_counts_what_it_leaves_out() -> None:
    from ipmasq.findings import Finding, Severity

    findings = [Finding(f"id-{i}", Severity.ERROR, "x\x1b[2K" * 400, "fix") for i in range(5)]
    line = mismatch_line([*findings, Finding("w", Severity.WARNING, "only a warning", "fix")])
    assert line is not None and line.isprintable() and len(line) <= 600 and line.endswith(" (and 3 more)")
    assert mismatch_line([Finding("w", Severity.WARNING, "only a warning", "fix")]) is None


def test_the_live_read_runs_only_readers_and_finds_the_writers_chain_in_its_variant() -> None:
    """The whole pass over the real reader (ipmasq.diagnose.sources, as `ipmasq check` reads a node): the runner it
    is given sees only reads; the writer's rules are in iptables-nft, iptables-legacy is empty."""
    from ipmasq.backends.base import Result
    from ipmasq.testing import FakeRunner

    ran: list[tuple[str, ...]] = []

    def answer(argv: Sequence[str], stdin: str | None) -> Result:
        ran.append(tuple(argv))
        if argv[0] == "iptables-nft-save":
            return Result(0, GKE_DEFAULT)
        if argv[0].endswith("-save"):
            return Result(0, "")
        return Result(1, "", "nft: not here")

    watcher = Observer(GKE, FakeRunner(answer), log=LOG, writer="gke", backend="iptables")
    watcher.take_config(config(""))
    assert watcher.reconcile().result is SyncResult.IN_SYNC
    watcher.take_config(config("nonMasqueradeCIDRs: [10.0.0.0/8]\n"))
    assert watcher.reconcile().result is SyncResult.OUT_OF_SYNC
    assert ran and all(argv[0].endswith("-save") or argv[:3] == ("nft", "-j", "list") for argv in ran), ran


def test_a_key_gkes_agent_ignores_is_said_beside_never_a_mismatch() -> None:
    from ipmasq.observe.observer import reference_reading
    from ipmasq.writers import WRITERS

    load, compare = reference_reading(WRITERS["gke"])
    gke_writes = "\n".join(line for line in GKE_DEFAULT.splitlines() if "172.16.0.0/12" not in line) + "\n"
    node = Node(gke_writes)
    watcher = Observer(GKE, runner=None, log=LOG, writer="gke", fingerprint=lambda: node.generation,  # type: ignore[arg-type]
                       read_rules=node.read, load=load, compare=compare)
    # GKE's agent reads nonMasqueradeCIDRs and writes exactly that chain; masqueradeCIDRs is ipmasq's own
    text = ("nonMasqueradeCIDRs: [10.0.0.0/8, 192.168.0.0/16, 100.64.0.0/10, 192.0.0.0/24, 192.0.2.0/24, "
            "192.88.99.0/24, 198.18.0.0/15, 198.51.100.0/24, 203.0.113.0/24, 240.0.0.0/4]\n"
            "masqueradeCIDRs: [10.11.0.0/24]\n")
    watcher.take_config(config(text))
    report = watcher.reconcile()
    assert report.result is SyncResult.IN_SYNC and report.mismatch is None, report.mismatch
    assert report.ignored == ("GKE's managed agent ignores masqueradeCIDRs (configmap/ip-masq-agent[config]:2): "
                              "10.11.0.0/24 stays un-masqueraded; enforce with ipmasq to use it")
    # without the key, nothing is said; a real difference stays a mismatch, the ignored key beside it
    watcher.take_config(config(text.replace("masqueradeCIDRs: [10.11.0.0/24]\n", "")))
    assert watcher.reconcile().ignored is None
    watcher.take_config(config(text.replace("10.0.0.0/8, ", "")))
    report = watcher.reconcile()
    assert report.result is SyncResult.OUT_OF_SYNC and report.mismatch is not None
    assert report.mismatch.startswith("rules-differ") and "ignores" not in report.mismatch
    assert report.ignored is not None and "10.11.0.0/24" in report.ignored
