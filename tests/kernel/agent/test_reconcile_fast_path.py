"""The idle pass's fast path against the real kernel, per backend and iptables variant: once a full read matched, an
idle pass runs no program at all; a change by another program (our rule deleted, a foreign table touched, in
nf_tables or in iptables-legacy, either family) is noticed on the very next pass, read in full and repaired."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest

from ipmasq.lab.netns import Network

# Each case: the agent's backend and variant, and what another program runs to delete one of our rules.
CASES = {
    "nftables": ("nftables", "auto",
                 ["nft", "delete", "element", "inet", "ip-masq-agent", "nomasq_v4", "{ 172.30.0.0/16 }"]),
    "iptables-nft": ("iptables", "nft", ["iptables-nft", "-t", "nat", "-D", "IP-MASQ-AGENT", "1"]),
    "iptables-legacy": ("iptables", "legacy", ["iptables-legacy", "-t", "nat", "-D", "IP-MASQ-AGENT", "1"]),
}
# Changes that are not ours and touch none of our rules: the pass after each must read (not take the fast path),
# write nothing, and stay in sync.
FOREIGN_CHANGES = (
    ["nft", "add", "table", "ip", "someone-else"],
    ["iptables-nft", "-t", "nat", "-N", "KUBE-NFT-CHAIN"],
    ["iptables-legacy", "-t", "nat", "-N", "KUBE-LEGACY-CHAIN"],
    ["ip6tables-legacy", "-t", "nat", "-A", "POSTROUTING", "-d", "fd00::1/128", "-j", "MASQUERADE"],
)

SCRIPT = textwrap.dedent("""
    import json, logging, subprocess, sys
    from ipmasq.agent.reconcile import Reconciler
    from ipmasq.backends.choose import make_backend
    from ipmasq.backends.generation import KernelFingerprint
    from ipmasq.backends.xtables_lock import xtables_lock_path
    from ipmasq.backends.runner import SubprocessRunner
    from ipmasq.config import ConfigInput
    from ipmasq.options import PolicyOptions

    backend_name, variant, tamper, foreign = json.loads(sys.argv[1])
    calls = []

    class Counting(SubprocessRunner):
        def __call__(self, argv, stdin=None):
            calls.append(argv[0])
            return super().__call__(argv, stdin)

        def stream(self, argv, chunks):
            calls.append(argv[0])
            return super().stream(argv, chunks)

        def read_lines(self, argv, consume):
            calls.append(argv[0])
            return super().read_lines(argv, consume)

    options = PolicyOptions()
    backend, others = make_backend(backend_name, options, Counting(), variant=variant)
    rec = Reconciler(backend, options, log=logging.getLogger("agent"), others=others,
                     fingerprint=KernelFingerprint(xtables_lock=xtables_lock_path()))
    rec.take_config(ConfigInput((("/etc/config/ip-masq-agent",
                                  b"nonMasqueradeCIDRs: [10.0.0.0/8, 172.30.0.0/16]\\n"),)))

    def step(what):
        del calls[:]
        report = rec.reconcile()
        return {"what": what, "result": report.result.value, "programs": len(calls), "drift": report.drift_repair,
                "ready": report.readiness.ok}

    out = [step("install"), step("read back"), step("idle"), step("idle")]
    subprocess.run(tamper, check=True)
    out += [step("after tamper"), step("read back"), step("idle")]
    for argv in foreign:
        subprocess.run(argv, check=True)
        out += [step("after foreign: " + " ".join(argv)), step("idle")]
    print(json.dumps(out))
""")


@pytest.mark.parametrize("case", list(CASES))
def test_idle_passes_run_nothing_and_another_programs_change_is_seen_next_pass(net: Network, case: str) -> None:
    backend, variant, tamper = CASES[case]
    node = net.add("node")
    out = node.run([sys.executable, "-c", SCRIPT, json.dumps([backend, variant, tamper, FOREIGN_CHANGES])],
                   timeout=120)
    steps = json.loads(out.stdout)
    by_what = [(s["what"], s["result"], s["programs"] > 0, s["drift"], s["ready"]) for s in steps]
    expected = [
        ("install", "applied", True, False, True),
        ("read back", "in-sync", True, False, True),  # our own write moved the fingerprint: one full read
        ("idle", "in-sync", False, False, True),  # then no program at all
        ("idle", "in-sync", False, False, True),
        ("after tamper", "applied", True, True, True),  # another program's delete: read, repaired as drift
        ("read back", "in-sync", True, False, True),
        ("idle", "in-sync", False, False, True),
    ]
    for argv in FOREIGN_CHANGES:
        expected += [(f"after foreign: {' '.join(argv)}", "in-sync", True, False, True),
                     ("idle", "in-sync", False, False, True)]
    assert by_what == expected
