#!/usr/bin/env bash
# The main job: set everything up, then show the seed-000 incident with ipmasq render and explain:
# GKE 1.14's defaults (172.16.0.0/12 preserved: the AWS VPC sees pod IPs and rejects them) versus the fix.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh >&2
ipmasq=.venv/bin/ipmasq
fix=$(mktemp); trap 'rm -f "$fix"' EXIT
printf 'nonMasqueradeCIDRs:\n  - 10.0.0.0/8\nresyncInterval: 60s\n' >"$fix"
pod=10.44.14.15 node=10.142.15.203 aws_db=172.30.12.110 vpc_peer=10.142.0.6

echo "### GKE 1.14 node defaults (--masq-chain=IP-MASQ --nomasq-all-reserved-ranges, no ConfigMap)"
$ipmasq render --masq-chain=IP-MASQ --nomasq-all-reserved-ranges
$ipmasq explain $aws_db $vpc_peer 8.8.8.8 --masq-chain=IP-MASQ --nomasq-all-reserved-ranges --source $pod --node-ip $node
echo
echo "### The fix from the incident report: ConfigMap ip-masq-agent with nonMasqueradeCIDRs: [10.0.0.0/8]"
$ipmasq render --masq-chain=IP-MASQ --nomasq-all-reserved-ranges --config "$fix"
$ipmasq explain $aws_db $vpc_peer 8.8.8.8 --masq-chain=IP-MASQ --nomasq-all-reserved-ranges --config "$fix" \
  --source $pod --node-ip $node
