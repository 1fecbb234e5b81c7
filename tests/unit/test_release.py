"""One version from one place: the package, `--version`, the image deploy/ installs, its labels and the CHANGELOG
follow ipmasq.__version__; scripts/release-image.sh pins deploy/ to a pushed digest; the release workflow passes
actionlint."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from ipmasq import __version__
from ipmasq.version import REVISION_FILE, revision, version_line
from tests.conftest import ROOT
from tests.tools import KUBECTL, need

SCRIPT = ROOT / "scripts" / "release-image.sh"
WORKFLOW = ROOT / ".github" / "workflows" / "release.yml"
ACTIONLINT = "github.com/rhysd/actionlint/cmd/actionlint@v1.7.7"  # built by the go command from the module proxy
DIGEST = "sha256:" + "0123456789abcdef" * 4


def _rendered_images(path: Path) -> set[str]:
    built = subprocess.run([need("kubectl", KUBECTL), "kustomize", str(path)],
                           capture_output=True, text=True, check=True, timeout=60).stdout
    return {c["image"] for d in yaml.safe_load_all(built) if d and d["kind"] in ("DaemonSet", "Deployment")
            for c in d["spec"]["template"]["spec"]["containers"]}


def test_the_package_takes_its_version_from_the_one_place() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"] and project["project"]["dynamic"] == ["version"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "ipmasq.__version__"}
    from importlib.metadata import version

    assert version("ipmasq") == __version__


def test_deploy_installs_this_release_from_a_named_registry() -> None:
    for path in (ROOT / "deploy", ROOT / "deploy" / "overlays" / "gke", ROOT / "deploy" / "webhook"):
        (image,) = _rendered_images(path)
        name, _, tag = image.partition("@")[0].rpartition(":")
        host = name.split("/", 1)[0]
        assert tag == __version__, image
        assert "." in host or ":" in host, f"{image}: no registry host (a bare name is Docker Hub's)"


def test_the_changelog_has_an_entry_per_version_newest_first() -> None:
    entries = re.findall(r"^## (\d+\.\d+\.\d+) ", (ROOT / "CHANGELOG.md").read_text(), re.MULTILINE)
    assert entries[0] == __version__
    assert "0.1.0" in entries and len(entries) == len(set(entries))


def test_version_names_the_checkouts_commit_and_else_the_images_file(tmp_path: Path) -> None:
    if (ROOT / ".git").exists() and shutil.which("git"):
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
        found = revision()
        assert found is not None and head.startswith(found.removesuffix("-dirty"))
    # an installed package (not a checkout) in an environment whose image wrote the file
    package = tmp_path / "site-packages" / "ipmasq"
    package.mkdir(parents=True)
    prefix = tmp_path / "prefix"
    assert version_line(package=package, prefix=prefix) == f"ipmasq {__version__}"
    (prefix / REVISION_FILE).parent.mkdir(parents=True)
    (prefix / REVISION_FILE).write_text("0123456789abcdef0123456789abcdef01234567\n")
    assert version_line(package=package, prefix=prefix) == \
        f"ipmasq {__version__} (commit 0123456789abcdef0123456789abcdef01234567)"
    for hostile in ("\x1b[2J", "a" * 200, "", "deadbeef; rm -rf /"):  # never printed as it is
        (prefix / REVISION_FILE).write_text(hostile)
        assert version_line(package=package, prefix=prefix) == f"ipmasq {__version__}"


@pytest.mark.parametrize("argv", [["--version"], ["agent", "--version"]])
def test_version_flag_prints_the_line(argv: list[str]) -> None:
    result = subprocess.run([sys.executable, "-m", "ipmasq", *argv], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"ipmasq {__version__}")


def test_the_image_carries_the_oci_labels_from_build_arguments() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    runtime = dockerfile.rsplit("\nFROM ", 1)[1]  # the image's own stage, not the build stage
    for label, argument in (("source", "SOURCE"), ("version", "VERSION"), ("revision", "REVISION")):
        assert f'org.opencontainers.image.{label}="${{{argument}}}"' in runtime
        assert f"ARG {argument}" in runtime
    script = SCRIPT.read_text()
    for argument in ("VERSION", "REVISION", "SOURCE"):
        assert f'--build-arg "{argument}=' in script


def test_pin_rewrites_deploy_to_the_digest_and_keeps_the_rest(tmp_path: Path) -> None:
    deploy = tmp_path / "deploy"
    shutil.copytree(ROOT / "deploy", deploy)
    before = {p: p.read_text() for p in deploy.rglob("*") if p.is_file()}
    result = subprocess.run(["bash", str(SCRIPT), "pin", "registry.example:5000/team/ipmasq", DIGEST, "--deploy",
                             str(deploy)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    pinned = f"registry.example:5000/team/ipmasq:{__version__}@{DIGEST}"
    for path in (deploy, deploy / "overlays" / "gke", deploy / "webhook"):
        assert _rendered_images(path) == {pinned}
    changed = {p for p, text in before.items() if p.read_text() != text}
    assert changed == {deploy / "base" / "kustomization.yaml", deploy / "webhook" / "kustomization.yaml"}
    for path in changed:  # only the images entry moved: every comment and resource is still there
        old, new = before[path].splitlines(), path.read_text().splitlines()
        assert [line for line in old if line not in new] == [
            line for line in old if "newName:" in line]
        assert [line for line in new if line not in old] == [
            "    newName: registry.example:5000/team/ipmasq", f"    digest: {DIGEST}"]
    # pinned again (a rebuild under the same tag): the new digest replaces the old one
    again = "sha256:" + "f" * 64
    subprocess.run(["bash", str(SCRIPT), "pin", "registry.example:5000/team/ipmasq", again, "--deploy", str(deploy)],
                   capture_output=True, text=True, check=True, timeout=120)
    assert _rendered_images(deploy) == {f"registry.example:5000/team/ipmasq:{__version__}@{again}"}


@pytest.mark.parametrize(("image", "digest", "said"), [
    ("acme/ipmasq", DIGEST, "not a registry host"),
    ("ipmasq", DIGEST, "name the registry"),
    ("ghcr.io/acme/ipmasq:0.2.0", DIGEST, "not a repository name"),
    ("ghcr.io/acme/ipmasq", "sha256:abc", "not a digest"),
    ("ghcr.io/acme/ipmasq", "sha256:" + "0" * 64 + "\nimages: []", "not a digest"),
])
def test_pin_refuses_what_is_not_a_qualified_image_or_a_digest(tmp_path: Path, image: str, digest: str,
                                                                said: str) -> None:
    deploy = tmp_path / "deploy"
    shutil.copytree(ROOT / "deploy", deploy)
    before = (deploy / "base" / "kustomization.yaml").read_text()
    result = subprocess.run(["bash", str(SCRIPT), "pin", image, digest, "--deploy", str(deploy)], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode != 0 and said in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert (deploy / "base" / "kustomization.yaml").read_text() == before


def test_the_release_workflow_passes_actionlint() -> None:
    go = need("go", "Go from its own install, as the Kubernetes lab builds with", also=("/usr/local/go/bin/go",))
    # -shellcheck= and -pyflakes=: actionlint's own checks, without tools this machine may not have
    result = subprocess.run([go, "run", ACTIONLINT, "-shellcheck=", "-pyflakes=", str(WORKFLOW)],
                            capture_output=True, text=True, timeout=900, env={**os.environ, "GOFLAGS": "-mod=mod"})
    assert result.returncode == 0, result.stdout + result.stderr
    workflow = yaml.safe_load(WORKFLOW.read_text())
    steps = [step.get("run", "") for step in workflow["jobs"]["image"]["steps"]]
    assert any("scripts/release-image.sh" in run for run in steps)  # the one way, in CI too
