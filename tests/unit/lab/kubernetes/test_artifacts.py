"""The Kubernetes lab's cache: keys of inputs, what a half-built artifact looks like, the pause image's archive, the
lab's configuration files for kubelet, kube-proxy, containerd and CNI."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import pytest

from ipmasq.errors import UsageError
from ipmasq.lab.kubernetes import artifacts, cluster
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
    monkeypatch.setattr(artifacts.shutil, "which", lambda name: None if name in ("etcd", "go") else "/bin/" + name)
    monkeypatch.setattr(artifacts.os.path, "exists", lambda path: True)  # the CNI plugins are there
    assert artifacts.missing_packages() == ["etcd-server", "golang-go"]
    assert artifacts.missing_packages(building=False) == ["etcd-server"]
    monkeypatch.setattr(artifacts.os.path, "exists", lambda path: False)
    assert "containernetworking-plugins" in artifacts.missing_packages()


def test_the_source_is_a_checkout_with_a_dockerfile_and_deploy(tmp_path: Path) -> None:
    assert find_source(str(ROOT)) == ROOT
    with pytest.raises(UsageError, match="not an ipmasq checkout"):
        find_source(str(tmp_path))


def test_node_configuration_files() -> None:
    node = cluster.NODES[0]
    kubelet = json.loads(cluster._kubelet_config(node, "1m"))
    assert kubelet["cgroupRoot"] == f"/ipmasq-lab/{node.name}" and kubelet["syncFrequency"] == "1m"
    proxy = json.loads(cluster._kube_proxy_config(node, Path("/k")))
    assert proxy["mode"] == "iptables" and proxy["conntrack"]["maxPerCore"] == 0  # machine-wide settings untouched
    cni = json.loads(cluster._cni_config(node, Path("/n")))
    bridge = cni["plugins"][0]
    assert bridge["ipMasq"] is False  # the agent decides what is masqueraded, not the CNI plugin
    assert bridge["ipam"]["ranges"] == [[{"subnet": node.pod_cidr, "gateway": node.pod_gateway}]]
    assert "restrict_oom_score_adj = true" in cluster._containerd_config(Path("/n"))
    # each node's pod range is its own, inside the lab's pod range, and the egress pool holds the spare address
    assert len({n.pod_cidr for n in cluster.NODES}) == len(cluster.NODES)
    assert cluster.NODES[0].extra_addresses == ("10.142.15.204",)
