"""`kubectl ipmasq`: the kubectl plugin (the executable `kubectl-ipmasq`, installed with the package).

    kubectl ipmasq status [-o json]                    the whole cluster (ipmasq status)
    kubectl ipmasq check NODE [CHECK FLAGS]            `ipmasq check` on that node, as it prints there
    kubectl ipmasq trace NODE DEST --source POD_IP ... `ipmasq trace` on that node
    kubectl ipmasq uninstall [--dry-run]               ipmasq off every node and out of the API (ipmasq.kube.uninstall)

check and trace run in the node's agent pod (`kubectl exec`: the agent's own config, flags and kernel view). Where
no ipmasq agent runs on the node (another agent owns it), a short-lived pod on the node's network with the ipmasq
image runs them instead (--image; default: the DaemonSet's image), and is deleted after.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Sequence

from ipmasq.version import IMAGE

__all__ = ["main"]

NAMESPACE = "kube-system"
AGENT_SELECTOR = "k8s-app=ip-masq-agent"
USAGE = """usage: kubectl ipmasq status [-o json] [--configmaps NAMES]
       kubectl ipmasq check NODE [--image IMAGE] [ipmasq check flags]
       kubectl ipmasq trace NODE DEST --source POD_IP [--image IMAGE] [ipmasq trace flags]
       kubectl ipmasq uninstall [--dry-run] [--image IMAGE]"""


def _kubectl(*args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(["kubectl", *args], capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError:
        raise SystemExit("kubectl ipmasq: kubectl not found on PATH") from None
    except subprocess.TimeoutExpired:
        raise SystemExit(f"kubectl ipmasq: kubectl {' '.join(args[:3])}: no answer within {timeout:.0f} s") from None


def agent_pod(node: str) -> str | None:
    """The running ipmasq agent pod on the node, if any."""
    result = _kubectl("get", "pods", "-n", NAMESPACE, "-l", AGENT_SELECTOR, "--field-selector",
                      f"spec.nodeName={node},status.phase=Running", "-o", "json")
    if result.returncode != 0:
        raise SystemExit(f"kubectl ipmasq: {result.stderr.strip()}")
    items = json.loads(result.stdout).get("items") or []
    return str(items[0]["metadata"]["name"]) if items else None


def _daemonset_image() -> str:
    result = _kubectl("get", "daemonset", "ip-masq-agent", "-n", NAMESPACE, "-o",
                      "jsonpath={.spec.template.spec.containers[0].image}")
    return result.stdout.strip() if result.returncode == 0 and result.stdout.strip() else IMAGE


def run_on_node(node: str, argv: Sequence[str], image: str | None) -> int:
    pod = agent_pod(node)
    if pod is not None:
        result = subprocess.run(["kubectl", "exec", "-n", NAMESPACE, pod, "-c", "ip-masq-agent", "--", *argv])
        return result.returncode
    return _debug_pod(node, argv, image or _daemonset_image())


def _debug_pod(node: str, argv: Sequence[str], image: str) -> int:
    """A pod on the node's network that runs the command once; its output is the command's. Deleted after."""
    name = f"ipmasq-debug-{int(time.time())}"
    print(f"kubectl ipmasq: no ipmasq agent on {node}: running in pod {NAMESPACE}/{name} ({image})", file=sys.stderr)
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": NAMESPACE,
                                                          "labels": {"app.kubernetes.io/name": "ipmasq-debug"}},
           "spec": {"nodeName": node, "hostNetwork": True, "restartPolicy": "Never",
                    "automountServiceAccountToken": False, "tolerations": [{"operator": "Exists"}],
                    "containers": [{"name": "ipmasq", "image": image, "imagePullPolicy": "IfNotPresent",
                                    "command": list(argv),
                                    "securityContext": {"capabilities": {"drop": ["ALL"],
                                                                         "add": ["NET_ADMIN", "NET_RAW"]},
                                                        "runAsUser": 0}}]}}
    created = subprocess.run(["kubectl", "apply", "-f", "-"], input=json.dumps(pod), capture_output=True, text=True)
    if created.returncode != 0:
        print(f"kubectl ipmasq: {created.stderr.strip()}", file=sys.stderr)
        return 1
    try:
        deadline = time.monotonic() + 120
        phase = ""
        while time.monotonic() < deadline:
            phase = _kubectl("get", "pod", name, "-n", NAMESPACE, "-o", "jsonpath={.status.phase}").stdout.strip()
            if phase in ("Succeeded", "Failed"):
                break
            time.sleep(0.5)
        else:
            print(f"kubectl ipmasq: pod {name} did not finish within 120 s (phase {phase or 'unknown'})",
                  file=sys.stderr)
            return 1
        sys.stdout.write(_kubectl("logs", name, "-n", NAMESPACE).stdout)
        code = _kubectl("get", "pod", name, "-n", NAMESPACE, "-o",
                        "jsonpath={.status.containerStatuses[0].state.terminated.exitCode}").stdout.strip()
        return int(code) if code.isdigit() else 1
    finally:
        _kubectl("delete", "pod", name, "-n", NAMESPACE, "--wait=false")


def _take_image(args: list[str]) -> tuple[list[str], str | None]:
    for at, arg in enumerate(args):
        if arg.startswith("--image="):
            return args[:at] + args[at + 1:], arg.split("=", 1)[1]
    if "--image" in args:
        at = args.index("--image")
        if at + 1 >= len(args):
            raise SystemExit("kubectl ipmasq: --image needs a value")
        return args[:at] + args[at + 2:], args[at + 1]
    return args, None


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0 if args else 2
    command, rest = args[0], args[1:]
    if command == "status":
        from ipmasq.cli import main as ipmasq_main

        return ipmasq_main(["status", *rest])
    if command == "uninstall":
        from ipmasq.kube.uninstall import main as uninstall_main

        return uninstall_main(rest)
    if command in ("check", "trace"):
        if not rest or rest[0].startswith("-"):
            print(f"kubectl ipmasq {command}: name the node first\n{USAGE}", file=sys.stderr)
            return 2
        node, flags = rest[0], rest[1:]
        flags, image = _take_image(flags)
        return run_on_node(node, ["ipmasq", command, *flags], image)
    print(f"kubectl ipmasq: unknown command {command!r}\n{USAGE}", file=sys.stderr)
    return 2
