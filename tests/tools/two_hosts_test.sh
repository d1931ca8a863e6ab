#!/usr/bin/env bash
# Two hosts, for real: two network namespaces joined by a veth pair (private
# addresses that exist only inside them), one torchrpc-launch per simulated
# host, and the parameter-server example across them (the server and a
# trainer on host A, two trainers on host B). Checks that every trainer
# trained and the server reported the test accuracy.
#
#   two_hosts_test.sh TORCHRPC_LAUNCH PS_MNIST
#
# Needs root and iproute2's `ip` (exit 77, CTest: skipped, otherwise). The
# EXIT trap kills every process below this script, by pid, and deletes both
# namespaces (which deletes the veth pair) however the test ends.
set -uo pipefail

launcher="$1"
ps_mnist="$2"
work="$(mktemp -d)"
tag="$$"
ns_a="trpc_a_${tag}"
ns_b="trpc_b_${tag}"
addr_a="10.231.77.1"
addr_b="10.231.77.2"
port=29731

descendants() {
  local child
  for child in $(ps -o pid= --ppid "$1" 2>/dev/null); do
    descendants "${child}"
    echo "${child}"
  done
}

cleanup() {
  for pid in $(descendants $$); do
    kill -KILL "${pid}" 2>/dev/null
  done
  ip netns del "${ns_a}" 2>/dev/null
  ip netns del "${ns_b}" 2>/dev/null
  rm -rf "${work}"
}
trap cleanup EXIT

skip() {
  echo "SKIP: $*"
  exit 77
}

fail() {
  echo "FAIL: $*" >&2
  for host in a b; do
    echo "---- host ${host}" >&2
    tail -n 40 "${work}/host_${host}.out" >&2 2>/dev/null
  done
  exit 1
}

[[ $(id -u) -eq 0 ]] || skip "network namespaces need root"
command -v ip >/dev/null || skip "ip (iproute2) is not installed"
[[ -x "${ps_mnist}" ]] || skip "ps_mnist was not built (it needs CLI11 and zlib)"
[[ -f /usr/share/datasets/fashion-mnist/t10k-labels-idx1-ubyte.gz ]] ||
  skip "dataset-fashion-mnist is not installed (bash tools/setup_debian.sh)"

ip netns add "${ns_a}" || skip "cannot create a network namespace here"
ip netns add "${ns_b}" || fail "cannot create the second namespace"
ip link add "va${tag}" type veth peer name "vb${tag}" || fail "no veth pair"
ip link set "va${tag}" netns "${ns_a}" || fail "cannot move the veth end"
ip link set "vb${tag}" netns "${ns_b}" || fail "cannot move the veth end"
ip -n "${ns_a}" addr add "${addr_a}/24" dev "va${tag}"
ip -n "${ns_b}" addr add "${addr_b}/24" dev "vb${tag}"
for ns in "${ns_a}" "${ns_b}"; do
  ip -n "${ns}" link set lo up
done
ip -n "${ns_a}" link set "va${tag}" up
ip -n "${ns_b}" link set "vb${tag}" up
ip -n "${ns_a}" route get "${addr_b}" >/dev/null ||
  fail "host a has no route to host b"

# host NAME NODE_RANK ADDRESS: one launcher with two workers on that host.
host() {
  local name="$1" node_rank="$2" address="$3"
  TORCHRPC_LISTEN_ADDR="${address}" timeout -k 5 200 \
    ip netns exec "$4" "${launcher}" --nnodes 2 --nproc-per-node 2 \
    --node-rank "${node_rank}" --master-addr "${addr_a}" \
    --master-port "${port}" -- "${ps_mnist}" --max-steps 30 \
    --progress-seconds 0.5 --cache-dir "${work}/cache_${name}" \
    --log-dir "${work}/runs_${name}" \
    --checkpoint-dir "${work}/checkpoints" >"${work}/host_${name}.out" 2>&1
}

host a 0 "${addr_a}" "${ns_a}" &
pid_a=$!
host b 1 "${addr_b}" "${ns_b}" &
pid_b=$!
wait "${pid_a}"
rc_a=$?
wait "${pid_b}"
rc_b=$?
[[ ${rc_a} -eq 0 ]] || fail "host a's launcher exited ${rc_a}"
[[ ${rc_b} -eq 0 ]] || fail "host b's launcher exited ${rc_b}"

# Ranks 0 (server) and 1 on host a, 2 and 3 on host b.
grep -qE '^\[rank 1\]: trainer1 epoch 1/[0-9]+ step [0-9]+' "${work}/host_a.out" ||
  fail "no progress from trainer1 on host a"
for rank in 2 3; do
  grep -qE "^\[rank ${rank}\]: trainer${rank} epoch 1/[0-9]+ step [0-9]+" \
    "${work}/host_b.out" || fail "no progress from trainer${rank} on host b"
done
grep -qE '^\[rank 0\]: test accuracy: [0-9.]+% on 10000' "${work}/host_a.out" ||
  fail "the server printed no test accuracy"
echo "PASS two hosts"
