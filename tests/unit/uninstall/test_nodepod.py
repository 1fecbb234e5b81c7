"""The removal pod: the agent's privileges and no more, flags from the API quoted as one word each, and its report
read back escaped, line by line."""

from __future__ import annotations

import subprocess

from ipmasq.uninstall.nodepod import TERMINATION_MESSAGE_BYTES, ended, removal_pod
from ipmasq.uninstall.plan import NodeVisit


def test_the_pod_has_the_agents_privileges_on_its_node_and_ipmasqs_labels() -> None:
    pod = removal_pod(NodeVisit("node-a", "kube-system", "reg/ipmasq:1", ("--masq-chain=IP-MASQ",), "why"))
    spec = pod["spec"]
    assert spec["nodeName"] == "node-a" and spec["hostNetwork"] is True and spec["restartPolicy"] == "Never"
    (container,) = spec["containers"]
    assert container["image"] == "reg/ipmasq:1"
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["NET_ADMIN", "NET_RAW"]}
    assert container["securityContext"]["privileged"] is False
    assert pod["metadata"]["generateName"].startswith("ipmasq-uninstall-")
    assert pod["metadata"]["labels"]["app.kubernetes.io/part-of"] == "ipmasq"
    assert pod["metadata"]["labels"]["app.kubernetes.io/component"] == "uninstall"


def test_a_hostile_chain_flag_is_one_word_to_the_shell() -> None:
    flag = "--masq-chain=X; touch /pwned $(id)"
    script = removal_pod(NodeVisit("n", "kube-system", "i", (flag,), "why"))["spec"]["containers"][0]["command"][-1]
    assert script == "ipmasq uninstall '--masq-chain=X; touch /pwned $(id)' >/dev/termination-log 2>&1"
    words = subprocess.run(["sh", "-c", script.replace("ipmasq uninstall", "printf '%s\\n'").split(" >")[0]],
                           capture_output=True, text=True, check=True).stdout
    assert words == flag + "\n"


def test_the_report_is_every_line_escaped_and_bounded() -> None:
    assert ended({"status": {"containerStatuses": [{"state": {"running": {}}}]}}) is None
    assert ended({"status": "x"}) is None and ended({}) is None
    message = "removed: nftables\n\nkept IP-MASQ (iptables-nft, ipv4): \x1b[2Jnot ours\n" + "x" * 10_000
    code, lines = ended({"status": {"containerStatuses": [
        {"state": {"terminated": {"exitCode": 0, "message": message}}}]}}) or (None, ())
    assert code == 0 and lines[:2] == ("removed: nftables", "kept IP-MASQ (iptables-nft, ipv4): \\x1b[2Jnot ours")
    assert sum(map(len, lines)) <= TERMINATION_MESSAGE_BYTES + 10
    assert ended({"status": {"containerStatuses": [{"state": {"terminated": {"exitCode": True}}}]}}) == (-1, ())
