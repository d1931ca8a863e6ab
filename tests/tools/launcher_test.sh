#!/usr/bin/env bash
# Tests of torchrpc-launch on small shell workers (test_worker.sh):
#
#   launcher_test.sh CASE PATH/TO/torchrpc-launch
#
# Each CASE is its own CTest entry (tests/tools/CMakeLists.txt). Every run
# is bounded by timeout(1); workers record their pids and the EXIT trap
# kills whatever is left by pid, however the test ends.
set -uo pipefail

case_name="$1"
launcher="$2"
here="$(cd "$(dirname "$0")" && pwd)"
worker="${here}/test_worker.sh"
work="$(mktemp -d)"
export PID_DIR="${work}/pids"
mkdir -p "${PID_DIR}"
out="${work}/stdout"
err="${work}/stderr"
launcher_pid=""

cleanup() {
  [[ -n "${launcher_pid}" ]] && kill -KILL "${launcher_pid}" 2>/dev/null
  for file in "${PID_DIR}"/*.pid; do
    [[ -e "${file}" ]] && kill -KILL "$(cat "${file}")" 2>/dev/null
  done
  rm -rf "${work}"
}
trap cleanup EXIT

fail() {
  echo "FAIL (${case_name}): $*" >&2
  echo "--- stdout" >&2
  cat "${out}" >&2 2>/dev/null
  echo "--- stderr" >&2
  cat "${err}" >&2 2>/dev/null
  exit 1
}

# run SECONDS ARGS...: the launcher, bounded; sets rc and elapsed (s).
run() {
  local bound="$1"
  shift
  local start=${SECONDS}
  timeout -k 5 "${bound}" "${launcher}" "$@" >"${out}" 2>"${err}"
  rc=$?
  elapsed=$((SECONDS - start))
  [[ ${rc} -eq 124 || ${rc} -eq 137 ]] && fail "launcher did not finish in ${bound}s"
}

expect_rc() {
  [[ ${rc} -eq $1 ]] || fail "exit code ${rc}, expected $1"
}

# expect_line FILE LINE: FILE has exactly this line.
expect_line() {
  grep -qxF -- "$2" "$1" || fail "no line '$2' in $(basename "$1")"
}

expect_match() {
  grep -qE -- "$2" "$1" || fail "nothing matches '$2' in $(basename "$1")"
}

# Every worker that recorded a pid is gone.
expect_workers_gone() {
  for file in "${PID_DIR}"/*.pid; do
    [[ -e "${file}" ]] || continue
    if kill -0 "$(cat "${file}")" 2>/dev/null; then
      fail "worker $(basename "${file}") still runs"
    fi
  done
}

# start_group MODE: the launcher in the background with two workers running
# MODE, once both printed "ready"; sets launcher_pid and real_launcher.
start_group() {
  env -u TORCHRPC_HANG_REPORT_SIGNAL timeout -k 5 30 "${launcher}" \
    --nproc-per-node 2 -- "${worker}" "$1" >"${out}" 2>"${err}" &
  launcher_pid=$!
  for _ in $(seq 100); do
    [[ $(grep -c 'ready' "${out}") -eq 2 ]] && break
    sleep 0.1
  done
  [[ $(grep -c 'ready' "${out}") -eq 2 ]] || fail "workers never got ready"
  # timeout(1) runs the launcher as its child; signal the launcher itself.
  real_launcher=$(ps -o pid= --ppid "${launcher_pid}" | head -1 | tr -d ' ')
  [[ -n "${real_launcher}" ]] || fail "no launcher process under timeout"
}

# forward_signal NAME EXIT_CODE: the launcher, with two workers waiting,
# gets SIGNAME; each worker must get it and the launcher exit once they did.
forward_signal() {
  local name="$1"
  local start=${SECONDS}
  start_group wait-for-signal
  kill -"${name}" "${real_launcher}"
  wait "${launcher_pid}"
  rc=$?
  launcher_pid=""
  expect_rc "$2"
  expect_line "${out}" "[rank 0]: rank 0 got SIG${name}"
  expect_line "${out}" "[rank 1]: rank 1 got SIG${name}"
  expect_match "${err}" "got SIG${name}, forwarding it to the workers"
  [[ $((SECONDS - start)) -lt 15 ]] || fail "took too long"
  expect_workers_gone
}

case "${case_name}" in
  SetsTorchrunsEnvironment)
    run 30 --nnodes 2:2 --node-rank 1 --nproc_per_node 2 \
      --master-addr 10.9.8.7 --master_port 1234 --max-restarts 0 \
      --run-id job42 -- "${worker}" env
    expect_rc 0
    for local in 0 1; do
      rank=$((2 + local))
      expect_line "${out}" "[rank ${rank}]: RANK=${rank} LOCAL_RANK=${local} WORLD_SIZE=4 LOCAL_WORLD_SIZE=2 GROUP_RANK=1 MASTER_ADDR=10.9.8.7 MASTER_PORT=1234 TORCHELASTIC_RESTART_COUNT=0 TORCHELASTIC_MAX_RESTARTS=0 TORCHELASTIC_RUN_ID=job42 "
    done
    [[ $(wc -l <"${out}") -eq 2 ]] || fail "expected 2 lines"
    # torchrun's defaults.
    run 30 -- "${worker}" env
    expect_rc 0
    expect_line "${out}" "[rank 0]: RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 LOCAL_WORLD_SIZE=1 GROUP_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 TORCHELASTIC_RESTART_COUNT=0 TORCHELASTIC_MAX_RESTARTS=0 TORCHELASTIC_RUN_ID=none "
    ;;
  PassesTracingAndMetricsSettings)
    run 30 --nproc-per-node 2 --trace-dir /tmp/traces --trace-steps 2:3 \
      --metrics-port 9100 --metrics-host 127.0.0.2 -- "${worker}" observability-env
    expect_rc 0
    expect_line "${out}" "[rank 0]: TORCHRPC_TRACE_DIR=/tmp/traces TORCHRPC_TRACE_STEPS=2:3 TORCHRPC_METRICS_ADDR=127.0.0.2:9100 "
    expect_line "${out}" "[rank 1]: TORCHRPC_TRACE_DIR=/tmp/traces TORCHRPC_TRACE_STEPS=2:3 TORCHRPC_METRICS_ADDR=127.0.0.2:9101 "
    # None of them unless asked.
    run 30 -- "${worker}" observability-env
    expect_rc 0
    expect_line "${out}" "[rank 0]: TORCHRPC_TRACE_DIR=unset TORCHRPC_TRACE_STEPS=unset TORCHRPC_METRICS_ADDR=unset "
    # Misuse is refused before any worker starts.
    run 30 --trace-steps 2:3 -- "${worker}" observability-env
    [[ ${rc} -ne 0 ]] || fail "--trace-steps without --trace-dir was accepted"
    grep -q -- "--trace-steps: needs --trace-dir" "${err}" || fail "no reason for refusing --trace-steps"
    run 30 --trace-dir /tmp/t --trace-steps 2:0 -- "${worker}" observability-env
    [[ ${rc} -ne 0 ]] || fail "--trace-steps 2:0 was accepted"
    [[ ! -s "${out}" ]] || fail "a worker ran after a usage error"
    # Too many digits is a usage error too, not a crash.
    run 30 --trace-dir /tmp/t --trace-steps 99999999999999999999:1 -- "${worker}" observability-env
    [[ ${rc} -ne 0 && ${rc} -lt 128 ]] || fail "a 20-digit --trace-steps: exit ${rc}"
    grep -q -- "--trace-steps" "${err}" || fail "no reason for refusing a 20-digit --trace-steps"
    ;;
  IsolatesEachWorker)
    run 30 --nproc-per-node 2 -- "${worker}" isolation
    expect_rc 0
    expect_line "${out}" "[rank 0]: stdin=/dev/null own-group=yes"
    expect_line "${out}" "[rank 1]: stdin=/dev/null own-group=yes"
    ;;
  StandalonePicksAFreeLocalPort)
    run 30 --standalone --nproc-per-node 2 "${worker}" env
    expect_rc 0
    expect_match "${out}" '^\[rank 0\]: RANK=0 .*MASTER_ADDR=127\.0\.0\.1 MASTER_PORT=[0-9]+ '
    port0=$(grep -oE 'MASTER_PORT=[0-9]+' "${out}" | sort -u | wc -l)
    [[ ${port0} -eq 1 ]] || fail "workers disagree on MASTER_PORT"
    grep -q 'MASTER_PORT=29500 ' "${out}" && fail "--standalone kept the fixed port"
    grep -q 'TORCHELASTIC_RUN_ID=none ' "${out}" && fail "--standalone has no run id"
    run 10 --standalone --nnodes 2 "${worker}" env
    [[ ${rc} -ne 0 ]] || fail "--standalone --nnodes 2 was accepted"
    expect_match "${err}" 'standalone'
    ;;
  PrefixesEveryLineWithTheRank)
    run 30 --nproc-per-node 2 -- "${worker}" chatty
    expect_rc 0
    for rank in 0 1; do
      expect_line "${out}" "[rank ${rank}]: out one"
      expect_line "${out}" "[rank ${rank}]: out two"
      expect_line "${out}" "[rank ${rank}]: out three"
      expect_line "${err}" "[rank ${rank}]: err one"
      expect_line "${err}" "[rank ${rank}]: err two"
    done
    [[ $(wc -l <"${out}") -eq 6 ]] || fail "expected 6 lines on stdout"
    [[ $(wc -l <"${err}") -eq 4 ]] || fail "expected 4 lines on stderr"
    grep -v '^\[rank [01]\]: ' "${out}" "${err}" && fail "a line without prefix"
    ;;
  WritesPerRankLogFiles)
    run 30 --nproc-per-node 2 --log-dir "${work}/logs" -- "${worker}" chatty
    expect_rc 0
    for rank in 0 1; do
      dir="${work}/logs/attempt_0/${rank}"
      [[ "$(cat "${dir}/stdout.log")" == $'out one\nout two\nout three' ]] ||
        fail "rank ${rank} stdout.log: $(cat "${dir}/stdout.log")"
      [[ "$(cat "${dir}/stderr.log")" == $'err one\nerr two' ]] ||
        fail "rank ${rank} stderr.log: $(cat "${dir}/stderr.log")"
    done
    expect_line "${out}" "[rank 1]: out three"
    ;;
  AFailedWorkerStopsTheOthers)
    run 30 --nproc-per-node 3 -- "${worker}" fail-on-rank-1
    expect_rc 1
    expect_match "${err}" '^torchrpc-launch: failed: rank 1 \(pid [0-9]+\) exited with code 3$'
    expect_line "${out}" "[rank 0]: rank 0 got SIGTERM"
    expect_line "${out}" "[rank 2]: rank 2 got SIGTERM"
    [[ ${elapsed} -lt 10 ]] || fail "took ${elapsed}s"
    expect_workers_gone
    ;;
  SigkillsWorkersThatIgnoreSigterm)
    run 30 --nproc-per-node 2 --stop-grace-seconds 1 -- "${worker}" ignore-term
    expect_rc 1
    expect_match "${err}" 'rank 1 \(pid [0-9]+\) exited with code 5'
    [[ ${elapsed} -lt 10 ]] || fail "took ${elapsed}s"
    expect_workers_gone
    ;;
  NamesTheSignalThatKilledAWorker)
    run 30 --nproc-per-node 2 -- "${worker}" segfault
    expect_rc 1
    expect_match "${err}" '^torchrpc-launch: failed: rank 0 \(pid [0-9]+\) was killed by signal 11 \(Segmentation fault\)$'
    expect_workers_gone
    ;;
  RestartsTheGroupAfterAFailure)
    run 60 --nproc-per-node 2 --max-restarts 2 --log-dir "${work}/logs" \
      -- "${worker}" fail-first-attempt
    expect_rc 0
    expect_line "${out}" "[rank 0]: attempt 1 ok"
    expect_line "${out}" "[rank 1]: attempt 1 ok"
    expect_line "${err}" "torchrpc-launch: restarting the group (restart 1 of 2)"
    grep -q 'restart 2 of 2' "${err}" && fail "restarted twice"
    [[ -d "${work}/logs/attempt_0/1" && -d "${work}/logs/attempt_1/1" ]] ||
      fail "no log directory per attempt"
    [[ "$(cat "${work}/logs/attempt_1/0/stdout.log")" == "attempt 1 ok" ]] ||
      fail "attempt_1/0/stdout.log"
    expect_workers_gone
    ;;
  GivesUpAfterMaxRestarts)
    run 60 --nproc-per-node 2 --max-restarts 2 -- "${worker}" always-fail
    expect_rc 1
    for attempt in 0 1 2; do
      expect_line "${out}" "[rank 1]: attempt ${attempt}"
    done
    grep -q 'attempt 3' "${out}" && fail "a fourth attempt"
    expect_match "${err}" '^torchrpc-launch: failed: rank 0 \(pid [0-9]+\) exited with code 6 after 2 restart\(s\)$'
    expect_workers_gone
    ;;
  ForwardsSigintAndExitsWhenWorkersAreGone)
    forward_signal INT 130
    ;;
  ForwardsSigtermAndExitsWhenWorkersAreGone)
    forward_signal TERM 143
    ;;
  PassesSigusr1ToTheLowestRankForAHangReport)
    start_group hang-report
    expect_line "${out}" "[rank 0]: TORCHRPC_HANG_REPORT_SIGNAL=USR1"
    expect_line "${out}" "[rank 1]: TORCHRPC_HANG_REPORT_SIGNAL=USR1"
    kill -USR1 "${real_launcher}"
    for _ in $(seq 100); do
      grep -q 'got SIGUSR1' "${out}" && break
      sleep 0.1
    done
    expect_line "${out}" "[rank 0]: rank 0 got SIGUSR1"
    expect_match "${err}" 'got SIGUSR1, asking rank 0 \(pid [0-9]+\) for the job.s hang report'
    # Only rank 0, and the job goes on.
    sleep 0.5
    grep -q 'rank 1 got SIGUSR1' "${out}" && fail "rank 1 got SIGUSR1 too"
    kill -0 "${real_launcher}" 2>/dev/null || fail "the launcher stopped on SIGUSR1"
    kill -TERM "${real_launcher}"
    wait "${launcher_pid}"
    rc=$?
    launcher_pid=""
    expect_rc 143
    expect_workers_gone
    # The user's own setting is kept; empty turns it off.
    TORCHRPC_HANG_REPORT_SIGNAL= run 30 -- "${worker}" hang-report-env
    expect_rc 0
    expect_line "${out}" "[rank 0]: TORCHRPC_HANG_REPORT_SIGNAL="
    TORCHRPC_HANG_REPORT_SIGNAL=USR2 run 30 -- "${worker}" hang-report-env
    expect_line "${out}" "[rank 0]: TORCHRPC_HANG_REPORT_SIGNAL=USR2"
    ;;
  SignalWhileStoppingDoesNotRestart)
    start=${SECONDS}
    timeout -k 5 30 "${launcher}" --nproc-per-node 2 --max-restarts 3 \
      --stop-grace-seconds 20 -- "${worker}" slow-to-stop \
      >"${out}" 2>"${err}" &
    launcher_pid=$!
    for _ in $(seq 100); do
      grep -q 'stopping slowly' "${out}" && break
      sleep 0.1
    done
    grep -q 'stopping slowly' "${out}" || fail "rank 0 was never stopped"
    real_launcher=$(ps -o pid= --ppid "${launcher_pid}" | head -1 | tr -d ' ')
    [[ -n "${real_launcher}" ]] || fail "no launcher process under timeout"
    kill -INT "${real_launcher}"
    wait "${launcher_pid}"
    rc=$?
    launcher_pid=""
    expect_rc 130
    expect_match "${err}" 'got SIGINT while stopping the workers; not restarting'
    grep -q 'restarting the group' "${err}" && fail "restarted after SIGINT"
    [[ $((SECONDS - start)) -lt 15 ]] || fail "waited out the grace period"
    expect_workers_gone
    ;;
  RefusesBadUsage)
    run 10 --nproc-per-node 2
    [[ ${rc} -ne 0 ]] || fail "no program was accepted"
    expect_match "${err}" 'no program to run'
    run 10 --nproc-per-node 0 -- true
    [[ ${rc} -ne 0 ]] || fail "--nproc-per-node 0 was accepted"
    run 10 --nnodes 2 --node-rank 2 -- true
    [[ ${rc} -ne 0 ]] || fail "--node-rank 2 of 2 was accepted"
    run 10 --nnodes 1:2 -- true
    [[ ${rc} -ne 0 ]] || fail "an elastic --nnodes 1:2 was accepted"
    expect_match "${err}" 'elastic range \(1:2\) is not supported'
    run 10 --nnodes 0 -- true
    [[ ${rc} -ne 0 ]] || fail "--nnodes 0 was accepted"
    expect_match "${err}" "expects N or N:N with N >= 1, got '0'"
    run 10 -- /nonexistent/program
    expect_rc 1
    expect_match "${err}" 'cannot execute /nonexistent/program'
    expect_match "${err}" 'rank 0 \(pid [0-9]+\) exited with code 127'
    ;;
  *)
    echo "unknown case ${case_name}" >&2
    exit 2
    ;;
esac
echo "PASS ${case_name}"
