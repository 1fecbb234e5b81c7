"""A real Kubernetes cluster inside the lab's namespaces, brought up and down as one unit.

    router (the VPC: a bridge for 10.142.0.0/20 and fd00:142::/64, each node's pod ranges routed to its node, as
     │      GKE routes alias ranges; the namespace lab's world behind it: peers, partner, Cloud NAT, internet)
     ├─ control plane 10.142.0.2, fd00:142::2: etcd, kube-apiserver, kube-controller-manager, kube-scheduler
     ├─ gke-prod-egress-pool-7f3k 10.142.15.203 (and the spare 10.142.15.204), fd00:142::203;
     │     pods 10.44.14.0/24, fd00:44:0:14::/64
     └─ gke-prod-general-pool-2b9x 10.142.15.210, fd00:142::210; pods 10.44.15.0/24, fd00:44:0:15::/64
         each node: containerd, kubelet, kube-proxy (the egress pool's in iptables mode, the general pool's in
         nftables mode), a CNI bridge for its pods

The cluster is dual-stack, IPv4 first, as users run one: every pod has an address of each family (the CNI bridge's
host-local ranges for both), every Node two InternalIPs and two podCIDRs, Services may ask for both families
(--service-cluster-ip-range has two ranges), kube-proxy programs both (its clusterCIDR has two ranges). The node
pod ranges are fixed, as GKE's alias ranges are, so the controller manager allocates none: the lab writes each
Node's podCIDRs once it has registered.

The API server enforces Pod Security `baseline` cluster-wide (an AdmissionConfiguration, as a hardened cluster
does); kube-system carries the labels the README tells users to set for the agent (PRIVILEGED_NAMESPACE_LABELS).

Every node has its own network namespace and its own mount namespace: a private /run (so the DaemonSet's hostPath
/run/xtables.lock and /run/ip-masq-agent are the node's, as on a real machine), /var/log, and the three kernel
settings kubelet insists on (vm.overcommit_memory, kernel.panic, kernel.panic_on_oops) shown to kubelet as it wants
them, so it changes nothing on the machine. Every process the lab starts runs in the cgroup tree `ipmasq-lab`
(kubelet's pods below each node's part of it): tearing down kills that tree, whatever was started inside it, then
deletes the namespaces and the state directory. kubectl on the machine reaches the API server through a loopback
port (ipmasq.lab.kubernetes.forward); nothing of the lab is linked to the machine's network, and the machine's own
netfilter rules are never written.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ipmasq.errors import ClusterError
from ipmasq.lab.kubernetes.artifacts import Artifacts
from ipmasq.lab.kubernetes.cgroups import cgroup_pids, join_cgroup, kill_cgroup_tree, make_cgroup, move_to_cgroup
from ipmasq.lab.kubernetes.config_files import (
    cni_config,
    containerd_config,
    kube_proxy_config,
    kubelet_config,
    make_pki,
    write_kubeconfig,
)
from ipmasq.lab.kubernetes.layout import (
    API_PORT,
    CONTROL_PLANE,
    CONTROL_PLANE6,
    KUBELET_KERNEL_SETTINGS,
    KUBELET_SYNC_FREQUENCY,
    LAB_NAMESPACE,
    NETNS_PREFIX,
    NODES,
    POD_SECURITY_DEFAULT,
    PRIVILEGED_NAMESPACE_LABELS,
    PROBE_DAEMONSET,
    SERVICE_CIDR,
    SERVICE_CIDR6,
    NodeSpec,
    state_dir,
)
from ipmasq.lab.netns import Namespace, Network
from ipmasq.lab.topology import ADDR, Lab, build_world

__all__ = ["Cluster", "Progress", "cluster_is_up", "tear_down"]


Progress = Callable[[str], None]


def _wait(condition: Callable[[], bool], timeout: float, interval: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        if condition():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)


@dataclass
class Cluster:
    """The running cluster: its namespaces, its world (the namespace lab's Lab), its state directory."""

    artifacts: Artifacts
    source: Path  # the repository checkout: deploy/ and the Dockerfile
    net: Network
    state: Path
    world: Lab | None = None
    nodes: tuple[NodeSpec, ...] = NODES
    holders: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)  # node name -> its mount ns holder
    kubelets: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    proxies: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    sync_frequency: str = KUBELET_SYNC_FREQUENCY
    api_port: int = API_PORT
    api_server: subprocess.Popen[bytes] | None = None
    _api_server_argv: list[str] = field(default_factory=list)

    # ---- names and paths ---------------------------------------------------------------------------------------

    @property
    def kubeconfig(self) -> Path:
        return self.state / "admin.kubeconfig"

    def namespace(self, node: NodeSpec) -> Namespace:
        return self.net[node.role]

    def node(self, name: str) -> NodeSpec:
        for node in self.nodes:
            if node.name == name:
                return node
        raise ClusterError(f"no node {name!r} in the lab (nodes: {', '.join(n.name for n in self.nodes)})")

    def _log(self, name: str) -> int:
        (self.state / "logs").mkdir(exist_ok=True)
        return os.open(self.state / "logs" / f"{name}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def _start(self, name: str, argv: Sequence[str], cgroup: tuple[str, ...]) -> subprocess.Popen[bytes]:
        log = self._log(name)
        try:
            return subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                    preexec_fn=join_cgroup(*cgroup), start_new_session=True)
        finally:
            os.close(log)

    def in_node(self, node: NodeSpec, argv: Sequence[str]) -> list[str]:
        """argv run in a node's network and mount namespaces (where its containerd socket and /run are)."""
        holder = self.holders[node.name].pid
        return ["nsenter", f"--mount=/proc/{holder}/ns/mnt", f"--net=/proc/{holder}/ns/net", "--", *argv]

    def kubectl(self, *args: str, stdin: str | None = None, check: bool = True,
                timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
        try:
            result = subprocess.run([self.artifacts.toolchain.kubectl, f"--kubeconfig={self.kubeconfig}", *args],
                                    input=stdin, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise ClusterError(f"kubectl {' '.join(args)}: no answer within {timeout:.0f} s") from None
        if check and result.returncode != 0:
            raise ClusterError(f"kubectl {' '.join(args)}: {result.stderr.strip()[-500:]}")
        return result

    def apply_shipped(self, kustomization: Path) -> None:
        """`kubectl apply -k` of a shipped kustomization (through the lab's overlay): a `Warning:` from the API
        server (a deprecated API or field, a Pod Security warning) fails it as an error would, since users would see
        it on every supported release."""
        result = self.kubectl("apply", "-k", str(kustomization))
        warnings = [line for line in result.stderr.splitlines() if line.startswith("Warning:")]
        if warnings:
            raise ClusterError(f"kubectl apply -k {kustomization}: the API server warned: {' | '.join(warnings)}")

    def kubectl_json(self, *args: str) -> Any:
        """What kubectl prints with -o json (the API's objects, as plain JSON values)."""
        return json.loads(self.kubectl(*args, "-o", "json").stdout)

    # ---- bringing it up ----------------------------------------------------------------------------------------

    def up(self, progress: Progress) -> None:
        started = time.monotonic()
        with socket.socket() as probe:  # before anything is made: the one thing on the machine the lab binds
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(("127.0.0.1", self.api_port))
            except OSError as exc:
                raise ClusterError(f"127.0.0.1:{self.api_port} (the lab's API port) is in use: {exc.strerror}"
                                   ) from None
        self.state.mkdir(parents=True)
        make_cgroup("control-plane")
        progress("network: router, control plane, nodes, peers, partner, Cloud NAT, internet")
        self._network()
        make_pki(self.state / "pki")
        self._credentials()
        self._control_plane()
        self.kubectl("label", "--overwrite", "namespace", "kube-system",
                     *(f"{k}={v}" for k, v in PRIVILEGED_NAMESPACE_LABELS.items()))
        progress(f"control plane up ({time.monotonic() - started:.0f} s)")
        for node in self.nodes:
            self._node(node)
        self._pod_cidrs()
        self.wait_nodes_ready()
        progress(f"nodes Ready: {', '.join(n.name for n in self.nodes)} ({time.monotonic() - started:.0f} s)")
        self._probe_pods()
        progress(f"probe pods Running ({time.monotonic() - started:.0f} s)")

    def _network(self) -> None:
        net = self.net
        router = net.add("router")
        router.run(["ip", "link", "add", "vpc", "type", "bridge"])
        router.run(["ip", "addr", "add", f"{ADDR.router}/20", "dev", "vpc"])
        router.run(["ip", "addr", "add", f"{ADDR.router6}/64", "dev", "vpc", "nodad"])
        router.run(["ip", "link", "set", "vpc", "up"])
        self.world = Lab(net, str(self.state / "world"))
        os.makedirs(self.world.workdir)
        make_cgroup("world")
        try:
            build_world(self.world, router)
        finally:  # its probe servers go with the cluster, whoever tears it down (--down from another process)
            for server in self.world.servers:
                move_to_cgroup(server.pid, "world")
        control_plane = net.add("cp")
        _, port = net.link(control_plane, [f"{CONTROL_PLANE}/20", f"{CONTROL_PLANE6}/64"], router, [])
        router.run(["ip", "link", "set", port, "master", "vpc"])
        control_plane.run(["ip", "route", "add", "default", "via", ADDR.router])
        control_plane.run(["ip", "-6", "route", "add", "default", "via", ADDR.router6])
        for node in self.nodes:
            ns = net.add(node.role)
            addresses = [f"{node.address}/20", *(f"{a}/20" for a in node.extra_addresses), f"{node.address6}/64"]
            _, port = net.link(ns, addresses, router, [])
            router.run(["ip", "link", "set", port, "master", "vpc"])
            ns.run(["ip", "route", "add", "default", "via", ADDR.router])
            ns.run(["ip", "-6", "route", "add", "default", "via", ADDR.router6])
            ns.sysctl("net.ipv4.ip_forward", "1")
            ns.sysctl("net.ipv4.conf.all.rp_filter", "0")
            ns.sysctl("net.ipv6.conf.all.forwarding", "1")
            router.run(["ip", "route", "add", node.pod_cidr, "via", node.address])
            router.run(["ip", "-6", "route", "add", node.pod_cidr6, "via", node.address6])

    def _credentials(self) -> None:
        """A token per user (admin, kube-proxy, the controllers, each node's kubelet) and each one's kubeconfig."""
        users = {"admin": ("admin", "system:masters"), "kube-proxy": ("system:kube-proxy", ""),
                 "controller-manager": ("system:kube-controller-manager", ""),
                 "scheduler": ("system:kube-scheduler", "")}
        users.update({node.name: (f"system:node:{node.name}", "system:nodes") for node in self.nodes})
        tokens = {name: secrets.token_hex(16) for name in users}
        lines = [f'{tokens[name]},{user},{user},"{groups}"' if groups else f"{tokens[name]},{user},{user}"
                 for name, (user, groups) in users.items()]
        (self.state / "pki" / "tokens.csv").write_text("\n".join(lines) + "\n")
        ca = self.state / "pki" / "ca.crt"
        # the machine's kubectl goes through the loopback port only: the lab's addresses exist only inside the lab,
        # and on the machine's own network they may well be somebody else's
        write_kubeconfig(self.kubeconfig, f"https://127.0.0.1:{self.api_port}", ca, tokens["admin"], "admin")
        for name in tokens:
            if name != "admin":  # the daemons inside the lab reach the API server at its lab address
                write_kubeconfig(self.state / f"{name}.kubeconfig", f"https://{CONTROL_PLANE}:6443", ca, tokens[name],
                                 name)

    def _control_plane(self) -> None:
        cp = self.net["cp"]
        pki = self.state / "pki"
        tools = self.artifacts.toolchain
        enter = ["nsenter", f"--net=/run/netns/{cp.name}", "--"]
        group = ("control-plane",)
        self._start("etcd", [*enter, tools.etcd, f"--data-dir={self.state / 'etcd'}", "--name=lab",
                             "--listen-client-urls=http://127.0.0.1:2379",
                             "--advertise-client-urls=http://127.0.0.1:2379",
                             "--listen-peer-urls=http://127.0.0.1:2380",
                             "--initial-advertise-peer-urls=http://127.0.0.1:2380",
                             "--initial-cluster=lab=http://127.0.0.1:2380"], group)
        self._api_server_argv = [
            *enter, tools.binaries["kube-apiserver"], "--etcd-servers=http://127.0.0.1:2379",
            f"--advertise-address={CONTROL_PLANE}", "--bind-address=0.0.0.0", "--secure-port=6443",
            f"--service-cluster-ip-range={SERVICE_CIDR},{SERVICE_CIDR6}",
            f"--token-auth-file={pki / 'tokens.csv'}", "--authorization-mode=Node,RBAC",
            "--enable-admission-plugins=NodeRestriction",
            f"--admission-control-config-file={self._admission_config()}",
            f"--tls-cert-file={pki / 'apiserver.crt'}", f"--tls-private-key-file={pki / 'apiserver.key'}",
            f"--client-ca-file={pki / 'ca.crt'}",
            f"--service-account-key-file={pki / 'sa.pub'}", f"--service-account-signing-key-file={pki / 'sa.key'}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            "--allow-privileged=true", "--kubelet-preferred-address-types=InternalIP",
            # no kube-proxy in the control plane's namespace, so no way to a Service's ClusterIP: the API server
            # calls admission webhooks (ipmasq webhook) at their Service's endpoints, the pod IPs the router routes
            "--enable-aggregator-routing=true",
            f"--cert-dir={self.state / 'apiserver-certs'}"]
        self.api_server = self._start("kube-apiserver", self._api_server_argv, group)
        # kubectl on the machine: a loopback port forwarded into the control plane's namespace
        self._start("forward", [sys.executable, "-m", "ipmasq.lab.kubernetes.forward", f"127.0.0.1:{self.api_port}",
                                f"/run/netns/{cp.name}", f"{CONTROL_PLANE}:6443"], group)
        self._wait_api_ready()
        self._start("kube-controller-manager", [
            *enter, tools.binaries["kube-controller-manager"],
            f"--kubeconfig={self.state / 'controller-manager.kubeconfig'}", "--leader-elect=false",
            f"--service-account-private-key-file={pki / 'sa.key'}", f"--root-ca-file={pki / 'ca.crt'}",
            # each controller acts as its own service account, with its bootstrap role (as kubeadm runs it)
            "--use-service-account-credentials=true", "--bind-address=127.0.0.1"], group)
        self._start("kube-scheduler", [
            *enter, tools.binaries["kube-scheduler"], f"--kubeconfig={self.state / 'scheduler.kubeconfig'}",
            "--leader-elect=false", "--bind-address=127.0.0.1"], group)

    def _admission_config(self) -> Path:
        """Pod Security's cluster-wide defaults (the API server's AdmissionConfiguration)."""
        path = self.state / "admission.yaml"
        path.write_text(json.dumps({
            "apiVersion": "apiserver.config.k8s.io/v1", "kind": "AdmissionConfiguration", "plugins": [{
                "name": "PodSecurity", "configuration": {
                    "apiVersion": "pod-security.admission.config.k8s.io/v1", "kind": "PodSecurityConfiguration",
                    "defaults": {f"{mode}{suffix}": (POD_SECURITY_DEFAULT if suffix == "" else "latest")
                                 for mode in ("enforce", "audit", "warn") for suffix in ("", "-version")},
                    "exemptions": {"usernames": [], "runtimeClasses": [], "namespaces": []}}}]}, indent=2) + "\n")
        return path

    def _wait_api_ready(self) -> None:
        def ready() -> bool:
            try:
                return self.kubectl("get", "--raw", "/readyz", check=False, timeout=5).returncode == 0
            except ClusterError:  # no answer within 5 s: a starting server on a loaded machine, ask again
                return False

        if not _wait(ready, 60, interval=0.5):
            raise ClusterError(f"the API server is not ready after 60 s (logs: {self.state / 'logs'})")

    def stop_api_server(self) -> None:
        """The API server gone, as in a crash (SIGKILL: a graceful stop waits on open watches for a minute): every
        watch and request to it fails until it is back."""
        if self.api_server is not None:
            self.api_server.kill()
            self.api_server.wait(30)
            self.api_server = None

    def start_api_server(self) -> None:
        """The API server back, with the same flags and state (etcd kept everything)."""
        if self.api_server is None:
            self.api_server = self._start("kube-apiserver", self._api_server_argv, ("control-plane",))
            self._wait_api_ready()

    def _node(self, node: NodeSpec) -> None:
        home = self.state / "nodes" / node.name
        (home / "cni").mkdir(parents=True)
        (home / "sysctl").mkdir()
        make_cgroup(node.name, "daemons")
        mounts = ["set -e", "mount -t tmpfs -o mode=755 node-run /run", "mkdir -p /run/lock",
                  "mount -t tmpfs -o mode=755 node-log /var/log"]
        for key, value in KUBELET_KERNEL_SETTINGS.items():
            shown = home / "sysctl" / key.replace("/", ".")
            shown.write_text(value + "\n")
            mounts.append(f"mount --bind {shown} /proc/sys/{key}")
        mounts += ["echo ready", "exec sleep infinity"]
        ns = self.namespace(node)
        log = self._log(f"{node.name}-holder")
        try:
            holder = subprocess.Popen(
                ["unshare", "--mount", "--propagation", "private", "--", "nsenter", f"--net=/run/netns/{ns.name}",
                 "--", "sh", "-c", "\n".join(mounts)],
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log,
                preexec_fn=join_cgroup(node.name, "daemons"), start_new_session=True)
        finally:
            os.close(log)
        assert holder.stdout is not None
        if holder.stdout.readline().strip() != b"ready":
            raise ClusterError(f"{node.name}: its mount namespace could not be set up "
                               f"(log: {self.state / 'logs' / (node.name + '-holder.log')})")
        self.holders[node.name] = holder
        (home / "containerd.toml").write_text(containerd_config(home))
        (home / "cni" / "10-lab.conflist").write_text(cni_config(node, home))
        group = (node.name, "daemons")
        tools = self.artifacts.toolchain
        # containerd finds its runc shim on PATH: the one built with it first
        path = f"PATH={tools.containerd_dir}:{os.environ.get('PATH', '/usr/sbin:/usr/bin:/sbin:/bin')}"
        self._start(f"{node.name}-containerd",
                    self.in_node(node, ["env", path, tools.binaries["containerd"],
                                        f"--config={home / 'containerd.toml'}"]), group)
        ctr = self._ctr()
        if not _wait(lambda: subprocess.run(self.in_node(node, [*ctr, "version"]), capture_output=True).returncode
                     == 0, 30):
            raise ClusterError(f"{node.name}: containerd did not start (log: {self.state / 'logs'})")
        for archive in (self.artifacts.pause_archive, self.artifacts.image_archive):
            result = subprocess.run(self.in_node(node, [*ctr, "images", "import", str(archive)]),
                                    capture_output=True, text=True, timeout=300)
            if result.returncode != 0:
                raise ClusterError(f"{node.name}: importing {archive.name}: {result.stderr.strip()[-300:]}")
        self.tag_image(node, self.artifacts.image, self.artifacts.image)
        (home / "kubelet.yaml").write_text(kubelet_config(node, self.sync_frequency))
        self.start_kubelet(node)
        (home / "kube-proxy.yaml").write_text(kube_proxy_config(node, self.state / "kube-proxy.kubeconfig"))
        self.start_kube_proxy(node)

    def tag_image(self, node: NodeSpec, image: str, as_name: str) -> None:
        """Name an imported image as the kubelet asks for it (docker.io/NAME:TAG, whatever name podman saved)."""
        ctr = self._ctr()
        listing = subprocess.run(self.in_node(node, [*ctr, "images", "ls", "-q"]), capture_output=True, text=True)
        tag = image.rsplit(":", 1)[1]
        source = next((ref for ref in listing.stdout.split() if ref.endswith(f"ipmasq/ipmasq:{tag}")), None)
        if source is None:
            raise ClusterError(f"{node.name}: the image {image} was not imported")
        target = f"docker.io/{as_name}"
        if source != target:
            subprocess.run(self.in_node(node, [*ctr, "images", "tag", "--force", source, target]),
                           capture_output=True, check=True)

    def _ctr(self) -> list[str]:
        return [self.artifacts.toolchain.binaries["ctr"], "--address=/run/containerd/containerd.sock",
                "--namespace=k8s.io"]

    def start_kubelet(self, node: NodeSpec) -> None:
        home = self.state / "nodes" / node.name
        self.kubelets[node.name] = self._start(f"{node.name}-kubelet", self.in_node(node, [
            self.artifacts.toolchain.binaries["kubelet"], f"--config={home / 'kubelet.yaml'}",
            f"--kubeconfig={self.state / (node.name + '.kubeconfig')}", f"--root-dir={home / 'kubelet'}",
            f"--node-ip={node.address},{node.address6}", f"--hostname-override={node.name}",
            f"--node-labels=cloud.google.com/gke-nodepool={node.pool}", "--v=1"]), (node.name, "daemons"))

    def start_kube_proxy(self, node: NodeSpec) -> None:
        home = self.state / "nodes" / node.name
        self.proxies[node.name] = self._start(
            f"{node.name}-kube-proxy",
            self.in_node(node, [self.artifacts.toolchain.binaries["kube-proxy"],
                                f"--config={home / 'kube-proxy.yaml'}"]),
            (node.name, "daemons"))

    def restart_kube_proxy(self, node: NodeSpec) -> None:
        """A new kube-proxy writes all of its rules at start (a flushed node has them back at once)."""
        proxy = self.proxies.pop(node.name)
        proxy.terminate()
        proxy.wait(30)
        self.start_kube_proxy(node)

    def restart_kubelets(self, sync_frequency: str) -> None:
        """Restart every kubelet with another pod sync period (its pods keep running meanwhile)."""
        if sync_frequency == self.sync_frequency:
            return
        self.sync_frequency = sync_frequency
        for node in self.nodes:
            kubelet = self.kubelets.pop(node.name)
            kubelet.terminate()
            kubelet.wait(30)
            (self.state / "nodes" / node.name / "kubelet.yaml").write_text(kubelet_config(node, sync_frequency))
            self.start_kubelet(node)
        healthz = [sys.executable, "-c", "import urllib.request as u; u.urlopen('http://127.0.0.1:10248/healthz')"]
        for node in self.nodes:  # the node stays Ready in the API meanwhile: ask each kubelet itself
            namespace = self.namespace(node)

            def healthy(ns: Namespace = namespace) -> bool:
                return ns.run(healthz, check=False).returncode == 0

            if not _wait(healthy, 60, 0.5):
                raise ClusterError(f"{node.name}: kubelet did not come back within 60 s")
        self.wait_nodes_ready()

    def _pod_cidrs(self, timeout: float = 60.0) -> None:
        """Each Node's podCIDRs, both families, once kubelet has registered it (set once: the API refuses a change)."""
        for node in self.nodes:
            def registered(name: str = node.name) -> bool:
                return self.kubectl("get", "node", name, check=False, timeout=10).returncode == 0

            if not _wait(registered, timeout, interval=0.5):
                raise ClusterError(f"{node.name}: kubelet did not register the Node within {timeout:.0f} s "
                                   f"(kubelet logs: {self.state / 'logs'})")
            self.kubectl("patch", "node", node.name, "--type=merge", "-p", json.dumps(
                {"spec": {"podCIDR": node.pod_cidr, "podCIDRs": [node.pod_cidr, node.pod_cidr6]}}))

    def wait_nodes_ready(self, timeout: float = 120.0) -> None:
        def ready() -> bool:
            result = self.kubectl("get", "nodes", "-o", "json", check=False, timeout=10)
            if result.returncode != 0:
                return False
            states = {item["metadata"]["name"]: any(c["type"] == "Ready" and c["status"] == "True"
                                                    for c in item["status"].get("conditions", []))
                      for item in json.loads(result.stdout)["items"]}
            return all(states.get(node.name) for node in self.nodes)

        if not _wait(ready, timeout, interval=1.0):
            raise ClusterError(f"nodes not Ready after {timeout:.0f} s (kubelet logs: {self.state / 'logs'})")

    def _probe_pods(self) -> None:
        """A long-running pod on every node, from the agent's image: where probes start, `kubectl exec` works."""
        self.kubectl("apply", "-f", "-", stdin=json.dumps({
            "apiVersion": "v1", "kind": "List", "items": [
                {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": LAB_NAMESPACE}},
                {"apiVersion": "apps/v1", "kind": "DaemonSet",
                 "metadata": {"name": PROBE_DAEMONSET, "namespace": LAB_NAMESPACE},
                 "spec": {"selector": {"matchLabels": {"app": PROBE_DAEMONSET}},
                          "template": {"metadata": {"labels": {"app": PROBE_DAEMONSET}}, "spec": {
                              "automountServiceAccountToken": False, "terminationGracePeriodSeconds": 0,
                              "containers": [{"name": "probe", "image": self.artifacts.image,
                                              "imagePullPolicy": "Never", "command": ["sleep", "infinity"]}]}}}},
            ]}))
        if not _wait(lambda: len(self.probe_pods()) == len(self.nodes), 120, interval=1.0):
            raise ClusterError("the probe pods did not start within 120 s "
                               f"({self.kubectl('get', 'pods', '-A', '-o', 'wide', check=False).stdout.strip()})")

    def probe_pods(self) -> dict[str, tuple[str, str]]:
        """node name -> (probe pod name, pod IP), for Running pods."""
        pods = self.kubectl_json("get", "pods", "-n", LAB_NAMESPACE, "-l", f"app={PROBE_DAEMONSET}")
        found: dict[str, tuple[str, str]] = {}
        for pod in pods["items"]:
            status = pod["status"]
            if status.get("phase") == "Running" and status.get("podIP"):
                found[pod["spec"]["nodeName"]] = (pod["metadata"]["name"], status["podIP"])
        return found

    def probe_pod_ips(self) -> dict[str, tuple[str, ...]]:
        """node name -> the Running probe pod's addresses, every family's (status.podIPs: IPv4 first, then IPv6)."""
        pods = self.kubectl_json("get", "pods", "-n", LAB_NAMESPACE, "-l", f"app={PROBE_DAEMONSET}")
        return {pod["spec"]["nodeName"]: tuple(p["ip"] for p in pod["status"].get("podIPs", []))
                for pod in pods["items"] if pod["status"].get("phase") == "Running"}

    # ---- what --keep hands over --------------------------------------------------------------------------------

    def describe(self) -> dict[str, Any]:
        agents = self.kubectl_json("get", "pods", "-n", "kube-system", "-l", "k8s-app=ip-masq-agent")
        probes = self.probe_pods()
        return {
            "kubeconfig": str(self.kubeconfig),
            "nodes": [{"name": n.name, "pool": n.pool, "address": n.address, "pod_cidr": n.pod_cidr,
                       "address6": n.address6, "pod_cidr6": n.pod_cidr6, "netns": self.namespace(n).name}
                      for n in self.nodes],
            "pods": [{"namespace": LAB_NAMESPACE, "name": probes[n.name][0], "node": n.name, "ip": probes[n.name][1]}
                     for n in self.nodes if n.name in probes]
            + [{"namespace": "kube-system", "name": p["metadata"]["name"], "node": p["spec"].get("nodeName"),
                "ip": p["status"].get("podIP")} for p in agents["items"]],
            "image": self.artifacts.image,
        }

    def save(self) -> None:
        (self.state / "cluster.json").write_text(json.dumps({
            "namespaces": [ns.name for ns in self.net.namespaces.values()], "kubeconfig": str(self.kubeconfig),
            "creator": os.getpid()}, indent=2) + "\n")


def cluster_is_up() -> bool:
    """A cluster kept with --keep (or one being used) holds processes in the lab's cgroup tree."""
    return bool(cgroup_pids())


def tear_down(net: Network | None = None) -> None:
    """Everything the lab started or made: processes (the whole cgroup tree), network namespaces, the state
    directory. Safe to call on a half-built cluster, twice, or after a crash (it reads what a kept cluster saved)."""
    state = state_dir()
    kill_cgroup_tree()
    names: set[str] = set()
    if net is not None:
        names.update(ns.name for ns in net.namespaces.values())
        net.namespaces.clear()
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        names.update(json.loads((state / "cluster.json").read_text())["namespaces"])
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    names.update(line.split()[0] for line in listing.splitlines() if line.startswith(f"{NETNS_PREFIX}-"))
    for name in sorted(names):
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
    # mounts made by kubelet and containerd lived in the nodes' mount namespaces, gone with their processes
    shutil.rmtree(state, ignore_errors=True)
