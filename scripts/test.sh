#!/usr/bin/env bash
# Set everything up, then run all the checks: ruff, mypy (strict), and the whole test suite, kernel tests
# included (they need root; with CI set a missing tool or missing root is a failure, not a skip).
#
# The Kubernetes lab's tests (marker `kubernetes`: real clusters, tests/kernel/lab/kubernetes) spend most of their
# time waiting on kubelet and the API server, so they run in pytests of their own beside the rest; their reports
# follow. Arguments go to the rest and to one run of the lab's tests (a path or -k that selects none of one leaves it
# with nothing to run). Each report ends with its slowest tests (--durations): where a run's time goes, in CI's own
# output.
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
# The Kubernetes lab's tests in two groups, each on a cluster of its own (IPMASQ_LAB_INSTANCE), so that no more than
# two runs share the machine's cores at once: the first group from the start, beside the rest of the tests; the
# second once the rest are done (the two groups' modules listed below; a new module joins the first, and a
# long one is moved to balance: the second group's modules take about as long as the rest of the tests less the
# first group's).
lab=tests/kernel/lab/kubernetes
second_group=("$lab/test_journeys.py" "$lab/test_observe.py" "$lab/test_observe_providers.py" "$lab/test_two_writers.py")
first_skips=()
for module in "${second_group[@]}"; do first_skips+=("--deselect=$module"); done
second_skips=()
for module in "$lab"/test_*.py; do
  case " ${second_group[*]} " in *" $module "*) ;; *) second_skips+=("--deselect=$module") ;; esac
done
kube_logs=()
kube_pids=()
start_kube() {  # LOG INSTANCE PYTEST-ARGS...
  local log=$1 instance=$2
  shift 2
  IPMASQ_LAB_INSTANCE=$instance .venv/bin/python -m pytest -q -p no:cacheprovider --durations=15 -m kubernetes "$@" >"$log" 2>&1 &
  kube_pids+=($!)
  kube_logs+=("$log")
}
# an interrupted run stops the cluster's tests too: SIGTERM, which their fixture turns into a clean teardown (a
# background job of a script ignores SIGINT)
stop_cluster_tests() {
  local pid
  for pid in "${kube_pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "${kube_pids[@]}"; do wait "$pid" 2>/dev/null || true; done
  rm -f "${kube_logs[@]}"
}
trap stop_cluster_tests EXIT
start_kube "$(mktemp)" "" "${first_skips[@]}" "$@"
rest=0
.venv/bin/python -m pytest -q -p no:cacheprovider --durations=25 -m "not kubernetes" "$@" || rest=$?
start_kube "$(mktemp)" 1 "${second_skips[@]}" "$@"
# 5: that run selected no test; the run fails if a test failed, or if no run ran one
status=0
ran=0
[ "$rest" -eq 5 ] || ran=1
[ "$rest" -eq 5 ] || [ "$rest" -eq 0 ] || status=$rest
for i in "${!kube_pids[@]}"; do
  code=0
  wait "${kube_pids[$i]}" || code=$?
  echo "== pytest (the Kubernetes lab's tests: group $((i + 1)) of ${#kube_pids[@]})"
  cat "${kube_logs[$i]}"
  [ "$code" -eq 5 ] || ran=1
  if [ "$code" -ne 5 ] && [ "$code" -ne 0 ] && [ "$status" -eq 0 ]; then status=$code; fi
done
if [ "$ran" -eq 0 ]; then exit 5; fi
exit "$status"
