#!/usr/bin/env bash
# apt-get ARGS..., waiting while another package manager holds apt's or dpkg's lock (a fresh machine often runs
# unattended-upgrades at boot) instead of failing with apt's raw "Could not get lock" error; any other failure is
# apt's own, at once. Waits at most APT_WAIT_SECONDS (default 900), saying once that it waits.
set -uo pipefail
limit=${APT_WAIT_SECONDS:-900}
interval=${APT_WAIT_INTERVAL:-5}
start=$SECONDS
said=0
while :; do
  # DPkg::Lock::Timeout: apt waits for dpkg's lock itself; the lists lock of `update` is retried here
  if out=$(apt-get -o DPkg::Lock::Timeout=60 "$@" 2>&1); then
    [ "$said" -eq 0 ] || echo "apt-get-waiting: the package manager is free; apt-get $1 done" >&2
    exit 0
  else
    code=$?
  fi
  if ! grep -qE "Could not get lock|Unable to (acquire|lock)|is another process using it" <<<"$out"; then
    printf '%s\n' "$out" >&2
    exit "$code"
  fi
  if [ $((SECONDS - start)) -ge "$limit" ]; then
    printf '%s\n' "$out" >&2
    echo "apt-get-waiting: another package manager held the lock for ${limit} s; run again once it is done" >&2
    exit "$code"
  fi
  if [ "$said" -eq 0 ]; then
    holder=$(grep -oE "held by process [0-9]+ \([^)]*\)" <<<"$out" | head -1)
    echo "apt-get-waiting: another package manager is busy${holder:+ (${holder})}; waiting for it (at most ${limit} s)" >&2
    said=1
  fi
  sleep "$interval"
done
