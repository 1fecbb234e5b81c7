"""lint's finding ids, each with its fix hint, and the one way lint makes a finding: at a place in a file."""

from __future__ import annotations

from ipmasq.findings import Finding, Severity

__all__ = ["HINTS", "lint_finding"]


# One fix hint per id; the ids are stable (scripts match on them), the messages are not.
HINTS: dict[str, str] = {
    "configmap-name": "name the ConfigMap ip-masq-agent: the agent's DaemonSet mounts it by that name",
    "configmap-namespace": "put the ConfigMap in namespace kube-system, where the agent's DaemonSet runs",
    "missing-config-key": "write the config as a block string under data: `config: |`, indented below it",
    "yaml-syntax": "fix the YAML at this position; `kubectl apply --dry-run=client -f FILE` shows the same error",
    "indentation": "indent every item of a list the same, and every key of the config under `config: |`",
    "invalid-cidr": "write an address and a prefix length, like 10.0.0.0/8",
    "misaligned-cidr": "use the network address of the block (the host bits must be zero)",
    "unknown-key": "the agent ignores unknown keys; fix the spelling",
    "key-case": "the agent matches keys case-insensitively, but other tools do not: use the documented spelling",
    "duplicate-key": "keep one occurrence: the last one wins and the earlier one is silently ignored",
    "wrong-type": "use the type the agent expects (a list of CIDR strings, a whole number, true/false, a duration)",
    "duplicate-cidr": "remove the repeated entry",
    "shadowed-cidr": "remove the entry: the larger one already decides every address in it",
    "conflicting-cidr": "keep the prefix in one list only",
    "too-many-cidrs": "raise cidrLimit, or merge the CIDRs into fewer, larger blocks",
    "ipv6-disabled": "set enableIPv6: true in the config or run the agent with --enable-ipv6, or drop the IPv6 CIDR",
    "bad-duration": "write a Go duration above zero, like 60s, 1m30s or 2h",
    "lookalike-character": "retype the character in plain ASCII; copy-pasted documentation carries lookalikes",
    "block-style": "use `config: |` (literal): `>` folds lines and can join two keys into one",
    "no-configmap": "lint the ip-masq-agent ConfigMap, or the config file itself",
    "duplicate-configmap": "keep one ip-masq-agent ConfigMap in the file: `kubectl apply` applies each in turn and "
                           "the last one wins",
    "ignored-document": "move these settings into the first document and delete the `---` line: the agent reads "
                        "only the first YAML document",
    "empty-config": "write the settings the node needs (nonMasqueradeCIDRs: ...); if the defaults are meant, list "
                    "them, so that the file says what the node does",
    "config-is-manifest": "put only the config in data.config: `kubectl apply -f` the manifest itself, or "
                          "`kubectl create configmap ip-masq-agent --from-file=config=FILE` with FILE the config "
                          "(nonMasqueradeCIDRs: ...)",
    "no-known-key": "write the agent's settings (nonMasqueradeCIDRs, masqLinkLocal, resyncInterval, ...); this looks "
                    "like another file, taken by mistake",
    "no-config-file": "name the config file ip-masq-agent (the agent reads only the ip-masq* files of its config "
                      "directory), or lint the file itself",
    "empty-non-masquerade": "list the ranges that must keep the pod IP, or delete the key to get the defaults; an "
                            "empty list is right only when every destination must see the node IP",
    "short-resync-interval": "use 60s, the default: drift is still repaired within a minute, without the CPU",
    "must-masquerade": "add the range to masqueradeCIDRs, or narrow the non-masquerade entry that covers it",
    "must-preserve": "add the range to nonMasqueradeCIDRs, or narrow the masqueradeCIDRs entry that covers it",
    "invalid-rule": "fix the rule as the message says: the agent refuses the whole config and keeps its last rules",
    "duplicate-rule": "give every rule its own name, across all config files",
    "shadowed-rule": "delete the rule, or move it above the rules that cover it, or narrow them",
    "rule-nodes-match-none": "fix the nodes globs (case-sensitive fnmatch, like gke-prod-egress-*), or delete the rule",
    "snat-to-pod-address": "set snatTo to an address of the node (a spare one the destination's firewall admits)",
    "snat-to-destination": "set snatTo to an address of the node, outside the rule's destinations",
    "rule-no-effect": "delete the rule, or keep it on purpose as documentation of what that traffic does",
    "rules-not-checked": "run ipmasq lint on the config: it checks every rule, without the admission review's bound",
}


def lint_finding(file: str, line: int | None, column: int | None, id_: str, severity: Severity,
                 message: str) -> Finding:
    """A finding at FILE:LINE:COLUMN, with the fix hint of its id."""
    return Finding(id_, severity, message, HINTS[id_], file=file, line=line, column=column)
