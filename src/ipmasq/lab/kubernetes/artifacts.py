"""What the Kubernetes lab runs, built from Go modules and Debian's packages and cached on the machine.

    CACHE/kubernetes/bin/      kube-apiserver, kube-controller-manager, kube-scheduler, kubelet, kube-proxy, kubectl:
                               module k8s.io/kubernetes (gomod/kubernetes/go.mod pins the release)
    CACHE/etcd/bin/            etcd: module go.etcd.io/etcd/server/v3 (gomod/etcd)
    CACHE/containerd/bin/      containerd, containerd-shim-runc-v2, ctr: module github.com/containerd/containerd/v2
                               (gomod/containerd)
    CACHE/pause/pause.tar      the pod sandbox image: a pause.c like Kubernetes' own, compiled static, as a
                               docker-archive
    CACHE/base/                a bookworm root file system (mmdebstrap), the image's base where none can be pulled
    CACHE/image/               the agent's image, built from the repository's Dockerfile with that base (podman)
    CACHE/go/                  the Go module and build caches of these builds

runc and the CNI plugins are Debian's (runc, containernetworking-plugins). CACHE is /var/cache/ipmasq/kube-lab
(IPMASQ_LAB_CACHE overrides it). Each artifact is stored with the key of its inputs (go.mod and go.sum, the Go
version, the pause source, the package list, the repository's files) and rebuilt only when the key changes. A build
writes into NAME.partial and is renamed into place with its key last, so a half-built artifact is never used and an
interrupted build starts again. Every module is downloaded before anything compiles: a module the proxy refuses (or
an unreachable proxy) ends the preparation with one line naming it, before any cluster starts.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from ipmasq.errors import BuildError

__all__ = [
    "CONTAINERD_BINARIES", "KUBE_BINARIES", "PAUSE_IMAGE", "Artifacts", "GoBuild", "Toolchain",
    "cache_dir", "ensure_artifacts", "kubernetes_toolchain", "missing_packages", "prometheus_binary",
]

KUBE_BINARIES = ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubelet", "kube-proxy", "kubectl")
CONTAINERD_BINARIES = ("containerd", "containerd-shim-runc-v2", "ctr")
PAUSE_IMAGE = "registry.k8s.io/pause:3.10"  # containerd's pinned sandbox image: imported, never pulled
BASE_PACKAGES = ("python3", "python3-venv", "iptables", "nftables", "conntrack", "iproute2", "ca-certificates")
IMAGE_REPOSITORY = "ipmasq/ipmasq"
IMAGE_KEEP_SECONDS = 6 * 3600
GOMOD = Path(__file__).with_name("gomod")
GO_MINIMUM = (1, 26)  # what kubelet 1.37 and its modules' go lines ask for
GO_JOBS = "2"  # compile jobs at once: the machines have 2 cores
GO_FALLBACKS = ("/usr/local/go/bin/go",)  # Go's own install location, when go is not on PATH

# command -> the Debian package that provides it (what `missing_packages` names)
REQUIRED_COMMANDS = {
    "runc": "runc", "nsenter": "util-linux", "unshare": "util-linux", "openssl": "openssl", "ip": "iproute2",
    "iptables": "iptables", "nft": "nftables", "conntrack": "conntrack", "podman": "podman",
    "mmdebstrap": "mmdebstrap", "gcc": "gcc",
}
BUILD_ONLY = {"podman", "mmdebstrap", "gcc"}
CNI_PLUGINS_DIR = "/usr/lib/cni"  # containernetworking-plugins


def cache_dir() -> Path:
    return Path(os.environ.get("IPMASQ_LAB_CACHE", "/var/cache/ipmasq/kube-lab"))


def missing_packages(*, building: bool = True) -> list[str]:
    """The Debian packages whose commands are missing (sorted, once each); `building`: also the build tools."""
    wanted = {c: p for c, p in REQUIRED_COMMANDS.items() if building or c not in BUILD_ONLY}
    missing = {p for c, p in wanted.items() if shutil.which(c) is None}
    if not os.path.exists(os.path.join(CNI_PLUGINS_DIR, "bridge")):
        missing.add("containernetworking-plugins")
    return sorted(missing)


@dataclass(frozen=True)
class Toolchain:
    """Where each binary of the cluster comes from: kube-*, kubectl, etcd, containerd, its shim and ctr."""

    binaries: dict[str, str]  # name -> path
    kubernetes_version: str  # the release the binaries were built from, e.g. v1.37.2

    @property
    def etcd(self) -> str:
        return self.binaries["etcd"]

    @property
    def kubectl(self) -> str:
        return self.binaries["kubectl"]

    @property
    def containerd_dir(self) -> str:
        """containerd finds its shim on PATH: this directory goes first on the daemon's PATH."""
        return os.path.dirname(self.binaries["containerd-shim-runc-v2"])


@dataclass(frozen=True)
class Artifacts:
    toolchain: Toolchain
    pause_archive: Path
    image_archive: Path
    image: str  # the agent image's name, as the nodes know it (ipmasq/ipmasq:lab-KEY)


Progress = Callable[[str], None]


def _run(argv: list[str], *, cwd: str | Path | None = None, env: dict[str, str] | None = None,
         timeout: float = 1800, what: str) -> str:
    try:
        result = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise BuildError(f"{what}: {exc}") from None
    if result.returncode != 0:
        tail = (result.stderr.strip() or result.stdout.strip()).splitlines()[-3:]
        raise BuildError(f"{what} failed ({result.returncode}): {' | '.join(tail)}")
    return result.stdout


def _key(*parts: str | bytes) -> str:
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part.encode() if isinstance(part, str) else part)
        digest.update(b"\0")
    return digest.hexdigest()[:16]


def _stamp_matches(directory: Path, key: str) -> bool:
    try:
        return bool(json.loads((directory / "key.json").read_text()).get("key") == key)
    except (OSError, ValueError, AttributeError):
        return False


def _write_stamp(directory: Path, key: str, **facts: object) -> None:
    (directory / "key.json").write_text(json.dumps({"key": key, **facts}, indent=2) + "\n")


def _step(progress: Progress, what: str, build: Callable[[], None]) -> None:
    progress(f"building {what} ...")
    started = time.monotonic()
    build()
    progress(f"built {what} in {time.monotonic() - started:.0f} s")


# ---- Go builds: Kubernetes, etcd, containerd -------------------------------------------------------------------

@dataclass(frozen=True)
class GoBuild:
    """One cached directory of binaries built from the module in gomod/NAME (its go.mod's `tool` lines)."""

    name: str  # gomod/NAME and CACHE/NAME
    binaries: tuple[str, ...]  # what lands in CACHE/NAME/bin
    # go build names a binary after its package's last element, the one before a /vN: server/v3 makes `server`
    renames: tuple[tuple[str, str], ...] = ()
    cgo: bool = False
    tags: tuple[str, ...] = ()  # go build -tags

    @property
    def module_dir(self) -> Path:
        return GOMOD / self.name

    def packages(self) -> list[str]:
        return _tool_packages((self.module_dir / "go.mod").read_text())

    def outputs(self) -> list[tuple[str, str]]:
        """(package, binary) for each tool package: the binary named as go build names it, or as renamed."""
        renamed = dict(self.renames)
        made = []
        for package in self.packages():
            parts = package.split("/")
            name = parts[-2] if re.fullmatch(r"v[0-9]+", parts[-1]) else parts[-1]
            made.append((package, renamed.get(name, name)))
        return made

    def ldflags(self) -> str:
        flags = "-s -w"
        if self.name == "kubernetes":  # what Kubernetes' own build stamps: the version kubelet and kubectl report
            version = kubernetes_version()
            major, minor = version.lstrip("v").split(".")[:2]
            flags += "".join(f" -X k8s.io/component-base/version.{name}={value}" for name, value in (
                ("gitVersion", version), ("gitMajor", major), ("gitMinor", minor), ("gitTreeState", "clean")))
        return flags


GO_BUILDS = (
    GoBuild("kubernetes", KUBE_BINARIES),
    GoBuild("etcd", ("etcd",), renames=(("server", "etcd"),)),
    GoBuild("containerd", CONTAINERD_BINARIES),
)
# Prometheus with its Kubernetes service discovery (Debian's build leaves it out), every other discovery left out by
# its own build tags; built only when a test asks for it (prometheus_binary), not by --prepare
PROMETHEUS_BUILD = GoBuild("prometheus", ("prometheus",), tags=("remove_all_sd", "enable_kubernetes_sd"))


def _tool_packages(go_mod: str) -> list[str]:
    """The packages of a go.mod's `tool` directives (one line or a block)."""
    packages: list[str] = []
    block = False
    for raw in go_mod.splitlines():
        line = raw.split("//", 1)[0].strip()
        if block:
            if line == ")":
                block = False
            elif line:
                packages.append(line)
        elif line == "tool (":
            block = True
        elif line.startswith("tool "):
            packages.append(line.split()[1])
    return packages


def kubernetes_version() -> str:
    """The k8s.io/kubernetes release gomod/kubernetes requires (the one source of the lab's version)."""
    found = re.search(r"^\s*(?:require\s+)?k8s\.io/kubernetes (v[0-9]+\.[0-9]+\.[0-9]+)\b",
                      (GOMOD / "kubernetes" / "go.mod").read_text(), re.MULTILINE)
    if found is None:
        raise BuildError(f"{GOMOD / 'kubernetes' / 'go.mod'}: requires no k8s.io/kubernetes release")
    return found.group(1)


def _go_env(cache: Path) -> dict[str, str]:
    """The builds' own caches under CACHE/go; no toolchain download (GOTOOLCHAIN=local: a too-old Go says so
    instead of fetching another); the module proxy as the machine configures it."""
    env = {**os.environ, "GOMODCACHE": str(cache / "go" / "mod"), "GOCACHE": str(cache / "go" / "build"),
           "GOTOOLCHAIN": "local", "GOFLAGS": "-mod=readonly -buildvcs=false", "CGO_ENABLED": "0"}
    go = shutil.which("go") or next((p for p in GO_FALLBACKS if os.access(p, os.X_OK)), None)
    if go is not None:  # where the machine keeps Go without putting it on every PATH (a service's environment)
        env["PATH"] = f"{os.path.dirname(go)}:{env.get('PATH', '/usr/bin:/bin')}"
    return env


def _go_version(env: dict[str, str]) -> str:
    if shutil.which("go", path=env.get("PATH")) is None:
        raise BuildError(f"go not found: the lab builds Kubernetes with Go {'.'.join(map(str, GO_MINIMUM))} or "
                         "newer on PATH")
    version = _run(["go", "env", "GOVERSION"], env=env, what="go env GOVERSION").strip()
    found = re.match(r"go(\d+)\.(\d+)", version)
    if found is None or (int(found.group(1)), int(found.group(2))) < GO_MINIMUM:
        raise BuildError(f"{version or 'go'} is too old: the lab builds Kubernetes with Go "
                         f"{'.'.join(map(str, GO_MINIMUM))} or newer")
    return version


def _go_download(build: GoBuild, work: Path, env: dict[str, str]) -> None:
    """Every module the build needs, fetched through the go command before anything compiles: a refusal names the
    module (go's own line, e.g. `go: k8s.io/kubernetes@v1.37.9: reading ...: 404 Not Found`)."""
    try:
        result = subprocess.run(["go", "mod", "download"], cwd=work, env=env, capture_output=True, text=True,
                                timeout=1800)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise BuildError(f"go mod download (gomod/{build.name}): {exc}") from None
    if result.returncode != 0:
        lines = [line.strip() for line in result.stderr.splitlines() if line.strip()]
        named = [line for line in lines if "@" in line] or lines or [f"exit {result.returncode}"]
        raise BuildError(f"a Go module could not be downloaded for gomod/{build.name}: {named[-1][:400]}")


def _go_build(cache: Path, build: GoBuild, key: str, env: dict[str, str], progress: Progress) -> None:
    """Each binary built on its own (the Go build cache shares what they have in common), timed and said."""
    target, partial = cache / build.name, cache / f"{build.name}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    (partial / "bin").mkdir(parents=True)
    work = partial / "module"
    work.mkdir()
    for name in ("go.mod", "go.sum"):  # built from a copy: the checkout is never written (go.sum stays as committed)
        shutil.copy2(build.module_dir / name, work / name)
    started = time.monotonic()
    _go_download(build, work, env)
    seconds = {"download": round(time.monotonic() - started, 1)}
    build_env = {**env, "CGO_ENABLED": "1" if build.cgo else "0"}
    for package, binary in build.outputs():
        started = time.monotonic()
        tags = ["-tags", ",".join(build.tags)] if build.tags else []
        _run(["go", "build", "-p", GO_JOBS, "-trimpath", *tags, "-ldflags", build.ldflags(), "-o",
              str(partial / "bin" / binary), package], cwd=work, env=build_env, timeout=3600,
             what=f"go build {package} (gomod/{build.name})")
        seconds[binary] = round(time.monotonic() - started, 1)
        progress(f"  {binary} in {seconds[binary]:.0f} s")
    missing = [name for name in build.binaries if not (partial / "bin" / name).is_file()]
    if missing:
        raise BuildError(f"go build (gomod/{build.name}) made no {', '.join(missing)}")
    shutil.rmtree(work)
    _write_stamp(partial, key, binaries=list(build.binaries), seconds=seconds)
    shutil.rmtree(target, ignore_errors=True)
    partial.rename(target)


def _go_key(build: GoBuild, go_version: str) -> str:
    return _key(build.name, go_version, build.ldflags(), *build.binaries, *build.tags,
                (build.module_dir / "go.mod").read_bytes(), (build.module_dir / "go.sum").read_bytes())


def _toolchain(cache: Path, progress: Progress) -> Toolchain:
    env = _go_env(cache)
    binaries: dict[str, str] = {}
    go_version = _go_version(env)
    for build in GO_BUILDS:
        key = _go_key(build, go_version)
        if not _stamp_matches(cache / build.name, key):
            _step(progress, f"{', '.join(build.binaries)} with {go_version} (gomod/{build.name})",
                  lambda build=build, key=key: _go_build(cache, build, key, env, progress))  # type: ignore[misc]
        binaries.update({name: str(cache / build.name / "bin" / name) for name in build.binaries})
    return Toolchain(binaries, kubernetes_version())


# ---- the pause image -------------------------------------------------------------------------------------------

_PAUSE_C = r"""
/* The pod sandbox's one process: sleep until told to stop, reap orphans (as Kubernetes' build/pause/linux/pause.c). */
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>
static void sigdown(int signo) { (void)signo; exit(0); }
static void sigreap(int signo) { (void)signo; while (waitpid(-1, NULL, WNOHANG) > 0) {} }
int main(void) {
  struct sigaction down = {.sa_handler = sigdown}, reap = {.sa_handler = sigreap, .sa_flags = SA_NOCLDSTOP};
  sigaction(SIGINT, &down, NULL);
  sigaction(SIGTERM, &down, NULL);
  sigaction(SIGCHLD, &reap, NULL);
  for (;;) pause();
}
"""


def _docker_archive(path: Path, tag: str, layer: Path, config: dict[str, object]) -> None:
    """One image of one layer as a docker-archive tarball (what `ctr images import` reads)."""
    layer_digest = hashlib.sha256(layer.read_bytes()).hexdigest()
    config = {**config, "architecture": "amd64", "os": "linux",
              "rootfs": {"type": "layers", "diff_ids": [f"sha256:{layer_digest}"]}}
    config_bytes = json.dumps(config).encode()
    config_name = hashlib.sha256(config_bytes).hexdigest() + ".json"
    manifest = json.dumps([{"Config": config_name, "RepoTags": [tag], "Layers": ["layer.tar"]}]).encode()
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / config_name).write_bytes(config_bytes)
        (Path(tmp) / "manifest.json").write_bytes(manifest)
        with tarfile.open(path, "w") as archive:
            archive.add(Path(tmp) / "manifest.json", "manifest.json")
            archive.add(Path(tmp) / config_name, config_name)
            archive.add(layer, "layer.tar")


def _pause(cache: Path, progress: Progress) -> Path:
    target = cache / "pause"
    gcc = _run(["gcc", "--version"], what="gcc --version").splitlines()[0]
    key = _key(_PAUSE_C, gcc, PAUSE_IMAGE)
    if _stamp_matches(target, key):
        return target / "pause.tar"

    def build() -> None:
        shutil.rmtree(target, ignore_errors=True)
        target.mkdir(parents=True)
        with tempfile.TemporaryDirectory() as tmp:
            source, binary, layer = Path(tmp) / "pause.c", Path(tmp) / "pause", Path(tmp) / "layer.tar"
            source.write_text(_PAUSE_C)
            _run(["gcc", "-Os", "-static", "-o", str(binary), str(source)], what="gcc -static pause.c")
            with tarfile.open(layer, "w") as tar:
                tar.add(binary, "pause")
            _docker_archive(target / "pause.tar", PAUSE_IMAGE, layer,
                            {"config": {"Entrypoint": ["/pause"], "User": "65535:65535"}})
        _write_stamp(target, key)

    _step(progress, "the pause image", build)
    return target / "pause.tar"


# ---- the base and the agent's image ----------------------------------------------------------------------------

def _base(cache: Path, progress: Progress) -> str:
    """A bookworm root file system with the packages the Dockerfile's stages need, imported into podman."""
    target = cache / "base"
    key = _key("bookworm", *BASE_PACKAGES)
    tag = f"localhost/ipmasq-lab-base:{key}"
    present = subprocess.run(["podman", "image", "exists", tag], capture_output=True).returncode == 0
    if _stamp_matches(target, key) and present:
        return tag

    def build() -> None:
        shutil.rmtree(target, ignore_errors=True)
        target.mkdir(parents=True)
        rootfs = target / "rootfs.tar"
        _run(["mmdebstrap", "--quiet", "--variant=apt", f"--include={','.join(BASE_PACKAGES)}", "bookworm",
              str(rootfs)], timeout=1200, what="mmdebstrap bookworm")
        _run(["podman", "import", "-q", str(rootfs), tag], what="podman import")
        rootfs.unlink()
        _write_stamp(target, key, tag=tag)

    _step(progress, f"the image base ({', '.join(BASE_PACKAGES)} from Debian bookworm)", build)
    return tag


def _context_files(source: Path) -> Iterable[Path]:
    """The build context as the Dockerfile sees it (.dockerignore's entries left out), in a stable order."""
    skip_dirs = {".git", ".venv", "__pycache__", "out", ".mypy_cache", ".ruff_cache", ".pytest_cache",
                 ".hypothesis", "build"}
    for root, dirs, files in os.walk(source):
        dirs[:] = sorted(d for d in dirs if d not in skip_dirs and not d.endswith(".egg-info"))
        for name in sorted(files):
            yield Path(root) / name


def _image(cache: Path, source: Path, base: str, progress: Progress) -> tuple[Path, str]:
    digest = hashlib.sha256()
    for path in _context_files(source):
        digest.update(str(path.relative_to(source)).encode() + b"\0")
        try:
            digest.update(path.read_bytes())
        except OSError:
            continue
    key = _key(digest.hexdigest(), base)
    # one directory per build: two checkouts on one machine (a branch's lab beside main's) each keep their own image
    target = cache / "images" / key
    image = f"{IMAGE_REPOSITORY}:lab-{key}"
    archive = target / f"ipmasq-{key}.tar"
    if _stamp_matches(target, key) and archive.exists():
        return archive, image

    def build() -> None:
        shutil.rmtree(target, ignore_errors=True)
        target.mkdir(parents=True)
        with tempfile.TemporaryDirectory() as tmp:
            # pip inside the build reaches the package index through this machine's TLS setup: its CA bundle and a
            # pip.conf naming it are mounted for the build only, nothing of them lands in the image
            pip_conf = Path(tmp) / "pip.conf"
            pip_conf.write_text("[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n")
            argv = ["podman", "build", "-q", "--network=host", "--build-arg", f"BASE={base}", "-t", image,
                    "-v", f"{pip_conf}:/etc/pip.conf:ro"]
            if os.path.exists("/etc/ssl/certs/ca-certificates.crt"):
                argv += ["-v", "/etc/ssl/certs/ca-certificates.crt:/etc/ssl/certs/ca-certificates.crt:ro"]
            _run([*argv, "-f", str(source / "Dockerfile"), str(source)], timeout=1200, what="podman build")
        _run(["podman", "save", "-q", "--format", "docker-archive", "-o", str(archive), image], what="podman save")
        _write_stamp(target, key, image=image)
        _forget_older_images(cache / "images", key)

    _step(progress, f"the agent image {image} from {source / 'Dockerfile'}", build)
    return archive, image


def _forget_older_images(images: Path, current: str) -> None:  # current: the key of the image just built
    """Earlier builds of the agent's image, and the build stages left untagged: the cache keeps the current one and
    those built in the last hours (another checkout's lab may be running on one of them)."""
    shutil.rmtree(images.parent / "image", ignore_errors=True)  # the single slot of earlier versions
    horizon = time.time() - IMAGE_KEEP_SECONDS
    for directory in images.iterdir():
        if directory.is_dir() and directory.name != current and directory.stat().st_mtime < horizon:
            shutil.rmtree(directory, ignore_errors=True)
    kept = {f"{IMAGE_REPOSITORY}:lab-{d.name}" for d in images.iterdir() if d.is_dir()}
    listing = subprocess.run(["podman", "images", "--format", "{{.Repository}}:{{.Tag}}"], capture_output=True,
                             text=True).stdout.split()
    older = [ref for ref in listing if f"{IMAGE_REPOSITORY}:lab-" in ref and not any(ref.endswith(k) for k in kept)]
    if older:
        subprocess.run(["podman", "rmi", "-f", *older], capture_output=True)
    subprocess.run(["podman", "image", "prune", "-f"], capture_output=True)


def prometheus_binary(progress: Progress) -> str:
    """A Prometheus that discovers targets through the Kubernetes API (gomod/prometheus), built or from the cache."""
    cache = cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    env = _go_env(cache)
    build = PROMETHEUS_BUILD
    key = _go_key(build, _go_version(env))
    if not _stamp_matches(cache / build.name, key):
        _step(progress, f"prometheus with {', '.join(build.tags)} (gomod/{build.name})",
              lambda: _go_build(cache, build, key, env, progress))
    return str(cache / build.name / "bin" / "prometheus")


def kubernetes_toolchain(progress: Progress) -> Toolchain:
    """Just the cluster's binaries (etcd, kube-apiserver, ...), built or taken from the cache: what a bench that
    needs a real API server runs, without the images."""
    cache_dir().mkdir(parents=True, exist_ok=True)
    return _toolchain(cache_dir(), progress)


def ensure_artifacts(source: Path, progress: Progress) -> Artifacts:
    """Everything the cluster runs, from the cache or built now (saying what and how long)."""
    if not (source / "Dockerfile").is_file():
        raise BuildError(f"{source}: no Dockerfile (the lab builds the agent's image from a checkout of ipmasq)")
    missing = missing_packages()
    if missing:
        raise BuildError(f"missing Debian packages: apt-get install {' '.join(missing)}")
    cache = cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    toolchain = _toolchain(cache, progress)
    pause = _pause(cache, progress)
    base = _base(cache, progress)
    archive, image = _image(cache, source, base, progress)
    return Artifacts(toolchain, pause, archive, image)
