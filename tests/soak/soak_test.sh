#!/usr/bin/env bash
# Soak.FourWorkersKilledAndRestarted: four soak workers under torchrpc-launch
# for SECONDS per generation; worker2 kills itself midway through the first,
# the launcher restarts the group once, and the restarted group must pass
# every check of soak_worker.cpp.
#
#   soak_test.sh TORCHRPC_LAUNCH SOAK_WORKER SECONDS
#
# Bounded by timeout(1); the EXIT trap kills, by pid, every process still
# below this script, however it ends.
set -uo pipefail

launcher="$1"
worker="$2"
seconds="$3"
work="$(mktemp -d)"
out="${work}/out"

# The pids of every descendant of process $1, deepest first.
descendants() {
  local child
  for child in $(ps -o pid= --ppid "$1" 2>/dev/null); do
    descendants "${child}"
    echo "${child}"
  done
}

cleanup() {
  local pids
  pids=$(descendants $$)
  for pid in ${pids}; do
    kill -KILL "${pid}" 2>/dev/null
  done
  rm -rf "${work}"
}
trap cleanup EXIT

fail() {
  echo "FAIL: $*" >&2
  exit 1
}

expect_match() {
  grep -qE -- "$1" "${out}" || fail "nothing matches '$1'"
}

# Two generations of SECONDS each plus start-up, drain and shutdown; the
# bound is generous for a loaded machine, not a timing assertion.
bound=$((3 * seconds + 240))
timeout -k 10 "${bound}" "${launcher}" --standalone --nproc-per-node 4 \
  --max-restarts 1 -- "${worker}" --seconds "${seconds}" --kill-rank 2 \
  2>&1 | tee "${out}"
rc=${PIPESTATUS[0]}
[[ ${rc} -eq 124 || ${rc} -eq 137 ]] && fail "did not finish in ${bound}s"
[[ ${rc} -eq 0 ]] || fail "torchrpc-launch exited ${rc}"
expect_match '^\[rank 2\]: worker2 generation 0: killing myself \(SIGKILL\) midway'
expect_match 'restarting the group \(restart 1 of 1\)'
for rank in 0 1 2 3; do
  expect_match "^\[rank ${rank}\]: worker${rank} generation 1: soak passed$"
done
expect_match '^\[rank 0\]: worker0 generation 1: [0-9]+ plain calls across 4 workers, each answered exactly once$'
grep -q ': FAIL: ' "${out}" && fail "a worker reported a failure"
echo "soak passed"
