#!/usr/bin/env bash
# Set up everything ipmasq needs on a fresh Debian machine: the kernel tools, Prometheus and what the Kubernetes lab
# builds and runs its cluster with (when missing), and a virtual environment with the package and its development
# dependencies. Idempotent; safe to run every time.
set -euo pipefail
cd "$(dirname "$0")/.."

need_debian=()
for tool in iptables:iptables ip6tables:iptables nft:nftables ip:iproute2 conntrack:conntrack promtool:prometheus \
    runc:runc podman:podman mmdebstrap:mmdebstrap gcc:gcc openssl:openssl; do
  # the second line: the Kubernetes lab (its Kubernetes, etcd and containerd are built from Go modules and cached)
  command -v "${tool%%:*}" >/dev/null 2>&1 || need_debian+=("${tool#*:}")
done
[ -x /usr/lib/cni/bridge ] || need_debian+=(containernetworking-plugins)
if [ ${#need_debian[@]} -gt 0 ]; then
  if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "bootstrap: installing ${need_debian[*]} from Debian" >&2
    bash scripts/apt-get-waiting.sh update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive bash scripts/apt-get-waiting.sh install -y -qq "${need_debian[@]}" >/dev/null
  else
    echo "bootstrap: missing ${need_debian[*]} (run as root on Debian to install them)" >&2
  fi
fi

# the Kubernetes lab builds Kubernetes 1.37 with the go command (Go 1.26 or newer; Debian 12's golang-go is 1.19)
if ! command -v go >/dev/null 2>&1; then
  echo "bootstrap: no go on PATH: the Kubernetes lab needs Go 1.26 or newer to build its cluster" >&2
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
