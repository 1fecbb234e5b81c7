"""The Kubernetes lab's cache: keys of inputs, what a half-built artifact looks like, the pause image's archive, the
lab's configuration files for kubelet, kube-proxy, containerd and CNI."""

from __future__ import annotations

import ipaddress
import json
import re
import tarfile
import tomllib
from pathlib import Path

import pytest

from ipmasq.errors import BuildError, UsageError
from ipmasq.lab.kubernetes import artifacts, config_files, layout
from ipmasq.lab.kubernetes.command import find_source
from tests.conftest import ROOT


def test_an_artifact_without_its_key_file_is_rebuilt(tmp_path: Path) -> None:
    assert not artifacts._stamp_matches(tmp_path, "k")  # half-built: the key is written last
    artifacts._write_stamp(tmp_path, "k", image="x")
    assert artifacts._stamp_matches(tmp_path, "k") and not artifacts._stamp_matches(tmp_path, "other")
    (tmp_path / "key.json").write_text("{not json")
    assert not artifacts._stamp_matches(tmp_path, "k")


def test_keys_change_with_any_input() -> None:
    assert artifacts._key("a", "b") == artifacts._key("a", "b")
    assert artifacts._key("a", "b") != artifacts._key("ab")  # parts are separated, not concatenated
    assert artifacts._key("a", "b") != artifacts._key("a", "c")


def test_the_build_context_skips_what_dockerignore_skips(tmp_path: Path) -> None:
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "HEAD").write_text("x")
    (tmp_path / ".venv").mkdir()
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.py").write_text("a")
    (tmp_path / "Dockerfile").write_text("FROM x")
    names = [p.relative_to(tmp_path).as_posix() for p in artifacts._context_files(tmp_path)]
    assert names == ["Dockerfile", "src/a.py"]


def test_a_docker_archive_ctr_can_import(tmp_path: Path) -> None:
    layer = tmp_path / "layer.tar"
    with tarfile.open(layer, "w") as tar:
        (tmp_path / "pause").write_bytes(b"\x7fELF")
        tar.add(tmp_path / "pause", "pause")
    archive = tmp_path / "image.tar"
    artifacts._docker_archive(archive, artifacts.PAUSE_IMAGE, layer, {"config": {"Entrypoint": ["/pause"]}})
    with tarfile.open(archive) as tar:
        (manifest,) = json.loads(tar.extractfile("manifest.json").read())  # type: ignore[union-attr]
        config = json.loads(tar.extractfile(manifest["Config"]).read())  # type: ignore[union-attr]
        assert manifest["RepoTags"] == [artifacts.PAUSE_IMAGE] and manifest["Layers"] == ["layer.tar"]
        assert config["rootfs"]["diff_ids"][0].startswith("sha256:") and config["os"] == "linux"


def test_missing_packages_are_named_by_their_debian_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(artifacts.shutil, "which", lambda name: None if name in ("runc", "podman") else "/bin/" + name)
    monkeypatch.setattr(artifacts.os.path, "exists", lambda path: True)  # the CNI plugins are there
    assert artifacts.missing_packages() == ["podman", "runc"]
    assert artifacts.missing_packages(building=False) == ["runc"]
    monkeypatch.setattr(artifacts.os.path, "exists", lambda path: False)
    assert "containernetworking-plugins" in artifacts.missing_packages()


def test_each_go_build_makes_the_binaries_its_go_mod_names_as_tools() -> None:
    for build in artifacts.GO_BUILDS:
        assert sorted(binary for _package, binary in build.outputs()) == sorted(build.binaries), build.name
    (etcd,) = [b for b in artifacts.GO_BUILDS if b.name == "etcd"]
    assert etcd.outputs() == [("go.etcd.io/etcd/server/v3", "etcd")]  # not "server", nor "v3"
    assert artifacts._tool_packages("tool x/y\ntool (\n\ta/b // why\n\n\tc/d\n)\n") == ["x/y", "a/b", "c/d"]


def test_the_lab_builds_one_kubernetes_release_and_stamps_it() -> None:
    version = artifacts.kubernetes_version()
    assert version.startswith("v1.37."), version
    (kubernetes,) = [b for b in artifacts.GO_BUILDS if b.name == "kubernetes"]
    assert f"version.gitVersion={version}" in kubernetes.ldflags() and "version.gitMinor=37" in kubernetes.ldflags()
    go_mod = (artifacts.GOMOD / "kubernetes" / "go.mod").read_text()
    # k8s.io/kubernetes pins its staging modules at v0.0.0: every one replaced by its release of the same version
    staging = version.replace("v1.", "v0.")
    for line in go_mod.split("replace (", 1)[1].split(")", 1)[0].strip().splitlines():
        module, arrow, target, target_version = line.split()
        assert arrow == "=>" and target == module and target_version == staging, line
    for build in artifacts.GO_BUILDS:  # what `go build -mod=readonly` needs: go.sum committed beside go.mod
        assert (build.module_dir / "go.sum").stat().st_size > 0


def test_a_module_the_proxy_refuses_ends_the_build_with_one_line_naming_it(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    if artifacts.shutil.which("go") is None and not Path(artifacts.GO_FALLBACKS[0]).exists():
        pytest.skip("no go command")
    monkeypatch.setenv("GOPROXY", "off")  # what an unreachable proxy looks like to a cold module cache
    with pytest.raises(BuildError) as raised:
        artifacts._toolchain(tmp_path, lambda line: None)
    message = str(raised.value)
    assert "\n" not in message and "gomod/kubernetes" in message, message
    assert re.search(r"go: [a-z0-9./-]+@v[0-9][^ ]*: module lookup disabled by GOPROXY=off", message), message
    assert not (tmp_path / "kubernetes").exists()  # nothing half-built stands where a build is looked for
    assert not artifacts._stamp_matches(tmp_path / "kubernetes.partial", "any")


def test_the_source_is_a_checkout_with_a_dockerfile_and_deploy(tmp_path: Path) -> None:
    assert find_source(str(ROOT)) == ROOT
    with pytest.raises(UsageError, match="not an ipmasq checkout"):
        find_source(str(tmp_path))


def test_node_configuration_files() -> None:
    node = layout.NODES[0]
    kubelet = json.loads(config_files.kubelet_config(node, "1m"))
    assert kubelet["cgroupRoot"] == f"/ipmasq-lab/{node.name}" and kubelet["syncFrequency"] == "1m"
    assert kubelet["failCgroupV1"] is False  # this machine's cgroup v1: kubelet 1.35+ refuses it otherwise
    proxy = json.loads(config_files.kube_proxy_config(node, Path("/k")))
    assert proxy["mode"] == "iptables" and proxy["conntrack"]["maxPerCore"] == 0  # machine-wide settings untouched
    assert {n.proxy_mode for n in layout.NODES} == {"iptables", "nftables"}  # the agent beside either mode
    cni = json.loads(config_files.cni_config(node, Path("/n")))
    bridge = cni["plugins"][0]
    assert bridge["ipMasq"] is False  # the agent decides what is masqueraded, not the CNI plugin
    # dual-stack: a range of each family, a default route of each, and kube-proxy told both cluster ranges
    assert bridge["ipam"]["ranges"] == [[{"subnet": node.pod_cidr, "gateway": node.pod_gateway}],
                                        [{"subnet": node.pod_cidr6, "gateway": node.pod_gateway6}]]
    assert bridge["ipam"]["routes"] == [{"dst": "0.0.0.0/0"}, {"dst": "::/0"}]
    assert proxy["clusterCIDR"] == "10.44.0.0/14,fd00:44::/48"
    assert node.pod_gateway6 == "fd00:44:0:14::1"
    for spec in layout.NODES:
        assert ipaddress.IPv6Network(spec.pod_cidr6).subnet_of(ipaddress.IPv6Network("fd00:44::/48"))
        assert ipaddress.ip_address(spec.address6) in ipaddress.ip_network("fd00:142::/64")
    containerd = tomllib.loads(config_files.containerd_config(Path("/n")))
    runtime = containerd["plugins"]["io.containerd.cri.v1.runtime"]
    assert containerd["version"] == 3 and runtime["restrict_oom_score_adj"] is True
    assert containerd["plugins"]["io.containerd.cri.v1.images"]["pinned_images"]["sandbox"] == artifacts.PAUSE_IMAGE
    # each node's pod range is its own, inside the lab's pod range, and the egress pool holds the spare address
    assert len({n.pod_cidr for n in layout.NODES}) == len({n.pod_cidr6 for n in layout.NODES}) == len(layout.NODES)
    assert layout.NODES[0].extra_addresses == ("10.142.15.204",)
