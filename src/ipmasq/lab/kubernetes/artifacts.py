"""What the Kubernetes lab runs, built from Debian's packages and cached on the machine.

    CACHE/kubernetes/bin/      kube-apiserver, kube-controller-manager, kube-scheduler, kubelet, kube-proxy, built
                               with Debian's Go from Debian's `kubernetes` source package (1.20.2: the newest Debian
                               ships with its vendor tree, so it builds offline) with Kubernetes' own `make`
    CACHE/pause/pause.tar      the pod sandbox image: Kubernetes' pause.c, compiled static, as a docker-archive
    CACHE/base/                a bookworm root file system (mmdebstrap), the image's base where none can be pulled
    CACHE/image/               the agent's image, built from the repository's Dockerfile with that base (podman)

CACHE is /var/cache/ipmasq/kube-lab (IPMASQ_LAB_CACHE overrides it). Each artifact is stored with the key of its
inputs (the source package, the Go version, the pause source, the package list, the repository's files) and rebuilt
only when the key changes; a half-built artifact never has a key, so an interrupted build starts again.
Control-plane binaries already on the machine (KUBEBUILDER_ASSETS, then PATH) are used instead of building.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from ipmasq.errors import IpmasqError

__all__ = [
    "KUBE_BINARIES", "PAUSE_IMAGE", "Artifacts", "BuildError", "Toolchain", "cache_dir", "ensure_artifacts",
    "kubernetes_toolchain", "missing_packages",
]

KUBE_BINARIES = ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubelet", "kube-proxy")
PAUSE_IMAGE = "k8s.gcr.io/pause:3.2"  # what kubelet 1.20 and containerd 1.6 name the sandbox image
BASE_PACKAGES = ("python3", "python3-venv", "iptables", "nftables", "conntrack", "ca-certificates")
IMAGE_REPOSITORY = "ipmasq/ipmasq"
# Debian's kubernetes source package is in main as deb-src only: a private sources list, never the machine's
DEB_SRC = ("deb-src [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian "
           "bookworm main")

# command -> the Debian package that provides it (what `missing_packages` names)
REQUIRED_COMMANDS = {
    "etcd": "etcd-server", "containerd": "containerd", "ctr": "containerd", "runc": "runc", "kubectl":
    "kubernetes-client", "nsenter": "util-linux", "unshare": "util-linux", "openssl": "openssl", "ip": "iproute2",
    "iptables": "iptables", "conntrack": "conntrack", "podman": "podman", "mmdebstrap": "mmdebstrap",
    "gcc": "gcc", "go": "golang-go", "make": "make", "rsync": "rsync", "jq": "jq", "dpkg-source": "dpkg-dev",
}
CNI_PLUGINS_DIR = "/usr/lib/cni"  # containernetworking-plugins
# Kubernetes 1.20 vendors reflect2 1.0.1, which crashes under Go 1.18 and newer on map iteration (the API server dies
# with "fatal error: fault" in reflect2's UnsafeIterate the first time it serves a custom resource); Debian's
# golang-github-modern-go-reflect2-dev is 1.0.2, the release that fixed it, with the same API. It replaces the
# vendored copy before the build.
REFLECT2_DIR = "/usr/share/gocode/src/github.com/modern-go/reflect2"
REFLECT2_PACKAGE = "golang-github-modern-go-reflect2-dev"


class BuildError(IpmasqError):
    """An artifact of the Kubernetes lab could not be built or found."""


def cache_dir() -> Path:
    return Path(os.environ.get("IPMASQ_LAB_CACHE", "/var/cache/ipmasq/kube-lab"))


def missing_packages(*, building: bool = True) -> list[str]:
    """The Debian packages whose commands are missing (sorted, once each); `building`: also the build tools."""
    build_only = {"podman", "mmdebstrap", "gcc", "go", "make", "rsync", "jq", "dpkg-source"}
    wanted = {c: p for c, p in REQUIRED_COMMANDS.items() if building or c not in build_only}
    missing = {p for c, p in wanted.items() if shutil.which(c) is None}
    if not os.path.exists(os.path.join(CNI_PLUGINS_DIR, "bridge")):
        missing.add("containernetworking-plugins")
    if building and not os.path.isdir(REFLECT2_DIR):
        missing.add(REFLECT2_PACKAGE)
    return sorted(missing)


@dataclass(frozen=True)
class Toolchain:
    """Where each binary of the cluster comes from."""

    binaries: dict[str, str]  # kube-* name -> path
    etcd: str


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


# ---- Kubernetes binaries ---------------------------------------------------------------------------------------

def _present_binary(name: str) -> str | None:
    assets = os.environ.get("KUBEBUILDER_ASSETS")
    if assets and os.access(os.path.join(assets, name), os.X_OK):
        return os.path.join(assets, name)
    return shutil.which(name)


def _go_version() -> str:
    return _run(["go", "version"], what="go version").strip()


def _apt(cache: Path, *args: str) -> list[str]:
    lists = cache / "apt" / "lists"
    (lists / "partial").mkdir(parents=True, exist_ok=True)
    sources = cache / "apt" / "sources.list"
    sources.write_text(DEB_SRC + "\n")
    return ["apt-get", "-qq", "-o", f"Dir::Etc::SourceList={sources}", "-o", "Dir::Etc::SourceParts=/dev/null",
            "-o", f"Dir::State::Lists={lists}", *args]


def _build_kubernetes(cache: Path, wanted: list[str], key: str) -> None:
    """Debian's source package, unpacked as upstream ships it, built with Kubernetes' own make."""
    target = cache / "kubernetes"
    work = cache / "kubernetes-src"
    shutil.rmtree(target, ignore_errors=True)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    _run(_apt(cache, "update"), what="apt-get update (deb-src)")
    _run(_apt(cache, "source", "--download-only", "kubernetes"), cwd=work, what="apt-get source kubernetes")
    (dsc,) = sorted(work.glob("kubernetes_*.dsc"))
    _run(["dpkg-source", "-x", "--skip-debianization", dsc.name, "tree"], cwd=work, what="dpkg-source -x")
    tree = work / "tree"
    vendored = tree / "vendor" / "github.com" / "modern-go" / "reflect2"
    shutil.rmtree(vendored)
    shutil.copytree(REFLECT2_DIR, vendored,
                    ignore=shutil.ignore_patterns("*_test.go", "tests", "go.mod", "go.sum", ".*"))
    gopath = tree / ".go"
    (gopath / "src" / "k8s.io").mkdir(parents=True)
    (gopath / "src" / "k8s.io" / "kubernetes").symlink_to("../../..")
    env = {**os.environ, "GOPATH": str(gopath), "GOCACHE": str(cache / "gocache"), "CGO_ENABLED": "0", "GOFLAGS": ""}
    _run(["make", f"WHAT={' '.join('cmd/' + b for b in wanted)}"], cwd=tree, env=env, timeout=3600,
         what="make (Kubernetes)")
    (target / "bin").mkdir(parents=True)
    for name in wanted:
        shutil.copy2(tree / "_output" / "bin" / name, target / "bin" / name)
    _write_stamp(target, key, source=dsc.name, binaries=wanted)
    shutil.rmtree(work, ignore_errors=True)  # 1.5 GB of tree and objects; the Go cache stays for a rebuild


def _reflect2_digest() -> str:
    if not os.path.isdir(REFLECT2_DIR):
        raise BuildError(f"{REFLECT2_DIR} not found: apt-get install {REFLECT2_PACKAGE}")
    digest = hashlib.sha256()
    for path in sorted(Path(REFLECT2_DIR).glob("*.go")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def _toolchain(cache: Path, progress: Progress) -> Toolchain:
    etcd = shutil.which("etcd") or _present_binary("etcd")
    if etcd is None:
        raise BuildError("etcd not found: apt-get install etcd-server")
    present = {name: _present_binary(name) for name in KUBE_BINARIES}
    wanted = [name for name, path in present.items() if path is None]
    binaries = {name: path for name, path in present.items() if path is not None}
    if wanted:
        key = _key("kubernetes bookworm source", _go_version(), _reflect2_digest(), *wanted)
        if not _stamp_matches(cache / "kubernetes", key):
            _step(progress, f"Kubernetes ({', '.join(wanted)}) from Debian's source package",
                  lambda: _build_kubernetes(cache, wanted, key))
        binaries.update({name: str(cache / "kubernetes" / "bin" / name) for name in wanted})
    return Toolchain(binaries, etcd)


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
    target = cache / "image"
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
        _forget_older_images(image)

    _step(progress, f"the agent image {image} from {source / 'Dockerfile'}", build)
    return archive, image


def _forget_older_images(current: str) -> None:
    """Earlier builds of the agent's image and the build stages left untagged: the cache keeps only the current one
    (a rebuild follows every change of the repository)."""
    listing = subprocess.run(["podman", "images", "--format", "{{.Repository}}:{{.Tag}}"], capture_output=True,
                             text=True).stdout.split()
    older = [ref for ref in listing if f"{IMAGE_REPOSITORY}:lab-" in ref and not ref.endswith(current)]
    if older:
        subprocess.run(["podman", "rmi", "-f", *older], capture_output=True)
    subprocess.run(["podman", "image", "prune", "-f"], capture_output=True)


def kubernetes_toolchain(progress: Progress) -> Toolchain:
    """Just the cluster's binaries (etcd, kube-apiserver, ...), built or taken from the cache: what a bench that
    needs a real API server runs, without the images."""
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
