"""`kubectl_complete-ipmasq`: shell completion for `kubectl ipmasq`, as kubectl asks plugins for it.

kubectl (1.26 and newer) completes a plugin's words by running the executable `kubectl_complete-PLUGIN` found on
PATH with the words typed after the plugin's name, the last one the word being completed (empty for a new word):

    kubectl ipmasq check no<TAB>      ->  kubectl_complete-ipmasq check no

It prints one candidate per line and, last, `:DIRECTIVE` (cobra's ShellCompDirective: 4 asks the shell not to fall
back to file names, 0 lets it). The subcommands and their flags come from the same tables and parsers that run them
(ipmasq.kubectl_plugin.SUBCOMMANDS, ipmasq.cli's parsers), so a new flag completes without a change here. Nodes,
namespaces and contexts are asked of kubectl with the flags already typed (`--context`, `--kubeconfig`), under a short
deadline; a name that is not a plain Kubernetes name is never printed (the shell would act on it).
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterable, Sequence

from ipmasq.kubectl_plugin import SUBCOMMANDS, KubectlFlags

__all__ = ["DIRECTIVE_DEFAULT", "DIRECTIVE_NO_FILES", "candidates", "main"]

DIRECTIVE_DEFAULT = 0  # the shell may complete file names
DIRECTIVE_NO_FILES = 4  # cobra's ShellCompDirectiveNoFileComp
KUBECTL_SECONDS = 5.0  # a completion the user waits for at a prompt
MAX_NAMES = 2000  # of the cluster's nodes or namespaces offered
# a node or namespace name (DNS subdomain) or a context name as people write them: nothing a shell acts on
_PLAIN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@/-]{0,252}")
_OUTPUTS = ("text", "json", "yaml")
# kubectl's own flags, which every subcommand takes (ipmasq.kubectl_plugin.split_kubectl_flags reads them)
_KUBECTL_FLAGS = ("--kubeconfig", "--context", "--namespace", "-n")
_ON_NODE = ("check", "trace")  # subcommands whose first argument is a node
_UNINSTALL_FLAGS = ["--all-nodes", "--dry-run", "--image", "--remove-unmarked", "--timeout"]


def _kubectl_names(flags: KubectlFlags, *args: str) -> list[str]:
    """Names kubectl prints, one per line (`-o name` forms lose their `kind/`); nothing on any failure."""
    argv = ["kubectl", *([f"--kubeconfig={flags.kubeconfig}"] if flags.kubeconfig else []),
            *([f"--context={flags.context}"] if flags.context else []), *args]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=KUBECTL_SECONDS,
                              stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return []
    if done.returncode != 0:
        return []
    names = [line.strip().rpartition("/")[2] if "/" in line and args[0] == "get" else line.strip()
             for line in done.stdout.splitlines()[:MAX_NAMES]]
    return [name for name in names if _PLAIN_NAME.fullmatch(name)]


def _options(command: str) -> list[str]:
    """The long flags of the ipmasq command run on the node (or of status), as its parser has them."""
    from ipmasq.cli import build_parser, subcommands

    parser = subcommands(build_parser(command))[command]
    return sorted({o for action in parser._actions for o in action.option_strings if o.startswith("--")})


def _flags_typed(words: Sequence[str]) -> KubectlFlags:
    values: dict[str, str] = {}
    for index, word in enumerate(words):
        name, eq, value = word.partition("=")
        if name in ("--kubeconfig", "--context") and not eq and index + 1 < len(words):
            value = words[index + 1]
        if name in ("--kubeconfig", "--context") and value:
            values[name[2:]] = value
    return KubectlFlags(**values)


def candidates(words: Sequence[str]) -> tuple[list[str], int]:
    """What completes the last of `words` (the words after `kubectl ipmasq`), and cobra's directive."""
    *before, current = list(words) or [""]
    flags = _flags_typed(before)
    previous = before[-1] if before else ""
    if previous in ("-n", "--namespace"):
        return _matching(_kubectl_names(flags, "get", "namespaces", "-o", "name"), current), DIRECTIVE_NO_FILES
    if previous == "--context":
        return _matching(_kubectl_names(flags, "config", "get-contexts", "-o", "name"), current), DIRECTIVE_NO_FILES
    if previous == "--kubeconfig":
        return [], DIRECTIVE_DEFAULT
    if previous in ("-o", "--output"):
        return _matching(_OUTPUTS, current), DIRECTIVE_NO_FILES
    # the words that are not kubectl's flags (nor their values): the subcommand and its arguments
    positional: list[str] = []
    skip = False
    for word in before:
        if skip:
            skip = False
        elif word in _KUBECTL_FLAGS or word == "--image":
            skip = True
        elif not word.startswith("-"):
            positional.append(word)
    if not positional:
        return _matching([*SUBCOMMANDS, "--version", "--help", *_KUBECTL_FLAGS[:3]], current), DIRECTIVE_NO_FILES
    command = positional[0]
    if command not in SUBCOMMANDS:
        return [], DIRECTIVE_NO_FILES
    if command in _ON_NODE and len(positional) == 1 and not current.startswith("-"):
        return _matching(_kubectl_names(flags, "get", "nodes", "-o", "name"), current), DIRECTIVE_NO_FILES
    if current.startswith("-"):
        extra = ["--image"] if command != "status" else []
        own = _UNINSTALL_FLAGS if command == "uninstall" else _options(command)
        return _matching(sorted({*own, *extra, *_KUBECTL_FLAGS[:3], "--help"}), current), DIRECTIVE_NO_FILES
    # a value of the node command's own flags (a file for --config or --from-dump): let the shell offer files
    return [], DIRECTIVE_DEFAULT


def _matching(names: Iterable[str], prefix: str) -> list[str]:
    return [name for name in names if name.startswith(prefix)]


def main(argv: Sequence[str] | None = None) -> int:
    words = list(sys.argv[1:] if argv is None else argv)
    try:
        found, directive = candidates(words)
    except Exception:  # a completion never prints a traceback at the user's prompt
        found, directive = [], DIRECTIVE_NO_FILES
    sys.stdout.write("".join(f"{name}\n" for name in found) + f":{directive}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
