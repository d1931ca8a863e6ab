#!/usr/bin/env bash
# A worker for the launcher's tests: `test_worker.sh MODE`. It records its
# pid in $PID_DIR (when set) so that the test can kill whatever is left,
# however the test ends.
set -u
rank="${RANK:?RANK is not set}"
if [[ -n "${PID_DIR:-}" ]]; then
  echo "$$" >"${PID_DIR}/worker.${TORCHELASTIC_RESTART_COUNT:-0}.${rank}.pid"
fi

# Sleeps until a signal ends it; `sleep & wait` lets traps run at once.
sleep_long() {
  sleep 60 &
  wait $!
}

case "$1" in
  observability-env)
    for name in TORCHRPC_TRACE_DIR TORCHRPC_TRACE_STEPS TORCHRPC_METRICS_ADDR; do
      printf '%s=%s ' "${name}" "${!name-unset}"
    done
    echo
    ;;
  env)
    for name in RANK LOCAL_RANK WORLD_SIZE LOCAL_WORLD_SIZE GROUP_RANK \
      MASTER_ADDR MASTER_PORT TORCHELASTIC_RESTART_COUNT \
      TORCHELASTIC_MAX_RESTARTS TORCHELASTIC_RUN_ID; do
      printf '%s=%s ' "${name}" "${!name-unset}"
    done
    echo
    ;;
  isolation)
    # stdin, and whether this worker leads a process group of its own.
    own=no
    [[ "$(ps -o pgid= -p $$ | tr -d ' ')" == "$$" ]] && own=yes
    echo "stdin=$(readlink /proc/$$/fd/0) own-group=${own}"
    ;;
  chatty)
    # Three lines out, two err, the last of each without a newline, written
    # in pieces.
    printf 'out one\nout '
    sleep 0.1
    printf 'two\nout three'
    printf 'err one\nerr two' >&2
    ;;
  fail-on-rank-1)
    if [[ "${rank}" == 1 ]]; then
      sleep 0.5
      exit 3
    fi
    trap 'echo "rank ${rank} got SIGTERM"; exit 143' TERM
    sleep_long
    ;;
  ignore-term)
    # Rank 1 fails; the others ignore SIGTERM and need SIGKILL.
    if [[ "${rank}" == 1 ]]; then
      sleep 0.5
      exit 5
    fi
    trap '' TERM
    sleep_long
    sleep_long
    ;;
  slow-to-stop)
    # Rank 1 fails; rank 0 takes its time to stop after SIGTERM.
    if [[ "${rank}" == 1 ]]; then
      sleep 0.5
      exit 7
    fi
    trap 'echo "rank ${rank} stopping slowly"; sleep_long; exit 143' TERM
    sleep_long
    ;;
  segfault)
    if [[ "${rank}" == 0 ]]; then
      sleep 0.2
      kill -SEGV $$
    fi
    sleep_long
    ;;
  fail-first-attempt)
    if [[ "${TORCHELASTIC_RESTART_COUNT}" == 0 && "${rank}" == 1 ]]; then
      exit 4
    fi
    if [[ "${TORCHELASTIC_RESTART_COUNT}" == 0 ]]; then
      sleep_long
    fi
    echo "attempt ${TORCHELASTIC_RESTART_COUNT} ok"
    ;;
  always-fail)
    echo "attempt ${TORCHELASTIC_RESTART_COUNT}"
    if [[ "${rank}" == 0 ]]; then
      sleep 0.2
      exit 6
    fi
    sleep_long
    ;;
  hang-report-env)
    echo "TORCHRPC_HANG_REPORT_SIGNAL=${TORCHRPC_HANG_REPORT_SIGNAL-unset}"
    ;;
  hang-report)
    # Says which signal it was told to print a hang report on, and when it
    # gets SIGUSR1; SIGTERM ends it.
    echo "TORCHRPC_HANG_REPORT_SIGNAL=${TORCHRPC_HANG_REPORT_SIGNAL-unset}"
    trap 'echo "rank ${rank} got SIGUSR1"' USR1
    trap 'exit 0' TERM
    echo "ready"
    # A trap interrupts the wait; keep waiting (60 s at most).
    for _ in $(seq 60); do
      sleep 1 &
      wait $!
    done
    ;;
  wait-for-signal)
    trap 'echo "rank ${rank} got SIGINT"; exit 0' INT
    trap 'echo "rank ${rank} got SIGTERM"; exit 0' TERM
    echo "ready"
    sleep_long
    ;;
  *)
    echo "unknown mode $1" >&2
    exit 2
    ;;
esac
