"""The Kubernetes lab: a real cluster (etcd, kube-apiserver, controller-manager, scheduler; per node containerd,
kubelet and kube-proxy) inside throwaway network namespaces, with the agent installed from `deploy/` as users
install it, and the namespace lab's world (router, VPN peers, partner, Cloud NAT, internet) around it.

    artifacts   what the cluster runs, built once from Debian's packages and cached on the machine
    cluster     bringing the cluster up and down (every process in one cgroup tree, every node in its own
                network and mount namespace)
    forward     the loopback port that lets kubectl on the machine reach the API server inside the lab
    scenarios   the namespace lab's scenarios on real pods
"""
