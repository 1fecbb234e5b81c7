"""`kubectl ipmasq`: the kubectl plugin (the executable `kubectl-ipmasq`, installed with the package).

    kubectl ipmasq status [-o text|json|yaml]           the whole cluster (ipmasq status)
    kubectl ipmasq check NODE [CHECK FLAGS]             `ipmasq check` on that node, as it prints there
    kubectl ipmasq trace NODE DEST --source POD_IP ...  `ipmasq trace` on that node
    kubectl ipmasq uninstall [--dry-run]                ipmasq off its nodes and out of the API, nothing else

Every subcommand takes kubectl's own flags with kubectl's meaning, before or after it: `--kubeconfig PATH`,
`--context NAME` and `-n/--namespace NS`, the namespace the agent lives in. That is kube-system unless -n says
otherwise, whatever the context's namespace: a context's namespace is where a person's workloads are, and the agent
is a node DaemonSet installed in kube-system (as GKE installs its own).

check and trace run in ipmasq's own pod on the node (`kubectl exec`: the agent's own config, flags and kernel
view): the enforcing agent's, else the observer's, found as pods owned by a DaemonSet ipmasq.ownership judges
ipmasq's (never by a name or a `k8s-app` label alone: GKE's own ip-masq-agent has both). In an observer's pod, a
check given nothing to compare with compares as that observer does: with what the provider's agent intends (`ipmasq
check --writer WRITER`), from that agent's inputs as the API holds them now (its ConfigMaps, EKS's aws-node
DaemonSet), read by the plugin and handed to the check on its standard input. Where neither runs on the node (another
agent owns it), one line says which DaemonSets were looked for, and a short-lived pod on the node's network runs them
instead with ipmasq's own image (--image; default: ipmasq's DaemonSet's image, else the release's), and is deleted
after.

The subcommands are the table SUBCOMMANDS: a new one is a function taking (KubectlFlags, its arguments) and a row.
Errors are one line, `kubectl ipmasq COMMAND: message`, with ipmasq's exit codes (ipmasq.cli.Exit).
"""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from ipmasq.cli import Exit, did_you_mean, report
from ipmasq.errors import IpmasqError, PluginError, UsageError, clip, one_line
from ipmasq.kube.paths import check_name
from ipmasq.ownership import DEBUG_COMPONENT, ObjectFacts, facts_of, judge, labels
from ipmasq.version import IMAGE

__all__ = ["DEFAULT_NAMESPACE", "SUBCOMMANDS", "KubectlFlags", "PodChoice", "Subcommand", "choose_pod", "main",
           "observer_check", "split_kubectl_flags"]

PROG = "kubectl ipmasq"
DEFAULT_NAMESPACE = "kube-system"
PROVIDER_NAMESPACE = "kube-system"  # where a provider's agent's inputs are (ipmasq.writers)
# `ipmasq check`'s flags that say what to compare with: any of them given, the check runs as given
COMPARISON_FLAGS = frozenset({"--config", "--writer", "--from-dump", "--manifest", "--agent", "--vpc-cidr",
                              "--masq-chain", "--nomasq-all-reserved-ranges", "--random-fully", "--to-ports",
                              "--enable-ipv6"})
DEBUG_POD_SECONDS = 120
DEBUG_LOG_BYTES = 8 << 20  # what is read of the debug pod's output (kubectl logs --limit-bytes): check's, trace's


@dataclass(frozen=True)
class KubectlFlags:
    """kubectl's own flags, as given (None: kubectl's default, or for the namespace, kube-system)."""

    kubeconfig: str | None = None
    context: str | None = None
    namespace: str = DEFAULT_NAMESPACE
    image: str | None = None  # check and trace: the debug pod's image where no ipmasq agent runs

    def kubectl_args(self) -> list[str]:
        """What every kubectl call of the plugin is given: the same cluster, user and namespace."""
        out = [f"--kubeconfig={self.kubeconfig}"] if self.kubeconfig else []
        out += [f"--context={self.context}"] if self.context else []
        return [*out, f"--namespace={self.namespace}"]


# flag -> KubectlFlags field; the short form as kubectl has it
_FLAGS = {"--kubeconfig": "kubeconfig", "--context": "context", "--namespace": "namespace", "-n": "namespace",
          "--image": "image"}


def split_kubectl_flags(args: Sequence[str]) -> tuple[KubectlFlags, list[str]]:
    """kubectl's flags taken out of `args` wherever they are (`-n NS`, `-nNS`, `--namespace NS`, `--namespace=NS`),
    the rest left in order; after `--` nothing is taken."""
    values: dict[str, str] = {}
    rest: list[str] = []
    index = 0
    while index < len(args):
        arg = args[index]
        if arg == "--":
            rest.extend(args[index:])
            break
        name, eq, value = arg.partition("=")
        if name not in _FLAGS and arg.startswith("-n") and not arg.startswith("--") and len(arg) > 2:
            name, eq, value = "-n", "=", arg[2:]
        if name in _FLAGS:
            if not eq:
                if index + 1 >= len(args):
                    raise UsageError(f"{name} needs a value")
                value = args[index + 1]
                index += 1
            if not value:
                raise UsageError(f"{name} needs a value")
            values[_FLAGS[name]] = value
        else:
            rest.append(arg)
        index += 1
    return KubectlFlags(**values), rest


def _kubectl(flags: KubectlFlags, *args: str, timeout: float = 60.0,
             stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    argv = ["kubectl", *flags.kubectl_args(), *args]
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, input=stdin)
    except FileNotFoundError:
        raise PluginError("kubectl not found on PATH") from None
    except subprocess.TimeoutExpired:
        raise PluginError(f"kubectl {' '.join(args[:3])}: no answer within {timeout:.0f} s") from None


def _said(result: subprocess.CompletedProcess[str]) -> str:
    """kubectl's error, as one line."""
    return one_line(clip(result.stderr.strip() or f"kubectl exited {result.returncode}", 400))


@dataclass(frozen=True)
class PodChoice:
    """Where `check`/`trace` run on a node: ipmasq's pod there (None: none runs), and what was looked at."""

    pod: str | None
    container: str
    image: str  # ipmasq's own image, for a debug pod where no pod of ipmasq runs
    looked_for: str  # one line: which DaemonSets were looked for (and which were not ipmasq's, and why)
    writer: str = ""  # the pod is an observer's: whose rules it observes (its --observe)


def _ours(daemonsets: Sequence[object]) -> tuple[list[ObjectFacts], list[str]]:
    """ipmasq's DaemonSets running its agent, the enforcing ones first; and the others, each with why."""
    ours, others = [], []
    for item in daemonsets:
        if not isinstance(item, dict):
            continue
        facts = facts_of("DaemonSet", item)
        verdict = judge(facts)
        if verdict is not None and verdict.ours and facts.agent is not None:
            ours.append(facts)
        elif verdict is not None and not verdict.ours:
            others.append(f"{facts.label}: {verdict.why}")
    ours.sort(key=lambda f: (f.agent is not None and f.agent.observes, f.name))
    return ours, others


def choose_pod(daemonsets: Sequence[object], pods: Sequence[object], namespace: str) -> PodChoice:
    """ipmasq's pod among `pods` (those running on the node): one owned by ipmasq's enforcing agent's DaemonSet,
    else by its observer's; never another program's, whatever its name or labels. Pure."""
    ours, others = _ours(daemonsets)
    image = next((f.agent.image for f in ours if f.agent is not None and f.agent.image), IMAGE)
    owners: dict[str, set[str]] = {}  # pod name -> the uids of its owners
    for pod in pods:
        meta = pod.get("metadata") if isinstance(pod, dict) else None
        refs = meta.get("ownerReferences") if isinstance(meta, dict) else None
        if isinstance(meta, dict) and isinstance(meta.get("name"), str) and isinstance(refs, list):
            owners[meta["name"]] = {ref["uid"] for ref in refs if isinstance(ref, dict) and isinstance(
                ref.get("uid"), str)}
    for facts in ours:
        # a pod's name reaches kubectl's command line: only a name the API server could have given (never `--...`)
        owned = sorted(name for name, uids in owners.items() if facts.uid and facts.uid in uids and _named(name))
        if owned and facts.agent is not None:
            return PodChoice(owned[0], facts.agent.container or "ip-masq-agent", image, "",
                             facts.agent.writer if facts.agent.observes else "")
    if ours:
        looked = "looked for the pods of " + ", ".join(f.label for f in ours)
    else:
        looked = f"no DaemonSet of ipmasq in {one_line(clip(namespace, 80))}"
        looked += f"; not ipmasq's: {'; '.join(others)}" if others else ""
    return PodChoice(None, "", image, one_line(clip(looked, 600)))


def _named(name: str) -> bool:
    try:
        check_name(name)
    except UsageError:
        return False
    return True


def _items(result: subprocess.CompletedProcess[str], what: str) -> list[object]:
    if result.returncode != 0:
        raise PluginError(_said(result))
    try:
        items = json.loads(result.stdout).get("items") or []
    except (ValueError, AttributeError):
        raise PluginError(f"kubectl get {what}: an answer that is not a list") from None
    if not isinstance(items, list):
        raise PluginError(f"kubectl get {what}: an answer that is not a list")
    return items


def agent_pod(flags: KubectlFlags, node: str) -> PodChoice:
    """ipmasq's pod on the node, found through its DaemonSets (choose_pod)."""
    daemonsets = _items(_kubectl(flags, "get", "daemonsets", "-o", "json"), "daemonsets")
    pods = _items(_kubectl(flags, "get", "pods", "--field-selector", f"spec.nodeName={node},status.phase=Running",
                           "-o", "json"), "pods")
    return choose_pod(daemonsets, pods, flags.namespace)


def observer_check(writer: str, args: Sequence[str]) -> tuple[list[str], list[tuple[str, str]]] | None:
    """What makes `ipmasq check ARGS` in the pod of an observer of `writer` compare as the observer does: the
    arguments to add and the provider's inputs to read from the API (kind, name in kube-system), handed to it on its
    standard input; None when ARGS say what to compare with, or the writer's truth is not a chain. Pure."""
    from ipmasq.goflags import normalise_go_flags
    from ipmasq.writers import WRITERS

    profile = WRITERS.get(writer)
    if profile is None or profile.chain is None:
        return None
    for arg in normalise_go_flags(list(args)):
        if arg == "--":
            break
        if arg.split("=", 1)[0] in COMPARISON_FLAGS:
            return None
    inputs = [("configmap", name) for name in profile.configmaps]
    inputs += [("daemonset", profile.daemonset)] if profile.daemonset else []
    return ["--writer", writer, "--manifest", "-"], inputs


def _writer_inputs(flags: KubectlFlags, inputs: Sequence[tuple[str, str]]) -> str:
    """The inputs as `kubectl get -o yaml` prints them, one document per kind (those that do not exist left out:
    the provider's agent then runs on its defaults, as the observer compares)."""
    documents = []
    there = replace(flags, namespace=PROVIDER_NAMESPACE)
    for kind in sorted({kind for kind, _ in inputs}):
        names = [name for k, name in inputs if k == kind]
        result = _kubectl(there, "get", kind, *names, "-o", "yaml", "--ignore-not-found")
        if result.returncode != 0:
            raise PluginError(_said(result))
        documents.append(result.stdout)
    return "---\n".join(documents)


def run_on_node(flags: KubectlFlags, node: str, argv: Sequence[str]) -> int:
    choice = agent_pod(flags, node)
    if choice.pod is None:
        return _debug_pod(flags, node, argv, flags.image or choice.image, choice.looked_for)
    argv, stdin = list(argv), None
    planned = observer_check(choice.writer, argv[2:]) if argv[1:2] == ["check"] and choice.writer else None
    if planned is not None:
        added, inputs = planned
        stdin = _writer_inputs(flags, inputs)
        argv[2:2] = added
        print(f"{PROG}: {one_line(clip(choice.pod, 200))} observes {one_line(clip(choice.writer, 40))}'s agent: "
              f"comparing as it does, with {', '.join(f'{k}/{n}' for k, n in inputs)} as the API holds them now",
              file=sys.stderr)
    command = ["kubectl", *flags.kubectl_args(), "exec", *(["-i"] if stdin is not None else []), choice.pod, "-c",
               choice.container, "--", *argv]
    return subprocess.run(command, input=stdin, text=True).returncode


def debug_pod_name() -> str:
    """Unique however many operators start one at once: the second it started and 8 random hex digits (32 bits: two
    operators in one second collide once in four billion)."""
    return f"ipmasq-debug-{int(time.time())}-{secrets.token_hex(4)}"


def _debug_pod(flags: KubectlFlags, node: str, argv: Sequence[str], image: str, looked_for: str) -> int:
    """A pod on the node's network that runs the command once; its output is the command's. Deleted after."""
    name = debug_pod_name()
    print(f"{PROG}: no ipmasq agent or observer on {one_line(clip(node, 200))} ({looked_for}): running in pod "
          f"{flags.namespace}/{name} ({one_line(clip(image, 200))})", file=sys.stderr)
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": flags.namespace,
                                                          "labels": labels(DEBUG_COMPONENT, name="ipmasq-debug")},
           "spec": {"nodeName": node, "hostNetwork": True, "restartPolicy": "Never",
                    "automountServiceAccountToken": False, "tolerations": [{"operator": "Exists"}],
                    "containers": [{"name": "ipmasq", "image": image, "imagePullPolicy": "IfNotPresent",
                                    "command": list(argv),
                                    "securityContext": {"capabilities": {"drop": ["ALL"],
                                                                         "add": ["NET_ADMIN", "NET_RAW"]},
                                                        "runAsUser": 0}}]}}
    created = _kubectl(flags, "apply", "-f", "-", stdin=json.dumps(pod))
    if created.returncode != 0:
        raise PluginError(_said(created))
    try:
        deadline = time.monotonic() + DEBUG_POD_SECONDS
        phase = ""
        while time.monotonic() < deadline:
            phase = _kubectl(flags, "get", "pod", name, "-o", "jsonpath={.status.phase}").stdout.strip()
            if phase in ("Succeeded", "Failed"):
                break
            time.sleep(0.5)
        else:
            raise PluginError(f"pod {name} did not finish within {DEBUG_POD_SECONDS} s (phase {phase or 'unknown'})")
        # the node's output, read bounded, each line escaped as every string from outside (a hostile node's kubelet
        # answers it)
        logs = _kubectl(flags, "logs", name, f"--limit-bytes={DEBUG_LOG_BYTES}").stdout
        sys.stdout.write("".join(one_line(line) + "\n" for line in logs.splitlines()))
        code = _kubectl(flags, "get", "pod", name, "-o",
                        "jsonpath={.status.containerStatuses[0].state.terminated.exitCode}").stdout.strip()
        return int(code) if code.isdigit() else Exit.COULD_NOT_RUN
    finally:
        _kubectl(flags, "delete", "pod", name, "--wait=false")


# --- the subcommands ----------------------------------------------------------------------------------------------


def _status(flags: KubectlFlags, args: list[str]) -> int:
    from ipmasq.cli import main as ipmasq_main

    passed = [f"--kubeconfig={flags.kubeconfig}"] if flags.kubeconfig else []
    passed += [f"--context={flags.context}"] if flags.context else []
    return ipmasq_main(["status", *passed, f"--namespace={flags.namespace}", *args], prog=PROG)


def _uninstall(flags: KubectlFlags, args: list[str]) -> int:
    """`kubectl ipmasq uninstall`: no prompt; --dry-run prints what would go and what stays, and changes nothing. Exit
    0 when every visited node's rules and every object of ipmasq are gone, 1 when a node's could not be removed
    (named), 2 for a usage error, 3 when the API server could not be asked."""
    from ipmasq.cli import ArgumentParser
    from ipmasq.kube.client import KubeClient
    from ipmasq.kube.kubeconfig import load as load_kubeconfig
    from ipmasq.uninstall.cluster import read, run
    from ipmasq.uninstall.plan import describe, plan_of

    parser = ArgumentParser(prog=f"{PROG} uninstall",
                            description="Remove ipmasq from the nodes where its agent wrote rules (the rules too) and "
                            "from the API: only objects that are ipmasq's (app.kubernetes.io/part-of=ipmasq, or "
                            "unmistakably ipmasq's); everything else, a provider's addon and the ip-masq-agent "
                            "ConfigMap included, is kept and said with why. --image IMAGE: the image of the pods "
                            "that remove the rules (default: ipmasq's DaemonSet's, else the release's).")
    parser.add_argument("--dry-run", action="store_true", help="print what would be removed and kept, change nothing")
    parser.add_argument("--all-nodes", action="store_true",
                        help="remove ipmasq's rules on every node, not only where the API says its enforcing agent "
                        "ran (after `kubectl delete -k deploy/`, or a node that was down)")
    parser.add_argument("--remove-unmarked", action="store_true",
                        help="on each node visited, also remove chains with ipmasq's rule comments that carry no "
                        "ipmasq ownership marker (an agent of 0.2.0 that was never upgraded), or whose rules changed "
                        "since ipmasq wrote them; only where no other "
                        "agent (GKE's, AKS's, the reference) writes one: passed to the nodes' `ipmasq uninstall`, "
                        "refused while GKE's ip-masq-agent or AKS's azure-ip-masq-agent DaemonSet is installed")
    parser.add_argument("--timeout", type=float, default=180.0, metavar="SECONDS",
                        help="how long the agent's pods, then the nodes' uninstall pods, may take (default 180)")
    try:
        parsed = parser.parse_args(args)
    except SystemExit as exc:  # --help
        return Exit.OK if exc.code in (0, None) else Exit.USAGE
    if not 0 < parsed.timeout <= 3600:
        raise UsageError("--timeout must be between 0 and 3600 seconds")
    client = KubeClient(load_kubeconfig(flags.kubeconfig, context=flags.context), timeout=30.0)
    plan = plan_of(read(client), image=flags.image, all_nodes=parsed.all_nodes,
                   remove_unmarked=parsed.remove_unmarked)
    if parsed.dry_run:
        for line in describe(plan):
            print(line)
        return Exit.OK
    done = run(client, plan, timeout=parsed.timeout, say=print)
    failed = [one_line(clip(n.node, 200)) for n in done.nodes if not n.ok]
    nodes = f"{len(done.nodes) - len(failed)} of {len(done.nodes)} nodes clean" if done.nodes else "no node visited"
    print(f"uninstalled in {done.seconds:.1f} s: {nodes}, {len(done.removed)} objects removed, {len(plan.kept)} kept"
          + (f"; rules left on {', '.join(failed)}" if failed else ""))
    return Exit.FINDINGS if failed else Exit.OK


def _on_node(command: str) -> Callable[[KubectlFlags, list[str]], int]:
    def run(flags: KubectlFlags, args: list[str]) -> int:
        if not args or args[0].startswith("-"):
            raise UsageError("name the node first: " + SUBCOMMANDS[command].usage)
        node, rest = args[0], args[1:]
        if not _named(node):  # "" would let the scheduler pick any node for the debug pod; "a,b" is no node either
            raise UsageError(f"{clip(node, 80)!r} is not a node's name: " + SUBCOMMANDS[command].usage)
        _check_flags(command, rest)  # a mistyped flag is said here, before any pod is asked
        return run_on_node(flags, node, ["ipmasq", command, *rest])

    return run


def _check_flags(command: str, args: list[str]) -> None:
    from ipmasq.cli import build_parser, subcommands
    from ipmasq.goflags import normalise_go_flags

    parser = subcommands(build_parser(command))[command]
    known = {o for a in parser._actions for o in a.option_strings}
    for arg in normalise_go_flags(args):
        if arg == "--":
            break
        name = arg.split("=", 1)[0]
        if name.startswith("--") and name not in known:
            raise UsageError(f"unrecognized arguments: {name}{did_you_mean(name, sorted(known))}")


@dataclass(frozen=True)
class Subcommand:
    usage: str  # after `kubectl ipmasq`
    summary: str
    run: Callable[[KubectlFlags, list[str]], int]


KUBECTL_FLAGS_USAGE = "[-n NAMESPACE] [--context NAME] [--kubeconfig PATH]"
SUBCOMMANDS: dict[str, Subcommand] = {
    "status": Subcommand("status [-o text|json|yaml] [--configmaps NAMES]",
                         "does every node enforce the current ConfigMap? (ipmasq status)", _status),
    "check": Subcommand("check NODE [--image IMAGE] [ipmasq check flags]",
                        "ipmasq check on the node, in ipmasq's pod there (else a short-lived pod)", _on_node("check")),
    "trace": Subcommand("trace NODE DEST --source POD_IP [--image IMAGE] [ipmasq trace flags]",
                        "ipmasq trace on the node, in ipmasq's pod there (else a short-lived pod)", _on_node("trace")),
    "uninstall": Subcommand("uninstall [--dry-run] [--all-nodes] [--remove-unmarked] [--timeout SECONDS] "
                            "[--image IMAGE]",
                            "ipmasq off its nodes (its rules too) and out of the API; what is not ipmasq's is kept",
                            _uninstall),
}


def usage() -> str:
    width = max(len(name) for name in SUBCOMMANDS)
    lines = [f"usage: {PROG} COMMAND {KUBECTL_FLAGS_USAGE} ...", "", "commands:"]
    lines += [f"  {name:<{width}}  {sub.summary}\n  {'':<{width}}    {PROG} {sub.usage}"
              for name, sub in SUBCOMMANDS.items()]
    lines += ["", "kubectl's flags, before or after the command, as kubectl means them:",
              "  -n, --namespace NS   where the agent runs (default kube-system, whatever the context's namespace)",
              "  --context NAME       a context of the kubeconfig (default: its current one)",
              "  --kubeconfig PATH    default: $KUBECONFIG, else ~/.kube/config",
              "", f"{PROG} COMMAND --help: the command's own flags and examples",
              f"{PROG} --version: the release (and source commit) of this plugin",
              "exit status: 0 ok, 1 findings, 2 usage, 3 could not run (no cluster, kubectl failed)"]
    return "\n".join(lines)


def _node_help(command: str) -> str:
    """`kubectl ipmasq check --help`: the plugin's line, then ipmasq's own help for the command run on the node."""
    from ipmasq.cli import build_parser, subcommands

    parser = subcommands(build_parser(command))[command]
    parser.prog = f"{PROG} {command} NODE"
    return (f"usage: {PROG} {SUBCOMMANDS[command].usage} {KUBECTL_FLAGS_USAGE}\n"
            f"  --image IMAGE   the short-lived pod's image where no pod of ipmasq runs (default: ipmasq's "
            f"DaemonSet's)\n\n"
            f"run on the node as:\n\n{parser.format_help()}")


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    who = PROG
    try:
        flags, rest = split_kubectl_flags(args)
        who = f"{PROG} {rest[0]}" if rest and rest[0] in SUBCOMMANDS else PROG
        if rest and rest[0] in ("--version", "version"):
            from ipmasq.version import version_line

            print(version_line())
            return Exit.OK
        if not rest or rest[0] in ("-h", "--help", "help"):
            print(usage(), file=sys.stdout if rest else sys.stderr)
            return Exit.OK if rest else Exit.USAGE
        command, rest = rest[0], rest[1:]
        sub = SUBCOMMANDS.get(command)
        if sub is None:
            raise UsageError(f"unknown command {one_line(clip(command))!r}{did_you_mean(command, list(SUBCOMMANDS))} "
                             f"(commands: {', '.join(SUBCOMMANDS)})")
        if command in ("check", "trace") and ("-h" in rest or "--help" in rest):
            print(_node_help(command))
            return Exit.OK
        if command == "status" and flags.image is not None:
            raise UsageError("--image is for check, trace and uninstall")
        return sub.run(flags, rest)
    except IpmasqError as exc:
        return report(who, exc)
    except KeyboardInterrupt:
        return Exit.INTERRUPTED
    except BrokenPipeError:
        return Exit.OK


if __name__ == "__main__":  # python -m ipmasq.kubectl_plugin: what the krew archive's launcher runs
    raise SystemExit(main())
