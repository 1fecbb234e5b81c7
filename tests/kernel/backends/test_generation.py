"""The iptables-legacy fingerprint's remembered walk against the real kernel: a nat table of 3,000 commented rules
(~1.3 MiB, about 20 chunks) in a throwaway namespace, read again and again by one reader. Traffic moving counters
alone is no change (and walks only the chunks it touched); every edit that keeps the table's size is noticed on the
next read, also where counters moved in the same chunk in the same interval: one CIDR changed for another, a chain
renamed to a name of the same length, a jump sent to another chain. Each digest equals a fresh reader's."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

from ipmasq.lab.netns import Network

SCRIPT = textwrap.dedent("""
    import json, socket, subprocess
    from ipmasq.backends.generation import KernelFingerprint, LegacyNatDigests
    from ipmasq.backends.xtables_lock import xtables_lock_path
    from ipmasq.prefix import Family

    def sh(*argv):
        subprocess.run(argv, check=True, capture_output=True)

    lines = ["*nat", ":MASQ-A - [0:0]", ":MASQ-B - [0:0]", "-A OUTPUT -d 127.9.0.0/16 -j MASQ-A"]
    for i in range(3000):
        if i == 1500:  # the test's traffic (over loopback) stops here: its counters move, the rules around it do not
            lines.append('-A MASQ-A -d 127.9.0.0/16 -m comment --comment "hit by the test traffic" -j RETURN')
        lines.append(f'-A MASQ-A -d 20.{i >> 8}.{i & 255}.0/24 -m comment --comment "not masqueraded {i}" -j RETURN')
    # a MASQUERADE rule, as the agent's: its target turns conntrack on in the namespace, without which the nat
    # table sees no packet and no counter moves
    lines += ['-A MASQ-B -m comment --comment "the other chain" -j RETURN',
              "-A POSTROUTING -d 192.0.2.0/24 -j MASQUERADE", "COMMIT", ""]
    subprocess.run(["iptables-legacy-restore"], input="\\n".join(lines), text=True, check=True)

    def traffic(connections):
        # each datagram from a new socket is a new conntrack entry: the nat table sees its first packet
        for port in range(connections):
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.sendto(b"x", ("127.9.0.7", 9000 + port))

    reader = LegacyNatDigests()
    agents = KernelFingerprint(xtables_lock=xtables_lock_path())  # as `ipmasq agent` builds it
    out = []

    def step(what):
        table = reader.read(Family.V4)
        out.append({"what": what, "digest": table.digest.hex(), "walked": table.walked_bytes,
                    "size": table.chunks[-1].end, "chunks": len(table.chunks),
                    "fresh": LegacyNatDigests().read(Family.V4).digest.hex(),
                    "agent's": agents.legacy(Family.V4).hex()})

    step("first read")
    step("idle")
    traffic(20)
    step("counters moved")
    traffic(5)
    # the rule right after the one the traffic hits: the same chunk, one CIDR for another (same size)
    sh("iptables-legacy", "-t", "nat", "-R", "MASQ-A", "1502", "-d", "21.0.0.0/24", "-m", "comment",
       "--comment", "not masqueraded 1500", "-j", "RETURN")
    step("a CIDR changed where counters moved")
    step("idle")
    sh("iptables-legacy", "-t", "nat", "-R", "MASQ-A", "2900", "-d", "22.0.0.0/24", "-m", "comment",
       "--comment", "not masqueraded 2898", "-j", "RETURN")
    step("a CIDR changed, no traffic")
    sh("iptables-legacy", "-t", "nat", "-E", "MASQ-B", "MASQ-C")
    step("a chain renamed")
    sh("iptables-legacy", "-t", "nat", "-R", "OUTPUT", "1", "-d", "127.9.0.0/16", "-j", "MASQ-C")
    step("a jump to another chain")
    traffic(5)
    step("counters moved again")
    print(json.dumps(out))
""")


def test_legacy_fingerprint_notices_same_size_edits_and_ignores_counters(net: Network) -> None:
    node = net.add("node")
    steps = json.loads(node.run([sys.executable, "-c", SCRIPT], timeout=120).stdout)
    by_what = {s["what"]: s for s in steps}
    first = by_what["first read"]
    assert first["chunks"] >= 15 and first["walked"] == first["size"]
    for s in steps:  # the remembered walk always agrees with a fresh one, and the agent's reader with both
        assert s["digest"] == s["fresh"] == s["agent's"], s["what"]
        assert s["size"] == first["size"], s["what"]  # every edit kept the table's size: GET_INFO cannot tell
    assert steps[1]["what"] == "idle" and steps[1]["digest"] == first["digest"] and steps[1]["walked"] == 0
    moved = by_what["counters moved"]
    assert moved["digest"] == first["digest"]
    assert 0 < moved["walked"] < moved["size"] // 4  # only the chunks where the counters are
    digests = [s["digest"] for s in steps]
    names = [s["what"] for s in steps]
    for change in ("a CIDR changed where counters moved", "a CIDR changed, no traffic", "a chain renamed",
                   "a jump to another chain"):
        index = names.index(change)
        assert digests[index] != digests[index - 1], change
        assert digests[index] not in digests[:index], change
        assert steps[index]["walked"] > 0, change
    # the CIDR and rename edits touch one or two chunks; the jump's also every entry of the chain it no longer
    # reaches (each entry's comefrom: the hooks it is reached from), here almost the whole table
    for change in ("a CIDR changed where counters moved", "a CIDR changed, no traffic", "a chain renamed"):
        assert steps[names.index(change)]["walked"] < first["size"] // 4, change
    assert digests[names.index("counters moved again")] == digests[names.index("a jump to another chain")]
    assert steps[names.index("counters moved again")]["walked"] > 0


LOCK_SCRIPT = textwrap.dedent("""
    import fcntl, json, os, subprocess, sys
    from ipmasq.backends.generation import LegacyNatDigests
    from ipmasq.prefix import Family

    lock, elsewhere = sys.argv[1], sys.argv[2]  # the lock the reader watches; another one, for writers that skip it
    open(lock, "w").close()

    def iptables(*argv, lock_file=lock):
        env = dict(os.environ, XTABLES_LOCKFILE=lock_file)
        subprocess.run(["iptables-legacy", "-t", "nat", *argv], check=True, capture_output=True, env=env)

    lines = ["*nat", ":MASQ-A - [0:0]"]
    lines += [f"-A MASQ-A -d 20.{i >> 8}.{i & 255}.0/24 -j RETURN" for i in range(300)]
    subprocess.run(["iptables-legacy-restore"], input="\\n".join(lines + ["COMMIT", ""]), text=True, check=True,
                   env=dict(os.environ, XTABLES_LOCKFILE=lock))

    reader = LegacyNatDigests(xtables_lock=lock, full_read_every=5)
    out = []

    def step(what):
        table = reader.read(Family.V4)
        out.append({"what": what, "copied": table.copied, "digest": table.digest.hex(),
                    "fresh": LegacyNatDigests().read(Family.V4).digest.hex()})

    step("first read")
    step("idle")
    step("idle")
    iptables("-R", "MASQ-A", "10", "-d", "21.0.0.0/24", "-j", "RETURN")
    step("a same-size edit that took the lock")
    step("idle")
    iptables("-R", "MASQ-A", "20", "-d", "22.0.0.0/24", "-j", "RETURN", lock_file=elsewhere)
    for _ in range(5):
        step("a same-size edit that skipped the lock")
    iptables("-A", "MASQ-A", "-d", "23.0.0.0/24", "-j", "RETURN", lock_file=elsewhere)
    step("a rule added without the lock (GET_INFO changed)")
    step("idle")
    with open(lock) as held:  # a writer that holds the lock across the reader's reads, and writes meanwhile
        fcntl.flock(held, fcntl.LOCK_EX)
        step("the lock taken")
        iptables("-R", "MASQ-A", "30", "-d", "24.0.0.0/24", "-j", "RETURN", lock_file=elsewhere)
        step("written while the lock is held")
    step("the lock released")
    step("idle")
    os.unlink(lock)
    step("the lock file gone")
    step("the lock file gone")
    open(lock, "w").close()
    step("a new lock file")
    step("idle")
    print(json.dumps(out))
""")


def test_legacy_reads_skip_the_copy_while_no_writer_took_the_xtables_lock(net: Network, tmp_path: Path) -> None:
    """The reader copies the table only after a program took the xtables lock, when GET_INFO changed, when the lock
    file cannot be watched, or every few reads (a writer that skips the lock is seen then), always agreeing with a
    fresh full read whenever a writer that took the lock has finished."""
    node = net.add("node")
    steps = json.loads(node.run([sys.executable, "-c", LOCK_SCRIPT, str(tmp_path / "xtables.lock"),
                                 str(tmp_path / "other.lock")], timeout=120).stdout)
    seen = [(s["what"], s["copied"], s["digest"] == s["fresh"]) for s in steps]
    assert seen == [
        ("first read", True, True),
        ("idle", False, True),
        ("idle", False, True),
        ("a same-size edit that took the lock", True, True),
        ("idle", False, True),
        # unseen until the backstop: the fifth read since the last full one copies again
        ("a same-size edit that skipped the lock", False, False),
        ("a same-size edit that skipped the lock", False, False),
        ("a same-size edit that skipped the lock", False, False),
        ("a same-size edit that skipped the lock", True, True),
        ("a same-size edit that skipped the lock", False, True),
        ("a rule added without the lock (GET_INFO changed)", True, True),
        ("idle", False, True),
        ("the lock taken", True, True),
        ("written while the lock is held", False, False),  # the writer has not finished: as if read before
        ("the lock released", True, True),
        ("idle", False, True),
        ("the lock file gone", True, True),
        ("the lock file gone", True, True),
        ("a new lock file", True, True),
        ("idle", False, True),
    ], seen
