#!/usr/bin/env bash
# The container image's install steps (the Dockerfile runs exactly this; the test suite runs it too, into a
# throwaway prefix, so the image recipe cannot rot unnoticed).
#   install-image.sh SOURCE_DIR PREFIX [REVISION]
# Installs Debian's iptables, nftables and conntrack when missing, then ipmasq with its webhook extra (non-editable;
# /metrics needs no extra) into a virtual environment at PREFIX, checks that the command runs, /metrics renders and
# the webhook imports, and removes pip and setuptools from the environment (the image's runtime stage copies it without them).
set -euo pipefail
src=${1:?usage: install-image.sh SOURCE_DIR PREFIX}
prefix=${2:?usage: install-image.sh SOURCE_DIR PREFIX [REVISION]}
revision=${3:-}

missing=()
for tool in iptables:iptables nft:nftables conntrack:conntrack; do
  command -v "${tool%%:*}" >/dev/null 2>&1 || missing+=("${tool#*:}")
done
if [ ${#missing[@]} -gt 0 ]; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
  rm -rf /var/lib/apt/lists/*
fi

python3 -m venv "$prefix"
# the webhook extra (its serving certificate): `ipmasq webhook` runs from the same image; the agent never imports it
"$prefix/bin/python" -m pip install -q --no-cache-dir --disable-pip-version-check "$src[webhook]"
# the commit it was built from, where `ipmasq --version` reads it (ipmasq.version.REVISION_FILE)
if [ -n "$revision" ]; then
  mkdir -p "$prefix/share/ipmasq"
  printf '%s\n' "$revision" >"$prefix/share/ipmasq/revision"
fi
# smoke test: the installed command renders the reference defaults, and the agent's /metrics text renders
"$prefix/bin/ipmasq" --version
"$prefix/bin/ipmasq" render >/dev/null
"$prefix/bin/python" -c 'from ipmasq.agent.metrics import AgentVitals, render_metrics
assert b"ipmasq_build_info" in render_metrics(AgentVitals(version="smoke", backend="none"))'
"$prefix/bin/python" -c 'import ipmasq.webhook.process'
# the environment runs, it never installs: pip and setuptools stay out of the image
"$prefix/bin/python" -m pip uninstall -q -y pip setuptools
