"""`kubectl ipmasq`: the kubectl plugin (the executable `kubectl-ipmasq`, installed with the package).

    kubectl ipmasq status [-o text|json|yaml]           the whole cluster (ipmasq status)
    kubectl ipmasq check NODE [CHECK FLAGS]             `ipmasq check` on that node, as it prints there
    kubectl ipmasq trace NODE DEST --source POD_IP ...  `ipmasq trace` on that node
    kubectl ipmasq uninstall [--dry-run]                ipmasq off every node and out of the API

Every subcommand takes kubectl's own flags with kubectl's meaning, before or after it: `--kubeconfig PATH`,
`--context NAME` and `-n/--namespace NS`, the namespace the agent lives in. That is kube-system unless -n says
otherwise, whatever the context's namespace: a context's namespace is where a person's workloads are, and the agent
is a node DaemonSet installed in kube-system (as GKE installs its own).

check and trace run in the node's agent pod (`kubectl exec`: the agent's own config, flags and kernel view). Where
no ipmasq agent runs on the node (another agent owns it), a short-lived pod on the node's network with the ipmasq
image runs them instead (--image; default: the DaemonSet's image), and is deleted after.

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
from dataclasses import dataclass

from ipmasq.cli import Exit, did_you_mean, report
from ipmasq.errors import IpmasqError, PluginError, UsageError, clip, one_line
from ipmasq.version import IMAGE

__all__ = ["DEFAULT_NAMESPACE", "SUBCOMMANDS", "KubectlFlags", "Subcommand", "main", "split_kubectl_flags"]

PROG = "kubectl ipmasq"
DEFAULT_NAMESPACE = "kube-system"
AGENT_SELECTOR = "k8s-app=ip-masq-agent"
DEBUG_POD_SECONDS = 120


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


def agent_pod(flags: KubectlFlags, node: str) -> str | None:
    """The running ipmasq agent pod on the node, if any."""
    result = _kubectl(flags, "get", "pods", "-l", AGENT_SELECTOR, "--field-selector",
                      f"spec.nodeName={node},status.phase=Running", "-o", "json")
    if result.returncode != 0:
        raise PluginError(_said(result))
    try:
        items = json.loads(result.stdout).get("items") or []
        return str(items[0]["metadata"]["name"]) if items else None
    except (ValueError, AttributeError, LookupError, TypeError):
        raise PluginError("kubectl get pods: an answer that is not a pod list") from None


def _daemonset_image(flags: KubectlFlags) -> str:
    result = _kubectl(flags, "get", "daemonset", "ip-masq-agent", "-o",
                      "jsonpath={.spec.template.spec.containers[0].image}")
    return result.stdout.strip() if result.returncode == 0 and result.stdout.strip() else IMAGE


def run_on_node(flags: KubectlFlags, node: str, argv: Sequence[str]) -> int:
    pod = agent_pod(flags, node)
    if pod is not None:
        command = ["kubectl", *flags.kubectl_args(), "exec", pod, "-c", "ip-masq-agent", "--", *argv]
        return subprocess.run(command).returncode
    return _debug_pod(flags, node, argv, flags.image or _daemonset_image(flags))


def debug_pod_name() -> str:
    """Unique however many operators start one at once: the second it started and 8 random hex digits (32 bits: two
    operators in one second collide once in four billion)."""
    return f"ipmasq-debug-{int(time.time())}-{secrets.token_hex(4)}"


def _debug_pod(flags: KubectlFlags, node: str, argv: Sequence[str], image: str) -> int:
    """A pod on the node's network that runs the command once; its output is the command's. Deleted after."""
    name = debug_pod_name()
    print(f"{PROG}: no ipmasq agent on {node}: running in pod {flags.namespace}/{name} ({image})", file=sys.stderr)
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": flags.namespace,
                                                          "labels": {"app.kubernetes.io/name": "ipmasq-debug"}},
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
        sys.stdout.write(_kubectl(flags, "logs", name).stdout)
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
    from ipmasq.kube.uninstall import main as uninstall_main

    return uninstall_main(args, kubeconfig=flags.kubeconfig, context=flags.context, image=flags.image)


def _on_node(command: str) -> Callable[[KubectlFlags, list[str]], int]:
    def run(flags: KubectlFlags, args: list[str]) -> int:
        if not args or args[0].startswith("-"):
            raise UsageError("name the node first: " + SUBCOMMANDS[command].usage)
        node, rest = args[0], args[1:]
        _check_flags(command, rest)  # a mistyped flag is said here, before any pod is asked
        return run_on_node(flags, node, ["ipmasq", command, *rest])

    return run


def _check_flags(command: str, args: list[str]) -> None:
    from ipmasq.cli import build_parser, subcommands
    from ipmasq.commands.common import normalise_go_flags

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
                        "ipmasq check on the node, in its agent pod (else a short-lived pod)", _on_node("check")),
    "trace": Subcommand("trace NODE DEST --source POD_IP [--image IMAGE] [ipmasq trace flags]",
                        "ipmasq trace on the node, in its agent pod (else a short-lived pod)", _on_node("trace")),
    "uninstall": Subcommand("uninstall [--dry-run] [--timeout SECONDS] [--image IMAGE]",
                            "ipmasq off every node (its rules too) and out of the API; the ConfigMap is kept",
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
              "exit status: 0 ok, 1 findings, 2 usage, 3 could not run (no cluster, kubectl failed)"]
    return "\n".join(lines)


def _node_help(command: str) -> str:
    """`kubectl ipmasq check --help`: the plugin's line, then ipmasq's own help for the command run on the node."""
    from ipmasq.cli import build_parser, subcommands

    parser = subcommands(build_parser(command))[command]
    parser.prog = f"{PROG} {command} NODE"
    return (f"usage: {PROG} {SUBCOMMANDS[command].usage} {KUBECTL_FLAGS_USAGE}\n"
            f"  --image IMAGE   the short-lived pod's image where no ipmasq agent runs (default: the DaemonSet's)\n\n"
            f"run on the node as:\n\n{parser.format_help()}")


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    who = PROG
    try:
        flags, rest = split_kubectl_flags(args)
        who = f"{PROG} {rest[0]}" if rest and rest[0] in SUBCOMMANDS else PROG
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
