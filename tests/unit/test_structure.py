"""The code's shape: one name per concept (no class name defined in two modules), every exception class in
ipmasq.errors (the one error tree), no import cycle between ipmasq's modules, and the floors of the house
(docs/architecture.md): each package or top-level module on one floor, importing only from its own floor or below."""

from __future__ import annotations

import ast
import importlib
import inspect
from collections import defaultdict
from pathlib import Path

from tests.conftest import ROOT

SRC = ROOT / "src"
PACKAGE = SRC / "ipmasq"
# Exceptions that steer control flow inside one module and never leave it (errors.py's docstring says why each).
PRIVATE_EXCEPTIONS = {("ipmasq.config.rules", "_Said"), ("ipmasq.netfilter.nft_json", "_Unrecognised")}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def test_no_class_name_is_defined_in_two_modules() -> None:
    defined: dict[str, set[str]] = defaultdict(set)
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                defined[node.name].add(name)
    twice = {cls: sorted(where) for cls, where in defined.items() if len(where) > 1}
    assert not twice, f"one name per concept: each class name in one module only; named twice: {twice}"


def test_every_exception_class_is_in_errors() -> None:
    outside = []
    for name in MODULES:
        if name.endswith("__main__") or name == "ipmasq.errors":  # __main__ runs the CLI when imported
            continue
        module = importlib.import_module(name)
        for cls_name, value in vars(module).items():
            if inspect.isclass(value) and value.__module__ == name and issubclass(value, BaseException) \
                    and (name, cls_name) not in PRIVATE_EXCEPTIONS:
                outside.append(f"{name}.{cls_name}")
    assert not outside, f"exception classes belong in ipmasq/errors.py (the one error tree): {outside}"


def test_the_allowed_private_exceptions_still_exist() -> None:
    """The list above names real classes: a removed one is taken off it, not left to allow a newcomer of its name."""
    for module, cls_name in PRIVATE_EXCEPTIONS:
        assert issubclass(getattr(importlib.import_module(module), cls_name), Exception)


def _imports(name: str, path: Path) -> set[str]:
    """The ipmasq modules `name` imports anywhere in its text: at the top, inside a function (a deferred import is
    still a cycle once both run) or under TYPE_CHECKING."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            # `from ipmasq.kube import objects` imports the module ipmasq.kube.objects
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
        else:
            continue
        found.update(target for target in targets if target in MODULES and target != name)
    return found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            for successor in successors:
                if successor not in index:
                    index[successor] = low[successor] = len(index)
                    stack.append(successor)
                    on_stack.add(successor)
                    work.append((successor, iter(sorted(graph[successor]))))
                    break
                if successor in on_stack:
                    low[node] = min(low[node], index[successor])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_no_import_cycle() -> None:
    graph = {name: _imports(name, path) for name, path in MODULES.items()}
    assert not _cycles(graph), f"import cycles between ipmasq's modules: {_cycles(graph)}"


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


# The floors, lowest first (docs/architecture.md draws them). A module imports only from its own floor and below;
# the features and the command line are the two floors that may not import each other's way up.
FLOORS: dict[str, frozenset[str]] = {
    # leaves: each one idea that everything may use, importing no other floor
    "leaves": frozenset({"ipmasq", "errors", "prefix", "options", "sha256", "findings", "version", "memory_file",
                         "documents", "goflags", "backoff", "http11", "input_files", "inotify", "ownership"}),
    # the pure core: decides (config, policy, the rules' text, the writers' readings, lint, diff, routes, audit)
    "core": frozenset({"config", "policy", "netfilter", "writers", "lint", "diff", "route", "audit", "cloudnat"}),
    # the two seams: the kernel (backends) and the API server (kube)
    "seams": frozenset({"backends", "kube"}),
    # features: what the tools and the agent are made of
    "features": frozenset({"diagnose", "agent", "observe", "fleet", "uninstall", "webhook", "conntrack", "testing"}),
    # the command line, the lab and what ships beside them
    "commands": frozenset({"commands", "cli", "__main__", "kubectl_plugin", "kubectl_complete", "lab", "monitoring"}),
}
# Within the seams, kube is the API seam alone: it imports leaves only (no config, no feature, no command line).
SEAM_ALLOWED = {"kube": FLOORS["leaves"], "backends": FLOORS["leaves"] | FLOORS["core"]}


def _room(module: str) -> str:
    """The package or top-level module `module` belongs to: ipmasq.kube.client -> kube, ipmasq.cli -> cli."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _floor_of(room: str) -> int:
    return next(index for index, rooms in enumerate(FLOORS.values()) if room in rooms)


def _upward(graph: dict[str, set[str]]) -> list[str]:
    """Every import that goes up a floor, or from a seam to what it may not use: `module -> target`."""
    found = []
    for module, targets in graph.items():
        room = _room(module)
        for target in sorted(targets):
            other = _room(target)
            if room == other:
                continue
            allowed = SEAM_ALLOWED.get(room)
            if (allowed is not None and other not in allowed) or _floor_of(other) > _floor_of(room):
                found.append(f"{module} -> {target}")
    return found


def test_every_package_and_top_level_module_is_on_one_floor() -> None:
    rooms = {_room(name) for name in MODULES}
    placed = [room for rooms_of in FLOORS.values() for room in rooms_of]
    assert len(placed) == len(set(placed)), "a room on two floors"
    assert rooms - set(placed) == set(), f"place every new package or module on a floor (FLOORS): {rooms - set(placed)}"
    assert set(placed) - rooms == set(), f"FLOORS names rooms that are gone: {set(placed) - rooms}"


def test_no_import_goes_up_a_floor() -> None:
    """The pure core imports nothing above it; kube imports neither the core, the features nor the command line;
    no feature imports the command line (ipmasq.documents and ipmasq.goflags are the helpers both share)."""
    graph = {name: _imports(name, path) for name, path in MODULES.items()}
    assert _upward(graph) == []


def test_the_floor_check_finds_an_import_that_goes_up() -> None:
    graph = {"ipmasq.kube.client": {"ipmasq.agent.loop"}, "ipmasq.config.model": {"ipmasq.backends.base"},
             "ipmasq.kube.paths": {"ipmasq.config.model"}, "ipmasq.fleet.view": {"ipmasq.commands.common"},
             "ipmasq.commands.status": {"ipmasq.fleet.view", "ipmasq.kube.client"}, "ipmasq.agent.loop": set()}
    assert _upward(graph) == ["ipmasq.kube.client -> ipmasq.agent.loop", "ipmasq.config.model -> ipmasq.backends.base",
                              "ipmasq.kube.paths -> ipmasq.config.model", "ipmasq.fleet.view -> ipmasq.commands.common"]


def test_no_module_of_src_is_over_650_lines() -> None:
    """A room of one idea stays small enough to read whole; one that grows past this holds two."""
    long = {name: lines for name, path in MODULES.items()
            if (lines := path.read_text(encoding="utf-8").count("\n")) > 650}
    assert long == {}
