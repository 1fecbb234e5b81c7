#!/usr/bin/env bash
# The main job: set everything up, then reproduce the GKE 1.14 upgrade outage in the lab — real network namespaces,
# the real agent, real TCP: GKE 1.14's defaults send the pod IP to the AWS VPC (172.30.0.0/16), whose firewall
# rejects it; publishing nonMasqueradeCIDRs: [10.0.0.0/8] (the way kubelet updates a ConfigMap) fixes it.
# Needs root (namespaces); without root it shows the same incident with render and explain only.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh >&2
ipmasq=.venv/bin/ipmasq

if [ "$(id -u)" -eq 0 ]; then
  exec $ipmasq lab --scenario incident-gke-1.14 "$@"
fi

echo "(not root: no lab; here is the model of the same incident)" >&2
fix=$(mktemp); trap 'rm -f "$fix"' EXIT
printf 'nonMasqueradeCIDRs:\n  - 10.0.0.0/8\nresyncInterval: 60s\n' >"$fix"
gke=(--masq-chain=IP-MASQ --nomasq-all-reserved-ranges)
echo "### GKE 1.14 node defaults"
$ipmasq render "${gke[@]}"
$ipmasq explain 172.30.12.110 10.142.0.6 8.8.8.8 "${gke[@]}" --source 10.44.14.15 --node-ip 10.142.15.203
echo "### with the ConfigMap nonMasqueradeCIDRs: [10.0.0.0/8]"
$ipmasq explain 172.30.12.110 10.142.0.6 8.8.8.8 "${gke[@]}" --config "$fix" --source 10.44.14.15 \
  --node-ip 10.142.15.203
