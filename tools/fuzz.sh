#!/usr/bin/env bash
# Builds the libFuzzer targets of tests/fuzz/ with clang (AddressSanitizer,
# UndefinedBehaviorSanitizer, LeakSanitizer) and runs each over its seed
# corpus. Exits non-zero on any crash, undefined behaviour, leak, timeout,
# or allocation over the caps below.
#
#   bash tools/fuzz.sh                  # each target for FUZZ_SECONDS (20) s
#   bash tools/fuzz.sh --runs 10000000  # each target for that many inputs
#   bash tools/fuzz.sh --write-corpus   # regenerate tests/fuzz/corpus/
#   FUZZERS="handshake_fuzzer" bash tools/fuzz.sh   # only these targets
#
# Build tree: build-fuzz/ (BUILD_DIR overrides). What the fuzzers find beyond
# the seeds goes to build-fuzz/fuzz-corpus/<target>/ (kept between runs, so
# later runs start from it); a crashing input to build-fuzz/fuzz-artifacts/.
# Logs: build-fuzz/fuzz-logs/<target>.log.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${BUILD_DIR:-${repo}/build-fuzz}"
jobs="${JOBS:-2}"
seconds="${FUZZ_SECONDS:-20}"
export CCACHE_DIR="${CCACHE_DIR:-${HOME:-/tmp}/.cache/ccache}"
# Paths inside the clone hash as relative ones, so a clone elsewhere (a
# fresh CI checkout) reuses what an earlier build of the same sources cached.
export CCACHE_BASEDIR="${CCACHE_BASEDIR:-${repo}}"
# -g builds: ccache would hash the build directory, which differs per clone.
export CCACHE_NOHASHDIR="${CCACHE_NOHASHDIR:-true}"

runs=""
write_corpus=0
while (($# > 0)); do
  case "$1" in
    --runs) runs="$2"; shift 2 ;;
    --write-corpus) write_corpus=1; shift ;;
    *) echo "fuzz.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done

fuzzers=(${FUZZERS:-frame_header_fuzzer handshake_fuzzer envelope_fuzzer value_fuzzer store_request_fuzzer})

if ! command -v clang++ >/dev/null; then
  echo "fuzz.sh: needs clang++ (libFuzzer); run tools/setup_debian.sh" >&2
  exit 1
fi

# Only rpc/ and the targets: nothing else is fuzzed, and the sanitizers make
# every object file slower to build.
configure=(cmake -S "${repo}" -B "${build}" -DCMAKE_BUILD_TYPE=RelWithDebInfo
  -DCMAKE_CXX_COMPILER=clang++ -DTORCHRPC_BUILD_FUZZERS=ON
  -DTORCHRPC_BUILD_TESTS=OFF -DTORCHRPC_BUILD_BENCH=OFF
  -DTORCHRPC_BUILD_EXAMPLES=OFF -DTORCHRPC_BUILD_LAUNCHER=OFF)
if [[ ! -f "${build}/CMakeCache.txt" ]] && command -v ninja >/dev/null; then
  configure+=(-G Ninja)
fi
start=${SECONDS}
"${configure[@]}" >/dev/null
cmake --build "${build}" -j "${jobs}" --target "${fuzzers[@]}" torchrpc_fuzz_corpus
echo "fuzz.sh: configured and built in $((SECONDS - start)) s"

if ((write_corpus)); then
  rm -rf "${repo}/tests/fuzz/corpus"
  "${build}/tests/fuzz/torchrpc_fuzz_corpus" "${repo}/tests/fuzz/corpus"
  echo "fuzz.sh: wrote $(find "${repo}/tests/fuzz/corpus" -type f | wc -l) seeds"
  exit 0
fi

# Caps. No input may make the process allocate one block over 64 MiB: the
# largest input is max_len (below 64 KiB), and every cap a decoder checks
# against is either the input's own size or, for the transport's frame
# lengths and the store, far below that (the store's caps are set small in
# its target). RSS stays under 2 GiB (libtorch and the sanitizers' shadow
# take about 400 MiB at start). An input taking over 10 s is a hang.
max_len() {
  case "$1" in
    frame_header_fuzzer) echo 1024 ;;
    handshake_fuzzer) echo 4097 ;;
    store_request_fuzzer) echo 4096 ;;
    *) echo 16384 ;;
  esac
}

export ASAN_OPTIONS="detect_leaks=1:allocator_may_return_null=0:${ASAN_OPTIONS:-}"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:${UBSAN_OPTIONS:-}"
mkdir -p "${build}/fuzz-logs" "${build}/fuzz-artifacts"
status=0
for fuzzer in "${fuzzers[@]}"; do
  seeds="${repo}/tests/fuzz/corpus/${fuzzer}"
  work="${build}/fuzz-corpus/${fuzzer}"
  mkdir -p "${work}"
  bound=(-max_total_time="${seconds}")
  rss_limit=2048
  if [[ -n "${runs}" ]]; then
    bound=(-runs="${runs}")
    # ASan keeps the stack of every distinct allocation site it has seen
    # (its stack depot, never freed); the recursive decoders make new ones
    # by nesting, so a long run's RSS climbs ~120-150 MiB per million inputs
    # (flat with malloc_context_size=0). The envelope target crossed 2 GiB
    # after 9.6 million. Single allocations stay capped at 64 MiB.
    rss_limit=4096
  fi
  log="${build}/fuzz-logs/${fuzzer}.log"
  t0=${SECONDS}
  # -close_fd_mask=1: the code under test may log to stdout.
  if "${build}/tests/fuzz/${fuzzer}" "${bound[@]}" \
      -max_len="$(max_len "${fuzzer}")" -malloc_limit_mb=64 \
      -rss_limit_mb="${rss_limit}" -timeout=10 -print_final_stats=1 \
      -artifact_prefix="${build}/fuzz-artifacts/${fuzzer}-" \
      "${work}" "${seeds}" >"${log}" 2>&1; then
    result=ok
  else
    result="FAILED (see ${log})"
    status=1
  fi
  execs="$(grep -Eo 'stat::number_of_executed_units: *[0-9]+' "${log}" | grep -Eo '[0-9]+$' || echo '?')"
  echo "fuzz.sh: ${fuzzer}: ${result}, ${execs} inputs in $((SECONDS - t0)) s"
done
exit "${status}"
