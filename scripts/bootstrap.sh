#!/usr/bin/env bash
# Set up everything ipmasq needs on a fresh Debian machine: the kernel tools, Prometheus and what the Kubernetes lab
# builds and runs its cluster with (when missing), and a virtual environment with the package and its development
# dependencies. Idempotent; safe to run every time.
set -euo pipefail
cd "$(dirname "$0")/.."

need_debian=()
for tool in iptables:iptables ip6tables:iptables nft:nftables ip:iproute2 conntrack:conntrack kubectl:kubernetes-client \
    promtool:prometheus \
    etcd:etcd-server containerd:containerd runc:runc podman:podman mmdebstrap:mmdebstrap go:golang-go make:make \
    rsync:rsync jq:jq dpkg-source:dpkg-dev gcc:gcc openssl:openssl; do
  # the second line: the Kubernetes lab (a real cluster from Debian's packages, built once and cached)
  command -v "${tool%%:*}" >/dev/null 2>&1 || need_debian+=("${tool#*:}")
done
[ -x /usr/lib/cni/bridge ] || need_debian+=(containernetworking-plugins)
# the Kubernetes lab's build replaces the reflect2 Kubernetes 1.20 vendors (it crashes under Debian's Go) with this one
[ -d /usr/share/gocode/src/github.com/modern-go/reflect2 ] || need_debian+=(golang-github-modern-go-reflect2-dev)
if [ ${#need_debian[@]} -gt 0 ]; then
  if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "bootstrap: installing ${need_debian[*]} from Debian" >&2
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_debian[@]}" >/dev/null
  else
    echo "bootstrap: missing ${need_debian[*]} (run as root on Debian to install them)" >&2
  fi
fi

PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
stamp=.venv/.ipmasq-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/python -m pip install -q --disable-pip-version-check -e '.[dev]'
  touch "$stamp"
fi
