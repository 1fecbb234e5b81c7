"""What the pages name exists: every module, file and path of this repository a page names, and every dependency it
names is one the project really installs.

Read from every Markdown page of the repository (README, docs/, deploy/, bench/, plugins/) but the records of the
past (CHANGELOG.md; docs/measurements.md, whose "before" columns name code since replaced: there only the benches and
scripts that print the figures are checked). What counts as a name:

- a file of ours: `src/...`, `tests/...`, `bench/...`, `scripts/...`, `deploy/...`, `plugins/...`, `.ci/...` (a file
  or a directory), and any `something.py` or `dir/something.py` or `.sh` (the end of a path of the repository:
  `agent/loop.py` is src/ipmasq/agent/loop.py); a template such as `test_<module>.py` is not a name;
- a module or what it defines: `ipmasq.kube.client`, `ipmasq.errors.one_line` (imported: the module must exist and
  hold each name after it); the API group `ipmasq.dev` and names inside other paths are not modules;
- a Go module or a package in one: a `host.tld/path` in backticks, which one of the Kubernetes lab's go.mod files
  (src/ipmasq/lab/kubernetes/gomod/*/go.mod) must require, replace or be;
- a Debian package: the backticked names after "Debian's", "Debian 12's" or "Debian packages", up to the end of the
  sentence or the word "packages" (what is in parentheses skipped), which scripts/bootstrap.sh or the Dockerfile
  installs;
- a Python package: what `pip install` is given (a name or an extra of `.`), what a code block imports, what
  `python -m` runs, and a word the page describes as a server, library, framework, parser or binding ("uvicorn (an
  asyncio ASGI server ...)"): the standard library, ipmasq, or a dependency of pyproject.toml.

A failure lists each page, line and name, and what to do: fix the page, or install the dependency from the project's
own files.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import re
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

from ipmasq.kube.paths import GROUP
from tests.conftest import ROOT

HISTORY = {"CHANGELOG.md", "docs/measurements.md"}  # records of the past: they name what was
TOP = ("src/", "tests/", "bench/", "scripts/", "deploy/", "plugins/", ".ci/")
GOMOD = ROOT / "src/ipmasq/lab/kubernetes/gomod"
# Names a page says the project no longer uses while another branch is rewriting that page: (page, name) -> why. An
# entry whose page no longer names it fails the test, so that it is removed once the rewrite has landed.
PENDING: dict[tuple[str, str], str] = {}


def _pages() -> list[Path]:
    found = [*ROOT.glob("*.md")]
    for top in ("docs", "deploy", "bench", "plugins"):
        found += (ROOT / top).rglob("*.md")
    return sorted(page for page in found if ".venv" not in page.parts)


def _name(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


def _lines(page: Path) -> Iterator[tuple[int, str]]:
    yield from enumerate(page.read_text(encoding="utf-8").splitlines(), 1)


def _repository_files() -> tuple[set[str], set[str]]:
    files: set[str] = set()
    directories: set[str] = set()
    skip = {".git", ".venv", "__pycache__", ".mypy_cache", ".ruff_cache", ".pytest_cache", ".hypothesis"}
    stack = [ROOT]
    while stack:
        for entry in stack.pop().iterdir():
            if entry.name in skip or entry.name.endswith(".egg-info"):
                continue
            relative = entry.relative_to(ROOT).as_posix()
            if entry.is_dir():
                directories.add(relative)
                stack.append(entry)
            else:
                files.add(relative)
    return files, directories


FILES, DIRECTORIES = _repository_files()
_SUFFIXES = {path[i + 1:] for path in FILES | DIRECTORIES for i, char in enumerate(path) if char == "/"}


# ---- files and modules -------------------------------------------------------------------------------------------

_REPO_PATH = re.compile(r"(?<![\w./-])((?:src|tests|bench|scripts|deploy|plugins|\.ci)/[\w./<>*{}-]*)")
_FILE = re.compile(r"(?<![\w./<>-])((?:[\w-]+/)*[\w-]+\.(?:py|sh))(?![\w/<>-])")
_DOTTED = re.compile(r"(?<![\w./-])ipmasq(?:\.[A-Za-z_]\w*)+(?![\w/-])")
# a class a page places in a file: "agent/api/summary.py SummaryWriter", "backoff.py`'s Backoff", "`Adopt` in
# `backends/base.py`"
_CLASS_AFTER = re.compile(r"(?<![\w./<>-])((?:[\w-]+/)*[\w-]+\.py)`?(?:'s)? `?([A-Z][a-z]\w*)\b")
_CLASS_BEFORE = re.compile(r"`([A-Z][a-z]\w*)` in `((?:[\w-]+/)*[\w-]+\.py)`")


def _ignored() -> tuple[str, ...]:
    """The directories .gitignore keeps out of the repository: what is written there (a bench's output) is named
    by the pages but never in a checkout."""
    lines = (ROOT / ".gitignore").read_text().splitlines()
    return tuple(line.strip().lstrip("/") for line in lines if line.strip().endswith("/") and "*" not in line)


OUTPUTS = _ignored()


def _exists(path: str) -> bool:
    path = path.rstrip("/.")  # a sentence's full stop, a directory's slash
    return path in FILES or path in DIRECTORIES or path in _SUFFIXES or path.startswith(OUTPUTS)


def _defines(path: str, name: str) -> bool:
    """Whether a file of the repository at (or ending in) `path` defines `name` at its top level."""
    definition = re.compile(rf"^(?:class|def)\s+{name}\b|^{name}\s*[:=]", re.M)
    return any(definition.search((ROOT / file).read_text(encoding="utf-8"))
               for file in FILES if file == path or file.endswith("/" + path))


def _resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for length in range(len(parts), 0, -1):
        base = ROOT / "src" / Path(*parts[:length])
        if base.with_suffix(".py").is_file() or (base / "__init__.py").is_file():
            found: object = importlib.import_module(".".join(parts[:length]))
            for attribute in parts[length:]:
                if not hasattr(found, attribute):
                    return False
                found = getattr(found, attribute)
            return True
    return False


def _file_and_module_names() -> Iterator[tuple[str, int, str, bool]]:
    """(page, line, name, exists) for every file, path and module a page names."""
    for page in _pages():
        history = _name(page) in HISTORY
        for number, line in _lines(page):
            seen: set[str] = set()
            for match in _REPO_PATH.finditer(line):
                path = match.group(1)
                if any(char in path for char in "<>*{}") or path.rstrip("/.") in seen:
                    continue
                if history and not path.startswith(("bench/", "scripts/")):
                    continue
                seen.add(path.rstrip("/."))
                yield _name(page), number, path, _exists(path)
            if history:
                continue
            for match in _FILE.finditer(line):
                path = match.group(1)
                if path.rstrip("/.") not in seen:
                    yield _name(page), number, path, _exists(path)
            for path, name in [*(m.groups() for m in _CLASS_AFTER.finditer(line)),
                               *((m.group(2), m.group(1)) for m in _CLASS_BEFORE.finditer(line))]:
                if _exists(path):
                    yield _name(page), number, f"{name} in {path}", _defines(path, name)
            for match in _DOTTED.finditer(line):
                dotted = match.group(0)
                if dotted != GROUP and not dotted.startswith(GROUP + "."):
                    yield _name(page), number, dotted, _resolves(dotted)


def test_every_file_path_and_module_the_pages_name_exists() -> None:
    named = list(_file_and_module_names())
    missing = [f"{page}:{line}: {name}" for page, line, name, exists in named if not exists]
    assert not missing, ("pages name files or modules that do not exist (rename them to what the code has now, or "
                         "drop the name):\n  " + "\n  ".join(missing))


def test_the_extraction_sees_the_architectures_names() -> None:
    """The check above is only as good as what it reads: the map of the code names these, in each form."""
    named = {(page, name) for page, _, name, _ in _file_and_module_names()}
    for expected in ["agent/loop.py", "backends/base.py", "kube/paths.py", "ipmasq.testing"]:
        assert ("docs/architecture.md", expected) in named, expected
    assert ("docs/development.md", "tests/unit/test_docs.py") in named
    assert ("docs/development.md", "src/ipmasq/lab/kubernetes/") in named
    assert ("docs/architecture.md", "SummaryWriter in agent/api/summary.py") in named
    assert ("docs/architecture.md", "Adopt in backends/base.py") in named
    assert not any(name == GROUP for _, name in named)


@pytest.mark.parametrize(("text", "missing"), [
    ("the loop (`agent/loop.py`) and `kube/paths.py`", []),
    ("the old reader (`kube/_http.py`)", ["kube/_http.py"]),
    ("`ipmasq.kube.client` and ipmasq.errors.one_line.", []),
    ("`ipmasq.kube.http` and `ipmasq.errors.no_such_name`", ["ipmasq.kube.http", "ipmasq.errors.no_such_name"]),
    ("the `ipmasq.dev` API, `ipmasq.io/v1`, plugins/ipmasq.yaml", []),
    ("`tests/unit/<package>/test_<module>.py` and `bench/` and `scripts/no-such.sh`", ["scripts/no-such.sh"]),
])
def test_the_extraction_on_examples(text: str, missing: list[str], tmp_path: Path) -> None:
    found = []
    for pattern in (_REPO_PATH, _FILE):
        found += [m.group(1) for m in pattern.finditer(text) if not any(c in m.group(1) for c in "<>*{}")]
    found += [m.group(0) for m in _DOTTED.finditer(text) if m.group(0) != GROUP]
    bad = [name for name in dict.fromkeys(found)
           if not (_resolves(name) if name.startswith("ipmasq.") else _exists(name))]
    assert bad == missing


def test_a_class_placed_in_the_wrong_file_is_caught() -> None:
    assert _defines("agent/api/summary.py", "SummaryWriter") and _defines("src/ipmasq/backoff.py", "Backoff")
    assert not _defines("agent/loop.py", "SummaryWriter")
    assert [m.groups() for m in _CLASS_AFTER.finditer("kube/configmaps.py ConfigMapFollower, backoff.py`'s Backoff")] \
        == [("kube/configmaps.py", "ConfigMapFollower"), ("backoff.py", "Backoff")]
    assert [m.groups() for m in _CLASS_BEFORE.finditer("(`Adopt` in `backends/base.py`)")] == \
        [("Adopt", "backends/base.py")]


# ---- dependencies ------------------------------------------------------------------------------------------------

def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _python_dependencies() -> tuple[set[str], set[str]]:
    """(distributions, extras) pyproject.toml declares."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    requirements = [*project["build-system"]["requires"], *project["project"]["dependencies"]]
    extras = project["project"].get("optional-dependencies", {})
    for listed in extras.values():
        requirements += listed
    names = {_normalized(re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", requirement).group(0))  # type: ignore[union-attr]
             for requirement in requirements}
    return names, set(extras)


DISTRIBUTIONS, EXTRAS = _python_dependencies()


def _python_names() -> set[str]:
    """What a page may name as Python: the standard library, ipmasq, pip, each declared distribution and the
    top-level modules it installs."""
    allowed = set(sys.stdlib_module_names) | {"ipmasq", "pip"} | DISTRIBUTIONS
    for module, distributions in importlib.metadata.packages_distributions().items():
        if any(_normalized(d) in DISTRIBUTIONS for d in distributions):
            allowed.add(module)
    return {_normalized(name) for name in allowed}


def _debian_packages() -> set[str]:
    bootstrap = (ROOT / "scripts/bootstrap.sh").read_text()
    loop = re.search(r"for tool in (.*?); do", bootstrap, re.S)
    assert loop is not None, "scripts/bootstrap.sh: its `for tool in TOOL:PACKAGE ...; do` list moved"
    packages = set(re.findall(r"[\w.+-]+:([\w.+-]+)", loop.group(1)))
    packages |= set(re.findall(r"need_debian\+=\(([\w.+-]+)\)", bootstrap))
    for install in re.findall(r"apt-get install((?:[^\n&|;]|\\\n)*)", (ROOT / "Dockerfile").read_text()):
        packages |= {word for word in install.replace("\\\n", " ").split() if not word.startswith("-")}
    return packages


def _go_modules() -> set[str]:
    modules: set[str] = set()
    for gomod in GOMOD.glob("*/go.mod"):
        text = re.sub(r"//[^\n]*", "", gomod.read_text())
        modules |= set(re.findall(r"^\s*(?:module\s+|require\s+|replace\s+)?([a-z0-9.-]+\.[a-z]+/[^\s]+)\s+(?:v|=>)",
                                  text, re.M))
        modules |= set(re.findall(r"=>\s*([a-z0-9.-]+\.[a-z]+/[^\s]+)\s+v", text))
        modules |= set(re.findall(r"^module\s+(\S+)", text, re.M))
    return modules


_DEBIAN = re.compile(r"Debian(?: \d+)?(?:'s| packages?)")
_BACKTICKED = re.compile(r"`([^`\n]+)`")
_GO_PATH = re.compile(r"`((?:[a-z0-9-]+\.)+[a-z]{2,}/[\w./~+-]+)`")
# where Go modules live; a label, an annotation, an API group or an image (`app.kubernetes.io/name`, `ipmasq.io/v1`,
# `ghcr.io/...`) is none, and a Go path on another host is taken as a module only after the word "module"
_GO_HOSTS = ("github.com/", "k8s.io/", "sigs.k8s.io/", "go.etcd.io/", "golang.org/", "google.golang.org/", "gopkg.in/")
_GO_FRAME = re.compile(r"\bmodules? $")
_PIP = re.compile(r"\bpip3? install ((?:[^`\n#;&|),]|,(?!\s))*)")
_REQUIREMENT = re.compile(r"([A-Za-z][\w.-]*)?(?:\[([\w,-]+)\])?(?:[=<>!~;@].*)?")
_IMPORT = re.compile(r"^\s*(?:from\s+([\w.]+)\s+import|import\s+([\w.]+))")
_RUN_MODULE = re.compile(r"\bpython3?(?:\.\d+)? -m ([\w.]+)")
_DESCRIBED = re.compile(r"(?<![\w./`-])`?([A-Za-z][\w.-]*[A-Za-z0-9])`? \(an? [\w ./-]{0,40}?"
                        r"\b(?:server|library|framework|parser|binding)\b")


def _paragraphs(page: Path) -> Iterator[tuple[int, str]]:
    """(first line, text joined into one line) of each paragraph or table row."""
    start, lines = 0, []
    for number, line in _lines(page):
        if not line.strip() or line.lstrip().startswith("|"):
            if lines:
                yield start, " ".join(lines)
            start, lines = number, []
            if line.strip():
                yield number, line
            continue
        if not lines:
            start = number
        lines.append(line.strip())
    if lines:
        yield start, " ".join(lines)


def debian_names(text: str) -> list[str]:
    """The Debian packages a paragraph names (see the module's docstring for the form)."""
    names: list[str] = []
    for frame in _DEBIAN.finditer(text):
        window = re.sub(r"\([^()]*\)", "", text[frame.end():])
        window = re.split(r"\.(?:\s|$)|[|;:)]", window, maxsplit=1)[0]
        for match in re.finditer(r"`([^`]+)`|\bpackages?\b", window):
            if match.group(1) is None:
                if names:
                    break
                continue
            names.append(match.group(1))
    return names


def python_names(text: str, code: bool) -> list[str]:
    """The Python packages a line names (in a code block, imports count too)."""
    names: list[str] = []
    for match in _PIP.finditer(text):
        for word in match.group(1).replace("'", " ").replace('"', " ").split():
            if word.startswith((".[", "-", "/", "~", "$")) and not word.startswith(".["):
                continue
            requirement = _REQUIREMENT.fullmatch(word[1:] if word.startswith(".[") else word)
            if requirement is None or requirement.group(0) == "":
                continue
            if requirement.group(1) and not word.startswith(".["):
                names.append(requirement.group(1))
            if requirement.group(2):
                names += [f"[{extra}]" for extra in requirement.group(2).split(",")]
    names += [match.group(1).split(".")[0] for match in _RUN_MODULE.finditer(text)]
    names += [match.group(1) for match in _DESCRIBED.finditer(text)]
    if code:
        imported = _IMPORT.match(text)
        if imported:
            names.append((imported.group(1) or imported.group(2)).split(".")[0])
    return names


def _dependency_names() -> Iterator[tuple[str, int, str, str]]:
    """(page, line, kind, name) for every dependency a page names."""
    for page in _pages():
        if _name(page) in HISTORY:
            continue
        for number, paragraph in _paragraphs(page):
            for name in debian_names(paragraph):
                yield _name(page), number, "Debian package", name
        fenced = False
        for number, line in _lines(page):
            if line.lstrip().startswith("```"):
                fenced = not fenced
                continue
            code = fenced or line.startswith("    ")
            for name in python_names(line, code):
                yield _name(page), number, "Python package", name
            for match in _GO_PATH.finditer(line):
                if match.group(1).startswith(_GO_HOSTS) or _GO_FRAME.search(line[:match.start()]):
                    yield _name(page), number, "Go module", match.group(1)


def _installed(kind: str, name: str) -> bool:
    if kind == "Debian package":
        return name in DEBIAN
    if kind == "Go module":
        return any(name == module or name.startswith(module + "/") for module in GO_MODULES)
    if name.startswith("["):
        return name[1:-1] in EXTRAS
    return _normalized(name) in PYTHON


DEBIAN, GO_MODULES, PYTHON = _debian_packages(), _go_modules(), _python_names()
_WHERE = {"Debian package": "scripts/bootstrap.sh (or the Dockerfile)", "Go module": "a go.mod of the lab's gomod/",
          "Python package": "pyproject.toml"}


def test_every_dependency_the_pages_name_is_one_the_project_installs() -> None:
    named = list(_dependency_names())
    stale = []
    for page, line, kind, name in named:
        if (page, name) in PENDING or _installed(kind, name):
            continue
        stale.append(f"{page}:{line}: {kind} {name!r}: not installed by {_WHERE[kind]}")
    assert not stale, ("pages name dependencies the project does not install (fix the page, or install it from the "
                       "project's own files):\n  " + "\n  ".join(stale))
    expired = [f"{page}: {name!r}" for page, name in PENDING
               if not any((p, n) == (page, name) for p, _, _, n in named)]
    assert not expired, ("no longer named, remove from PENDING in tests/unit/test_docs_names.py: "
                         + ", ".join(expired))


def test_the_extraction_sees_the_dependencies_the_pages_name() -> None:
    named = {(page, kind, name) for page, _, kind, name in _dependency_names()}
    for page, kind, name in [
        ("docs/development.md", "Debian package", "nftables"),
        ("docs/development.md", "Debian package", "containernetworking-plugins"),
        ("README.md", "Debian package", "openssl"),
        ("docs/development.md", "Go module", "go.etcd.io/etcd/server/v3"),
        ("docs/development.md", "Go module", "k8s.io/kubernetes"),
        ("docs/getting-started.md", "Python package", "[audit]"),
    ]:
        assert (page, kind, name) in named, (page, kind, name)
    assert {"iptables", "nftables", "conntrack", "containernetworking-plugins", "openssl"} <= DEBIAN
    assert {"pyyaml", "h11", "cryptography", "orjson", "lightkube"} <= DISTRIBUTIONS
    assert {"yaml", "h11", "ssl", "asyncio"} <= PYTHON
    assert {"k8s.io/kubernetes", "go.etcd.io/etcd/server/v3", "github.com/prometheus/prometheus"} <= GO_MODULES


@pytest.mark.parametrize(("text", "names"), [
    ("install Debian's `iptables`, `nftables`,  `iproute2` and `prometheus` packages when missing (`apt-get`), then "
     "a virtual environment `.venv`", ["iptables", "nftables", "iproute2", "prometheus"]),
    ("installs the Debian packages that are missing of `iptables`, `conntrack` (the agent), `runc` and `gcc` (the "
     "lab), waiting for apt's lock; then `.venv`", ["iptables", "conntrack", "runc", "gcc"]),
    ("| runc | 1.1.5 | Debian 12's `runc`, `containernetworking-plugins` |", ["runc", "containernetworking-plugins"]),
    ("Debian's `prometheus` package is built without service discovery (`field not found`): `go`", ["prometheus"]),
    ("Debian and Ubuntu refuse a bare `pip install`", []),
    ("Debian 12's golang-go is too old (`go` on PATH)", []),
])
def test_debian_names_in_their_forms(text: str, names: list[str]) -> None:
    assert debian_names(text) == names


@pytest.mark.parametrize(("text", "code", "names"), [
    ("`pip install '.[audit]'` adds orjson", False, ["[audit]"]),
    ("    python3 -m venv .venv && .venv/bin/pip install .", True, ["venv"]),
    ("pip install --user uvicorn requests==2.0", False, ["uvicorn", "requests"]),
    ("(`pip install 'ipmasq[webhook]'`), which the image has", False, ["ipmasq", "[webhook]"]),
    ("pip install -e '.[dev,audit]'", False, ["[dev]", "[audit]"]),
    ("The webhook serves HTTPS with uvicorn (an asyncio ASGI server, on h11 like the rest)", False, ["uvicorn"]),
    ("HTTP/1.1 through h11 (an HTTP/1.1 parser) and `orjson` (a JSON library)", False, ["h11", "orjson"]),
    ("    from kubernetes import client", True, ["kubernetes"]),
    ("from this page (see above) import nothing", False, []),
    ("a watch is followed (the token goes to the API server)", False, []),
    ("kubectl exec POD -- python -m ipmasq.lab.probe connect", False, ["ipmasq"]),
])
def test_python_names_in_their_forms(text: str, code: bool, names: list[str]) -> None:
    assert python_names(text, code) == names


def test_a_python_name_the_project_does_not_install_is_caught() -> None:
    assert not _installed("Python package", "uvicorn")
    assert not _installed("Python package", "[no-such-extra]")
    assert _installed("Python package", "PyYAML") and _installed("Python package", "prometheus_client")
    assert not _installed("Debian package", "golang-go")
    assert not _installed("Go module", "github.com/example/nothing")
    assert _installed("Go module", "github.com/prometheus/prometheus/cmd/prometheus")
