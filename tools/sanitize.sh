#!/usr/bin/env bash
# Builds the library and its in-process test binaries with ThreadSanitizer and
# runs every test that does not fork, in a few processes per binary (one test
# after another: that also exercises start, shutdown and start again of many
# runtimes in one process). `bash tools/test.sh` runs it after the suite
# (`TORCHRPC_TSAN=0` skips it there).
#
#   bash tools/sanitize.sh thread
#
# (AddressSanitizer, LeakSanitizer and UndefinedBehaviorSanitizer cover the
# whole suite: `bash tools/test.sh`, whose default that is.)
#
# Build tree: build-thread/ (BUILD_DIR overrides). libtorch and TensorPipe are
# not instrumented; tests/tsan.supp silences what TSan reports inside them.
# Exits non-zero when a test fails or TSan reports a race.
set -euo pipefail

sanitizer="${1:-thread}"
if [[ "${sanitizer}" != thread ]]; then
  echo "usage: $0 thread (ASan and UBSan: SANITIZE=address,undefined bash tools/test.sh)" >&2
  exit 2
fi
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${BUILD_DIR:-${repo}/build-${sanitizer}}"
jobs="${JOBS:-2}"
export CCACHE_DIR="${CCACHE_DIR:-${HOME:-/tmp}/.cache/ccache}"
export CCACHE_BASEDIR="${CCACHE_BASEDIR:-${repo}}"
# -g builds: ccache would hash the build directory, which differs per clone.
export CCACHE_NOHASHDIR="${CCACHE_NOHASHDIR:-true}"

binaries=(torchrpc_rpc_tests torchrpc_rref_tests torchrpc_autograd_tests
  torchrpc_training_tests)

# TORCHRPC_TEST_SHARDS: the in-process tests in shards (CTest label
# in_process); under TSan the tests that fork are not registered at all
# (tests/CMakeLists.txt says which and why).
configure=(cmake -S "${repo}" -B "${build}" -DCMAKE_BUILD_TYPE=RelWithDebInfo
  "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O2 -g1" "-DSANITIZE=${sanitizer}"
  -DTORCHRPC_TEST_SHARDS=4 -DTORCHRPC_BUILD_BENCH=OFF
  -DTORCHRPC_BUILD_EXAMPLES=OFF -DTORCHRPC_BUILD_LAUNCHER=OFF
  # On: the tracing tests check the workers' files with the merge tool's
  # own code, and tracing is concurrent code that TSan must see.
  -DTORCHRPC_BUILD_TRACE_TOOLS=ON)
if [[ ! -f "${build}/CMakeCache.txt" ]] && command -v ninja >/dev/null; then
  configure+=(-G Ninja)
fi
start=${SECONDS}
"${configure[@]}" >/dev/null
cmake --build "${build}" -j "${jobs}" --target "${binaries[@]}"
echo "sanitize.sh: configured and built in $((SECONDS - start)) s"

# halt_on_error=0: a shard runs all its tests and lists every race; TSan's
# exit code (66) then fails the shard.
export TSAN_OPTIONS="suppressions=${repo}/tests/tsan.supp:halt_on_error=0:${TSAN_OPTIONS:-}"
status=0
ctest --test-dir "${build}" -L in_process --output-on-failure -j "${jobs}" ||
  status=$?
exit "${status}"
