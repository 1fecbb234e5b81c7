"""The agent's kernel suite runs once per backend: what "our objects", "everything else" and "drift" mean for each."""

from __future__ import annotations

from dataclasses import dataclass

from ipmasq.lab.netns import Namespace
from ipmasq.netfilter.iptables import marker_chain
from ipmasq.netfilter.nft import MARKER_SET
from tests.kernel.agent_harness import foreign, ours

TABLE = ("inet", "ip-masq-agent")


def nft_table(node: Namespace, *, handles: bool = False) -> list[str]:
    """Our nft table as `nft list` prints it (with -a: handles, which change on every rewrite); [] when absent."""
    result = node.run(["nft", *(["-a"] if handles else []), "list", "table", *TABLE], check=False)
    return result.stdout.splitlines() if result.returncode == 0 else []


def nft_foreign(node: Namespace) -> list[str]:
    """`nft -s list ruleset` without our table: every other table (iptables-nft's included), counters aside."""
    out: list[str] = []
    skipping = False
    for line in node.run(["nft", "-s", "list", "ruleset"]).stdout.splitlines():
        if line.startswith("table "):
            skipping = line == f"table {' '.join(TABLE)} {{"
        if not skipping:
            out.append(line)
        if line == "}":
            skipping = False
    return out


def save(node: Namespace, family: int = 4) -> str:
    return node.run(["iptables-save" if family == 4 else "ip6tables-save", "-t", "nat"]).stdout


@dataclass(frozen=True)
class Flavor:
    backend: str  # the --backend value

    def __str__(self) -> str:
        return self.backend

    @property
    def flag(self) -> str:
        return f"--backend={self.backend}"

    def ours(self, node: Namespace, family: int = 4) -> list[str]:
        """Our objects as the kernel lists them (the nft table holds both families)."""
        return ours(save(node, family)) if self.backend == "iptables" else nft_table(node)

    def dump(self, node: Namespace, family: int = 4) -> str:
        """Where our objects live, whole: the nat table's iptables-save, or our nft table."""
        return save(node, family) if self.backend == "iptables" else "\n".join(nft_table(node))

    def foreign(self, node: Namespace) -> list[str]:
        """Everything that is not ours, both frameworks, both families."""
        if self.backend == "iptables":
            return foreign(save(node, 4)) + foreign(save(node, 6))
        return [line for f in (4, 6) for line in save(node, f).splitlines() if not line.startswith("#")] \
            + nft_foreign(node)

    def fingerprint(self, node: Namespace) -> list[str]:
        """Changes on any write of ours: iptables' per-rule counters (zeroed by a rewrite), nft's handles."""
        if self.backend == "iptables":
            return [line for line in node.run(["iptables-save", "-t", "nat", "-c"]).stdout.splitlines()
                    if "ip-masq-agent" in line]
        return nft_table(node, handles=True)

    def drifts(self, good: list[str], *, family: int = 4) -> dict[str, list[list[str]]]:
        """Ways an operator or another program damages our objects, as commands to run on the node."""
        if self.backend == "nftables":
            nft = ["nft"]
            chain = [*TABLE, "postrouting"]
            return {
                "delete table": [[*nft, "delete", "table", *TABLE]],
                "flush chain": [[*nft, "flush", "chain", *chain]],
                "flush set": [[*nft, "flush", "set", *TABLE, "nomasq_v4" if family == 4 else "nomasq_v6"]],
                "insert rule": [[*nft, "insert", "rule", *chain, "ip", "daddr", "172.30.0.0/16", "return"]],
                "add rule": [[*nft, "add", "rule", *chain, "counter"]],
                "delete marker": [[*nft, "delete", "set", *TABLE, MARKER_SET]],
            }
        tool = "iptables" if family == 4 else "ip6tables"
        nat = [tool, "-t", "nat"]
        jump = next(line for line in good if line.startswith("-A POSTROUTING"))
        # our jump deleted by its full spec (a foreign POSTROUTING jump stays)
        delete_jump = ["sh", "-c", f"{tool}-save -t nat | grep -F -- '{jump}' | sed 's/^-A/-D/' | "
                                   f"sed 's/^/*nat\\n/; s/$/\\nCOMMIT/' | {tool}-restore --noflush"]
        # the whole chain in one transaction, as a tool replacing the node's rules does it: three commands in a row
        # would race the agent, which may repair the jump between them (then -X fails: the chain is in use)
        delete_chain = ["sh", "-c", f"{tool}-save -t nat | grep -F -- '{jump}' | sed 's/^-A/-D/' | "
                                    f"sed 's/^/*nat\\n/; s/$/\\n-F IP-MASQ-AGENT\\n-X IP-MASQ-AGENT\\nCOMMIT/' | "
                                    f"{tool}-restore --noflush"]
        inserted = "172.30.0.0/16" if family == 4 else "fd00:1::/64"
        marker = marker_chain("IP-MASQ-AGENT")
        return {
            "flush": [[*nat, "-F", "IP-MASQ-AGENT"]],
            "delete jump": [delete_jump],
            "delete chain": [delete_chain],
            "insert": [[*nat, "-I", "IP-MASQ-AGENT", "1", "-d", inserted, "-j", "RETURN"]],
            "reorder": [[*nat, "-D", "IP-MASQ-AGENT", "2"],
                        [*nat, "-A", "IP-MASQ-AGENT", "-d", "10.0.0.0/8" if family == 4 else "fd00::/8",
                         "-j", "RETURN"]],
            # in one transaction, as the agent may repair the marker between two commands
            "delete marker": [["sh", "-c", f"printf '*nat\\n-F {marker}\\n-X {marker}\\nCOMMIT\\n' | "
                                           f"{tool}-restore --noflush"]],
            "empty marker": [[*nat, "-F", marker]],
        }


FLAVORS = (Flavor("iptables"), Flavor("nftables"))
