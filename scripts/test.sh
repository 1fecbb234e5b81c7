#!/usr/bin/env bash
# Set everything up, then run all the checks: ruff, mypy (strict), and the whole test suite, kernel tests
# included (they need root; with CI set a missing tool or missing root is a failure, not a skip).
#
# The Kubernetes lab's tests (marker `kubernetes`: a real cluster, tests/kernel/lab/kubernetes) spend most of their
# time waiting on kubelet and the API server, so they run in a second pytest beside the rest; their report follows.
# Arguments go to both (a path or -k that selects none of one half leaves that half with nothing to run).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
echo "== ruff" && .venv/bin/ruff check src tests bench
echo "== mypy" && .venv/bin/mypy
if [ "$(id -u)" -eq 0 ]; then
  # the cluster's builds first (cached on the machine; a fresh one builds Kubernetes for some minutes), so that no
  # compiler runs beside the timed tests
  echo "== the Kubernetes lab's binaries and images" && .venv/bin/ipmasq lab --kubernetes --prepare
fi
echo "== pytest"
kube_log=$(mktemp)
.venv/bin/python -m pytest -q -p no:cacheprovider -m kubernetes "$@" >"$kube_log" 2>&1 &
kube=$!
# an interrupted run stops the cluster's tests too: SIGTERM, which their fixture turns into a clean teardown (a
# background job of a script ignores SIGINT)
stop_cluster_tests() {
  kill -TERM "$kube" 2>/dev/null || true
  wait "$kube" 2>/dev/null || true
  rm -f "$kube_log"
}
trap stop_cluster_tests EXIT
rest=0
.venv/bin/python -m pytest -q -p no:cacheprovider -m "not kubernetes" "$@" || rest=$?
cluster=0
wait "$kube" || cluster=$?
echo "== pytest (the Kubernetes lab's tests, run beside the others)"
cat "$kube_log"
# 5: that half selected no test; the run fails if a test failed, or if neither half ran one
if [ "$rest" -eq 5 ] && [ "$cluster" -eq 5 ]; then exit 5; fi
if [ "$rest" -eq 5 ]; then rest=0; fi
if [ "$cluster" -eq 5 ]; then cluster=0; fi
if [ "$rest" -ne 0 ]; then exit "$rest"; fi
exit "$cluster"
