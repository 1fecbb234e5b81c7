"""The code's shape: one name per concept (no class name defined in two modules), every exception class in
ipmasq.errors (the one error tree), and no import cycle between ipmasq's modules."""

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
