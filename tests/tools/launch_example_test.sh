#!/usr/bin/env bash
# Runs examples/hello_workers, the restart worker and the parameter-server
# example (a few steps) under each launcher:
#
#   launch_example_test.sh CASE TORCHRPC_LAUNCH HELLO_WORKERS RESTART_WORKER [PS_MNIST]
#
# Exit 77 (CTest: skipped) when the launcher a case needs is not installed.
# Every run is bounded by timeout(1); the workers' pids are not known to us
# under torchrun and mpirun, so the EXIT trap kills, by pid, every process
# still below this script.
set -uo pipefail

case_name="$1"
launcher="$2"
hello="$3"
restart_worker="$4"
ps_mnist="${5:-}"
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
  echo "FAIL (${case_name}): $*" >&2
  cat "${out}" >&2 2>/dev/null
  exit 1
}

need() {
  command -v "$1" >/dev/null || {
    echo "SKIP: $1 is not installed (bash tools/setup_debian.sh installs it)"
    exit 77
  }
}

# bounded SECONDS CMD...: runs it, output to ${out}, sets rc.
bounded() {
  local seconds="$1"
  shift
  timeout -k 5 "${seconds}" "$@" >"${out}" 2>&1
  rc=$?
  [[ ${rc} -eq 124 || ${rc} -eq 137 ]] && fail "did not finish in ${seconds}s"
}

expect_rc() {
  [[ ${rc} -eq $1 ]] || fail "exit code ${rc}, expected $1"
}

expect_match() {
  grep -qE -- "$1" "${out}" || fail "nothing matches '$1'"
}

# What hello_workers' worker0 prints with two workers.
expect_hello_output() {
  local prefix="$1"
  expect_match "^${prefix}hello worker0, this is worker1$"
  expect_match "^${prefix}a total kept on worker1:  6$"
  expect_match "^${prefix}gradient of w through worker1 and worker1:  12$"
  expect_match "^${prefix}a bad call fails as a value: \[bad arguments\]"
}

# ps_mnist's arguments for a short run: one server and two trainers, 20
# steps, everything it writes inside ${work}.
ps_args=(--max-steps 20 --progress-seconds 0.5
  --cache-dir "${work}/cache" --log-dir "${work}/runs"
  --checkpoint-dir "${work}/checkpoints")

# What a short ps_mnist run prints: both trainers' progress, the accuracy.
expect_ps_output() {
  local prefix="$1"
  expect_match "^${prefix}trainer1 epoch 1/[0-9]+ step [0-9]+"
  expect_match "^${prefix}trainer2 epoch 1/[0-9]+ step [0-9]+"
  expect_match "^${prefix}test accuracy: [0-9.]+% on 10000"
}

need_ps() {
  [[ -n "${ps_mnist}" && -x "${ps_mnist}" ]] || {
    echo "SKIP: ps_mnist was not built (it needs CLI11 and zlib)"
    exit 77
  }
  [[ -f /usr/share/datasets/fashion-mnist/t10k-labels-idx1-ubyte.gz ]] || {
    echo "SKIP: dataset-fashion-mnist is not installed (bash tools/setup_debian.sh)"
    exit 77
  }
}

free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

case "${case_name}" in
  HelloWorkersUnderTorchrpcLaunch)
    bounded 120 "${launcher}" --standalone --nproc-per-node 2 -- "${hello}"
    expect_rc 0
    expect_hello_output '\[rank 0\]: '
    ;;
  HelloWorkersUnderTorchrun)
    need torchrun
    # Debian's torchrun 1.13 crashes in its log redirection set-up when
    # --redirects/--tee are left unset (AttributeError: 'NoneType' object
    # has no attribute 'get'); naming a local rank that does not exist (9)
    # gives it a map and changes nothing else. If this first check fails,
    # Debian fixed it and README's workaround can go.
    bounded 120 torchrun --standalone --nproc_per_node 2 --no_python "${hello}"
    [[ ${rc} -ne 0 ]] && grep -q "'NoneType' object has no attribute 'get'" "${out}" ||
      fail "torchrun without --redirects no longer crashes; update README"
    bounded 120 torchrun --standalone --nproc_per_node 2 \
      --redirects 9:1 --tee 9:1 --no_python "${hello}"
    expect_rc 0
    expect_hello_output ''
    ;;
  HelloWorkersUnderMpirun)
    need mpirun
    # mpirun sets OMPI_COMM_WORLD_*; on one node the worker defaults to
    # 127.0.0.1:29500, so name a free port to not meet another job there.
    bounded 120 mpirun --allow-run-as-root --oversubscribe -np 2 \
      -x MASTER_PORT="$(free_port)" "${hello}"
    expect_rc 0
    expect_hello_output ''
    ;;
  RestartedGroupMeetsAgainUnderTorchrpcLaunch)
    bounded 120 "${launcher}" --standalone --nproc-per-node 2 \
      --max-restarts 1 -- "${restart_worker}"
    expect_rc 0
    expect_match '^\[rank 1\]: rank 1 fails before start in restart 0$'
    expect_match '^\[rank 0\]: worker0 met worker1 in restart 1 \(theirs: 1\)$'
    expect_match '^\[rank 1\]: worker1 met worker0 in restart 1 \(theirs: 1\)$'
    ;;
  RestartedGroupMeetsAgainUnderTorchrun)
    need torchrun
    # Not --standalone: torchrun's static rendezvous keeps one agent store
    # (TORCHELASTIC_USE_AGENT_STORE=True) across restarts, with the keys the
    # failed group left in it.
    bounded 150 torchrun --nnodes 1 --nproc_per_node 2 \
      --master_addr 127.0.0.1 --master_port "$(free_port)" --max_restarts 1 \
      --redirects 9:1 --tee 9:1 --no_python "${restart_worker}"
    expect_rc 0
    expect_match '^rank 1 fails before start in restart 0$'
    expect_match '^worker0 met worker1 in restart 1 \(theirs: 1\)$'
    expect_match '^worker1 met worker0 in restart 1 \(theirs: 1\)$'
    ;;
  PsMnistUnderTorchrpcLaunch)
    need_ps
    bounded 200 "${launcher}" --standalone --nproc-per-node 3 -- \
      "${ps_mnist}" "${ps_args[@]}"
    expect_rc 0
    expect_ps_output '\[rank [0-9]\]: '
    ;;
  PsMnistUnderTorchrun)
    need torchrun
    need_ps
    bounded 200 torchrun --standalone --nproc_per_node 3 \
      --redirects 9:1 --tee 9:1 --no_python "${ps_mnist}" "${ps_args[@]}"
    expect_rc 0
    expect_ps_output ''
    ;;
  PsMnistUnderMpirun)
    need mpirun
    need_ps
    bounded 200 mpirun --allow-run-as-root --oversubscribe -np 3 \
      -x MASTER_PORT="$(free_port)" "${ps_mnist}" "${ps_args[@]}"
    expect_rc 0
    expect_ps_output ''
    ;;
  *)
    echo "unknown case ${case_name}" >&2
    exit 2
    ;;
esac
echo "PASS ${case_name}"
