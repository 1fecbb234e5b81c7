"""The files the lab cluster's components read: its PKI (a CA, the API server's certificate, the service-account
key), kubeconfigs, and each node's containerd, CNI, kubelet and kube-proxy configurations."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from ipmasq.errors import ClusterError
from ipmasq.lab.kubernetes.artifacts import PAUSE_IMAGE
from ipmasq.lab.kubernetes.cgroups import CGROUP_ROOT
from ipmasq.lab.kubernetes.layout import CONTROL_PLANE, KUBERNETES_SERVICE, NodeSpec
from ipmasq.lab.topology import ADDR

__all__ = [
    "cni_config", "containerd_config", "kube_proxy_config", "kubelet_config", "make_pki", "write_kubeconfig",
]


def _openssl(*args: str, cwd: Path) -> None:
    result = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True)
    if result.returncode != 0:
        raise ClusterError(f"openssl {args[0]}: {result.stderr.strip().splitlines()[-1:]}")


def make_pki(pki: Path) -> None:
    """A cluster CA, the API server's serving certificate (every name a client uses for it) and the service-account
    signing key."""
    pki.mkdir(parents=True)
    names = ["DNS:kubernetes", "DNS:kubernetes.default", "DNS:kubernetes.default.svc",
             "DNS:kubernetes.default.svc.cluster.local", "DNS:localhost", f"IP:{CONTROL_PLANE}",
             f"IP:{KUBERNETES_SERVICE}", "IP:127.0.0.1"]
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt", "-days", "30",
             "-subj", "/CN=ipmasq-lab-ca", cwd=pki)
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "apiserver.key", "-out", "apiserver.csr",
             "-subj", "/CN=kube-apiserver", cwd=pki)
    (pki / "san.cnf").write_text(f"subjectAltName={','.join(names)}\nextendedKeyUsage=serverAuth\n")
    _openssl("x509", "-req", "-in", "apiserver.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
             "-out", "apiserver.crt", "-days", "30", "-extfile", "san.cnf", cwd=pki)
    _openssl("genrsa", "-out", "sa.key", "2048", cwd=pki)
    _openssl("rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=pki)


def write_kubeconfig(path: Path, server: str, ca: Path, token: str, user: str) -> None:
    import base64

    config = {
        "apiVersion": "v1", "kind": "Config", "current-context": "ipmasq-lab",
        "clusters": [{"name": "ipmasq-lab", "cluster": {
            "server": server, "certificate-authority-data": base64.b64encode(ca.read_bytes()).decode()}}],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [{"name": "ipmasq-lab", "context": {"cluster": "ipmasq-lab", "user": user}}],
    }
    path.write_text(json.dumps(config, indent=2) + "\n")
    path.chmod(0o600)


def containerd_config(home: Path) -> str:
    """containerd 2's configuration (version 3): the node's own root, state and socket; its CRI plugin with the lab's
    pause image pinned (imported, never pulled), Debian's runc and CNI plugins, the node's CNI configuration."""
    return f"""version = 3
root = "{home / 'containerd'}"
state = "/run/containerd"
[grpc]
  address = "/run/containerd/containerd.sock"
[plugins.'io.containerd.cri.v1.images']
  snapshotter = "overlayfs"
  [plugins.'io.containerd.cri.v1.images'.pinned_images]
    sandbox = "{PAUSE_IMAGE}"
[plugins.'io.containerd.cri.v1.runtime']
  # root here cannot lower a process's oom_score_adj: runc would fail every sandbox
  restrict_oom_score_adj = true
  [plugins.'io.containerd.cri.v1.runtime'.containerd]
    default_runtime_name = "runc"
    [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
  [plugins.'io.containerd.cri.v1.runtime'.cni]
    bin_dirs = ["/usr/lib/cni"]
    conf_dir = "{home / 'cni'}"
"""


def cni_config(node: NodeSpec, home: Path) -> str:
    """A bridge for the node's pods, addressed from its own pod range; no masquerade (the agent decides that)."""
    return json.dumps({"cniVersion": "0.4.0", "name": "lab", "plugins": [
        {"type": "bridge", "bridge": "cni0", "isGateway": True, "ipMasq": False, "hairpinMode": True,
         "ipam": {"type": "host-local", "dataDir": str(home / "ipam"),
                  "ranges": [[{"subnet": node.pod_cidr, "gateway": node.pod_gateway}],
                             [{"subnet": node.pod_cidr6, "gateway": node.pod_gateway6}]],
                  "routes": [{"dst": "0.0.0.0/0"}, {"dst": "::/0"}]}},
    ]}, indent=2) + "\n"


def kubelet_config(node: NodeSpec, sync_frequency: str) -> str:
    return json.dumps({
        "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
        "cgroupDriver": "cgroupfs", "cgroupRoot": f"/{CGROUP_ROOT}/{node.name}", "failSwapOn": False,
        # this machine's cgroup hierarchy is v1, which kubelet refuses from 1.35 unless told (removal: 1.38 at the
        # earliest); on a cgroup v2 host the setting changes nothing
        "failCgroupV1": False,
        "containerRuntimeEndpoint": "unix:///run/containerd/containerd.sock",
        "address": node.address, "readOnlyPort": 0, "healthzBindAddress": "127.0.0.1",
        "authentication": {"anonymous": {"enabled": True}, "webhook": {"enabled": False}},
        "authorization": {"mode": "AlwaysAllow"},
        "syncFrequency": sync_frequency, "resolvConf": "/etc/resolv.conf", "clusterDomain": "cluster.local",
        # a shared disk: no evictions or image garbage collection because the machine's disk is busy
        "evictionHard": {"memory.available": "100Mi", "nodefs.available": "1%", "imagefs.available": "1%",
                         "nodefs.inodesFree": "1%"},
        "imageGCHighThresholdPercent": 100, "imageGCLowThresholdPercent": 99,
    }, indent=2) + "\n"


def kube_proxy_config(node: NodeSpec, kubeconfig: Path) -> str:
    sync = {"syncPeriod": "30s", "minSyncPeriod": "1s"}
    return json.dumps({
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1", "kind": "KubeProxyConfiguration",
        "clientConnection": {"kubeconfig": str(kubeconfig)}, "mode": node.proxy_mode,
        "clusterCIDR": f"{ADDR.pod_range},{ADDR.pod_range6}",
        "hostnameOverride": node.name, "bindAddress": node.address,
        "metricsBindAddress": "127.0.0.1:10249", "healthzBindAddress": "127.0.0.1:10256",
        # 0: leave the machine-wide conntrack table size and hash alone (kube-proxy would set them for everyone)
        "conntrack": {"maxPerCore": 0, "min": 0, "tcpEstablishedTimeout": "0s", "tcpCloseWaitTimeout": "0s"},
        "iptables": sync, "nftables": sync,
    }, indent=2) + "\n"
