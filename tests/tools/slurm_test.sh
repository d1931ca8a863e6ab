#!/usr/bin/env bash
# Runs examples/hello_workers, then a short run of the parameter-server
# example, under a real `srun` on a one-node Slurm that this script starts in
# a scratch directory (its own munged, slurmctld and slurmd, on free ports;
# nothing of the system's Slurm or munge is used):
#
#   slurm_test.sh PATH/TO/hello_workers [PATH/TO/ps_mnist]
#
# Needs root (slurmd launches tasks as the job's user) and Debian's slurmd,
# slurmctld, slurm-client and munge; exits 77 (CTest: skipped) with the
# reason otherwise. The daemons are killed by pid on every path; every wait
# is bounded.
set -uo pipefail

hello="$1"
ps_mnist="${2:-}"

skip() {
  echo "SKIP: $*"
  exit 77
}
[[ ${EUID} -eq 0 ]] || skip "a one-node Slurm needs root"
for tool in srun sinfo slurmctld slurmd munged; do
  command -v "${tool}" >/dev/null ||
    skip "${tool} is not installed (apt-get install slurmd slurmctld slurm-client munge)"
done

work="$(mktemp -d)"
chmod 711 "${work}"
daemon_pids=()
out="${work}/out"

cleanup() {
  local pid
  for pid in "${daemon_pids[@]}"; do
    kill -TERM "${pid}" 2>/dev/null
  done
  for _ in $(seq 50); do
    local alive=0
    for pid in "${daemon_pids[@]}"; do
      kill -0 "${pid}" 2>/dev/null && alive=1
    done
    ((alive)) || break
    sleep 0.1
  done
  for pid in "${daemon_pids[@]}"; do
    kill -KILL "${pid}" 2>/dev/null
  done
  rm -rf "${work}"
}
trap cleanup EXIT

fail() {
  echo "FAIL: $*" >&2
  for log in "${out}" "${work}"/log/*; do
    [[ -f "${log}" ]] && { echo "--- ${log##*/}" >&2; tail -20 "${log}" >&2; }
  done
  exit 1
}

# A port nobody listens on, in [low, high).
free_port() {
  python3 - "$1" "$2" <<'PY'
import random, socket, sys
low, high = int(sys.argv[1]), int(sys.argv[2])
for _ in range(200):
    port = random.randrange(low, high)
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", port))
    except OSError:
        continue
    finally:
        s.close()
    print(port)
    break
PY
}

mkdir -p "${work}"/{state,spool,log,munge}
chmod 700 "${work}/munge"
head -c 1024 /dev/urandom >"${work}/munge/munge.key"
chmod 400 "${work}/munge/munge.key"
socket="${work}/munge/munge.socket.2"
munged -F -f --socket="${socket}" --key-file="${work}/munge/munge.key" \
  --pid-file="${work}/munge/munged.pid" --log-file="${work}/log/munged.log" \
  --seed-file="${work}/munge/munged.seed" >/dev/null 2>&1 &
daemon_pids+=($!)

host="$(hostname -s)"
ctld_port="$(free_port 20000 30000)"
slurmd_port="$(free_port 30000 40000)"
# Workers take their master port from the job id (10000 + id mod 10000,
# Note [Launch environment]); start the ids where that port is free.
master_port="$(free_port 10000 20000)"
export SLURM_CONF="${work}/slurm.conf"
cat >"${SLURM_CONF}" <<CONF
ClusterName=torchrpctest
SlurmctldHost=${host}(127.0.0.1)
AuthType=auth/munge
AuthInfo=socket=${socket}
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
SlurmctldPort=${ctld_port}
SlurmdPort=${slurmd_port}
FirstJobId=$((master_port - 10000))
StateSaveLocation=${work}/state
SlurmdSpoolDir=${work}/spool
SlurmctldPidFile=${work}/slurmctld.pid
SlurmdPidFile=${work}/slurmd.pid
SlurmctldLogFile=${work}/log/slurmctld.log
SlurmdLogFile=${work}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MpiDefault=none
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
NodeName=${host} NodeAddr=127.0.0.1 CPUs=2 RealMemory=1000 State=UNKNOWN
PartitionName=debug Nodes=${host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
CONF

for _ in $(seq 50); do
  [[ -S "${socket}" ]] && break
  sleep 0.1
done
[[ -S "${socket}" ]] || fail "munged did not start"
slurmctld -D -f "${SLURM_CONF}" >"${work}/log/slurmctld.out" 2>&1 &
daemon_pids+=($!)
slurmd -D -f "${SLURM_CONF}" >"${work}/log/slurmd.out" 2>&1 &
daemon_pids+=($!)
state=""
for _ in $(seq 300); do
  state="$(timeout 5 sinfo -h -o %T 2>/dev/null)"
  [[ "${state}" == idle ]] && break
  sleep 0.1
done
[[ "${state}" == idle ]] || fail "the Slurm node never became idle (${state})"

timeout -k 5 120 srun --nodes 1 --ntasks 2 --kill-on-bad-exit=1 \
  "${hello}" >"${out}" 2>&1
rc=$?
[[ ${rc} -eq 0 ]] || fail "srun exited with ${rc}"
for line in \
  '^hello worker0, this is worker1$' \
  '^a total kept on worker1:  6$' \
  '^gradient of w through worker1 and worker1:  12$'; do
  grep -qE "${line}" "${out}" || fail "nothing matches '${line}'"
done

if [[ -n "${ps_mnist}" ]]; then
  [[ -f /usr/share/datasets/fashion-mnist/t10k-labels-idx1-ubyte.gz ]] ||
    fail "dataset-fashion-mnist is not installed (bash tools/setup_debian.sh)"
  # One server and two trainers on a 2-CPU node: --overcommit. The port is
  # named here (the derived one belongs to the job before).
  MASTER_PORT="$(free_port 40000 50000)" timeout -k 5 200 \
    srun --nodes 1 --ntasks 3 --overcommit --kill-on-bad-exit=1 \
    "${ps_mnist}" --max-steps 20 --progress-seconds 0.5 \
    --cache-dir "${work}/ps/cache" --log-dir "${work}/ps/runs" \
    --checkpoint-dir "${work}/ps/checkpoints" >"${out}" 2>&1
  rc=$?
  [[ ${rc} -eq 0 ]] || fail "srun of ps_mnist exited with ${rc}"
  for line in \
    '^trainer1 epoch 1/[0-9]+ step [0-9]+' \
    '^trainer2 epoch 1/[0-9]+ step [0-9]+' \
    '^test accuracy: [0-9.]+% on 10000'; do
    grep -qE "${line}" "${out}" || fail "nothing matches '${line}'"
  done
fi

# Let the jobs' slurmstepd processes finish before the daemons go: each
# keeps a socket in the spool directory while it runs.
for _ in $(seq 100); do
  [[ -z "$(timeout 5 squeue -h 2>/dev/null)" ]] &&
    ! compgen -G "${work}/spool/${host}_*" >/dev/null && break
  sleep 0.1
done
echo "PASS ExamplesUnderSrun"
